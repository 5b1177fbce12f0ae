"""algo='sliced_conv' (docs/math.md §3.2): ATen's convolution (TF32 off) over slices of the
batch, each sample centred on its own mean before squaring. Forced on every configuration
family against PyTorch's modules in float64, output and statistics over three steps; and the
loop over several slices, which only problems past 64 MiB of convolution output reach with
the built-in limit, reached on small problems through fused_ops.testing.limit."""
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, TOL, TRAIN_PROBLEMS, Problem, assert_train_steps_match,
                      check_training, make_input, make_models)

DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", TRAIN_PROBLEMS, ids=Problem.ids)
def test_matches_reference_over_steps(problem, dtype, device):
    check_training(problem, dtype, device, "sliced_conv")


SLICED = Problem(5, 4, 6, (3, 4, 5), (3, 2, 3), scale=-1.5,
                 conv_kwargs=dict(stride=(2, 1, 1), padding=(1, 0, 1), groups=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("samples_per_slice, slices", [(0.5, 5), (1, 5), (2, 3), (4, 2), (5, 1)])
def test_loops_over_slices_of_the_batch(samples_per_slice, slices, dtype, device):
    """slice_bytes bounds the convolution output held at once: floor(slice_bytes / one
    sample's output) samples per slice, at least one. Each slice is one aten::_convolution;
    the energies of all slices (and of the last, partial one) against float64, with x offset
    so that each sample's centring matters."""
    sample_bytes = SLICED.out_channels * math.prod(SLICED.out_size()) * dtype.itemsize
    ref, fused = make_models(SLICED, dtype, device, algo="sliced_conv")
    calls = []

    def next_input():
        x = make_input(SLICED, dtype, device, offset=0.75)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.ops.fused_ops.ct_bn_pool_stats(x, fused.conv_transpose.weight.detach(),
                                                 algo="sliced_conv", stride=[2, 1, 1],
                                                 padding=[1, 0, 1], groups=2)
        calls.append(sum(e.name == "aten::_convolution" for e in prof.events()))
        return x

    with fused_ops.testing.limit(slice_bytes=int(samples_per_slice * sample_bytes)):
        assert_train_steps_match(ref, fused, next_input, TOL[dtype])
    assert calls == [slices] * 3
