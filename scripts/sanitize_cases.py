"""Small calls that run every CUDA kernel once, for compute-sanitizer (scripts/gpu_check.sh).

    python scripts/sanitize_cases.py [--shard I/N]

Kernels that `auto` does not pick for these shapes are reached with fused_ops.testing.route.
--shard I/N runs the I-th of N interleaved parts of the cases (0 <= I < N), so that N
sanitizer processes share the work: racecheck runs each case an order of magnitude slower
than memcheck.
"""
import argparse
import itertools

import torch

import fused_ops
import fused_ops.testing

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--shard", default="0/1", help="I/N: the I-th of N parts of the cases")
SHARD, SHARDS = (int(part) for part in parser.parse_args().shard.split("/"))
if not 0 <= SHARD < SHARDS:
    parser.error(f"--shard {SHARD}/{SHARDS}: needs 0 <= I < N")
CASES = itertools.count()


def mine() -> bool:
    """Whether the next case is this shard's."""
    return next(CASES) % SHARDS == SHARD


def run(batch, ci, co, size, kernel, training, algo, dtype=torch.float32, bn_dtype=None,
        view=lambda x: x, **conv):
    if not mine():
        return
    m = fused_ops.ConvTransposeBNPool3d(ci, co, kernel, 2.0, algo=algo, **conv).cuda().to(dtype)
    m.batch_norm.to(bn_dtype or dtype)
    m.train(training)
    with torch.no_grad():
        out = m(view(torch.randn(batch, ci, *size, device="cuda", dtype=dtype)))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def no_stats_and_the_split_ops():
    """The overload without running statistics, and ct_bn_pool_stats / ct_bn_pool_apply."""
    m = fused_ops.ConvTransposeBNPool3d(4, 6, 3, 2.0, stride=2, track_running_stats=False).cuda()
    with torch.no_grad():
        assert torch.isfinite(m(torch.randn(2, 4, 3, 4, 5, device="cuda"))).all()
    x, w = torch.randn(3, 4, 3, 4, 5, device="cuda"), torch.randn(4, 6, 2, 2, 2, device="cuda")
    sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(x, w)
    out = torch.ops.fused_ops.ct_bn_pool_apply(sums, stats, 4 * 5 * 6, None, 2.0, None, None,
                                               None, None, 0.1, 1e-5, torch.float32)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def training_step(batch, ci, co, size, kernel, backward="auto", dtype=torch.float32, **conv):
    """A training step where gradients flow: on a padded problem, the "kept" route's ops
    (csrc/kept/kept.cpp: y's moments, the finalize, the gradient coefficients and the
    backward; the moments in each dtype of y, the coefficients in float32 and float64); with
    one tap per output position and `backward` "gram", its backward from the kept statistics
    (csrc/gram/gram.cpp)."""
    if not mine():
        return
    m = fused_ops.ConvTransposeBNPool3d(ci, co, kernel, 2.0, **conv).cuda().to(dtype)
    x = torch.randn(batch, ci, *size, device="cuda", dtype=dtype, requires_grad=True)
    with fused_ops.testing.route(backward=backward):
        m(x).square().sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.conv_transpose.weight.grad).all()


training_step(3, 5, 6, (3, 4, 5), 3, padding=1)
training_step(2, 6, 9, (5, 3, 4), 3, stride=2, padding=1, output_padding=1, groups=3)
training_step(3, 6, 4, (3, 4, 5), 2, backward="gram", stride=2, groups=2)
training_step(2, 4, 6, (3, 4, 5), 3, dtype=torch.float64, padding=1)
training_step(2, 4, 6, (3, 4, 5), 3, dtype=torch.bfloat16, padding=1)
for training in (False, True):
    for algo in ("direct", "sliced_conv"):
        run(3, 5, 19, (3, 4, 5), (2, 3, 2), training, algo)
        run(2, 6, 9, (5, 3, 4), 3, training, algo, stride=2, padding=1, output_padding=1, groups=3)
# direct_energy.cu's kernel from global memory: 256 KiB of x per sample, past what it stages in
# shared memory (the cases above are staged; at stride and dilation 1
# direct_energy_stride1.cu's).
run(1, 8, 4, (16, 16, 16), 2, True, "direct", torch.float64, dilation=(1, 1, 2))
# At stride and dilation 1, direct_stats_mma.cu and direct_energy_stride1.cu: padding with halos
# outside x, several staged chunks of input channels, a partial tile of output channels, groups;
# the tensor cores' kernel also with tiles of part of a row, several tiles per block and its weights
# kept over them, one MMA tile per block; box_sums.cu in float32, float64 and bfloat16 x.
for route in ("mma", "simt"):
    with fused_ops.testing.route(direct=route):
        for dtype in (torch.float32, torch.float64):
            run(2, 40, 20, (9, 9, 11), 5, True, "direct", dtype, padding=(5, 2, 0))
            run(3, 6, 9, (4, 13, 7), (2, 3, 2), True, "direct", dtype, groups=3, padding=(0, 1, 1))
