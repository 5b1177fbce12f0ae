"""CUDA graph capture and replay: no host synchronization, no state that can go stale; every
configuration family and algorithm, the module and the functional, against float64."""
import pytest
import torch

import fused_ops.testing

from conftest import (GRAD_TOL, TOL, Problem, assert_gradients_match, make_input, make_models, relerr,
                      run_backward, skip_unless_algo_covers)
from test_compile_export import FAMILIES, FUNCTIONAL_FAMILIES, FunctionalModel

pytestmark = pytest.mark.cuda
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


# momentum=None is left out: its factor 1 / float(num_batches_tracked) is read on the host,
# a synchronization that capture forbids (nn.BatchNorm3d(momentum=None) cannot be captured
# either); a captured graph would also freeze the factor.
GRAPH_FAMILIES = [f for f in FAMILIES if FAMILIES[f].momentum is not None]
GRAPH_MODES = [(False, "auto"), (True, "auto"), (True, "fft"), (True, "direct"),
               (True, "sliced_conv"), (True, "correlation"), (True, "cross_spectrum"),
               (True, "border")]


def assert_same_state(fused, ref):
    for key, value in ref.state_dict().items():
        got = fused.state_dict()[key]
        assert (relerr(got, value) <= TOL[torch.float32] if value.is_floating_point()
                else torch.equal(got.cpu(), value)), key


@torch.no_grad()
@pytest.mark.parametrize("form", ["module", "functional"])
@pytest.mark.parametrize("mode", GRAPH_MODES,
                         ids=[f"{'train' if t else 'eval'}-{a}" for t, a in GRAPH_MODES])
@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_replay_every_family(family, mode, form):
    """Each replay: the output of the new input, the running statistics and
    num_batches_tracked updated (training) or left alone (eval), as PyTorch's modules."""
    problem = FAMILIES[family]
    training, algo = mode
    if form == "functional" and family not in FUNCTIONAL_FAMILIES:
        pytest.skip("the functional form takes a fixed momentum and running statistics")
    skip_unless_algo_covers(problem, algo, "cuda")
    ref, fused = make_models(problem, torch.float32, "cuda", algo=algo)
    ref.train(training)
    fused.train(training)
    model = fused if form == "module" else FunctionalModel(fused).train(training)
    static_x = make_input(problem, torch.float32, "cuda")
    ref(static_x.double().cpu())  # the reference takes the warm-up step too
    graph, static_out = capture(model, static_x)
    assert_same_state(fused, ref)  # capture itself runs nothing
    for _ in range(3):
        static_x.copy_(make_input(problem, torch.float32, "cuda"))
        graph.replay()
        assert relerr(static_out, ref(static_x.double().cpu())) <= 1e-6
        assert_same_state(fused, ref)
    if training and problem.bn_kwargs.get("track_running_stats", True):
        assert int(fused.batch_norm.num_batches_tracked) == 4


@torch.no_grad()
def test_eval_replay_reads_weight_and_bn_inputs_anew():
    """The finalize reads the weight and BN inputs before its wait: replays must see
    in-place changes made between them (16-byte loads of x here, unlike test_cuda_graphs)."""
    p = Problem(4, 8, 19, (4, 8, 8), (3, 2, 3))
    ref, fused = make_models(p, torch.float32, "cuda", beta="random")
    ref.eval()
    fused.eval()
    static_x = make_input(p, torch.float32, "cuda")
    graph, static_out = capture(fused, static_x)
    for _ in range(3):
        static_x.copy_(make_input(p, torch.float32, "cuda"))
        fused.conv_transpose.weight.mul_(1.25).add_(0.01)
        fused.batch_norm.running_mean.add_(0.5)
        fused.batch_norm.weight.mul_(-1.5)
        ref.load_state_dict(fused.state_dict())
        ref.double()
        graph.replay()
        assert relerr(static_out, ref(static_x.double().cpu())) <= 1e-6


# torch.compile's CUDA graph trees: warm-up runs allocate from the graph's memory pool, and a
# tensor left there (a cached table) is refused; the table-caching paths (fft, cross_spectrum,
# border) must build theirs outside it. Stride 1 without padding for the FFT and spectral
# paths, a padded problem for the box-sum and border paths.
OVERHEAD_PROBLEMS = {"plain": Problem(3, 4, 6, (5, 6, 7), (2, 3, 2)),
                     "padded": Problem(3, 4, 6, (5, 6, 7), (3, 3, 3), conv_kwargs=dict(padding=1))}
