"""Issue 38: a true drop-in. ConvTransposeBNPool3d and fused chains behave exactly like the
modules they replace (every mode combination, torch.fx, saving and loading, devices), and
`fused_ops.fuse` finds the pattern as people write it, says what it did, and leaves near
misses alone.

Self-contained: every reference is PyTorch's own modules (nn.ConvTranspose3d, a Python
scale, nn.BatchNorm3d, nn.AdaptiveAvgPool3d or a mean) run in float64 on the same values.
"""
import copy
import io
import logging
import pickle
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fused_ops  # noqa: E402
from fused_ops import ConvTransposeBNPool3d  # noqa: E402
from fused_ops.fusion import _FusedChain  # noqa: E402

F64 = torch.float64
TIGHT = 1e-10  # float64 against float64


# --- Helpers ---------------------------------------------------------------------------------

def relerr(got, want):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def close(got, want, tol, floor=0.0):
    """|got - want| <= tol * max(|want|, floor) (norms); integers equal. `floor`: the
    scale below which values count as rounding noise (a gradient that is zero in exact
    arithmetic, as the conv bias's under a batch norm in training, is computed as zero by
    one and as noise by the other)."""
    if got is None or want is None:
        return got is None and want is None
    if not want.is_floating_point():
        return torch.equal(got, want)
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).norm()) <= tol * max(float(want.norm()), floor)


def randomized(bn, seed=None):
    """A batch norm with non-trivial affine parameters and running statistics."""
    gen = torch.Generator().manual_seed(seed if seed is not None else 1234)
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.copy_(torch.rand(bn.num_features, generator=gen) + 0.5)
            bn.bias.copy_(torch.randn(bn.num_features, generator=gen))
        if bn.running_mean is not None:
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=gen))
            bn.running_var.copy_(torch.rand(bn.num_features, generator=gen) + 0.5)
    return bn


def randomize_batch_norms(model):
    for i, m in enumerate(model.modules()):
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            randomized(m, seed=i)
    return model


class Unfused(nn.Module):
    """The pattern written out, under ConvTransposeBNPool3d's submodule names."""

    def __init__(self, cin=3, cout=4, kernel=2, scale=1.5, **bn_kwargs):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(cin, cout, kernel)
        self.scale_factor = scale
        self.batch_norm = nn.BatchNorm3d(cout, **bn_kwargs)
        self.global_avg_pool = nn.AdaptiveAvgPool3d((1, 1, 1))

    def forward(self, x):
        return self.global_avg_pool(self.batch_norm(self.conv_transpose(x) * self.scale_factor))


def pair(scale=1.5, **bn_kwargs):
    """(the drop-in module, the unfused modules) in float64, in the same state."""
    torch.manual_seed(0)
    ref = Unfused(scale=scale, **bn_kwargs).double()
    randomized(ref.batch_norm)
    module = ConvTransposeBNPool3d(3, 4, 2, scale, **bn_kwargs).double()
    module.load_state_dict(ref.state_dict())
    return module, ref


def x_like(batch=2, channels=3, size=(3, 2, 3), dtype=F64, seed=None, requires_grad=False):
    gen = torch.Generator().manual_seed(seed if seed is not None else 7)
    x = torch.randn(batch, channels, *size, generator=gen, dtype=dtype)
    return x.requires_grad_(requires_grad)


def assert_same_state(got, want, tol=TIGHT):
    """Identical state_dict keys (num_batches_tracked included), values within `tol`."""
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state) or set(got_state) == set(want_state)
    for key, value in want_state.items():
        assert close(got_state[key], value, tol), key


GRAD_FLOOR = 1e-3  # gradients in these tests are of order 0.1 to 10


def assert_same_grads(got, want, tol=TIGHT):
    """Each parameter's gradient within `tol` of its own size, or of a tenth of the whole
    model's gradient where it is smaller (a gradient zero in exact arithmetic)."""
    got_params, want_params = dict(got.named_parameters()), dict(want.named_parameters())
    assert set(got_params) == set(want_params)
    grads = [p.grad.detach().double().norm() for p in want_params.values() if p.grad is not None]
    floor = max(0.1 * float(torch.stack(grads).norm()) if grads else 0.0, GRAD_FLOOR)
    for name, p in want_params.items():
        assert close(got_params[name].grad, p.grad, tol, floor), name


def fused_chains(model):
    return [m for m in model.modules() if isinstance(m, _FusedChain)]


