"""Eval mode (docs/math.md §2): the running statistics normalize the pooled output, which
needs x's sums and the weight's, no convolution. Against PyTorch's modules in float64 on every
configuration family (beta random: eval's output has no batch statistics to hide); the box
sums' contraction with padding in both of its branches (the finalize's own loops, or one GEMM
past finalize_terms); on CUDA, which of the eval kernels runs where."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, KERNELS, OUT_TOL, SPECIAL, TOL, Problem, make_dtype_models,
                      make_input, make_models, random_problems, relerr)

DTYPES = [torch.float64, torch.float32]
EVAL_PROBLEMS = SPECIAL + random_problems(10, seed=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", EVAL_PROBLEMS, ids=Problem.ids)
def test_matches_reference(problem, dtype, device):
    ref, fused = make_models(problem, dtype, device, beta="random")
    ref.eval()
    fused.eval()
    x = make_input(problem, dtype, device)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    with torch.no_grad():
        out = fused(x)
        expected = ref(x.double().cpu())
    assert out.shape == expected.shape and out.dtype == dtype and out.device == x.device
    assert relerr(out, expected) <= TOL[dtype]
    for key, value in fused.state_dict().items():  # eval writes nothing
        assert torch.equal(value, before[key]), key


def call_with_aten_ops(fused, x):
    """(fused(x), the names of the ATen ops the call ran)."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fused(x)
    return out, sorted(e.name for e in prof.events() if e.name.startswith("aten::"))


# (problem, its box-sum terms B Cig taps per channel against the built-in 16384)
TERM_PROBLEMS = [
    Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(padding=1)),  # 216: the finalize
    Problem(3, 6, 9, (3, 4, 5), (3, 2, 3), scale=-1.5,
            conv_kwargs=dict(padding=(1, 0, 2), stride=(1, 2, 1), groups=3)),
    Problem(5, 64, 4, (3, 4, 5), (5, 5, 3), conv_kwargs=dict(padding=2)),  # 24000: the GEMM
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("problem", TERM_PROBLEMS, ids=Problem.ids)
def test_box_sums_contraction_on_both_sides_of_the_term_limit(problem, training, dtype, device):
    """With padding the per-sample sums contract the box sums with the weight: B Cig taps
    terms per output channel, in the finalize up to finalize_terms, as one GEMM past it.
    finalize_terms=1 forces the GEMM on every problem, a large value the finalize; both
    against float64 (output and, in training, running statistics), and the two calls run
    different ATen ops (the limit took effect). Training with sliced_conv, which takes the
    sample sums from the box sums (CUDA's direct kernels at stride 1 take them from y)."""
    runs = {}
    for name, limit in (("gemm", 1), ("finalize", 1 << 40)):
        torch.manual_seed(0)
        ref, fused = make_models(problem, dtype, device, beta="random",
                                 algo="sliced_conv" if training else "auto")
        ref.train(training)
        fused.train(training)
        x = make_input(problem, dtype, device, offset=0.5)
        with fused_ops.testing.limit(finalize_terms=limit):
            out, ops = call_with_aten_ops(fused, x)
        with torch.no_grad():
            assert relerr(out, ref(x.double().cpu())) <= TOL[dtype], name
        if training:
            for stat in ("running_mean", "running_var"):
                assert relerr(getattr(fused.batch_norm, stat),
                              getattr(ref.batch_norm, stat)) <= TOL[dtype], (name, stat)
        runs[name] = ops
    assert runs["gemm"] != runs["finalize"]


# --- CUDA: which kernels run -------------------------------------------------------------------

NEW = (KERNELS["eval_x_sums"], KERNELS["eval_finalize"])
OLD = (KERNELS["spatial_sum_plain"], KERNELS["bn_finalize"])
CHANNELS_LAST = (KERNELS["channels_last_sums"], KERNELS["bn_finalize"])


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


def check(problem, x=None, dtype=torch.float32, factorized=False):
    """The fused module in eval mode against the float64 reference on x; the kernels it ran."""
    ref, fused = make_models(problem, dtype, "cuda", beta="random")
    ref.eval()
    fused.eval()
    if x is None:
        x = make_input(problem, dtype, "cuda")
    names = kernels_of_call(fused, x)
    with torch.no_grad():
        out = fused(x)
        expected = factorized_reference(ref, x) if factorized else ref(x.double().cpu())
    assert relerr(out, expected) <= TOL[dtype]
    return names


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


