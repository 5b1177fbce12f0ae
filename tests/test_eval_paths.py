"""CUDA eval mode's two paths (README, memory formats; docs/performance.md, V5): the x-only
pass with the finalize that sums the weight (csrc/cuda/spatial_sum_x.cu, eval_finalize.cu)
where it applies, the x-and-weight pass with the plain finalize elsewhere. Which kernels run
is read from the profiler; every case is checked against the float64 modules."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import Problem, make_input, make_models, relerr
from test_dtypes import assert_output_accurate, make_dtype_models, rounded_input

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW = ("spatial_sum_x_kernel", "eval_finalize_kernel")
OLD = ("spatial_sum_kernel", "bn_finalize_kernel")
CHANNELS_LAST = ("spatial_sum_channels_last_kernel", "bn_finalize_kernel")


def pdl_device():
    return torch.cuda.get_device_capability()[0] >= 9


def kernels_of_call(fused, x):
    """Names of the CUDA kernels one call launches."""
    with torch.no_grad():
        fused(x)  # first call outside the profile (the launch sizing is cached per device)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fused(x)
            torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def assert_path(names, expected):
    for kernel in expected:
        assert any(kernel in n for n in names), (kernel, names)
    for kernel in {*NEW, *OLD, *CHANNELS_LAST} - set(expected):
        assert not any(kernel in n for n in names), (kernel, names)


def factorized_reference(ref, x):
    """Eval output of ref (stride 1, padding 0, groups 1) on x in float64 through
    docs/math.md §2.1 in ATen ops: the seed problem's convolution takes hours on a CPU."""
    conv, bn = ref.conv_transpose, ref.batch_norm
    sums = x.double().cpu().sum(dim=(2, 3, 4)) @ conv.weight.sum(dim=(2, 3, 4))
    positions = 1
    for size, k in zip(x.shape[2:], conv.kernel_size):
        positions *= size + k - 1
    z = ref.scale_factor * (sums / positions + conv.bias)
    out = (z - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    return out.view(*out.shape, 1, 1, 1)


def check(problem, x=None, dtype=torch.float32, training=False, factorized=False):
    """The fused module against the float64 reference on x; returns the kernels it ran."""
    ref, fused = make_models(problem, dtype, "cuda")
    ref.train(training)
    fused.train(training)
    if x is None:
        x = make_input(problem, dtype, "cuda")
    names = kernels_of_call(fused, x) if not training else None
    with torch.no_grad():
        out = fused(x)
        expected = factorized_reference(ref, x) if factorized else ref(x.double().cpu())
    assert relerr(out, expected) <= (1e-10 if dtype == torch.float64 else 1e-6)
    return names


# (problem, what it exercises in the new path)
SEED = Problem(16, 64, 128, (16, 32, 32), (5, 5, 5))
SHAPES = [
    (SEED, "seed: 2 parts a row on an H200, 16 lanes a sample"),
    (Problem(1, 1, 3, (64, 64, 64), (2, 2, 2)), "one row: fewer items than blocks, 32 parts"),
    (Problem(16, 100, 3, (1, 96, 96), (1, 1, 1)),
     "2 parts a row on an H200, 200 terms: a batch of 8 loads a lane and a remainder"),
    (Problem(1, 3, 4, (7, 9, 11), (2, 2, 2)), "odd row length: scalar loads, 32 lanes"),
    (Problem(300, 4, 5, (2, 2, 4), (2, 1, 2)), "batch > 256: one lane a sample, two rounds"),
    (Problem(2, 1024, 3, (2, 2, 2), (2, 2, 2)), "1024 input channels: the most terms"),
    (Problem(3, 1040, 4, (1, 2, 4), (1, 1, 2), conv_kwargs=dict(groups=2)),
     "groups of 520 input channels"),
    (Problem(5, 24, 36, (3, 5, 8), (3, 2, 2), conv_kwargs=dict(groups=3, stride=2, dilation=2)),
     "groups, stride and dilation; terms not a multiple of the batch of loads"),
]


@pytest.mark.parametrize("problem,why", SHAPES, ids=[w for _, w in SHAPES])
def test_x_only_path_shapes(problem, why):
    names = check(problem, factorized=problem is SEED)
    assert_path(names, NEW if pdl_device() else OLD)


@pytest.mark.parametrize("dtypes", [(torch.float64,) * 2, (torch.float16,) * 2,
                                    (torch.bfloat16, torch.float32)], ids=str)
def test_x_only_path_dtypes(dtypes):
    """16-byte loads of every dtype; BN inputs in another dtype are copied before the x pass."""
    conv_dtype, bn_dtype = dtypes
    p = Problem(4, 16, 12, (8, 8, 8), (3, 3, 3))
    ref, fused = make_dtype_models(p, conv_dtype, bn_dtype, "cuda")
    ref.eval()
    fused.eval()
    x = rounded_input(p, conv_dtype, "cuda")
    assert_path(kernels_of_call(fused, x), NEW if pdl_device() else OLD)
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert_output_accurate(out, expected, ref, x, bn_dtype)


def test_unaligned_x_takes_scalar_loads():
    p = Problem(2, 8, 6, (4, 8, 8), (2, 2, 2))
    flat = torch.randn(2 * 8 * 4 * 8 * 8 + 1, device="cuda")
    x = flat[1:].view(2, 8, 4, 8, 8)  # 4 bytes past a 16-byte boundary
    names = check(p, x)
    assert_path(names, NEW if pdl_device() else OLD)


def test_more_than_1024_input_channels_per_group_fall_back():
    names = check(Problem(2, 1040, 3, (1, 2, 2), (1, 1, 2)))
    assert_path(names, OLD)


def test_channels_last_keeps_its_kernel():
    p = Problem(3, 16, 10, (4, 6, 8), (2, 3, 2))
    x = make_input(p, torch.float32, "cuda").contiguous(memory_format=torch.channels_last_3d)
    names = check(p, x)
    assert_path(names, CHANNELS_LAST)


def test_training_keeps_the_weight_in_the_x_pass():
    p = Problem(4, 16, 12, (8, 8, 8), (3, 3, 3))
    _, fused = make_models(p, torch.float32, "cuda", algo="direct")
    fused.train()
    x = make_input(p, torch.float32, "cuda")
    names = kernels_of_call(fused, x)
    assert any("spatial_sum_kernel" in n for n in names), names
    assert not any(k in n for n in names for k in NEW), names
    check(p, training=True)


def test_eval_is_deterministic():
    _, fused = make_models(SEED, torch.float32, "cuda")
    fused.eval()
    x = make_input(SEED, torch.float32, "cuda")
    with torch.no_grad():
        first = fused(x)
        for _ in range(5):
            assert torch.equal(fused(x), first)


@torch.no_grad()
def test_graph_replay_reads_weight_and_bn_inputs_anew():
    """The finalize reads the weight and BN inputs before its wait: replays must see
    in-place changes made between them (16-byte loads of x here, unlike test_cuda_graphs)."""
    p = Problem(4, 8, 19, (4, 8, 8), (3, 2, 3))
    ref, fused = make_models(p, torch.float32, "cuda")
    ref.eval()
    fused.eval()
    static_x = make_input(p, torch.float32, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused(static_x)
    for _ in range(3):
        static_x.copy_(make_input(p, torch.float32, "cuda"))
        fused.conv_transpose.weight.mul_(1.25).add_(0.01)
        fused.batch_norm.running_mean.add_(0.5)
        fused.batch_norm.weight.mul_(-1.5)
        ref.load_state_dict(fused.state_dict())
        ref.double()
        graph.replay()
        assert relerr(static_out, ref(static_x.double().cpu())) <= 1e-6