def state_copy(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def freeze_batch_norms(model):
    """The common 'freeze BN' loop."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm3d):
            m.eval()


# --- 2. The drop-in module: the batch norm's mode decides --------------------------------------

MODE_SETUPS = {
    "train": lambda m: m.train(),
    "eval": lambda m: m.eval(),
    "train-bn-frozen": lambda m: (m.train(), freeze_batch_norms(m)),
    "eval-bn-training": lambda m: (m.eval(), m.batch_norm.train()),
    "train-params-frozen": lambda m: (m.train(), m.requires_grad_(False)),
    "train-bn-frozen-params-frozen": lambda m: (m.train(), freeze_batch_norms(m),
                                                m.batch_norm.requires_grad_(False)),
    "train-conv-frozen": lambda m: (m.train(), m.conv_transpose.requires_grad_(False)),
}


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("setup", list(MODE_SETUPS))
def test_module_follows_the_unfused_modules_in_every_mode(setup, momentum):
    module, ref = pair(momentum=momentum)
    for model in (module, ref):
        MODE_SETUPS[setup](model)
    assert module.batch_norm.training == ref.batch_norm.training
    for step in range(3):
        outs = []
        for model in (module, ref):
            x = x_like(seed=step, requires_grad=True)
            out = model(x)
            (out * torch.linspace(-1, 2, out.numel(), dtype=F64).view_as(out)).sum().backward()
            outs.append((out, x.grad))
        assert relerr(outs[0][0], outs[1][0]) <= TIGHT, step
        assert close(outs[0][1], outs[1][1], TIGHT, GRAD_FLOOR), step
        assert_same_grads(module, ref)
        assert_same_state(module, ref)
        module.zero_grad(), ref.zero_grad()


def test_freezing_batch_norms_in_a_model_in_training_mode():
    """The issue's case: the loop puts the batch norm in eval mode; the module normalizes
    with the running statistics and leaves them, and the counter, alone."""
    module, _ = pair()
    holder = nn.Sequential(nn.Identity(), module).train()
    freeze_batch_norms(holder)
    before = state_copy(module)
    rm, rv = module.batch_norm.running_mean, module.batch_norm.running_var
    x = x_like()
    want = F.adaptive_avg_pool3d(F.batch_norm(
        module.conv_transpose(x) * module.scale_factor, rm.clone(), rv.clone(),
        module.batch_norm.weight, module.batch_norm.bias, False, 0.1, 1e-5), 1)
    assert relerr(holder(x), want) <= TIGHT
    assert unchanged(module, before)


@pytest.mark.parametrize("bn_mode", ["train", "eval"])
def test_from_modules_takes_the_batch_norms_mode(bn_mode):
    conv, bn = nn.ConvTranspose3d(3, 4, 2).double(), randomized(nn.BatchNorm3d(4).double())
    bn.train(bn_mode == "train")
    module = ConvTransposeBNPool3d.from_modules(conv, 1.5, bn)
    assert module.training == (bn_mode == "train")
    assert bn.training == (bn_mode == "train")  # not changed
    ref = Unfused().double()
    ref.conv_transpose, ref.batch_norm = copy.deepcopy(conv), copy.deepcopy(bn)
    ref.train(bn_mode == "train")
    x = x_like()
    assert relerr(module(x), ref(x)) <= TIGHT
    assert_same_state(module, ref)


# --- 1. torch.fx: the module and fused chains are leaves ---------------------------------------

class Holder(nn.Module):
    """A model holding the drop-in module between other layers."""

    def __init__(self, block):
        super().__init__()
        self.stem = nn.Conv3d(3, 3, 1)
        self.block = block
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.stem(x))).flatten(1))


def holder_pair():
    """(Holder with the drop-in module, Holder with the unfused modules), same state."""
    module, ref = pair()
    torch.manual_seed(1)
    ref_holder = Holder(ref).double()
    holder = Holder(module).double()
    holder.load_state_dict(ref_holder.state_dict())
    return holder, ref_holder


def run_modes(traced, ref, modes=("train", "eval", "bn-frozen", "train")):
    """Switches modes after tracing and compares outputs and states in each."""
    for step, mode in enumerate(modes):
        for model in (traced, ref):
            model.train(mode != "eval")
            if mode == "bn-frozen":
                freeze_batch_norms(model)
        x = x_like(seed=10 + step)
        with torch.no_grad():
            assert relerr(traced(x), ref(x)) <= TIGHT, mode
        assert_same_state(traced, ref)


@pytest.mark.parametrize("trace", ["symbolic_trace", "fuse", "fuse-twice"])
@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_tracing_a_model_holding_the_module_records_one_call(trace, traced_in):
    holder, ref = holder_pair()
    holder.train(traced_in == "train"), ref.train(traced_in == "train")
    modes = [m.training for m in holder.modules()]
    before = state_copy(holder)
    if trace == "symbolic_trace":
        traced = fx.symbolic_trace(holder)
    elif trace == "fuse":
        traced = fused_ops.fuse(holder)
    else:
        traced = fused_ops.fuse(fused_ops.fuse(holder))
    # Nothing run, nothing modified, no mode changed by the trace.
    assert unchanged(holder, before)
    assert [m.training for m in holder.modules()] == modes
    calls = [n for n in traced.graph.nodes if n.op == "call_module" and n.target == "block"]
    assert len(calls) == 1
    assert traced.get_submodule("block") is holder.block
    assert list(traced.state_dict()) == list(holder.state_dict())
    assert "block.batch_norm.num_batches_tracked" in traced.state_dict()
    run_modes(traced, ref)


def test_tracing_the_module_itself_follows_its_modes():
    """The module as fx's root: one call of the op with its submodules, read at each call
    (the batch norm's mode at that moment), nothing modified by the trace."""
    module, ref = pair()
    before = state_copy(module)
    for traced in (fx.symbolic_trace(module), fused_ops.fuse(module)):
        assert unchanged(module, before)
        assert not [n for n in traced.graph.nodes
                    if n.op == "call_function" and n.target is torch.mul]
        assert list(traced.state_dict()) == list(ref.state_dict())
    traced = fx.symbolic_trace(module)
    run_modes(traced, ref)


class Chain(nn.Module):
    """The pattern written out (module batch norm), inside a model with another layer."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose3d(3, 4, 2)
        self.norm = nn.BatchNorm3d(4)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.pool(self.norm(self.up(x) * 2.0)).flatten(1))


class FunctionalChain(nn.Module):
    """F.conv_transpose3d -> / c -> F.batch_norm(self.training) -> mean."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4, 2, 2, 2) * 0.3)
        self.bias = nn.Parameter(torch.randn(4))
        self.bn_weight = nn.Parameter(torch.rand(4) + 0.5)
        self.bn_bias = nn.Parameter(torch.randn(4))
        self.register_buffer("running_mean", torch.randn(4))
        self.register_buffer("running_var", torch.rand(4) + 0.5)

    def forward(self, x):
        y = F.conv_transpose3d(x, self.weight, self.bias) / -4.0
        z = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias,
                         self.training, 0.2, 1e-4)
        return z.mean((2, 3, 4))


def chain_pair(cls):
    torch.manual_seed(2)
    model = randomize_batch_norms(cls().double())
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("cls", [Chain, FunctionalChain])
@pytest.mark.parametrize("retrace", ["symbolic_trace", "fuse"])
def test_fused_chains_are_leaves(cls, retrace):
    """`fuse(fuse(model))` and fx.symbolic_trace of a fused model keep each fused chain one
    call: modes still switch, the state_dict keeps its keys, nothing counts at trace."""
    model, ref = chain_pair(cls)
    fused = fused_ops.fuse(model)
    before = state_copy(fused)
    again = fused_ops.fuse(fused) if retrace == "fuse" else fx.symbolic_trace(fused)
    assert unchanged(fused, before)
    assert len(fused_chains(again)) == 1
    assert [m for m in again.modules() if isinstance(m, _FusedChain)][0] is fused_chains(fused)[0]
    assert list(again.state_dict()) == list(ref.state_dict())
    run_modes(again, ref)


def test_a_fused_chain_traced_by_itself_is_refused():
    chain = fused_chains(fused_ops.fuse(Chain()))[0]
    with pytest.raises(RuntimeError, match="cannot trace this module by itself"):
        fx.symbolic_trace(chain)


def test_issue_case_fuse_of_a_model_holding_the_module():
    """The issue's numbers: the mode was frozen to True by the trace, num_batches_tracked
    lost from the state_dict, the original's counter counted once, eval 0.22 off."""
    holder, ref = holder_pair()
    fused = fused_ops.fuse(holder)
    assert int(holder.block.batch_norm.num_batches_tracked) == 0
    assert set(fused.state_dict()) == set(holder.state_dict())
    fused.eval(), ref.eval()
    x = x_like()
    with torch.no_grad():
        assert relerr(fused(x), ref(x)) <= TIGHT


# --- 4. Saving, loading, copying ---------------------------------------------------------------

class SequentialHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(3, 3, 1)
        self.head = nn.Sequential(nn.ConvTranspose3d(3, 4, 2), nn.BatchNorm3d(4, momentum=None),
                                  nn.AdaptiveAvgPool3d(1), nn.Flatten())

    def forward(self, x):
        return self.head(self.stem(x))


def _save_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {
    "torch.save": _save_load,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "deepcopy": copy.deepcopy,
}
def _traced(make, trace, chains=0):
    def pair_of_models():
        model, ref = make()
        traced = trace(model)
        assert len(fused_chains(traced)) == chains
        return traced, ref
    return pair_of_models


MODELS = {  # (the model, the unfused modules in the same state)
    "module_bn": _traced(lambda: chain_pair(Chain), fused_ops.fuse, 1),
    "functional_bn": _traced(lambda: chain_pair(FunctionalChain), fused_ops.fuse, 1),
    "sequential": _traced(lambda: chain_pair(SequentialHead), fused_ops.fuse, 1),
    "holds_module": _traced(holder_pair, fused_ops.fuse),
    "holds_module_traced": _traced(holder_pair, fx.symbolic_trace),
    "module_itself": pair,
    "module_itself_traced": _traced(pair, fx.symbolic_trace),
}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("model", list(MODELS))
def test_copies_behave_identically(model, how):
    """The copy (and the original) against the unfused modules, in each mode."""
    original, ref = MODELS[model]()
    for m in (original, ref):
        m.train()(x_like(seed=3))  # some state: counted batches, moved running statistics
    copied = COPIES[how](original)
    assert list(copied.state_dict()) == list(original.state_dict())
    assert set(copied.state_dict()) == set(ref.state_dict())
    assert_same_state(copied, original, 0.0)
    for step, mode in enumerate(("train", "eval", "bn-frozen", "train")):
        for m in (original, copied, ref):
            m.train(mode != "eval")
            if mode == "bn-frozen":
                freeze_batch_norms(m)
        x = x_like(seed=20 + step)
        with torch.no_grad():
            want = ref(x)
            assert relerr(copied(x), want) <= TIGHT, mode
            assert relerr(original(x), want) <= TIGHT, mode
        assert_same_state(copied, ref)
        assert_same_state(original, ref)
    # Independent copies (deepcopy, load): the copy's buffers are its own.
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(
        copied.state_dict().values(), original.state_dict().values()))


