"""Memory formats and strided views of x: the answer of contiguous x and of float64, and no
hidden copy of x where a strided read is cheap (README, memory formats)."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import (DEVICES, STATS_TOL, Problem, assert_gradients_match, assert_stats_match,
                      make_input, make_models, module_conv_options, relerr)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-6}
P = Problem(3, 8, 6, (4, 5, 6), (2, 3, 2))
CHANNELS_LAST = torch.channels_last_3d


def in_memory_order(x, order):
    """x with its dims laid out in memory in `order`, outermost first."""
    inverse = sorted(range(5), key=order.__getitem__)
    return x.permute(order).contiguous().permute(inverse)


def spread(x, dim, step, memory_format=torch.contiguous_format):
    """x as every step-th index along dim of a larger tensor."""
    shape = list(x.shape)
    shape[dim] *= step
    big = torch.zeros(shape, dtype=x.dtype, device=x.device).contiguous(memory_format=memory_format)
    index = [slice(None)] * 5
    index[dim] = slice(None, None, step)
    view = big[tuple(index)]
    view.copy_(x)
    return view


def channel_window(x):
    """channels_last_3d x as channels 1..C of a tensor of C + 3: channels adjacent, but each
    position's channels start one element past a 16-byte boundary."""
    b, c, *size = x.shape
    big = torch.zeros(b, c + 3, *size, dtype=x.dtype, device=x.device)
    view = big.contiguous(memory_format=CHANNELS_LAST)[:, 1:c + 1]
    view.copy_(x)
    return view


# Each view of x; the comment says how the CUDA sums read it (sums_kernels.h: SampleLayout).
VIEWS = {
    "channels_last_3d": lambda x: x.contiguous(memory_format=CHANNELS_LAST),  # channels adjacent
    "dhw_permuted": lambda x: in_memory_order(x, (0, 1, 4, 2, 3)),  # positions adjacent
    "channels_last_dhw_permuted": lambda x: in_memory_order(x, (0, 3, 4, 2, 1)),  # channels adj.
    "batch_innermost": lambda x: in_memory_order(x, (1, 2, 3, 4, 0)),  # neither: copied
    "batch_step": lambda x: spread(x, 0, 2),  # positions adjacent
    "channel_step": lambda x: spread(x, 1, 2),  # positions adjacent
    "channel_step_channels_last": lambda x: spread(x, 1, 2, CHANNELS_LAST),  # neither: copied
    "channel_window_channels_last": channel_window,  # channels adjacent, 4-byte loads
    "w_step": lambda x: spread(x, 4, 2),  # neither: copied
    "w_step_channels_last": lambda x: spread(x, 4, 2, CHANNELS_LAST),  # channels adjacent
    "expanded_batch": lambda x: x[:1].expand_as(x),  # positions adjacent, batch stride 0
}


def check_call(problem, view, dtype, device, training, algo="auto"):
    """The fused module on the view of x: the float64 reference's answer, and that of the
    same values in a contiguous tensor (outputs and, in training, the batch statistics and
    the running statistics)."""
    beta = "zero" if training else "random"
    ref, fused = make_models(problem, dtype, device, algo=algo, beta=beta)
    _, twin = make_models(problem, dtype, device, algo=algo, beta=beta)
    twin.load_state_dict(fused.state_dict())
    for m in (ref, fused, twin):
        m.train(training)
    x = VIEWS[view](make_input(problem, dtype, device))
    assert not x.is_contiguous()
    with torch.no_grad():
        out, out_contiguous, expected = fused(x), twin(x.contiguous()), ref(x.double().cpu())
    tol = TOLERANCE[dtype]
    if training and view == "expanded_batch":
        # Every sample the same: each is the batch mean, the output beta (0) exactly; the
        # statistics below are the check.
        assert out.abs().max().item() <= tol and out_contiguous.abs().max().item() <= tol
    else:
        assert relerr(out, expected) <= tol
        assert relerr(out, out_contiguous) <= tol
    if training:
        weight, options = fused.conv_transpose.weight.detach(), module_conv_options(fused)
        assert_stats_match(x, weight, options, algo, STATS_TOL[dtype])
    for name in ("running_mean", "running_var"):
        got = getattr(fused.batch_norm, name)
        assert relerr(got, getattr(twin.batch_norm, name)) <= tol, name
        assert relerr(got, getattr(ref.batch_norm, name)) <= tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("view", VIEWS)
