"""CUDA graph capture and replay: no host synchronization, no state that can go stale."""
import pytest
import torch

from conftest import Problem, make_input, make_models, relerr

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
P = Problem(4, 8, 19, (5, 6, 7), (3, 2, 3))


def capture(fused, static_x):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused(static_x)  # warm-up outside the graph, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused(static_x)
    return graph, static_out


@torch.no_grad()
def test_eval_replay_follows_new_inputs_and_in_place_weight_changes():
    ref, fused = make_models(P, torch.float32, "cuda")
    ref.eval()
    fused.eval()
    static_x = make_input(P, torch.float32, "cuda")
    graph, static_out = capture(fused, static_x)
    for _ in range(3):
        static_x.copy_(make_input(P, torch.float32, "cuda"))
        fused.conv_transpose.weight.mul_(1.25).add_(0.01)  # in place: the graph reads it anew
        ref.conv_transpose.weight.copy_(fused.conv_transpose.weight)
        graph.replay()
        assert relerr(static_out, ref(static_x.double().cpu())) <= 1e-6


@torch.no_grad()
@pytest.mark.parametrize("algo", ["direct", "sliced_conv"])
def test_train_replay_updates_running_stats_every_time(algo):
    ref, fused = make_models(P, torch.float32, "cuda", algo=algo)
    ref.train()
    fused.train()
    static_x = make_input(P, torch.float32, "cuda")
    ref(static_x.double().cpu())  # the reference takes the warm-up step too
    graph, static_out = capture(fused, static_x)
    for _ in range(3):
        static_x.copy_(make_input(P, torch.float32, "cuda"))
        graph.replay()
        assert relerr(static_out, ref(static_x.double().cpu())) <= 1e-6
        assert relerr(fused.batch_norm.running_var, ref.batch_norm.running_var) <= 1e-6
        assert relerr(fused.batch_norm.running_mean, ref.batch_norm.running_mean) <= 1e-6
    assert int(fused.batch_norm.num_batches_tracked) == int(ref.batch_norm.num_batches_tracked) == 4