@pytest.mark.parametrize("cls", [Chain, FunctionalChain, SequentialHead])
def test_state_dict_round_trips_with_the_unfused_model(cls):
    model, ref = chain_pair(cls)
    fused = fused_ops.fuse(model)
    assert len(fused_chains(fused)) == 1
    assert list(fused.state_dict()) == list(ref.state_dict())
    # Unfused -> fused.
    torch.manual_seed(5)
    other = randomize_batch_norms(cls().double())
    other.train()(x_like(seed=4))
    fused.load_state_dict(other.state_dict())
    assert_same_state(fused, other, 0.0)
    # Fused -> unfused, through a file.
    fused.train()(x_like(seed=5))
    other(x_like(seed=5))
    buffer = io.BytesIO()
    torch.save(fused.state_dict(), buffer)
    buffer.seek(0)
    back = cls().double()
    back.load_state_dict(torch.load(buffer))
    assert_same_state(back, other)
    run_modes(fused, other)


# --- 3. Devices: a meta tensor among CPU ones is refused, nothing counted ----------------------

META_CASES = {
    # which tensor goes to meta: (where, the argument the op names)
    "running_mean": ("batch_norm.running_mean", "running_mean"),
    "running_var": ("batch_norm.running_var", "running_var"),
    "bn_weight": ("batch_norm.weight", "bn_weight"),
    "bn_bias": ("batch_norm.bias", "bn_bias"),
    "conv_weight": ("conv_transpose.weight", "weight"),
    "conv_bias": ("conv_transpose.bias", "bias"),
}


