"""Testing hooks: force a kernel route or shrink a size limit inside a ``with`` block.

The dispatch (``docs/dispatch.md``) picks one kernel per problem. Tests and the sanitizer
cases need the others too, on one GPU and in one process; these context managers set the
choice in the extension (a process-wide setting, read by the kernels' launchers, not from
the environment) and restore the previous one on exit. They are for tests and
diagnostics, not for production use: outputs are identical whatever the route, only the
kernel that computes them changes.

Routes (``route(...)``), each ``"auto"`` by default:

========== ===================== =============================================================
knob       values                what it forces (CUDA)
========== ===================== =============================================================
direct     ``mma``, ``simt``     the direct statistics at stride 1: the float64 tensor-core
                                 kernel, or the SIMT kernel with x's sums
s_stage    ``simt``              the cross-spectrum S stage without the tensor cores
contraction ``gemm``             the cross-spectrum contraction by cuBLAS and a reduction
                                 kernel instead of the fused tensor-core kernel
overlap    ``off``               kernels launched one after another instead of with
                                 programmatic dependent launch (for profiling)
backward   ``aten``, ``kept``,   training mode's backward (CPU and CUDA): the recomputed
           ``spectral``,         convolution and ATen's ``convolution_backward``, the
           ``gram``              forward's output kept for it, or a path without it
                                 (docs/dispatch.md; where it does not apply, the backward
                                 raises)
========== ===================== =============================================================

Limits (``limit(...)``), in the units named, ``0`` restoring the built-in value:

================ ============================================================================
name             what it bounds
================ ============================================================================
slice_bytes      the conv output that ``sliced_conv`` holds at once (bytes); smaller values
                 make it loop over more slices of the batch
finalize_terms   the box-sum terms per output channel that the finalize contracts itself
                 with padding; past it the contraction is one batched GEMM
================ ============================================================================
"""
import contextlib
from typing import Dict, Iterator

import torch

from . import _backward_routes

__all__ = ["route", "limit"]


@contextlib.contextmanager
def route(**routes: str) -> Iterator[None]:
    """Force kernel routes, e.g. ``with fused_ops.testing.route(direct="simt"): ...``.

    An unknown knob or value raises ``RuntimeError`` naming it; nothing is changed then.
    """
    previous: Dict[str, str] = {}
    try:
        for knob, value in routes.items():
            previous[knob] = _set_route(knob, str(value))
        yield
    finally:
        for knob, value in previous.items():
            _set_route(knob, value)


# Knobs of the Python layer: knob -> (module holding ROUTE, its values besides "auto").
_PYTHON_KNOBS = {"backward": (_backward_routes, _backward_routes.ROUTES)}


def _set_route(knob: str, value: str) -> str:
    """Sets one knob, in Python or in the extension; returns its previous value."""
    if knob not in _PYTHON_KNOBS:
        return torch.ops.fused_ops._set_route(knob, value)
    module, values = _PYTHON_KNOBS[knob]
    if value not in ("auto", *values):
        raise RuntimeError(f"fused_ops.testing.route: {knob} must be one of "
                           f"{', '.join(repr(v) for v in ('auto', *values))}, got '{value}'")
    previous, module.ROUTE = module.ROUTE, value
    return previous


@contextlib.contextmanager
def limit(**limits: int) -> Iterator[None]:
    """Shrink size limits, e.g. ``with fused_ops.testing.limit(slice_bytes=1 << 16): ...``."""
    previous: Dict[str, int] = {}
    try:
        for name, value in limits.items():
            previous[name] = torch.ops.fused_ops._set_limit(name, int(value))
        yield
    finally:
        for name, value in previous.items():
            torch.ops.fused_ops._set_limit(name, value)
