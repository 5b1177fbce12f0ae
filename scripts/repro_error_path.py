"""Calls the op with a 4-D x (a rejected input) through the full dispatcher ('op') or
straight to the CPU kernel ('cpu_kernel'); prints how it ended."""
import sys

import torch

import fused_ops  # noqa: F401

x, w = torch.randn(4, 3, 4, 5), torch.randn(4, 6, 2, 3, 2)
args = (x, w, None, 2.0, None, None, None, None, True, 0.1, 1e-5)
op = torch.ops.fused_ops.ct_bn_pool.default
try:
    if sys.argv[1] == "op":
        op(*args)
    else:
        op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)
except Exception as e:  # the expected outcome
    print(sys.argv[1], "raised", type(e).__name__, str(e).splitlines()[0][:120])
