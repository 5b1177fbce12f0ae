"""`python -m fused_ops`: what the build contains, and one run against the reference."""
import argparse
import time

import torch
from torch import nn

import fused_ops


def reference_pattern(in_channels, out_channels, kernel_size, scale_factor):
    return nn.Sequential(
        nn.ConvTranspose3d(in_channels, out_channels, kernel_size),
        _Scale(scale_factor),
        nn.BatchNorm3d(out_channels),
        nn.AdaptiveAvgPool3d((1, 1, 1)),
    )


class _Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def timed(fn, x, device, reps=10):
    fn(x)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"fused_ops {fused_ops.__version__}; built with {fused_ops.build_info()}")
    print(f"torch {torch.__version__} at run time; CUDA available: {torch.cuda.is_available()}")
    for i in range(torch.cuda.device_count()):
        print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
    # The seed problem on a GPU, a smaller one on the CPU.
    b, ci, co, size, k = (16, 64, 128, (16, 32, 32), 5) if device.type == "cuda" else (
        4, 16, 32, (8, 16, 16), 3)
    print(f"problem: x [{b}, {ci}, {', '.join(map(str, size))}], ConvTranspose3d({ci}, {co}, {k}), "
          f"scale 2.0, float32, on {device}")
    ref = reference_pattern(ci, co, k, 2.0)
    fused = fused_ops.ConvTransposeBNPool3d.from_modules(ref[0], 2.0, ref[2]).to(device)
    ref64 = reference_pattern(ci, co, k, 2.0).double()
    ref64.load_state_dict(ref.state_dict())
    x = torch.randn(b, ci, *size, device=device)
    for mode in ("eval", "train"):
        for m in (ref, fused, ref64):
            m.train(mode == "train")
        ref64_state = {n: t.clone() for n, t in ref64.state_dict().items()}
        with torch.no_grad():
            out = fused(x)
            expected = ref64.cpu()(x.double().cpu())
            err = ((out.double().cpu() - expected).norm() / expected.norm()).item()
            ref64.load_state_dict(ref64_state)
            t_fused = timed(fused, x, device)
            t_ref = timed(ref, x, device)
        print(f"{mode:5s}: relerr vs float64 {err:.2e}; fused {t_fused:.3f} ms, PyTorch eager "
              f"{t_ref:.3f} ms per call (wall clock, 10 calls)")


if __name__ == "__main__":
    main()