OVERHEAD_MODES = [(False, "auto"), (True, "auto"), (True, "fft"), (True, "direct"),
                  (True, "sliced_conv"), (True, "cross_spectrum"), (True, "border")]


@pytest.mark.parametrize("mode", OVERHEAD_MODES,
                         ids=[f"{'train' if t else 'eval'}-{a}" for t, a in OVERHEAD_MODES])
@pytest.mark.parametrize("name", OVERHEAD_PROBLEMS)
def test_compile_reduce_overhead(name, mode):
    """Steps of torch.compile(mode="reduce-overhead") match the unfused modules' outputs and
    state step by step, and run as CUDA graphs (none skipped)."""
    from torch._dynamo.utils import counters

    problem, (training, algo) = OVERHEAD_PROBLEMS[name], mode
    skip_unless_algo_covers(problem, algo, "cuda")
    torch._dynamo.reset()
    counters.clear()
    ref, fused = make_models(problem, torch.float32, "cuda", algo=algo)
    ref.train(training)
    fused.train(training)
    compiled = torch.compile(fused, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(4):  # warm-up, recording, then replays
            x = make_input(problem, torch.float32, "cuda")
            out = compiled(x).clone()  # a replay overwrites the graph's output
            assert relerr(out, ref(x.double().cpu())) <= 1e-6
            assert_same_state(fused, ref)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_compile_reduce_overhead_training_step():
    """Forward and backward of training steps under reduce-overhead: outputs, every gradient
    and the state as the unfused modules' in float64 (TF32 off, as test_gradients)."""
    problem = OVERHEAD_PROBLEMS["plain"]
    torch._dynamo.reset()
    ref, fused = make_models(problem, torch.float32, "cuda")
    compiled = torch.compile(fused, mode="reduce-overhead")
    for _ in range(4):
        x = make_input(problem, torch.float32, "cuda")
        grad_out = torch.randn(problem.batch, problem.out_channels, 1, 1, 1, dtype=torch.float64)
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            out, got = run_backward(compiled, x, grad_out.float().cuda())
        want_out, want = run_backward(ref, x.double().cpu(), grad_out)
        assert relerr(out, want_out) <= 1e-6
        assert set(got) == set(want)
        assert_gradients_match(got, want, GRAD_TOL[torch.float32])
        assert_same_state(fused, ref)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_capture_training_step(training):
    """A whole training step (forward, backward, SGD step) captured in one graph, as PyTorch's
    whole-network capture does: each replay on a new input gives the unfused modules' output,
    parameters and running statistics after the same step (float64 reference, TF32 off)."""
    ref, fused = make_models(P, torch.float32, "cuda")
    ref.train(training)
    fused.train(training)
    optimizer = torch.optim.SGD(fused.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.05)
    static_x = make_input(P, torch.float32, "cuda")
    static_grad = torch.randn(P.batch, P.out_channels, 1, 1, 1, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = fused(static_x)
        out.backward(static_grad)
        optimizer.step()
        return out

    def ref_step():
        ref_optimizer.zero_grad(set_to_none=True)
        out = ref(static_x.double().cpu())
        out.backward(static_grad.double().cpu())
        ref_optimizer.step()
        return out

    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up outside the graph, the reference alongside
                step()
                ref_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_out = step()
        for _ in range(3):
            static_x.copy_(make_input(P, torch.float32, "cuda"))
            graph.replay()
            want = ref_step()
            assert relerr(static_out, want) <= 1e-5
            for key, value in ref.state_dict().items():
                got = fused.state_dict()[key]
                assert (relerr(got, value) <= 1e-5 if value.is_floating_point()
                        else torch.equal(got.cpu(), value)), key


def test_capture_training_step_with_the_spectral_backward():
    """test_capture_training_step's training step with the backward's spectral route forced
    (docs/dispatch.md: CUDA's dispatch takes it on large stride-1 problems): nothing of it
    copies a host tensor, which capture refuses."""
    with fused_ops.testing.route(backward="spectral"):
        test_capture_training_step(True)
