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


def _kernel(op, device_type):
    key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _KEYS[device_type]))

    def autocast_kernel(x, weight, bias, *args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(key):
            out = op(_cast(x, device_type, dtype), _cast(weight, device_type, dtype),
                     _cast(bias, device_type, dtype), *args, **kwargs)
        wanted = _OUTPUT_DTYPE[device_type]
        return out if wanted is None or x.dtype == torch.float64 else out.to(wanted)

    return autocast_kernel


for _device_type, _key in _KEYS.items():
    for _name, _op in (("ct_bn_pool", torch.ops.fused_ops.ct_bn_pool.default),
                       ("ct_bn_pool.no_stats", torch.ops.fused_ops.ct_bn_pool.no_stats)):
        _LIB.impl(_name, _kernel(_op, _device_type), _key)