@pytest.mark.cuda
@pytest.mark.parametrize("problem,why", SHAPES, ids=[w for _, w in SHAPES])
def test_x_only_path_shapes(problem, why):
    names = check(problem, factorized=problem is SEED)
    assert_path(names, NEW if pdl_device() else OLD)


@pytest.mark.cuda
@pytest.mark.parametrize("dtypes", [(torch.float64,) * 2, (torch.float16,) * 2,
                                    (torch.bfloat16, torch.float32)], ids=str)
def test_x_only_path_dtypes(dtypes):
    """16-byte loads of every dtype; BN inputs in another dtype are copied before the x pass."""
    conv_dtype, bn_dtype = dtypes
    p = Problem(4, 16, 12, (8, 8, 8), (3, 3, 3))
    ref, fused = make_dtype_models(p, conv_dtype, bn_dtype, "cuda", beta="random")
    ref.eval()
    fused.eval()
    x = make_input(p, conv_dtype, "cuda")
    assert_path(kernels_of_call(fused, x), NEW if pdl_device() else OLD)
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= OUT_TOL[conv_dtype]


@pytest.mark.cuda
def test_unaligned_x_takes_scalar_loads():
    p = Problem(2, 8, 6, (4, 8, 8), (2, 2, 2))
    flat = torch.randn(2 * 8 * 4 * 8 * 8 + 1, device="cuda")
    x = flat[1:].view(2, 8, 4, 8, 8)  # 4 bytes past a 16-byte boundary
    assert_path(check(p, x), NEW if pdl_device() else OLD)


@pytest.mark.cuda
def test_more_than_1024_input_channels_per_group_fall_back():
    assert_path(check(Problem(2, 1040, 3, (1, 2, 2), (1, 1, 2))), OLD)


@pytest.mark.cuda
def test_channels_last_keeps_its_kernel():
    p = Problem(3, 16, 10, (4, 6, 8), (2, 3, 2))
    x = make_input(p, torch.float32, "cuda").contiguous(memory_format=torch.channels_last_3d)
    assert_path(check(p, x), CHANNELS_LAST)


@pytest.mark.cuda
def test_training_keeps_the_weight_in_the_x_pass():
    p = Problem(4, 16, 12, (8, 8, 8), (3, 3, 3))
    _, fused = make_models(p, torch.float32, "cuda", algo="direct")
    fused.train()
    names = kernels_of_call(fused, make_input(p, torch.float32, "cuda"))
    assert any(KERNELS["spatial_sum_plain"] in n for n in names), names
    assert not any(k in n for n in names for k in NEW), names


@pytest.mark.cuda
def test_is_deterministic():
    _, fused = make_models(SEED, torch.float32, "cuda")
    fused.eval()
    x = make_input(SEED, torch.float32, "cuda")
    with torch.no_grad():
        first = fused(x)
        for _ in range(5):
            assert torch.equal(fused(x), first)


@pytest.mark.cuda
@pytest.mark.parametrize("problem, layout, kernel", [
    (Problem(2, 5, 6, (4, 6, 7), (3, 2, 3), conv_kwargs=dict(padding=(1, 1, 2))),
     torch.contiguous_format, True),
    # read in place through its strides
    (Problem(2, 5, 6, (4, 6, 7), (3, 2, 3), conv_kwargs=dict(stride=2, padding=(1, 0, 2), output_padding=1)),
     torch.channels_last_3d, True),
    # one plane of x (120 x 120 positions) past the kernel's 48 KiB: ATen's einsums
    (Problem(1, 2, 3, (2, 120, 120), (1, 3, 3), conv_kwargs=dict(padding=(0, 1, 1))),
     torch.contiguous_format, False),
], ids=["contiguous", "channels-last-strided", "large-plane"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_box_sums_kernel(problem, layout, kernel, dtype):
    """The sums of x over the taps' boxes (docs/math.md §2.2), which an eval call with padding
    turns into its whole output, against float64 (float16 and bfloat16 x: tests/test_dtypes.py)."""
    ref, fused = make_models(problem, dtype, "cuda", beta="random")
    ref.eval()
    fused.eval()
    x = make_input(problem, dtype, "cuda").contiguous(memory_format=layout)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    assert any(KERNELS["box_sums"] in e.name for e in prof.events()) == kernel
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= TOL[dtype]