with fused_ops.testing.route(direct="mma"):
    for dtype in (torch.float32, torch.float64):
        run(2, 3, 5, (2, 3, 300), (2, 2, 3), True, "direct", dtype, padding=(0, 1, 1))
        run(3, 5, 7, (9, 11, 13), (2, 3, 4), True, "direct", dtype)
        run(2, 4, 6, (3, 4, 5), 3, True, "direct", dtype, padding=1)
run(2, 5, 6, (4, 6, 7), 3, False, "auto", torch.bfloat16, padding=1)
# Input channels over 16 sets of threads and (kd, kh) pairs over 2 (132 SMs), rows of odd length.
for dtype in (torch.float32, torch.float64):
    run(1, 27, 20, (5, 6, 7), 3, True, "direct", dtype, dilation=(1, 2, 1))
for conv in ({}, {"groups": 2, "dilation": (2, 1, 1)}):
    run(19, 6, 38, (5, 4, 7), (3, 2, 3), True, "fft", **conv)  # two b passes, edge tiles
run(2, 3, 5, (30, 2, 3), 2, True, "fft")  # two fd passes
# fft_spectral_energy.cu's kernel for small batches (each block's own weight spectrum): the
# bench's t8c64, taps in several pieces (k5), groups with dilation, odd channel counts.
run(8, 64, 64, (8, 8, 8), 3, True, "fft")
run(8, 32, 32, (8, 8, 8), 5, True, "fft")
run(5, 14, 10, (4, 5, 6), (3, 2, 3), True, "fft", groups=2, dilation=(2, 1, 3))
run(3, 7, 5, (6, 3, 5), 2, True, "fft")
# x_spectrum_dft.cu's tiles at the seed problem's grid (5 W bins per thread, rows of x in the
# plane spectrum's memory, depth radix 4 in one pass of 5 rows; the plane sums of training)
# and at a depth grid of 40 (two passes of 8).
run(2, 8, 4, (16, 32, 32), 5, True, "cross_spectrum")
run(2, 8, 4, (38, 32, 32), (3, 5, 5), True, "fft")
# One depth position and frequency (border's plane problems): plane_dft writes the spectrum and
# the channels' sums, in float32 and float64, a channels-last x in slices; the W stage writes Z^.
run(3, 20, 12, (1, 9, 12), (1, 3, 3), True, "cross_spectrum")
run(2, 12, 6, (1, 32, 26), (1, 2, 3), True, "cross_spectrum", torch.float64, groups=2)
run(30, 8, 4, (1, 256, 256), (1, 3, 3), True, "cross_spectrum",
    view=lambda x: x.contiguous(memory_format=torch.channels_last_3d))
run(3, 20, 12, (1, 9, 12), (1, 3, 3), True, "fft")
# The border's terms (padding > 0): planes, lines and corners as padding-0 problems
# (the border's line-operand kernels). Not here: lines too long for their staging
# (tests/test_border.py has one): the float64 case that had them took sliced_conv for its full
# grid, and racecheck flags ATen's own reduce_kernel there (its y.mean over rows of 155k
# values; pytorch/pytorch#162995).
run(2, 4, 6, (4, 5, 3), 3, True, "border", stride=2, padding=1, output_padding=1)
run(2, 4, 6, (4, 5, 3), (3, 2, 3), True, "border", stride=(2, 3, 1), dilation=(1, 2, 2),
    padding=(2, 3, 1), groups=2)
# Phases of a strided problem (docs/math.md §3.3.1): empty phases (k < s), dilation,
# output_padding, groups; and the overload without running statistics.
run(3, 4, 6, (3, 4, 5), 1, True, "fft", stride=2)
run(2, 6, 9, (4, 3, 5), (3, 2, 4), True, "fft", stride=(2, 1, 3), dilation=(1, 2, 1),
    output_padding=(1, 0, 2), groups=3)
# cross_spectrum_s_stage.cu: float32 with two tiles (the second partial) and two launches of W
# lags; three tiles in float32 and five in float64 (off-diagonal pairs beyond the first
# row); float64 (one tile); a batch over two chunks; groups and phases; whole chunks of
# samples and whole tiles (the unrolled steps), float32 and float64, 10 W lags (5 + 5).
# cross_spectrum_lag_stage.cu: 13 D lags and 11 H lags (two launches each).
# cross_spectrum_tap_spectrum.cu runs in these and the next cases where k'w <= 8 (k'w of 2, 3
# and 7).
run(2, 40, 6, (3, 4, 5), (2, 2, 10), True, "cross_spectrum")
run(32, 32, 5, (3, 4, 5), (3, 2, 10), True, "cross_spectrum")
run(16, 16, 4, (3, 4, 5), 2, True, "cross_spectrum", torch.float64)
run(2, 72, 6, (3, 4, 5), 3, True, "cross_spectrum")
run(2, 72, 6, (3, 4, 5), 3, True, "cross_spectrum", torch.float64)
run(2, 5, 6, (3, 4, 5), (7, 6, 2), True, "cross_spectrum")
run(19, 6, 8, (3, 4, 5), 3, True, "cross_spectrum", torch.float64)
run(2, 6, 9, (4, 3, 5), (3, 2, 4), True, "cross_spectrum", stride=(2, 1, 3), groups=3)
# cross_spectrum_s_stage_mma.cu (float32, even groups, sm_90; the cases above with an even group
# run it): a partial chunk of 3 samples and a block whose columns end at 34 of its 48;
# groups of 20 channels. cross_spectrum_s_stage.cu's float32 kernel, forced where that one runs.
run(19, 34, 5, (3, 4, 5), (3, 2, 3), True, "cross_spectrum")
run(10, 40, 6, (4, 3, 5), (2, 3, 7), True, "cross_spectrum", groups=2)
with fused_ops.testing.route(s_stage="simt"):
    run(2, 40, 6, (3, 4, 5), (2, 2, 10), True, "cross_spectrum")
    run(32, 32, 5, (3, 4, 5), (3, 2, 10), True, "cross_spectrum")
