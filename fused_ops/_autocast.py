"""Autocast kernels of the fused_ops ops: under ``torch.autocast`` the op computes what the
unfused chain computes there. Autocast runs ``ConvTranspose3d`` in the autocast dtype (so x, the
weight and the conv bias are cast to it, as autocast casts a convolution's inputs) and leaves
``BatchNorm3d``'s parameters and running statistics in float32, which the op takes beside a
lower-precision x. The result has the dtype the chain's last layer gives: the autocast dtype on
CUDA, float32 on the CPU, whose autocast runs ``adaptive_avg_pool3d`` in float32.
"""
import torch

_LIB = torch.library.Library("fused_ops", "IMPL")
_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}
# The dtype of the unfused chain's output under autocast, by device: None for the autocast dtype.
_OUTPUT_DTYPE = {"cuda": None, "cpu": torch.float32}


def _cast(t, device_type, dtype):
    # As autocast's own casts: floating tensors of that device, float64 left alone.
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == device_type):
        return t.to(dtype)
    return t


def _autocast_call(fn, device_type, x, weight, bias, *args, **kwargs):
    """fn on x, the weight and the conv bias cast as autocast casts a convolution's inputs, its
    output in the dtype of the unfused chain's; autocast itself kept off inside by the caller."""
    dtype = torch.get_autocast_dtype(device_type)
    out = fn(_cast(x, device_type, dtype), _cast(weight, device_type, dtype),
             _cast(bias, device_type, dtype), *args, **kwargs)
    wanted = _OUTPUT_DTYPE[device_type]
    return out if wanted is None or x.dtype == torch.float64 else out.to(wanted)


def _kernel(op, device_type):
    key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _KEYS[device_type]))

    def autocast_kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(key):
            return _autocast_call(op, device_type, *args, **kwargs)

    return autocast_kernel


def as_under_autocast(fn, x, weight, bias, *args, **kwargs):
    """fn(x, weight, bias, ...) as the op's autocast kernel runs the op, where autocast is on
    for x's device; as it is elsewhere. For the synchronized path (fused_ops/distributed.py),
    which calls the split ops from Python: ct_bn_pool_apply never sees x (the output dtype is
    its argument), so the casts come before the split, here."""
    device_type = x.device.type
    if device_type not in _KEYS or not torch.is_autocast_enabled(device_type):
        return fn(x, weight, bias, *args, **kwargs)
    with torch.autocast(device_type, enabled=False):
        return _autocast_call(fn, device_type, x, weight, bias, *args, **kwargs)


for _device_type, _key in _KEYS.items():
    for _name, _op in (("ct_bn_pool", torch.ops.fused_ops.ct_bn_pool.default),
                       ("ct_bn_pool.no_stats", torch.ops.fused_ops.ct_bn_pool.no_stats)):
        _LIB.impl(_name, _kernel(_op, _device_type), _key)
