"""Forward + backward of the fused module against the unfused PyTorch modules: time, peak
memory and gradient error (float32 against a float64 run of the modules), both BN modes.

    python scripts/backward_check.py [cuda|cpu]

CUDA: the seed problem (B=16, 64 -> 128 channels, 16x32x32, k=5), with PyTorch's TF32
default for convolutions and with TF32 off. CPU: a small problem, as a smoke test.
"""
import statistics
import sys
import time

import torch
from torch import nn

import fused_ops

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
B, CI, CO, D, H, W, K = (16, 64, 128, 16, 32, 32, 5) if DEVICE == "cuda" else (4, 8, 16, 6, 8, 8, 3)


class Unfused(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(CI, CO, K)
        self.batch_norm = nn.BatchNorm3d(CO)

    def forward(self, x):
        return nn.functional.adaptive_avg_pool3d(self.batch_norm(self.conv_transpose(x) * 2.0), 1)


def models(training):
    torch.manual_seed(0)
    unfused = Unfused()
    with torch.no_grad():
        unfused.batch_norm.weight.uniform_(0.5, 1.5)
        unfused.batch_norm.bias.normal_()
        unfused.batch_norm.running_mean.normal_()
        unfused.batch_norm.running_var.uniform_(0.5, 2.0)
    fused = fused_ops.ConvTransposeBNPool3d(CI, CO, K, 2.0)
    fused.load_state_dict(unfused.state_dict())
    return unfused.to(DEVICE).train(training), fused.to(DEVICE).train(training)


def gradients(module, x, grad_out):
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    module(x).backward(grad_out)
    return [x.grad] + [p.grad for p in module.parameters()]


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_step(module, x, grad_out, repeats=10):
    """Median seconds of a forward + backward, and the peak memory above the start (MiB)."""
    gradients(module, x, grad_out)  # warm-up (cuDNN algorithm choice)
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start_memory = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        gradients(module, x, grad_out)
        sync()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() - start_memory) / 2**20 if DEVICE == "cuda" else 0
    return statistics.median(times), peak


def relerr(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


NAMES = ("x", "conv weight", "conv bias", "bn weight", "bn bias")


def check(training, tf32):
    torch.backends.cudnn.allow_tf32 = tf32
    x = torch.randn(B, CI, D, H, W, device=DEVICE)
    grad_out = torch.randn(B, CO, 1, 1, 1, device=DEVICE)
    reference, _ = models(training)
    want = gradients(reference.double(), x.double(), grad_out.double())
    unfused, fused = models(training)
    mode = "train" if training else "eval"
    for name, module in (("fused", fused), ("unfused", unfused)):
        errors = dict(zip(NAMES, (relerr(g, w) for g, w in zip(gradients(module, x, grad_out),
                                                              want))))
        if training:  # the conv bias's gradient is zero: the reference's is rounding noise
            errors.pop("conv bias")
        seconds, peak = timed_step(module, x, grad_out)
        print(f"{mode:5} tf32={tf32!s:5} {name:7}: {seconds * 1e3:8.2f} ms fwd+bwd, "
              f"peak +{peak:7.0f} MiB, grad relerr "
              + ", ".join(f"{k} {e:.0e}" for k, e in errors.items()))


if __name__ == "__main__":
    print(f"{DEVICE}: B={B} Ci={CI} Co={CO} {D}x{H}x{W} k={K}; torch {torch.__version__}")
    for training in (True, False):
        for tf32 in ((True, False) if DEVICE == "cuda" else (False,)):
            check(training, tf32)