def test_eval_view_matches_contiguous(view, dtype, device):
    check_call(P, view, dtype, device, training=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["auto", "direct", "sliced_conv", "correlation", "cross_spectrum"])
@pytest.mark.parametrize("view", VIEWS)
def test_train_view_matches_contiguous(view, algo, device):
    check_call(P, view, torch.float32, device, training=True, algo=algo)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv", [dict(padding=1), dict(stride=2, groups=2)], ids=str)
@pytest.mark.parametrize("training", [False, True])
def test_channels_last_with_other_geometry(conv, training, device):
    problem = Problem(2, 8, 6, (4, 5, 6), (3, 2, 3), conv_kwargs=conv)
    check_call(problem, "channels_last_3d", torch.float32, device, training)


# The channels-last CUDA kernel's cases: 4-byte loads (C = 2, 3 in float32), channels
# narrower than a warp (8, 12), slabs of channels and chunks of positions (64, 2 samples),
# wider than a warp (200), more vectors than a block has threads (2100).
SHAPES = [(2, 2, (3, 4, 5)), (3, 3, (5, 4, 3)), (2, 8, (8, 16, 16)), (4, 12, (3, 5, 7)),
          (2, 64, (8, 16, 32)), (3, 200, (2, 3, 5)), (1, 2100, (2, 3, 4))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("batch,channels,size", SHAPES, ids=str)
def test_channels_last_eval_shapes(batch, channels, size, dtype, device):
    check_call(Problem(batch, channels, 3, size, (2, 1, 2)), "channels_last_3d", dtype, device,
               training=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True])
def test_channels_last_gradients_match_contiguous(training, device):
    _, fused = make_models(P, torch.float64, device)
    fused.train(training)
    x = make_input(P, torch.float64, device)
    weights = torch.linspace(-1, 2, P.out_channels, device=device).view(1, -1, 1, 1, 1)
    grads = []
    for x_in in (x.contiguous(memory_format=CHANNELS_LAST), x):
        fused.zero_grad()
        x_in = x_in.detach().requires_grad_()
        (fused(x_in) * weights).sum().backward()
        grads.append({"x": x_in.grad, **{n: p.grad for n, p in fused.named_parameters()}})
    assert_gradients_match(grads[0], grads[1], 1e-10)


COPIES = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy"}


@pytest.mark.parametrize("view", VIEWS)
def test_cpu_eval_reads_x_in_place(view):
    _, fused = make_models(P, torch.float32, "cpu")
    fused.eval()
    x = VIEWS[view](make_input(P, torch.float32, "cpu"))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fused(x)
    copies = [e.name for e in prof.events()
              if e.name in COPIES and e.input_shapes and e.input_shapes[0] == list(x.shape)]
    assert not copies


# The views the CUDA sums read in place (the others are copied: README, memory formats).
IN_PLACE_ON_CUDA = ["channels_last_3d", "dhw_permuted", "channels_last_dhw_permuted",
                    "batch_step", "channel_step", "channel_window_channels_last",
                    "w_step_channels_last", "expanded_batch"]


@pytest.mark.cuda
@pytest.mark.parametrize("view", IN_PLACE_ON_CUDA)
def test_cuda_eval_allocates_no_copy_of_x(view):
    problem = Problem(4, 64, 128, (16, 32, 32), (5, 5, 5))
    _, fused = make_models(problem, torch.float32, "cuda")
    fused.eval()
    x = VIEWS[view](make_input(problem, torch.float32, "cuda"))
    with torch.no_grad():
        fused(x)  # warm-up: lazy initializations allocate too
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fused(x)
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < x.numel() * x.element_size() / 16, extra
