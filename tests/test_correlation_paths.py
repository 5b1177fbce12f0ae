"""The training paths built on x's channel cross-correlation at the phases' lags
(docs/math.md §3.4, §3.5): `correlation` (the lags by GEMMs over x, in float64) and
`cross_spectrum` (the lags from x's per-frequency cross-spectrum, contracted on a small
grid), on any device. Forced on the problems they cover (every padding-0 configuration:
strides, dilation, output padding, groups, kernels smaller than the stride) against
PyTorch's modules in float64, over several steps; refused with a clear error, and nothing
changed, where padding > 0."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import (DEVICES, Problem, assert_no_host_sync, assert_train_steps_match, cuda_train_step,
                      cuda_train_step_kernels, make_input, make_models, random_problems, relerr)
from test_fft_energy import FFT_PROBLEMS, STRIDED_FFT_PROBLEMS

# The FFT path's problems (every padding-0 family, two passes of its tiles, the seed
# problem's channels) and a few where the correlation's lags are few: kernel = stride.
PROBLEMS = FFT_PROBLEMS + STRIDED_FFT_PROBLEMS + [
    Problem(3, 5, 7, (4, 5, 3), (2, 2, 2), conv_kwargs=dict(stride=2)),  # one lag
    Problem(2, 6, 8, (3, 4, 5), (4, 2, 3), conv_kwargs=dict(stride=(2, 2, 3), groups=2)),
    Problem(1, 3, 4, (1, 1, 1), (3, 3, 3), conv_kwargs=dict(stride=2)),  # one input position
    # cross_spectrum.cu: 40 channels (two 32-wide tiles, the second partial) and 10 W lags
    # from 0 on (two launches of 5); several chunks of depth frequencies; 72 channels
    # (float32: three tiles, float64: five; off-diagonal pairs beyond the first row).
    Problem(2, 40, 24, (3, 4, 5), (2, 2, 10)),
    Problem(2, 72, 6, (3, 4, 5), (3, 3, 3)),
    Problem(1, 64, 8, (40, 20, 20), (3, 3, 3)),
    # cross_spectrum.cu's staging: 19 samples (a second chunk of 3) and 33 channels (a
    # second 32-wide tile of one); groups of 20 channels and 10 samples, with strides.
    Problem(19, 33, 5, (3, 4, 5), (3, 2, 3), scale=-1.5),
    Problem(10, 40, 6, (4, 3, 5), (2, 3, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2)),
    # and its unrolled steps (whole chunks of 16 samples, whole tiles): 32 samples in two
    # chunks and 32 channels, 7 W lags (launches of 5 and 2); 16 samples and 16 channels
    # (float32's 16-wide tile).
    Problem(32, 32, 5, (3, 4, 5), (3, 2, 7)),
    Problem(16, 16, 4, (3, 4, 5), (2, 2, 2), scale=0.5),
    # lag_stage.cu: 13 D lags and 11 H lags (two launches of up to 9 each).
    Problem(2, 5, 6, (3, 4, 5), (7, 6, 2)),
    # x_spectrum_dft.cu: odd D and H on even grids (radix 2 with a missing last odd input),
    # rows of x not whole 16-byte pieces (W = 6), and blocks of 8 channels whose second
    # group has one (20 x 7 x 2 blocks fill two per SM on an H200).
    Problem(20, 9, 6, (7, 7, 6), (2, 2, 3)),
] + random_problems(6, seed=11, conv_kwargs=dict(stride=(1, 2, 2), dilation=(2, 1, 1)))
TOL = {torch.float32: 1e-6, torch.float64: 1e-10}
ALGOS = ["correlation", "cross_spectrum"]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.ids)
def test_matches_reference_over_steps(problem, device, dtype, algo):
    ref, fused = make_models(problem, dtype, device, algo=algo)
    with torch.no_grad():
        out = ref.conv_transpose(make_input(problem, torch.float64))
    if out.shape[0] * out[0, 0].numel() == 1:
        pytest.skip("one value per channel: training is refused (tests/test_errors.py)")
    assert_train_steps_match(ref, fused, lambda: make_input(problem, dtype, device), TOL[dtype])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_kwargs", [dict(), dict(stride=2), dict(stride=2, kernel_size=2),
                                         dict(stride=(2, 1, 3), output_padding=(1, 0, 2))],
                         ids=str)
def test_survives_a_large_offset(device, conv_kwargs, algo):
    """correlation subtracts the mean in float64 from a float64 sum of squares (§3.4): an
    offset 50 times the spread leaves about 2500 x 1e-16 of it. cross_spectrum never forms
    the uncentred sum: the DC bin is left out of the float32 cross-spectrum (§3.5)."""
    conv_kwargs = dict(conv_kwargs)
    kernel = conv_kwargs.pop("kernel_size", 3)
    p = Problem(4, 6, 10, (5, 6, 7), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, device, algo=algo)
    x = make_input(p, torch.float32, device) + 50.0
    with torch.no_grad():
        assert relerr(fused(x), ref(x.double().cpu())) <= 1e-6


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conv_kwargs", [dict(padding=1), dict(stride=2, padding=(0, 1, 0))],
                         ids=str)
def test_refuses_padding(device, conv_kwargs, algo):
    p = Problem(2, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=conv_kwargs)
    _, fused = make_models(p, torch.float32, device, algo=algo)
    before = fused.batch_norm.running_var.clone()
    with pytest.raises(ValueError, match=f"algo='{algo}' needs padding 0"):
        fused(make_input(p, torch.float32, device))
    assert torch.equal(fused.batch_norm.running_var, before)
    assert int(fused.batch_norm.num_batches_tracked) == 0


@pytest.mark.parametrize("kernel, conv_kwargs, convolution", [
    (2, dict(stride=2), False),        # kernel = stride: one lag, a quarter of the conv's work
    (4, dict(stride=2), False),        # 27 lags, a fifth
    (3, dict(), True),                 # stride 1: 125 lags, three times the conv's work
    (2, dict(stride=2, padding=1), True),  # padding: not covered
], ids=["up2", "st2", "k3", "padding"])
def test_auto_on_cpu_takes_correlation_where_it_is_cheaper(kernel, conv_kwargs, convolution):
    """CPU auto: correlation where its float64 GEMMs have under a third of the
    convolution's multiply-adds (csrc/cpu/ct_bn_pool_cpu.cpp), else ATen's convolution."""
    p = Problem(4, 16, 32, (8, 8, 8), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, "cpu")
    ref.train()
    fused.train()
    x = make_input(p, torch.float32, "cpu")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fused(x)
    assert any("convolution" in e.name for e in prof.events()) == convolution
    with torch.no_grad():
        assert relerr(out, ref(x.double())) <= 1e-6


# What each path leaves in the profile: our kernels by name, correlation's GEMMs (aten::bmm),
# sliced_conv's aten::_convolution (csrc/sliced_conv_energy.cpp calls it directly).
PATH_MARKS = {"cross_spectrum": ("cross_spectrum_",), "fft": ("spectral_energy_kernel",),
              "direct": ("energy_direct_", "direct_stats_mma_kernel"), "sliced_conv": ("aten::_convolution",)}
CUDA_AUTO_CASES = [
    (4, 4, dict(stride=2), "cross_spectrum"),    # st2: 27 lags from the cross-spectrum
    (2, 4, dict(stride=2), "correlation"),       # up2: one lag, the Gram matrix
    (3, 16, dict(), "fft"),                      # stride 1, 2.2e8 multiply-adds: Parseval
    (3, 4, dict(), "direct"),                    # stride 1, 5.5e7: the direct kernel
    (2, 16, dict(stride=2, padding=1), "sliced_conv"),  # padding, 1.8e8: cuDNN over slices
    (2, 4, dict(stride=2, padding=1), "direct"),        # padding, 4.5e7: the direct kernel
    (3, 16, dict(padding=1), "direct"),          # padding at stride 1, 1.1e8: the direct kernel
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel, batch, conv_kwargs, expected", CUDA_AUTO_CASES,
                         ids=["st2", "up2", "k3", "k3-small", "padding", "padding-small", "padding-stride1"])
def test_auto_on_cuda_takes_the_measured_fastest(kernel, batch, conv_kwargs, expected):
    """CUDA auto (csrc/cuda/ct_bn_pool_cuda.cpp, docs/performance.md): with a stride and
    padding 0 the cross-spectrum, or the correlation's single GEMM when every phase has
    one tap; elsewhere the direct kernel under 1e8 multiply-adds (2e8 with padding at
    stride 1), then at stride 1 the FFT path, with padding cuDNN's convolution."""
    p = Problem(batch, 16, 32, (8, 8, 8), (kernel,) * 3, conv_kwargs=conv_kwargs)
    ref, fused = make_models(p, torch.float32, "cuda")
    ref.train()
    fused.train()
    x = make_input(p, torch.float32, "cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    seen = {path for path, marks in PATH_MARKS.items() if any(m in name for m in marks for name in names)}
    assert seen == ({expected} & PATH_MARKS.keys())
    if expected == "correlation":
        assert any(name == "aten::bmm" for name in names)
    with torch.no_grad():
        assert relerr(out, ref(x.double().cpu())) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_cross_spectrum_builds_its_tables_once_per_geometry(device):
    """The lag phases and tap slots depend on the geometry alone (csrc/table_cache.h): a
    second call with other samples, batch and channels but the same sizes builds none
    (aten::polar makes the phases) and is still right."""
    first, second = (Problem(batch, ci, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(stride=(1, 2, 1)))
                     for batch, ci in ((2, 5), (3, 7)))
    for p, expect_polar in ((first, None), (second, False)):
        ref, fused = make_models(p, torch.float32, device, algo="cross_spectrum")
        ref.train()
        fused.train()
        x = make_input(p, torch.float32, device)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fused(x)
        if expect_polar is not None:
            assert any(e.name == "aten::polar" for e in prof.events()) == expect_polar
        with torch.no_grad():
            assert relerr(out, ref(x.double().cpu())) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch, size, kernel, expected", [
    (16, (16, 32, 32), (5, 5, 5), "cross_spectrum"),
    (4, (16, 32, 32), (5, 5, 5), "cross_spectrum"),
    (16, (8, 16, 16), (5, 5, 5), "fft"),
    (16, (1, 32, 32), (1, 5, 5), "cross_spectrum"),
], ids=["seed", "b4", "s8", "depth-1"])
def test_auto_on_cuda_at_stride_1_weighs_the_cross_spectrum(batch, size, kernel, expected):
    """At stride 1 CUDA auto takes the cross-spectrum where its work is large enough to beat
    the FFT path (the seed problem and its batch of 4: 1.2e9 and 5.0e8 multiply-adds), else
    the FFT path (s8, 2.3e8): csrc/cuda/ct_bn_pool_cuda.cpp, docs/performance.md (14:14 UTC
    run); with one position in the depth (border's plane problems) the cross-spectrum whatever
    its work (5.9e7 here; 17:56 UTC run). Checked against float64 on the GPU."""
    p = Problem(batch, 64, 128, size, kernel)
    ref, fused = make_models(p, torch.float32, "cuda")
    ref.cuda().train()
    fused.train()
    x = make_input(p, torch.float32, "cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fused(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert {path for path, marks in PATH_MARKS.items() if any(m in name for m in marks for name in names)} == {expected}
    with torch.no_grad():
        assert relerr(out, ref(x.double())) <= 1e-6


def cross_spectrum_step_kernels(problem, dtype=torch.float32):
    return cuda_train_step_kernels(problem, "cross_spectrum", dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch, d_stages, chunks", [(8, 1, 2), (1, 6, 6)], ids=["kept", "per-chunk"])
def test_cross_spectrum_keeps_the_w_stage_output_where_x_spectrum_is_larger(batch, d_stages, chunks):
    """csrc/cross_spectrum_energy.cpp: over 42 depth frequencies in chunks, the W stage's
    output (20.6 MB of complex64 here, whatever the batch) is kept for one D stage where x's
    spectrum is at least as large (batch 8: 45 MB, 2 chunks), else the D stage runs per chunk
    (batch 1: 5.7 MB, 6 chunks of at most 8 MiB of Q). Both against float64."""
    names = cross_spectrum_step_kernels(Problem(batch, 64, 8, (40, 20, 20), (3, 3, 3)))
    # the D stage is the lag stage that stores float64 sums (the W stage stores x's dtype)
    assert sum("lag_stage_kernel<float2, double2" in n for n in names) == d_stages
    assert sum("lag_stage_kernel<float2, float2" in n for n in names) == chunks


# The S stage's cases (tests above): tiles past the channels, lag launches of 5 and 2,
# chunks of samples with a partial one, groups, strides; and for cross_spectrum_mma.cu a
# partial chunk of samples with an even group (34 channels: a block whose columns end at
# 34 of its 48).
S_STAGE_PROBLEMS = [p for p in PROBLEMS if p.in_channels >= 16 or p.batch >= 10] + [
    Problem(19, 34, 5, (3, 4, 5), (3, 2, 3), scale=-1.5),
    # cross_spectrum_mma.cu's paired blocks (BlockPlan): 48 channels (one pair of row blocks,
    # 0 and 2) and 128 (two pairs, 1 and 3, 5 and 7).
    Problem(3, 48, 5, (3, 4, 5), (2, 3, 3)),
    Problem(2, 128, 4, (3, 3, 4), (2, 2, 3)),
    # and its stores (16 bytes per two entries of a row, the diagonal's i = j + 1 alone): groups
    # of 2 channels (one partial tile; 2 h lags: the 2-lag kernel) and 6, and 10 channels (a
    # pair of row blocks with one idle side).
    Problem(2, 12, 6, (3, 4, 5), (2, 2, 3), conv_kwargs=dict(groups=6)),
    Problem(3, 12, 4, (3, 4, 5), (3, 2, 3), scale=-1.5, conv_kwargs=dict(groups=2)),
    Problem(3, 10, 5, (3, 4, 5), (2, 3, 3))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("s_stage", ["default", "simt"])
@pytest.mark.parametrize("problem", S_STAGE_PROBLEMS, ids=Problem.ids)
def test_cross_spectrum_s_stage_kernels(problem, s_stage, monkeypatch):
    """csrc/cuda/cross_spectrum_mma.cu (float64 tensor cores) on sm_90 and later where the
    groups have an even number of channels, else cross_spectrum.cu; FUSED_OPS_S_STAGE=simt
    takes the latter everywhere. Both against float64, and the kernel that ran is the one
    named."""
    if s_stage == "simt":
        monkeypatch.setenv("FUSED_OPS_S_STAGE", "simt")
    names = cross_spectrum_step_kernels(problem)
    group_channels = problem.in_channels // problem.conv_kwargs.get("groups", 1)
    mma = s_stage == "default" and torch.cuda.get_device_capability()[0] >= 9 and group_channels % 2 == 0
    assert any("cross_spectrum_mma_kernel" in n for n in names) == mma
    assert any("cross_spectrum_kernel<float" in n for n in names) == (not mma)


# The contraction's cases (csrc/cuda/quad_form_mma.cu; R = 2 Cig rows, C columns per group and
# call): R = C = 128 (the seed problem's two row and two column tiles); R = 10 (one partial row
# tile, one chunk) with C = 37 (odd: W copied 8 bytes at a time); R = 72 (a second row tile of
# 8 rows, a chunk past R) with C = 200 (a last column tile of 8); groups of 3, with R = 72 and
# C = 20, and R = 10 and C = 7; 48 output channels in calls of 20, 20 and 8 columns
# (phase_energies' 8 MiB of spectra per chunk); two phases (C = P n).
CONTRACTION_PROBLEMS = [
    Problem(2, 64, 128, (3, 4, 5), (2, 2, 3)),
    Problem(2, 5, 37, (3, 4, 5), (2, 3, 2)),
    Problem(2, 36, 200, (3, 4, 5), (2, 2, 2)),
    Problem(2, 108, 60, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(groups=3)),
    Problem(2, 15, 21, (3, 4, 5), (2, 3, 2), scale=-1.5, conv_kwargs=dict(groups=3)),
    Problem(2, 64, 48, (2, 3, 3), (5, 5, 5)),
    Problem(2, 4, 12, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("contraction", ["default", "gemm"])
@pytest.mark.parametrize("problem", CONTRACTION_PROBLEMS, ids=Problem.ids)
def test_cross_spectrum_contraction_kernels(problem, contraction, monkeypatch):
    """csrc/cuda/quad_form_mma.cu (the fused contraction, float64 tensor cores) on sm_90 and
    later, else cuBLAS's product and quad_form.cu; FUSED_OPS_CONTRACTION=gemm takes the latter
    everywhere. Both against float64, and the kernel that ran is the one named."""
    if contraction == "gemm":
        monkeypatch.setenv("FUSED_OPS_CONTRACTION", "gemm")
    names = cross_spectrum_step_kernels(problem)
    fused = contraction == "default" and torch.cuda.get_device_capability()[0] >= 9
    assert any("quad_form_mma_kernel" in n for n in names) == fused
    assert any("quad_form_kernel" in n for n in names) == (not fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("problem, kernel", [
    (Problem(3, 6, 5, (3, 4, 5), (2, 3, 4)), True),
    (Problem(2, 4, 12, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2)), True),
    (Problem(3, 6, 10, (4, 4, 3), (2, 3, 8)), True),   # k'w = 8: the kernel's largest
    (Problem(2, 5, 6, (3, 4, 5), (2, 2, 10)), False),  # k'w = 10: ATen's GEMMs
    (Problem(2, 3, 4, (2, 8, 8), (1, 7, 7)), False),   # k'h k'w = 49: past its shared memory
], ids=["k2x3x4", "groups-strided", "kw8", "kw10", "k7x7"])
def test_cross_spectrum_tap_spectrum_kernel(problem, kernel):
    """csrc/cuda/tap_spectrum.cu takes the sub-kernels' spectra where k'w <= 8 and a block's
    planes fit 48 KiB of shared memory (k'h k'w < 48), else ATen's GEMMs one dim at a time
    (tap_spectrum_aten). Both against float64: the kernel forms half the depth bins and
    mirrors the rest, so k'd of 1 to 3 and groups are among the cases (the reference tests
    above run it on every shape they cover with k'w <= 8)."""
    names = cross_spectrum_step_kernels(problem)
    assert any("tap_spectrum_kernel" in n for n in names) == kernel


TAP_SOURCES = ["StackTaps", "WeightTaps<float>", "WeightTaps<double>"]


def tap_spectrum_sources(names):
    """Where the tap_spectrum.cu launches among the kernels named read the taps (their Taps type)."""
    return {source for n in names if "tap_spectrum_kernel<" in n for source in TAP_SOURCES if source in n}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("problem, dtype, source", [
    (Problem(3, 6, 5, (3, 4, 5), (2, 3, 4)), torch.float32, "WeightTaps<float>"),
    (Problem(3, 6, 5, (3, 4, 5), (2, 3, 4)), torch.float64, "WeightTaps<double>"),
    # 144 columns: tiles of 32, the last of 16, across the weight's rows of 12
    (Problem(2, 12, 36, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(groups=3)), torch.float32, "WeightTaps<float>"),
    # 48 output channels in chunks of 20, 20 and 8 (phase_energies' 8 MiB of spectra per chunk)
    (Problem(2, 64, 48, (2, 3, 3), (5, 5, 5)), torch.float32, "WeightTaps<float>"),
    # dilation and output padding: one phase, not the full convolution
    (Problem(2, 4, 6, (3, 4, 5), (2, 3, 3), conv_kwargs=dict(dilation=2, output_padding=(1, 0, 1))),
     torch.float32, "WeightTaps<float>"),
    # phases: phase_stack's float64 gather
    (Problem(2, 4, 12, (3, 4, 5), (3, 5, 3), conv_kwargs=dict(stride=(1, 2, 1), groups=2)), torch.float32,
     "StackTaps"),
    # 200 k'd x 8 k'w float64 taps: 0.4 MB of shared memory per block of 32 columns, past any GPU's
    (Problem(2, 2, 3, (1, 1, 2), (200, 1, 8)), torch.float64, "StackTaps"),
    # 27 taps (odd) of 64 output channels: each tile of 32 columns one run of the weight,
    # staged by the whole block; 40 in float64: a second tile of 8, one run too
    (Problem(2, 3, 64, (3, 4, 5), (3, 3, 3)), torch.float32, "WeightTaps<float>"),
    (Problem(2, 1, 40, (3, 4, 5), (3, 3, 3)), torch.float64, "WeightTaps<double>"),
    # k'h = 10: pairs of h bins and plane rows past the block's 8 warps (warps 0 and 1 take two)
    (Problem(2, 3, 4, (3, 12, 4), (2, 10, 2)), torch.float32, "WeightTaps<float>"),
], ids=["seed-like", "float64", "groups", "chunks", "dilated", "phases", "staging-too-large", "one-run",
        "one-run-partial", "pairs-past-warps"])
def test_cross_spectrum_tap_spectrum_reads_the_weight(problem, dtype, source):
    """With one phase tap_spectrum.cu reads the taps from the weight itself in its dtype
    (WeightTaps: each warp's columns staged in shared memory), also per chunk of output
    channels; with phases, or where the staging does not fit a block's shared memory, from
    the float64 stack (StackTaps). Both against float64."""
    assert tap_spectrum_sources(cross_spectrum_step_kernels(problem, dtype)) == {source}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cross_spectrum_tap_spectrum_reads_a_strided_weight():
    """A weight whose channels are strided in memory (Ci and Co swapped) reaches the path
    contiguous (the op's copy in the energy's dtype), so it is read in place too."""
    problem = Problem(3, 6, 5, (3, 4, 5), (2, 3, 4))
    ref, fused = make_models(problem, torch.float32, "cuda", algo="cross_spectrum")
    weight = fused.conv_transpose.weight
    with torch.no_grad():
        fused.conv_transpose.weight = torch.nn.Parameter(weight.transpose(0, 1).contiguous().transpose(0, 1))
    assert not fused.conv_transpose.weight.is_contiguous()
    names = cuda_train_step(problem, ref, fused, torch.float32)
    assert tap_spectrum_sources(names) == {"WeightTaps<float>"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapping_launches_off_gives_the_same_bits(monkeypatch):
    """FUSED_OPS_OVERLAP=off (csrc/cuda/pdl.cuh, for profiling) launches the training chain's
    kernels one after another: the same output and running statistics, bit for bit."""
    p = Problem(3, 16, 8, (5, 6, 7), (3, 2, 3))
    x = make_input(p, torch.float32, "cuda") + 1.0
    results = []
    for overlap in ("auto", "off"):
        monkeypatch.setenv("FUSED_OPS_OVERLAP", overlap)
        torch.manual_seed(0)  # the same parameters for both
        _, fused = make_models(p, torch.float32, "cuda", algo="cross_spectrum")
        fused.train()
        with torch.no_grad():
            out = fused(x)
        results.append([out, fused.batch_norm.running_mean, fused.batch_norm.running_var])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variable, algo", [("FUSED_OPS_S_STAGE", "cross_spectrum"),
                                             ("FUSED_OPS_CONTRACTION", "cross_spectrum"),
                                             ("FUSED_OPS_OVERLAP", "cross_spectrum"),
                                             ("FUSED_OPS_DIRECT", "direct")])
def test_a_forced_route_refuses_an_unknown_value(variable, algo, monkeypatch):
    """FUSED_OPS_S_STAGE takes `auto` or `simt`, FUSED_OPS_CONTRACTION `auto` or `gemm`,
    FUSED_OPS_OVERLAP `auto` or `off`, FUSED_OPS_DIRECT `auto`, `mma` or `simt`; anything else
    is an error naming the variable, and the running statistics and the batch count are left as
    they were."""
    monkeypatch.setenv(variable, "tensor_cores")
    p = Problem(2, 8, 4, (3, 4, 5), (2, 2, 2))
    _, fused = make_models(p, torch.float32, "cuda", algo=algo)
    fused.train()
    bn = fused.batch_norm
    before = [t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    with torch.no_grad(), pytest.raises(RuntimeError, match=variable):
        fused(make_input(p, torch.float32, "cuda"))
    for old, now in zip(before, (bn.running_mean, bn.running_var, bn.num_batches_tracked)):
        assert torch.equal(old, now)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algo", ALGOS)
def test_no_host_sync_on_cuda(algo):
    """Every table (phases, lags, sub-kernels) is built on the device: nothing waits."""
    p = Problem(3, 4, 6, (3, 4, 5), (3, 3, 3), conv_kwargs=dict(stride=(2, 1, 3)))
    _, fused = make_models(p, torch.float32, "cuda", algo=algo)
    assert_no_host_sync(fused, make_input(p, torch.float32, "cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algo", ["cross_spectrum", "fft", "correlation"])
@pytest.mark.parametrize("problem, from_spectrum", [
    (Problem(2, 16, 4, (17, 128, 128), (1, 2, 2), scale=-1.5), True),  # 35.7 MB of x
    (Problem(2, 16, 4, (17, 128, 128), (2, 2, 2), conv_kwargs=dict(stride=2, groups=2)), True),
    (Problem(3, 10, 6, (5, 9, 12), (3, 2, 3)), False),  # 130 KB
    (Problem(3, 10, 6, (1, 9, 12), (1, 2, 3)), True),  # one depth position: no sum over D to add
], ids=lambda v: Problem.ids(v) if isinstance(v, Problem) else str(v))
def test_training_takes_large_x_sums_from_the_spectrum_pass(problem, from_spectrum, algo):
    """From 32 MiB of x the spectral paths take x's sums (the means, docs/math.md §2) from
    their pass over x for its spectrum (x_spectrum's channel sums, csrc/cuda/x_spectrum_dft.cu:
    the planes' sums, added over D by the D DFT's launch), not from a pass of their own
    (spatial_sum_kernel); below it, and on the correlation
    path, which forms no spectrum, that pass stays (csrc/ct_bn_pool.cpp: kMinSpectrumSumsBytes);
    with one depth position at any size (training_sample_sums). Checked against float64: output
    and running statistics."""
    names = cuda_train_step_kernels(problem, algo)
    spectral = algo != "correlation"
    assert any("spatial_sum" in name for name in names) == (not (spectral and from_spectrum))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algo, dtype", [("cross_spectrum", torch.float32), ("cross_spectrum", torch.float64),
                                         ("fft", torch.float32)], ids=str)
def test_one_depth_position_skips_the_depth_stages(algo, dtype):
    """With one depth position and frequency (border's plane problems, docs/math.md §3.6):
    plane_dft writes x's spectrum itself (csrc/cuda/x_spectrum_dft.cu: no depth_dft), and on the
    cross-spectrum path the W stage's coefficients carry the D stage's 1 / |L|, so that one lag
    stage writes Z^ in float64 (csrc/cross_spectrum_energy.cpp: Tables::coef_wd). Checked
    against float64: output and running statistics."""
    names = cuda_train_step_kernels(Problem(3, 20, 12, (1, 9, 12), (1, 3, 3)), algo, dtype)
    assert any("plane_dft" in n for n in names)
    assert not any("depth_dft" in n for n in names)
    if algo == "cross_spectrum":
        complex_t = "float2" if dtype == torch.float32 else "double2"
        assert sum("lag_stage_kernel" in n for n in names) == 1
        assert sum(f"lag_stage_kernel<{complex_t}, double2" in n for n in names) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_depth_position_in_slices_of_a_channels_last_x():
    """csrc/cuda/x_spectrum_dft.cu copies an x of another layout a slice of the batch at a time
    (48 MiB of spectrum: 23 of these samples); with one depth position plane_dft writes each
    slice's samples, and their sums, at their own place in the spectrum: 30 samples, slices of 23
    and 7. Against float64: output and running statistics."""
    p = Problem(30, 8, 4, (1, 256, 256), (1, 3, 3), scale=-1.5)
    ref, fused = make_models(p, torch.float32, "cuda", algo="cross_spectrum")
    x = make_input(p, torch.float32, "cuda").to(memory_format=torch.channels_last_3d)
    assert_train_steps_match(ref, fused, lambda: x, 1e-6, steps=1)