# cross_spectrum_quad_form_mma.cu (sm_90; the cross_spectrum cases above run it): R = 72 rows
# with 200 columns (partial row and column tiles, a chunk past R), and 37 columns (odd: 8-byte
# copies of W); cuBLAS's product and cross_spectrum_quad_form.cu, forced where that one runs.
run(2, 36, 200, (3, 4, 5), 2, True, "cross_spectrum")
run(2, 5, 37, (3, 4, 5), (2, 3, 2), True, "cross_spectrum")
with fused_ops.testing.route(contraction="gemm"):
    run(2, 36, 200, (3, 4, 5), 2, True, "cross_spectrum")
if mine():
    no_stats_and_the_split_ops()
run(1, 3, 4, (7, 9, 11), 3, False, "auto")  # odd length: the scalar spatial-sum path
run(2, 4, 8, (64, 64, 64), 1, False, "auto")  # few rows: a row split into parts
# Eval's x-only pass and finalize (eval_x_sums.cu, eval_finalize.cu) on sm_90: one lane a
# sample over two rounds; a batch of loads a lane plus a remainder; groups; and more than
# 1024 input channels per group (the x-and-weight pass instead).
run(300, 4, 5, (2, 2, 4), (2, 1, 2), False, "auto")
run(16, 100, 3, (1, 96, 96), 1, False, "auto")
run(5, 24, 36, (3, 5, 8), (3, 2, 2), False, "auto", groups=3, stride=2, dilation=2)
run(2, 1040, 3, (1, 2, 2), (1, 1, 2), False, "auto")
for dtype in (torch.float16, torch.bfloat16):  # 8 values per 16-byte load; float32 BN too
    for training in (False, True):
        run(3, 5, 19, (3, 4, 5), (2, 3, 2), training, "auto", dtype)  # odd rows: scalar loads
        run(2, 4, 8, (8, 8, 16), 1, training, "auto", dtype, torch.float32)  # 16-byte loads
    run(2, 6, 9, (5, 3, 4), 3, True, "direct", dtype, stride=2, padding=1, groups=3)


def channels_last(x):
    return x.contiguous(memory_format=torch.channels_last_3d)


def channel_window(x):  # channels adjacent, but not 16-byte aligned: 4-byte loads
    return channels_last(torch.cat([x, x], 1))[:, 1:x.shape[1] + 1]


# The channels-last kernel: 4-byte loads (3 channels), narrower than a warp (8), slabs and
# chunks of positions (64), wider than a warp (200), more vectors than threads (2100).
for ci, size in ((3, (5, 6, 7)), (8, (4, 16, 16)), (64, (8, 16, 32)), (200, (2, 3, 5)),
                 (2100, (2, 3, 4))):
    run(2, ci, 5, size, 1, False, "auto", view=channels_last)
run(2, 8, 5, (3, 4, 5), 2, False, "auto", view=channel_window)
run(3, 8, 6, (3, 4, 5), 2, False, "auto", view=lambda x: torch.cat([x, x])[::2])  # row kernel
run(3, 8, 6, (3, 4, 5), 2, False, "auto", view=lambda x: x[..., ::2])  # copied
for algo in ("fft", "direct", "sliced_conv"):
    run(3, 8, 6, (3, 4, 5), 2, True, algo, view=channels_last)
# sliced_conv's loop over several slices of the batch, and the padded sums' GEMM past the
# finalize's term limit, on small problems
with fused_ops.testing.limit(slice_bytes=1, finalize_terms=1):
    run(3, 5, 6, (3, 4, 5), 3, True, "sliced_conv", padding=1)
    run(3, 5, 6, (3, 4, 5), 3, False, "auto", padding=1)
for dtype in (torch.float16, torch.bfloat16):  # 8 channels a 16-byte load, and 2-byte loads
    for ci in (16, 6):
        run(2, ci, 5, (4, 6, 8), 2, False, "auto", dtype, torch.float32, view=channels_last)
print(f"sanitize cases ran: shard {SHARD} of {SHARDS}, {next(CASES)} cases in all")