def _to_meta(module, where):
    owner, name = where.rsplit(".", 1)
    owner = module.get_submodule(owner)
    value = getattr(owner, name)
    if isinstance(value, nn.Parameter):
        setattr(owner, name, nn.Parameter(value.detach().to("meta"),
                                          requires_grad=value.requires_grad))
    else:
        setattr(owner, name, value.to("meta"))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", list(META_CASES))
def test_a_meta_tensor_among_cpu_ones_is_refused(case, mode, requires_grad):
    module, _ = pair()
    module.train(mode == "train").requires_grad_(requires_grad)
    where, name = META_CASES[case]
    _to_meta(module, where)
    before = {k: v.clone() for k, v in module.state_dict().items() if v.device.type == "cpu"}
    with pytest.raises(RuntimeError, match=rf"ct_bn_pool: {name} must be on the same device "
                                           rf"as x \(cpu\), got meta"):
        module(x_like(requires_grad=requires_grad))
    after = module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert int(module.batch_norm.num_batches_tracked) == 0


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_meta_input_with_cpu_weights_is_refused(mode):
    module, _ = pair()
    module.train(mode == "train")
    with pytest.raises(RuntimeError, match=r"ct_bn_pool: weight must be on the same device as "
                                           r"x \(meta\), got cpu"):
        module(torch.empty(2, 3, 3, 2, 3, dtype=F64, device="meta"))
    assert int(module.batch_norm.num_batches_tracked) == 0
    # All on meta: the output's shape, dtype and device.
    module.to("meta")
    out = module(torch.empty(2, 3, 3, 2, 3, dtype=F64, device="meta"))
    assert out.shape == (2, 4, 1, 1, 1) and out.device.type == "meta" and out.dtype == F64


def test_the_synchronized_steps_apply_checks_devices():
    sums = torch.zeros(2, 4, dtype=F64)
    stats = torch.zeros(3, 4, dtype=F64)
    with pytest.raises(RuntimeError, match=r"running_mean must be on the same device as "
                                           r"sample_sums \(cpu\), got meta"):
        torch.ops.fused_ops.ct_bn_pool_apply(sums, stats, 4, None, 1.0, None, None,
                                             torch.zeros(4, dtype=F64, device="meta"),
                                             torch.ones(4, dtype=F64), 0.1, 1e-5, F64)
    with pytest.raises(RuntimeError, match=r"stats must be on the same device as sample_sums "
                                           r"\(cpu\), got meta"):
        torch.ops.fused_ops.ct_bn_pool_apply.no_stats(sums, stats.to("meta"), 4, None, 1.0,
                                                      None, None, 1e-5, F64)


# --- 6. The fake kernel refuses bad input as the op does ---------------------------------------

def _op_arguments():
    module, _ = pair()
    bn, conv = module.batch_norm, module.conv_transpose
    return dict(x=x_like(), weight=conv.weight.detach(), bias=conv.bias.detach(), scale=2.0,
                bn_weight=bn.weight.detach(), bn_bias=bn.bias.detach(),
                running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone(),
                training=True, momentum=0.1, eps=1e-5)


