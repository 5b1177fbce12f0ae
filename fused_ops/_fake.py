"""Fake (meta) kernels of the fused_ops ops, for FakeTensor, torch.compile and export.

A fake kernel is also the ops' Meta kernel, the one a call reaches when any tensor argument
is on the meta device. Each one therefore checks what the C++ kernels check
(csrc/validate.cpp: validate_inputs, validate_apply_inputs, parse_energy_algo), in the same
order, with the same error types (TORCH_CHECK: RuntimeError; TORCH_CHECK_VALUE: ValueError)
and messages:

- a call mixing devices (x on cpu, running_mean on meta, say) is refused, naming the
  argument and both devices, instead of returning uninitialized memory;
- torch.compile and torch.export refuse bad input while tracing the forward with the op's
  own error, instead of failing later in a trace the bad input breaks (the backward's, whose
  shapes follow from the forward's: BackendCompilerFailed).

Conditions on sizes go through torch._check / torch._check_value, so that symbolic sizes
(dynamic=True, export's dynamic dims) get runtime assertions rather than guards.
"""
import torch

from . import _gram_backward

_ALGOS = ("auto", "fft", "direct", "sliced_conv", "correlation", "cross_spectrum", "border")
_CONV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the small (per-channel, weight-sized) algebra for inputs of `dtype`, as
    csrc's compute_dtype: float32 for float16 and bfloat16."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# c10::toString's names for the dtypes the messages may name (csrc/message.h's to_str).
_C10_NAMES = {torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
              torch.int64: "Long", torch.bool: "Bool", torch.complex32: "ComplexHalf",
              torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def _dtype_str(dtype):
    if dtype in _CONV_DTYPES:
        return str(dtype).replace("torch.", "")
    return _C10_NAMES.get(dtype, str(dtype))


def _sizes_str(values):
    return "[" + ", ".join(str(v) for v in values) + "]"


def _number_str(value):
    return f"{value:g}"


# A condition that is a plain True (concrete sizes) returns at once: the kept route
# (_kept_output.py) runs these checks on eager calls an op refuses; torch._check's machinery is
# for symbolic ones.
def _runtime(cond, message):
    if cond is not True:
        torch._check(cond, lambda: "ct_bn_pool: " + message())


def _value(cond, message):
    if cond is not True:
        torch._check_value(cond, lambda: "ct_bn_pool: " + message())


def _check_same_device(t, name, like, like_name):
    _runtime(t.device == like.device,
             lambda: f"{name} must be on the same device as {like_name} ({like.device}), "
                     f"got {t.device}")


def _check_dtype(t, name, want, want_from):
    _runtime(t.dtype == want, lambda: f"{name} must have the same dtype as {want_from} "
                                      f"({_dtype_str(want)}), got {_dtype_str(t.dtype)}")


def _check_conv_dtype(dtype, name):
    _runtime(dtype in _CONV_DTYPES, lambda: f"{name} must be float16, bfloat16, float32 or "
                                            f"float64, got {_dtype_str(dtype)}")


def _check_channel_vector(t, name, channels, like, like_name="x"):
    if t is None:
        return
    _runtime(t.dim() == 1 and t.size(0) == channels,
             lambda: f"{name} must have shape [{channels}] (one value per output channel), "
                     f"got {_sizes_str(t.shape)}")
    _check_same_device(t, name, like, like_name)


def _check_batch_norm_dtypes(named, conv_dtype, conv_dtype_from):
    """BatchNorm's tensors share one dtype: the conv's, or float32 for a float16 or bfloat16
    conv; the first one given fixes it for the others."""
    first = None
    for t, name in named:
        if t is None:
            continue
        if first is not None:
            _check_dtype(t, name, first[0].dtype, first[1])
            continue
        first = (t, name)
        if conv_dtype in (torch.float16, torch.bfloat16):
            _runtime(t.dtype in (conv_dtype, torch.float32),
                     lambda: f"{name} must have the same dtype as {conv_dtype_from} "
                             f"({_dtype_str(conv_dtype)}) or be float32, got "
                             f"{_dtype_str(t.dtype)}")
        else:
            _check_dtype(t, name, conv_dtype, conv_dtype_from)


def _check_triple(values, name, min_value):
    _runtime(len(values) == 3,
             lambda: f"{name} must have 3 values (D, H, W), got {_sizes_str(values)}")
    for v in values:
        _value(v >= min_value, lambda: f"{name} must be >= {min_value} in every dimension, "
                                       f"got {_sizes_str(values)}")


def _validate_inputs(x, weight, bias, bn_weight, bn_bias, running_mean, running_var, training,
                     eps, stride, padding, output_padding, dilation, groups, one_of_many=False):
    """validate_inputs of csrc/validate.cpp: (out_channels, output size)."""
    _runtime(x.dim() == 5, lambda: f"x must be a 5-D tensor [B, C_in, D, H, W], got {x.dim()}-D "
                                   f"with shape {_sizes_str(x.shape)}")
    _check_conv_dtype(x.dtype, "x")
    # x may have an empty batch, not empty channel or spatial dims.
    _runtime(x.size(1) * x.size(2) * x.size(3) * x.size(4) > 0,
             lambda: f"x must have non-empty channel and spatial dims, got shape "
                     f"{_sizes_str(x.shape)}")
    _runtime(weight.dim() == 5,
             lambda: "weight must be a 5-D ConvTranspose3d weight [C_in, C_out/groups, kD, kH, "
                     f"kW], got shape {_sizes_str(weight.shape)}")
    _check_same_device(weight, "weight", x, "x")
    _check_dtype(weight, "weight", x.dtype, "x")
    _value(groups >= 1, lambda: f"groups must be >= 1, got {groups}")
    _runtime(weight.size(0) == x.size(1),
             lambda: f"weight.size(0) must equal x.size(1) = {x.size(1)} (input channels), got "
                     f"weight shape {_sizes_str(weight.shape)}")
    _value(x.size(1) % groups == 0, lambda: f"input channels ({x.size(1)}) must be divisible "
                                            f"by groups ({groups})")
    _runtime(weight.numel() > 0,
             lambda: f"weight must be non-empty, got shape {_sizes_str(weight.shape)}")
    _check_triple(stride, "stride", 1)
    _check_triple(padding, "padding", 0)
    _check_triple(output_padding, "output_padding", 0)
    _check_triple(dilation, "dilation", 1)
    out_size = []
    for d in range(3):
        _value(output_padding[d] < stride[d] or output_padding[d] < dilation[d],
               lambda: "output_padding must be smaller than either stride or dilation, got "
                       f"output_padding {_sizes_str(output_padding)}, stride "
                       f"{_sizes_str(stride)}, dilation {_sizes_str(dilation)}")
        size = ((x.size(2 + d) - 1) * stride[d] - 2 * padding[d]
                + dilation[d] * (weight.size(2 + d) - 1) + output_padding[d] + 1)
        _runtime(size >= 1,
                 lambda: f"the conv-transpose output would be empty (size {size} in spatial dim "
                         f"{d}): padding {_sizes_str(padding)} is too large for input "
                         f"{_sizes_str(x.shape)} and kernel {_sizes_str(weight.shape)}")
        out_size.append(size)
    channels = weight.size(1) * groups
    for t, name in ((bias, "bias"), (bn_weight, "bn_weight"), (bn_bias, "bn_bias"),
                    (running_mean, "running_mean"), (running_var, "running_var")):
        _check_channel_vector(t, name, channels, x)
    if bias is not None:
        _check_dtype(bias, "bias", x.dtype, "x")
    _check_batch_norm_dtypes(((bn_weight, "bn_weight"), (bn_bias, "bn_bias"),
                              (running_mean, "running_mean"), (running_var, "running_var")),
                             x.dtype, "x")
    _value((running_mean is None) == (running_var is None),
           lambda: "running_mean and running_var must be given together or both be None")
    _value(training or running_mean is not None,
           lambda: "training=False normalizes with running statistics, so running_mean and "
                   "running_var are required (pass training=True for batch statistics)")
    if training:
        _value(eps > 0, lambda: f"eps must be positive in training mode, got {_number_str(eps)}")
    else:
        _value(eps >= 0, lambda: f"eps must be non-negative, got {_number_str(eps)}")
    if training and not one_of_many:
        values = x.size(0) * out_size[0] * out_size[1] * out_size[2]
        _value(values != 1, lambda: f"Expected more than 1 value per channel when training, "
                                    f"got {values} (batch {x.size(0)} x output size "
                                    f"{_sizes_str(out_size)})")
    return channels, out_size


def _check_algo(algo, x, weight, stride, padding, dilation):
    """parse_energy_algo's refusals. The C++ op parses `algo` only for a non-empty batch (an
    empty one returns before); fft's further conditions on CUDA (kernel height per stride
    phase, shared memory) are left to it."""
    if isinstance(x.size(0), int) and x.size(0) == 0:
        return
    has_padding = any(p != 0 for p in padding)
    if algo == "fft":
        _value(x.device.type == "cuda",
               lambda: "algo='fft' is implemented for CUDA tensors only; use 'auto', 'direct' "
                       "or 'sliced_conv' on this device")
        # The necessary conditions of fft_applies: a float32 energy (not float64), padding 0.
        _value(x.dtype != torch.float64 and not has_padding,
               lambda: "algo='fft' needs float32, float16 or bfloat16 and padding 0 (any "
                       "stride, dilation and output_padding) and a kernel height per stride "
                       "phase (kH at stride 1, else dilation (kH - 1) / stride + 1) of at most "
                       f"16; got dtype {_dtype_str(x.dtype)}, padding {_sizes_str(padding)}, "
                       f"kernel {_sizes_str(weight.shape[2:])}, stride {_sizes_str(stride)}, "
                       f"dilation {_sizes_str(dilation)} (use 'auto')")
    elif algo in ("correlation", "cross_spectrum"):
        _value(not has_padding,
               lambda: f"algo='{algo}' needs padding 0 (any stride, dilation and "
                       f"output_padding); got padding {_sizes_str(padding)} (use 'auto')")
    elif algo == "border":
        _value(has_padding, lambda: "algo='border' needs padding > 0 in some dim; got padding "
                                    f"{_sizes_str(padding)} (use 'auto')")
    else:
        _value(algo in _ALGOS,
               lambda: "algo must be one of 'auto', 'fft', 'direct', 'sliced_conv', "
                       f"'correlation', 'cross_spectrum', 'border', got '{algo}'")


@torch.library.register_fake("fused_ops::ct_bn_pool")
def _ct_bn_pool_fake(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                     training, momentum=0.1, eps=1e-5, *, stride=(1, 1, 1), padding=(0, 0, 0),
                     output_padding=(0, 0, 0), dilation=(1, 1, 1), groups=1, algo="auto"):
    channels, _ = _validate_inputs(x, weight, bias, bn_weight, bn_bias, running_mean,
                                   running_var, training, eps, stride, padding, output_padding,
                                   dilation, groups)
    _check_algo(algo, x, weight, stride, padding, dilation)
    # In x's dtype, whatever the batch norm's (float32 for a float16 x, say).
    return x.new_empty((x.shape[0], channels, 1, 1, 1))


@torch.library.register_fake("fused_ops::ct_bn_pool.no_stats")
def _ct_bn_pool_no_stats_fake(x, weight, bias, scale, bn_weight, bn_bias, eps=1e-5, *,
                              stride=(1, 1, 1), padding=(0, 0, 0), output_padding=(0, 0, 0),
                              dilation=(1, 1, 1), groups=1, algo="auto"):
    return _ct_bn_pool_fake(x, weight, bias, scale, bn_weight, bn_bias, None, None, True, 0.0,
                            eps, stride=stride, padding=padding, output_padding=output_padding,
                            dilation=dilation, groups=groups, algo=algo)


@torch.library.register_fake("fused_ops::ct_bn_pool_stats")
def _ct_bn_pool_stats_fake(x, weight, *, stride=(1, 1, 1), padding=(0, 0, 0),
                           output_padding=(0, 0, 0), dilation=(1, 1, 1), groups=1, algo="auto"):
    channels, _ = _validate_inputs(x, weight, None, None, None, None, None, True, 1.0, stride,
                                   padding, output_padding, dilation, groups, one_of_many=True)
    _check_algo(algo, x, weight, stride, padding, dilation)
    # float64 whatever x's dtype: the sums and statistics are accumulated in double.
    return (x.new_empty((x.shape[0], channels), dtype=torch.float64),
            x.new_empty((3, channels), dtype=torch.float64))


@torch.library.register_fake("fused_ops::ct_bn_pool_apply")
def _ct_bn_pool_apply_fake(sample_sums, stats, spatial, bias, scale, bn_weight, bn_bias,
                           running_mean, running_var, momentum, eps, dtype):
    """validate_apply_inputs of csrc/validate.cpp."""
    _runtime(sample_sums.dim() == 2 and sample_sums.dtype == torch.float64,
             lambda: f"sample_sums must be a float64 [B, C_out] tensor, got "
                     f"{_dtype_str(sample_sums.dtype)} of shape {_sizes_str(sample_sums.shape)}")
    _runtime(sample_sums.size(1) > 0, lambda: "sample_sums must have at least one channel")
    channels = sample_sums.size(1)
    _runtime(stats.dim() == 2 and stats.size(0) == 3 and stats.size(1) == channels,
             lambda: f"stats must have shape [3, {channels}] (count, mean, m2 per channel), "
                     f"got {_sizes_str(stats.shape)}")
    _check_same_device(stats, "stats", sample_sums, "sample_sums")
    _check_dtype(stats, "stats", torch.float64, "sample_sums")
    _value(spatial >= 1, lambda: f"spatial must be >= 1, got {spatial}")
    _check_conv_dtype(dtype, "dtype")
    for t, name in ((bias, "bias"), (bn_weight, "bn_weight"), (bn_bias, "bn_bias"),
                    (running_mean, "running_mean"), (running_var, "running_var")):
        _check_channel_vector(t, name, channels, sample_sums, "sample_sums")
    if bias is not None:
        _check_dtype(bias, "bias", dtype, "the dtype argument")
    _check_batch_norm_dtypes(((bn_weight, "bn_weight"), (bn_bias, "bn_bias"),
                              (running_mean, "running_mean"), (running_var, "running_var")),
                             dtype, "the dtype argument")
    _value((running_mean is None) == (running_var is None),
           lambda: "running_mean and running_var must be given together or both be None")
    _value(eps > 0, lambda: f"eps must be positive, got {_number_str(eps)}")
    return sample_sums.new_empty((sample_sums.shape[0], channels, 1, 1, 1), dtype=dtype)


@torch.library.register_fake("fused_ops::ct_bn_pool_apply.no_stats")
def _ct_bn_pool_apply_no_stats_fake(sample_sums, stats, spatial, bias, scale, bn_weight, bn_bias,
                                    eps, dtype):
    return _ct_bn_pool_apply_fake(sample_sums, stats, spatial, bias, scale, bn_weight, bn_bias,
                                  None, None, 0.0, eps, dtype)


@torch.library.register_fake("fused_ops::_ct_bn_pool_kept_stats")
def _ct_bn_pool_kept_stats_fake(x, weight, *, stride=(1, 1, 1), padding=(0, 0, 0),
                                output_padding=(0, 0, 0), dilation=(1, 1, 1), groups=1):
    channels, size = _validate_inputs(x, weight, None, None, None, None, None, True, 1.0,
                                      stride, padding, output_padding, dilation, groups)
    _runtime(x.shape[0] > 0, lambda: "_ct_bn_pool_kept_stats: x must hold at least one sample")
    # y contiguous in x's dtype; the sums and statistics float64.
    return (x.new_empty((x.shape[0], channels, *size)),
            x.new_empty((x.shape[0], channels), dtype=torch.float64),
            x.new_empty((3, channels), dtype=torch.float64))


@torch.library.register_fake("fused_ops::_ct_bn_pool_kept_backward")
def _ct_bn_pool_kept_backward_fake(grad_out, x, weight, bn_weight, y, sample_sums, stats, scale,
                                   eps, *, stride, padding, output_padding, dilation, groups,
                                   output_mask):
    conv = dict(stride=stride, padding=padding, dilation=dilation)
    _runtime(y is not None or _gram_backward.supported(conv, weight),
             lambda: "_ct_bn_pool_kept_backward: without y the backward needs padding 0 and one "
                     "tap per output position (dilation (k - 1) < stride in every dim)")
    compute = compute_dtype(x.dtype)
    channels = stats.shape[1]
    return (x.new_empty(x.shape if output_mask[0] else (0,)),
            weight.new_empty(weight.shape if output_mask[1] else (0,)),
            x.new_empty((channels,), dtype=compute), x.new_empty((channels,), dtype=compute))


@torch.library.register_fake("fused_ops::_ct_bn_pool_lag_spectrum")
def _ct_bn_pool_lag_spectrum_fake(x, weight, *, dilation=(1, 1, 1), groups=1):
    _validate_inputs(x, weight, None, None, None, None, None, True, 1.0, (1, 1, 1), (0, 0, 0),
                     (0, 0, 0), dilation, groups, one_of_many=True)
    k = weight.shape[2:]
    cig = x.shape[1] // groups
    full = [x.shape[2 + d] + dilation[d] * (k[d] - 1) for d in range(3)]
    spectrum = torch.complex128 if x.dtype == torch.float64 else torch.complex64
    # R^ on the lags' grid 2k - 1 (the last dimension's half spectrum), complex128, and x's
    # spectrum on the full output's grid, a frequency's [B, Ci] contiguous.
    return (x.new_empty((2 * k[0] - 1, 2 * k[1] - 1, k[2], groups, cig, cig),
                        dtype=torch.complex128),
            x.new_empty((full[0], full[1], full[2] // 2 + 1, x.shape[0], x.shape[1]),
                        dtype=spectrum))
