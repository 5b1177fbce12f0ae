"""The op under PyTorch's tooling: opcheck, FakeTensor, torch.compile, autograd."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fused_ops
from conftest import DEVICES, Problem, make_input, make_models, relerr, twin_modules

P = Problem(2, 4, 6, (3, 4, 5), (2, 3, 2))
OP = torch.ops.fused_ops.ct_bn_pool.default


def op_arguments(device, training, conv=None):
    _, fused = make_models(P, torch.float32, device)
    bn, c = fused.batch_norm, fused.conv_transpose
    args = (make_input(P, torch.float32, device), c.weight.detach(), c.bias.detach(), 2.0,
            bn.weight.detach(), bn.bias.detach(), bn.running_mean, bn.running_var, training,
            0.1, 1e-5)
    return args, conv or {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("conv", [{}, dict(stride=[2, 1, 2], padding=[1, 0, 1],
                                           output_padding=[1, 0, 0], dilation=[1, 2, 1])])
def test_opcheck(conv, training, device):
    args, kwargs = op_arguments(device, training, conv)
    torch.library.opcheck(OP, args, kwargs)


def test_fake_tensor_gives_the_output_shape():
    args, _ = op_arguments("cpu", True)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = OP(*fake, groups=2)
    assert tuple(out.shape) == (2, 12, 1, 1, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [True, False])
def test_compiled_module_matches_eager(training, device):
    torch._dynamo.reset()
    _, eager = make_models(P, torch.float32, device)
    _, compiled_module = make_models(P, torch.float32, device)
    compiled_module.load_state_dict(eager.state_dict())
    eager.train(training)
    compiled_module.train(training)
    compiled = torch.compile(compiled_module, fullgraph=True)
    for _ in range(2):
        x = make_input(P, torch.float32, device)
        with torch.no_grad():
            assert relerr(compiled(x), eager(x)) <= 1e-6
    for key, value in eager.state_dict().items():
        if value.is_floating_point():
            assert relerr(compiled_module.state_dict()[key], value) <= 1e-6, key
    assert int(compiled_module.batch_norm.num_batches_tracked) == (2 if training else 0)


def assert_same_state(module, reference):
    for key, value in reference.state_dict().items():
        got = module.state_dict()[key]
        assert (relerr(got, value) <= 1e-6 if value.is_floating_point()
                else torch.equal(got, value)), key


@pytest.mark.parametrize("device", DEVICES)
def test_compile_with_dynamic_shapes(device):
    torch._dynamo.reset()
    module, eager = twin_modules(P, torch.float32, device, training=True)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, *make_input(P, torch.float32, device).shape[1:], device=device)
            assert relerr(compiled(x), eager(x)) <= 1e-6
    assert_same_state(module, eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True])
def test_exported_program_matches_eager(training, device):
    module, eager = twin_modules(P, torch.float32, device, training)
    x = make_input(P, torch.float32, device)
    exported = torch.export.export(module, (x,)).module()
    with torch.no_grad():
        for _ in range(2):
            x = make_input(P, torch.float32, device)
            assert relerr(exported(x), eager(x)) <= 1e-6
    assert_same_state(exported, eager)


def test_backward_flows_through_the_op():
    """ct_bn_pool has a backward (tests/test_autograd.py checks its values)."""
    _, fused = make_models(P, torch.float32)
    x = make_input(P).requires_grad_()
    fused(x).sum().backward()
    assert x.grad is not None and fused.conv_transpose.weight.grad is not None


def synchronized_half_output(op):
    """The output of ct_bn_pool_stats or ct_bn_pool_apply (the synchronized training step's
    halves, fused_ops/distributed.py) computed from an input that requires grad."""
    _, fused = make_models(P, torch.float64)
    c, bn = fused.conv_transpose, fused.batch_norm
    x = make_input(P, torch.float64).requires_grad_(op == "stats")
    sample_sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(x, c.weight.detach())
    if op == "stats":
        return sample_sums
    spatial = math.prod(s + k - 1 for s, k in zip(P.size, P.kernel))
    return torch.ops.fused_ops.ct_bn_pool_apply(
        sample_sums, stats, spatial, None, 2.0, bn.weight, None, bn.running_mean,
        bn.running_var, 0.1, 1e-5, torch.float64)  # bn.weight requires grad


@pytest.mark.parametrize("op", ["stats", "apply"])
def test_backward_through_the_synchronized_halves_raises_naming_the_op(op):
    """They have no backward: a backward through them raises instead of returning wrong
    gradients (README, docs/distributed.md)."""
    out = synchronized_half_output(op)
    with pytest.raises(RuntimeError, match=f"fused_ops::ct_bn_pool_{op} is not implemented"):
        out.sum().backward()


def test_build_info_reports_the_build():
    info = fused_ops.build_info()
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert "cuda_archs" in info