BAD_INPUTS = {
    "bn_weight_shape": lambda a: a.update(bn_weight=a["bn_weight"][:3]),
    "bias_dtype": lambda a: a.update(bias=a["bias"].float()),
    "running_var_dtype": lambda a: a.update(running_var=a["running_var"].float()),
    "weight_channels": lambda a: a.update(weight=a["weight"][:2]),
    "x_4d": lambda a: a.update(x=a["x"][0]),
    "running_var_missing": lambda a: a.update(running_var=None),
    "eval_without_stats": lambda a: a.update(training=False, running_mean=None,
                                             running_var=None),
    "one_value": lambda a: a.update(x=a["x"][:1, :, :1, :1, :1],
                                    weight=a["weight"][:, :, :1, :1, :1]),
    "groups": lambda a: a.update(groups=2),
    "output_padding": lambda a: a.update(output_padding=(1, 0, 0)),
    "padding_too_large": lambda a: a.update(padding=(4, 0, 0)),
    "unknown_algo": lambda a: a.update(algo="winograd"),
    "fft_on_cpu": lambda a: a.update(algo="fft"),
    "border_without_padding": lambda a: a.update(algo="border"),
    "correlation_with_padding": lambda a: a.update(algo="correlation", padding=(1, 0, 0)),
}


def _call_op(a):
    a = dict(a)
    options = {k: a.pop(k) for k in ("stride", "padding", "output_padding", "dilation",
                                     "groups", "algo") if k in a}
    for key in ("stride", "padding", "output_padding", "dilation"):
        if key in options:
            options[key] = list(options[key])
    return torch.ops.fused_ops.ct_bn_pool.default(*a.values(), **options)


def _outcome(call):
    try:
        return "ok", tuple(call().shape)
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, str(error).splitlines()[0]


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_fake_kernel_refuses_bad_input_as_the_op_does(case):
    """Under FakeTensorMode (torch.compile's and export's tracing) and on meta tensors: the
    op's own error type and message."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    a = _op_arguments()
    BAD_INPUTS[case](a)
    real = _outcome(lambda: _call_op(a))
    assert real[0] != "ok"
    mode = FakeTensorMode()
    fake_args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                 for k, v in a.items()}
    with mode:
        assert _outcome(lambda: _call_op(fake_args)) == real
    meta_args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    fake = _outcome(lambda: _call_op(meta_args))
    if case != "fft_on_cpu":  # on meta, fft is refused as not CUDA
        assert fake == (real[0], real[1].replace("cpu", "meta"))


def test_compile_with_gradients_reports_the_ops_own_error():
    """The issue: a bad bn weight under torch.compile with gradients on failed in the
    backward's trace (BackendCompilerFailed, a broadcast error). Now the forward's trace
    refuses it with the op's message, and nothing is counted."""
    torch._dynamo.reset()
    module, _ = pair()
    module.batch_norm.weight = nn.Parameter(torch.ones(3, dtype=F64))
    compiled = torch.compile(module, backend="aot_eager")
    with pytest.raises(RuntimeError) as caught:
        compiled(x_like(requires_grad=True))
    assert not isinstance(caught.value, torch._dynamo.exc.BackendCompilerFailed)
    assert "ct_bn_pool: bn_weight must have shape [4] (one value per output channel), got [3]" \
        in str(caught.value)
    assert int(module.batch_norm.num_batches_tracked) == 0
    torch._dynamo.reset()


# --- 5. fuse finds the pattern as people write it ---------------------------------------------

class Spelled(nn.Module):
    """conv -> (spelling of the scale) -> bn -> (spelling of the pool)."""

    def __init__(self, forward, momentum=0.1):
        super().__init__()
        self.ct = nn.ConvTranspose3d(3, 4, 2)
        self.bn = nn.BatchNorm3d(4, momentum=momentum)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.spelling = forward

    def forward(self, x):
        return self.spelling(self, x)


def _in_place_unused(s, x):
    y = s.ct(x)
    y.mul_(-2.0)
    return s.pool(s.bn(y))


def _in_place_div_unused(s, x):
    y = s.ct(x)
    y.div_(3.0)
    return s.bn(y).mean((2, 3, 4), keepdim=True)


SPELLINGS = {  # forward, the scale fused
    "no_scale": (lambda s, x: s.pool(s.bn(s.ct(x))), 1.0),
    "mul": (lambda s, x: s.pool(s.bn(s.ct(x) * 2.5)), 2.5),
    "rmul_int": (lambda s, x: s.pool(s.bn(3 * s.ct(x))), 3.0),
    "div": (lambda s, x: s.pool(s.bn(s.ct(x) / 3.0)), 1 / 3.0),
    "div_int": (lambda s, x: s.pool(s.bn(s.ct(x) / 7)), 1 / 7),
    "torch_div": (lambda s, x: s.pool(s.bn(torch.div(s.ct(x), -0.3))), 1 / -0.3),
    "method_div": (lambda s, x: s.pool(s.bn(s.ct(x).div(10.0))), 0.1),
    "neg": (lambda s, x: s.pool(s.bn(-s.ct(x))), -1.0),
    "mul_": (lambda s, x: s.pool(s.bn(s.ct(x).mul_(1.75))), 1.75),
    "mul_unused_result": (_in_place_unused, -2.0),
    "div_unused_result": (_in_place_div_unused, 1 / 3.0),
    "mean_keepdim": (lambda s, x: s.bn(s.ct(x) * 2.0).mean((2, 3, 4), keepdim=True), 2.0),
    "mean_negative_dims": (lambda s, x: s.bn(s.ct(x) * 2.0).mean([-3, -2, -1]), 2.0),
    "torch_mean": (lambda s, x: torch.mean(s.bn(s.ct(x)), dim=(4, 2, 3)), 1.0),
    "flatten_mean": (lambda s, x: s.bn(s.ct(x) / 2).flatten(2).mean(-1), 0.5),
    "flatten_mean_keepdim": (lambda s, x: torch.flatten(s.bn(s.ct(x)), 2).mean(2, True), 1.0),
    "functional_pool": (lambda s, x: F.adaptive_avg_pool3d(s.bn(s.ct(x)), (1, 1, 1)), 1.0),
}


