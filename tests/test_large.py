"""Sizes past 2^31 elements: one (batch, channel) row of x longer than 2^31, on the GPU.

The 1x1x1 kernel makes the transposed convolution pointwise (z = scale * (w x + bias)), so
the float64 reference is PyTorch's own elementwise ops and F.batch_norm on the full-size z;
nn.ConvTranspose3d itself cannot run float64 on 2^31-element tensors within the memory a
test should take. Needs about 70 GB of free GPU memory; skipped elsewhere.
"""
import pytest
import torch
import torch.nn.functional as F

import fused_ops
from conftest import relerr

SIZE = (1, 1, 1300, 1300, 1300)  # 2.197e9 elements > 2^31 in a single row
NEEDED_BYTES = 70 * 2**30


def _enough_memory():
    if not torch.cuda.is_available():
        return False
    free, _ = torch.cuda.mem_get_info()
    return free >= NEEDED_BYTES


pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not _enough_memory(), reason="needs a CUDA device with 70 GB free")]


def _reference(x, w, b, scale, gamma, beta, rm, rv, training):
    z = x.double().mul_(float(w)).add_(float(b)).mul_(scale)
    out = F.batch_norm(z, rm, rv, gamma, beta, training, 0.1, 1e-5)
    del z
    return out.mean(dim=(2, 3, 4), keepdim=True)


@torch.no_grad()
@pytest.mark.parametrize("training", [False, True])
def test_row_longer_than_2_pow_31(training):
    assert torch.Size(SIZE).numel() > 2**31
    x = torch.empty(SIZE, device="cuda").uniform_(-1.0, 3.0)  # mean 1: the sum must not cancel
    w = torch.tensor([[[[[1.7]]]]], device="cuda")
    b = torch.tensor([0.3], device="cuda")
    gamma, beta = torch.tensor([1.2], device="cuda"), torch.tensor([-0.4], device="cuda")
    rm, rv = torch.tensor([0.9], device="cuda"), torch.tensor([1.3], device="cuda")
    rm64, rv64 = rm.double(), rv.double()
    out = fused_ops.ct_bn_pool(x, w, b, 2.0, gamma, beta, rm, rv, training)
    # B = 1 and Co = 1: in training the output is beta exactly; the statistics carry the test
    # (running_var with momentum 0.1 moves by a tenth of the batch variance: 1e-6 of it is
    # 1e-5 of the variance).
    ref = _reference(x, w, b, 2.0, gamma.double(), beta.double(), rm64, rv64, training)
    assert relerr(out, ref) <= 1e-6
    assert relerr(rm, rm64) <= 1e-6
    assert relerr(rv, rv64) <= 1e-6
