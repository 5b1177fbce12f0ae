"""Small calls that run every CUDA kernel once, for compute-sanitizer (scripts/gpu_check.sh)."""
import torch

import fused_ops


def run(batch, ci, co, size, kernel, training, algo, dtype=torch.float32, bn_dtype=None, **conv):
    m = fused_ops.ConvTransposeBNPool3d(ci, co, kernel, 2.0, algo=algo, **conv).cuda().to(dtype)
    m.batch_norm.to(bn_dtype or dtype)
    m.train(training)
    with torch.no_grad():
        out = m(torch.randn(batch, ci, *size, device="cuda", dtype=dtype))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


for training in (False, True):
    for algo in ("direct", "sliced_conv"):
        run(3, 5, 19, (3, 4, 5), (2, 3, 2), training, algo)
        run(2, 6, 9, (5, 3, 4), 3, training, algo, stride=2, padding=1, output_padding=1, groups=3)
for conv in ({}, {"groups": 2, "dilation": (2, 1, 1)}):
    run(19, 6, 38, (5, 4, 7), (3, 2, 3), True, "fft", **conv)  # two b passes, edge tiles
run(2, 3, 5, (30, 2, 3), 2, True, "fft")  # two fd passes
for name in ("ct_bn_pool_stats", "ct_bn_pool_apply"):
    assert hasattr(torch.ops.fused_ops, name)
x, w = torch.randn(3, 4, 3, 4, 5, device="cuda"), torch.randn(4, 6, 2, 2, 2, device="cuda")
sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(x, w)
out = torch.ops.fused_ops.ct_bn_pool_apply(sums, stats, 4 * 5 * 6, None, 2.0, None, None,
                                           None, None, 0.1, 1e-5, torch.float32)
torch.cuda.synchronize()
assert torch.isfinite(out).all()
run(1, 3, 4, (7, 9, 11), 3, False, "auto")  # odd length: the scalar spatial-sum path
run(2, 4, 8, (64, 64, 64), 1, False, "auto")  # few rows: a row split into parts
for dtype in (torch.float16, torch.bfloat16):  # 8 values per 16-byte load; float32 BN too
    for training in (False, True):
        run(3, 5, 19, (3, 4, 5), (2, 3, 2), training, "auto", dtype)  # odd rows: scalar loads
        run(2, 4, 8, (8, 8, 16), 1, training, "auto", dtype, torch.float32)  # 16-byte loads
    run(2, 6, 9, (5, 3, 4), 3, True, "direct", dtype, stride=2, padding=1, groups=3)
print("sanitize cases ran")