def spelled_pair(forward, momentum=0.1):
    torch.manual_seed(3)
    model = Spelled(forward, momentum).double()
    randomized(model.bn)
    return model, copy.deepcopy(model)


def check_fused_follows(fused, ref, steps=("train", "train", "eval", "bn-frozen", "train")):
    """Forward and backward in each mode: outputs (shape included), x's and the
    parameters' gradients, buffers."""
    for step, mode in enumerate(steps):
        for m in (fused, ref):
            m.train(mode != "eval")
            if mode == "bn-frozen":
                freeze_batch_norms(m)
            m.zero_grad()
        outs = []
        for m in (fused, ref):
            x = x_like(seed=30 + step, requires_grad=True)
            out = m(x)
            (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum() \
                .backward()
            outs.append((out, x.grad))
        assert outs[0][0].shape == outs[1][0].shape, mode
        assert relerr(outs[0][0], outs[1][0]) <= TIGHT, mode
        assert close(outs[0][1], outs[1][1], TIGHT, GRAD_FLOOR), mode
        assert_same_grads(fused, ref)
        assert_same_state(fused, ref)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_fuse_finds_each_spelling(spelling):
    forward, scale = SPELLINGS[spelling]
    model, ref = spelled_pair(forward)
    fused = fused_ops.fuse(model)
    chains = fused_chains(fused)
    assert len(chains) == 1
    assert chains[0].scale == pytest.approx(scale, rel=1e-15)
    assert not any(isinstance(m, nn.AdaptiveAvgPool3d) for m in fused.modules())
    assert list(fused.state_dict()) == list(ref.state_dict())
    check_fused_follows(fused, ref)


def test_division_is_exactly_a_scale_by_the_reciprocal():
    """`/ c` fused as scale 1 / c: eval mode (where the scale enters the output directly)
    and training (where it enters against eps), with a divisor whose reciprocal is
    inexact, in float64 and float32."""
    for dtype, tol in ((F64, 1e-13), (torch.float32, 2e-6)):
        model, ref = spelled_pair(lambda s, x: s.pool(s.bn(s.ct(x) / 0.7)), momentum=0.5)
        model.to(dtype), ref.to(dtype)
        model.bn.eps = ref.bn.eps = 0.5  # eps comparable to the variance: the scale shows
        fused = fused_ops.fuse(model)
        assert fused_chains(fused)[0].scale == 1 / 0.7
        for mode in (True, False):
            fused.train(mode), ref.train(mode)
            x = x_like(dtype=dtype)
            with torch.no_grad():
                assert relerr(fused(x), ref(x)) <= tol, (dtype, mode)
            assert close(model.bn.running_var, ref.bn.running_var, tol)


class InSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = nn.Sequential(
            nn.ConvTranspose3d(3, 5, 2, stride=2), nn.BatchNorm3d(5), nn.ReLU(),
            nn.Sequential(nn.ConvTranspose3d(5, 4, 2), nn.BatchNorm3d(4),
                          nn.AdaptiveAvgPool3d((1, 1, 1))),
            nn.Flatten())

    def forward(self, x):
        return self.decoder(x)


def test_fuse_finds_a_chain_in_a_sequential():
    model, ref = chain_pair(InSequential)
    fused = fused_ops.fuse(model)
    assert len(fused_chains(fused)) == 1
    assert not any(isinstance(m, nn.AdaptiveAvgPool3d) for m in fused.modules())
    assert list(fused.state_dict()) == list(ref.state_dict())
    check_fused_follows(fused, ref)


def _bn_used_elsewhere(s, x):
    z = s.bn(s.ct(x) * 2.0)
    return s.pool(z) + z.amax()


def _in_place_after_the_batch_norm(s, x):
    y = s.ct(x)
    z = s.bn(y)
    y.mul_(2.0)
    return s.pool(z)


def _buffer_scale(s, x):
    return s.pool(s.bn(s.ct(x) * s.bn.weight[:1]))


NEAR_MISSES = {  # forward, words of the reason fuse gives
    "add": (lambda s, x: s.pool(s.bn(s.ct(x) + 2.0)), "comes from +"),
    "sub": (lambda s, x: s.pool(s.bn(s.ct(x) - 2.0)), "comes from -"),
    "rsub": (lambda s, x: s.pool(s.bn(2.0 - s.ct(x))), "comes from -"),
    "number_divided_by_conv": (lambda s, x: s.pool(s.bn(2.0 / s.ct(x))), "divided by the conv"),
    "floor_div": (lambda s, x: s.pool(s.bn(s.ct(x) // 2.0)), "comes from"),
    "div_rounding": (lambda s, x: s.pool(s.bn(torch.div(s.ct(x), 2.0, rounding_mode="trunc"))),
                     "rounding"),
    "div_by_zero": (lambda s, x: s.pool(s.bn(s.ct(x) / 0.0)), "divided by 0.0"),
    "pow": (lambda s, x: s.pool(s.bn(s.ct(x) ** 2)), "comes from"),
    "tensor_scale": (_buffer_scale, "tensor"),
    "two_scales": (lambda s, x: s.pool(s.bn(s.ct(x) * 2.0 * 3.0)), "comes from *"),
    "mean_two_dims": (lambda s, x: s.bn(s.ct(x)).mean((2, 3), keepdim=True), "dims (2, 3)"),
    "mean_with_channels": (lambda s, x: s.bn(s.ct(x)).mean((1, 2, 3, 4)), "dims (1, 2, 3, 4)"),
    "mean_all": (lambda s, x: s.bn(s.ct(x)).mean(), "every dim"),
    "mean_other_dtype": (lambda s, x: s.bn(s.ct(x)).mean((2, 3, 4), dtype=torch.float32),
                         "dtype"),
    "flatten_1_mean": (lambda s, x: s.bn(s.ct(x)).flatten(1).mean(-1), "flatten(2)"),
    "flatten_3_mean": (lambda s, x: s.bn(s.ct(x)).flatten(3).mean(-1, keepdim=True),
                       "flatten(2)"),
    "flatten_mean_channels": (lambda s, x: s.bn(s.ct(x)).flatten(2).mean(1), "over dims 1,"),
    "pool_not_global": (lambda s, x: F.adaptive_avg_pool3d(s.bn(s.ct(x)), (1, 2, 1)),
                        "not to 1"),
    "max_pool": (lambda s, x: F.adaptive_max_pool3d(s.bn(s.ct(x)), 1), "not to a global"),
    "bn_used_elsewhere": (_bn_used_elsewhere, "also used elsewhere"),
    "in_place_after_bn": (_in_place_after_the_batch_norm, "also used elsewhere"),
}


@pytest.mark.parametrize("near_miss", list(NEAR_MISSES))
def test_near_misses_are_left_alone_and_reported(near_miss, caplog):
    forward, reason = NEAR_MISSES[near_miss]
    model, ref = spelled_pair(forward)
    with caplog.at_level(logging.INFO, logger="fused_ops.fusion"):
        fused = fused_ops.fuse(model)
    assert fused_chains(fused) == []
    report = fused.meta["fused_ops.fuse"]
    assert report.fused == [] and len(report.left_alone) == 1
    assert reason in report.left_alone[0][1], report.left_alone
    assert any("left alone" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records)
    for mode in (True, False):
        fused.train(mode), ref.train(mode)
        x = x_like(seed=4)
        with torch.no_grad():
            want = ref(x)
            got = fused(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_fuse_reports_what_it_did(capsys, caplog):
    model, _ = chain_pair(Decoder)
    with caplog.at_level(logging.INFO, logger="fused_ops.fusion"):
        fused = fused_ops.fuse(model, "auto", verbose=True)
    printed = capsys.readouterr().out
    report = fused.meta["fused_ops.fuse"]
    assert len(report.fused) == 1 and report.fused[0][1] in dict(fused.named_modules())
    assert "head_ct (ConvTranspose3d) -> head_bn (BatchNorm3d) -> .mean()" in report.fused[0][0]
    # The stages' batch norms feed a ReLU: left alone, saying so.
    assert len(report.left_alone) == 2
    assert all("not to a global average pool" in why for _, why in report.left_alone)
    assert "1 chain(s) fused, 2 left alone" in printed
    assert [r.getMessage() for r in caplog.records if r.name == "fused_ops.fusion"] == [
        f"fused_ops.fuse: {line}" for line in report.lines()]
    # Quiet by default; the positional algo still works.
    fused_ops.fuse(chain_pair(Decoder)[0], "sliced_conv")
    assert capsys.readouterr().out == ""


# --- A decoder as people write it, trained fused and unfused ----------------------------------

class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage1 = nn.Sequential(nn.ConvTranspose3d(4, 6, 2, stride=2, bias=False),
                                    nn.BatchNorm3d(6), nn.ReLU(inplace=True))
        self.stage2 = nn.Sequential(nn.ConvTranspose3d(6, 5, 3, stride=1, padding=1),
                                    nn.BatchNorm3d(5), nn.ReLU())
        self.head_ct = nn.ConvTranspose3d(5, 3, 2, stride=2)
        self.head_bn = nn.BatchNorm3d(3)

    def forward(self, x):
        z = self.head_bn(self.head_ct(self.stage2(self.stage1(x))))
        return z.mean((2, 3, 4))


def test_decoder_trains_like_the_unfused_one():
    model, ref = chain_pair(Decoder)
    fused = fused_ops.fuse(model)
    assert len(fused_chains(fused)) == 1
    opt_fused = torch.optim.SGD(fused.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    target = torch.randn(3, 3, dtype=F64)
    for step in range(6):
        if step == 4:
            fused.eval(), ref.eval()
        x = x_like(3, 4, (2, 2, 1), seed=40 + step)
        losses = []
        for m, opt in ((fused, opt_fused), (ref, opt_ref)):
            opt.zero_grad()
            out = m(x)
            loss = F.mse_loss(out, target)
            loss.backward()
            losses.append(out)
        assert relerr(losses[0], losses[1]) <= 1e-9, step
        assert_same_grads(fused, ref, 1e-8)
        opt_fused.step(), opt_ref.step()
        assert_same_state(fused, ref, 1e-9)


# --- A differential test: fused and unfused side by side through random histories -------------

class Net(nn.Module):
    """Two chains (one through the drop-in module if `drop_in`), other layers around."""

    def __init__(self, drop_in):
        super().__init__()
        self.stem = nn.Conv3d(2, 3, 1)
        self.head = ConvTransposeBNPool3d(3, 4, 2, -1.5) if drop_in else Unfused(3, 4, 2, -1.5)
        self.up = nn.ConvTranspose3d(3, 5, (2, 1, 2), stride=(2, 1, 1))
        self.bn = nn.BatchNorm3d(5, momentum=None)
        self.fc = nn.Linear(9, 2)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        a = self.head(h).flatten(1)
        b = self.bn(self.up(h) / 2.0).mean((2, 3, 4))
        return self.fc(torch.cat([a, b], dim=1))


FREEZABLE = ["stem", "head.conv_transpose", "head.batch_norm", "up", "bn", "fc"]


def _make_models():
    torch.manual_seed(11)
    ref = randomize_batch_norms(Net(drop_in=False).double())
    models = [ref, fused_ops.fuse(copy.deepcopy(ref))]
    drop_in = Net(drop_in=True).double()
    drop_in.load_state_dict(ref.state_dict())
    models.append(fused_ops.fuse(drop_in))
    assert [len(fused_chains(m)) for m in models] == [0, 2, 1]
    return models


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_and_unfused_agree_through_random_histories(seed):
    rng = random.Random(seed)
    models = _make_models()
    ref = models[0]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    dtype, drifted = F64, False  # drifted: float32 steps since the last resync

    def tol():
        return 2e-4 if drifted or dtype != F64 else TIGHT

    def check_state():
        for m in models[1:]:
            assert_same_state(m, ref, tol())

    for step in range(40):
        action = rng.choice(["step", "step", "step", "forward", "train", "eval", "freeze_bn",
                             "unfreeze_bn", "freeze_params", "unfreeze_params", "save_load",
                             "dtype", "resync"])
        if action in ("train", "eval"):
            for m in models:
                m.train(action == "train")
        elif action in ("freeze_bn", "unfreeze_bn"):
            name = rng.choice(["head.batch_norm", "bn", "all"])
            for m in models:
                for bn in ([m.get_submodule(name)] if name != "all" else
                           [b for b in m.modules() if isinstance(b, nn.BatchNorm3d)]):
                    bn.train(action == "unfreeze_bn")
        elif action in ("freeze_params", "unfreeze_params"):
            name = rng.choice(FREEZABLE)
            for m in models:
                m.get_submodule(name).requires_grad_(action == "unfreeze_params")
        elif action == "save_load":
            # Each model's state_dict through a file into a new fused (or unfused) model.
            new_models = [Net(drop_in=False).double(),
                          fused_ops.fuse(Net(drop_in=False).double()),
                          fused_ops.fuse(Net(drop_in=True).double())]
            for old, new in zip(models, new_models):
                buffer = io.BytesIO()
                torch.save(old.state_dict(), buffer)
                buffer.seek(0)
                new.to(dtype).load_state_dict(torch.load(buffer))
                for name, module in old.named_modules():
                    new.get_submodule(name).training = module.training
                for name, p in old.named_parameters():
                    new.get_parameter(name).requires_grad_(p.requires_grad)
            models[:] = new_models
            ref = models[0]
            optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
            check_state()
        elif action == "dtype":
            dtype = torch.float32 if dtype == F64 else F64
            drifted = drifted or dtype != F64
            for m in models:
                m.to(dtype)
            check_state()
        elif action == "resync":  # the reference's state into the others: tight again
            for m in models[1:]:
                m.load_state_dict(ref.state_dict())
            drifted = dtype != F64
            check_state()
        else:
            grad = action == "step"
            x = x_like(3, 2, (2, 2, 3), dtype=dtype, seed=1000 + step, requires_grad=grad)
            outs = []
            for m, opt in zip(models, optimizers):
                opt.zero_grad()
                xi = x.detach().clone().requires_grad_(grad)
                with torch.set_grad_enabled(grad):
                    out = m(xi)
                    if grad and out.requires_grad:
                        F.mse_loss(out, torch.arange(6, dtype=dtype).view(3, 2) / 5).backward()
                outs.append((out.detach(), xi.grad))
            for m, (out, x_grad) in zip(models[1:], outs[1:]):
                assert relerr(out, outs[0][0]) <= tol(), (step, action)
                assert close(x_grad, outs[0][1], tol(), GRAD_FLOOR), (step, action)
                assert_same_grads(m, ref, tol())
            if grad:
                for opt in optimizers:
                    opt.step()
            check_state()
