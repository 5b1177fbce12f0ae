"""Training mode's "kept" route (docs/dispatch.md, docs/math.md §6.2.4): when a gradient will
flow, the forward forms the convolution output y once with ATen's convolution, takes the
batch statistics from it, and keeps it for the backward.

Where the backward's only route is ``convolution_backward`` of a field affine in y, it needs
y; the op's own forward never forms it, so the ``aten`` route computes it again. On the CPU
the op's statistics cost a convolution themselves (``sliced_conv``) or about as much
(``correlation``), so a step there ran two convolutions and a ``convolution_backward``
against the unfused modules' one and one. Keeping y costs what the unfused modules keep (the
BatchNorm's input), and the backward's field is one pass over it.

ATen ops and ``ct_bn_pool_apply`` only (AOTAutograd traces them); y in x's dtype, as the
unfused modules' convolution gives it, its statistics accumulated as the op's (float64).
"""
import torch
from torch import Tensor

from . import _fake
from .distributed import merge_stats


def can_keep(call: dict) -> bool:
    """Only ``algo="auto"`` (a forced algorithm computes the statistics its way) and a
    non-empty batch (the op's own empty-batch semantics)."""
    return call["algo"] == "auto" and call["x"].shape[0] > 0


def _check(call: dict) -> None:
    """The op's checks (its fake kernel's statement of csrc/validate.cpp), before anything
    runs: bad input fails with the op's messages, and nothing is written."""
    _fake._validate_inputs(
        call["x"], call["weight"], call["bias"], call["bn_weight"], call["bn_bias"],
        call["running_mean"], call["running_var"], call["training"], call["eps"],
        call["stride"], call["padding"], call["output_padding"], call["dilation"],
        call["groups"])


def _conv_output(call: dict) -> Tensor:
    """y = conv_transpose3d(x, weight), no bias (it cancels in batch statistics). On CUDA
    with TF32 off whatever the global flags say, as the op's statistics are float32-exact
    (``aten._convolution`` takes the flag; CUDA's dispatch keeps y only in eager, where the
    sizes are concrete). Elsewhere ``aten.convolution``, which also takes the symbolic sizes of
    a trace (``torch.export`` with a dynamic batch; ``aten._convolution`` refuses them in
    torch 2.11)."""
    args = (call["x"], call["weight"], None, call["stride"], call["padding"], call["dilation"],
            True, call["output_padding"], call["groups"])
    if not call["x"].is_cuda:
        return torch.ops.aten.convolution.default(*args)
    cudnn = torch.backends.cudnn
    return torch.ops.aten._convolution.default(*args, cudnn.benchmark, cudnn.deterministic,
                                               cudnn.enabled, False)


def statistics(y: Tensor) -> tuple:
    """(sample_sums [B, C], stats [3, C] = count, mean, M2), float64, as ``ct_bn_pool_stats``
    returns them: each sample's mean and centred sum of squares in y's compute dtype (two
    passes and ATen's cascade sums: no cancellation), merged as the process group's batches
    are (``distributed.merge_stats``)."""
    compute = torch.float64 if y.dtype == torch.float64 else torch.float32
    per_sample = y.flatten(2).to(compute)
    mean = per_sample.mean(2, keepdim=True)
    m2 = (per_sample - mean).square_().sum(2)  # [B, C]
    mean = mean.squeeze(2).double()
    count = torch.full_like(mean, per_sample.shape[2])
    merged = merge_stats(torch.stack([count, mean, m2.double()], dim=1))  # over [B, 3, C]
    return mean * per_sample.shape[2], merged


def forward(call: dict) -> tuple:
    """(out, (y, sample_sums, stats)): the op's output and running-statistics update, computed
    through y, and what the backward keeps."""
    _check(call)
    y = _conv_output(call)
    sums, stats = statistics(y)
    args = (sums, stats, y.shape[2] * y.shape[3] * y.shape[4], call["bias"], call["scale"],
            call["bn_weight"], call["bn_bias"])
    if call["running_mean"] is None:
        out = torch.ops.fused_ops.ct_bn_pool_apply.no_stats(*args, call["eps"], call["x"].dtype)
    else:
        out = torch.ops.fused_ops.ct_bn_pool_apply(
            *args, call["running_mean"], call["running_var"], call["momentum"], call["eps"],
            call["x"].dtype)
    return out, (y, sums, stats)


def output_gradient(y: Tensor, field: Tensor, k: Tensor, mean: Tensor) -> Tensor:
    """dL/dy = A + K (y - mean) (docs/math.md §6.2.2) in one pass over y, in y's dtype:
    ``field`` A [B, C], ``k`` K [C], ``mean`` y's batch mean [C]."""
    shift = (field - k * mean).to(y.dtype)[..., None, None, None]
    return torch.addcmul(shift, y, k.to(y.dtype).view(1, -1, 1, 1, 1))
