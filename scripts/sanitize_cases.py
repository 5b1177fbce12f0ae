"""Small calls that run every CUDA kernel once, for compute-sanitizer (scripts/gpu_check.sh)."""
import torch

import fused_ops


def run(batch, ci, co, size, kernel, training, algo, **conv):
    m = fused_ops.ConvTransposeBNPool3d(ci, co, kernel, 2.0, algo=algo, **conv).cuda()
    m.train(training)
    with torch.no_grad():
        out = m(torch.randn(batch, ci, *size, device="cuda"))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


for training in (False, True):
    for algo in ("direct", "sliced_conv"):
        run(3, 5, 19, (3, 4, 5), (2, 3, 2), training, algo)
        run(2, 6, 9, (5, 3, 4), 3, training, algo, stride=2, padding=1, output_padding=1, groups=3)
run(1, 3, 4, (7, 9, 11), 3, False, "auto")  # odd length: the scalar spatial-sum path
run(2, 4, 8, (64, 64, 64), 1, False, "auto")  # few rows: a row split into parts
print("sanitize cases ran")
