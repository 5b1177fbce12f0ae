"""Training statistics over several processes (fused_ops/distributed.py, docs/distributed.md).

The merge alone; the whole synced path for a group simulated in this process, forward and
backward; and real gloo groups of 2 and 3 processes on loopback with unequal batch sizes,
whose outputs, running statistics and gradients must equal a float64 run of the unfused
pattern on the concatenated batch (nn.SyncBatchNorm itself refuses CPU tensors once
torch.distributed is initialized; scripts/dist_check.py compares against it on GPUs).
"""
import contextlib
import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, GRAD_TOL, HALF_TYPES, OUT_TOL, Problem,
                      assert_gradients_match, make_dtype_models, make_models, relerr)
from fused_ops import distributed
from fused_ops.fusion import _FusedChain
from fused_ops.modules import conv_transpose_options

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

P = Problem(0, 3, 5, (3, 4, 5), (2, 3, 2))  # the batch size is set per rank
P_OPTS = Problem(0, 4, 6, (3, 2, 4), (3, 2, 2), scale=-1.5, momentum=None, conv_kwargs=dict(
    stride=(2, 1, 2), padding=(1, 0, 1), output_padding=(1, 0, 0), dilation=(1, 2, 1), groups=2))
# One output position per sample: a rank with one sample has one value per channel.
P_POINT = Problem(0, 3, 4, (1, 1, 1), (1, 1, 1))
TOL = {torch.float32: 1e-6, torch.float64: 1e-10}
MODES = ["train", "train", "eval", "train"]
# Each way of asking for synchronized statistics: (name, problem, dtype, seed).
SCENARIOS = [("explicit", P, torch.float32, 0),            # process_group= on the module
             ("convert_then_fuse", P_OPTS, torch.float64, 1),  # fuse maps nn.SyncBatchNorm
             ("fuse_then_convert", P, torch.float32, 2),   # convert_sync_batchnorm after fuse
             ("compiled", P, torch.float32, 0)]            # torch.compile(fullgraph=True)
# Training with gradients over a group, each way of asking for it: (name, problem, dtype, seed).
GRAD_SCENARIOS = [("module", P, torch.float64, 3),          # process_group= on the module
                  ("functional", P_OPTS, torch.float32, 4),  # fused_ops.ct_bn_pool(process_group=)
                  ("convert_then_fuse", P_OPTS, torch.float64, 5),  # nn.SyncBatchNorm, fused
                  ("unequal_sizes", P, torch.float64, 6),   # x's spatial size differs per rank
                  ("empty_rank", P, torch.float32, 7),      # the last rank's batch is empty
                  ("ddp", P, torch.float64, 8),             # DistributedDataParallel around it
                  ("compiled", P, torch.float32, 9)]        # torch.compile(fullgraph=True)
# x's spatial size on each rank in the unequal_sizes scenario.
RANK_SIZES = [(3, 4, 5), (2, 3, 4), (4, 4, 3)]
COLLECTIVES = ["all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce",
               "broadcast", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter",
               "reduce", "barrier"]


def global_input(p, batches, step, dtype):
    """The concatenated batch of one step; rank r's input is its r-th split."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(sum(batches), p.in_channels, *p.size, generator=g, dtype=dtype)


def conv_options(conv):
    return dict(stride=list(conv.stride), padding=list(conv.padding),
                output_padding=list(conv.output_padding), dilation=list(conv.dilation),
                groups=conv.groups)


def exact_stats(values):
    """(count, mean, M2) per channel of values [C, n], two-pass in float64."""
    mean = values.mean(1)
    return torch.stack([torch.full_like(mean, values.shape[1]), mean,
                        ((values - mean[:, None]) ** 2).sum(1)])


def pairwise_fold(gathered):
    """docs/math.md §4.1 applied one batch at a time."""
    n, mu, m2 = gathered[0].unbind(0)
    for nb, mub, m2b in (g.unbind(0) for g in gathered[1:]):
        total = n + nb
        delta = mub - mu
        mu = mu + delta * nb / total
        m2 = m2 + m2b + delta * delta * n * nb / total
        n = total
    return torch.stack([n, mu, m2])


# --- The merge -------------------------------------------------------------------------------

def test_merge_equals_the_concatenated_statistics():
    g = torch.Generator().manual_seed(0)
    # A large common offset: raw sums of squares would lose every digit of the variance.
    values = 1e6 + torch.randn(4, 40, generator=g, dtype=torch.float64)
    sizes = [7, 1, 20, 12]
    gathered = torch.stack([exact_stats(part) for part in values.split(sizes, dim=1)])
    merged = distributed.merge_stats(gathered)
    expected = exact_stats(values)
    assert torch.equal(merged[0], expected[0])
    assert relerr(merged[1:], expected[1:]) <= 1e-14
    assert relerr(merged, pairwise_fold(gathered)) <= 1e-14


def test_merge_ignores_empty_batches():
    values = torch.randn(3, 9, dtype=torch.float64)
    empty = torch.tensor([[0.0] * 3, [float("nan")] * 3, [0.0] * 3], dtype=torch.float64)
    gathered = torch.stack([exact_stats(values[:, :4]), empty, exact_stats(values[:, 4:])])
    assert relerr(distributed.merge_stats(gathered), exact_stats(values)) <= 1e-14


def test_one_value_per_channel_over_the_group_is_refused():
    merged = torch.tensor([[1.0, 1.0], [0.5, -0.5], [0.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        distributed.check_count(merged, 1)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        distributed.check_count(torch.zeros(3, 2, dtype=torch.float64), 0)
    # A process with more values than one knows the group has more too.
    distributed.check_count(merged, 2)


# --- The synced path, with the all-gather simulated in this process ---------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p, batches", [(P, [3, 1, 5]), (P_OPTS, [2, 4]), (P_POINT, [0, 1, 2])],
                         ids=["3ranks", "opts", "empty_and_single_value_ranks"])
def test_simulated_group_matches_the_concatenated_batch(p, batches, dtype, monkeypatch):
    torch.manual_seed(0)
    ref, fused = make_models(p, dtype)
    ranks = [copy.deepcopy(fused) for _ in batches]
    conv = fused.conv_transpose
    for step in range(2):
        x = global_input(p, batches, step, dtype)
        shards = x.split(batches)
        every = torch.stack([torch.ops.fused_ops.ct_bn_pool_stats(
            s, conv.weight.detach(), **conv_options(conv))[1] for s in shards])
        outs = []
        for rank, (module, shard) in enumerate(zip(ranks, shards)):
            def gather(stats, group, rank=rank):
                assert torch.equal(stats, every[rank]) and group == "group"
                return every
            monkeypatch.setattr(distributed, "all_gather_stats", gather)
            c, bn = module.conv_transpose, module.batch_norm
            with torch.no_grad():
                outs.append(distributed.synced_ct_bn_pool(
                    shard, c.weight, c.bias, p.scale, bn.weight, bn.bias, bn.running_mean,
                    bn.running_var, 0.1, bn.eps, algo="auto", process_group="group",
                    **conv_options(c)))
        ref.train()
        ref.batch_norm.momentum = 0.1  # what synced_ct_bn_pool was given
        with torch.no_grad():
            expected = ref(x.double())
        assert relerr(torch.cat(outs), expected) <= TOL[dtype]
        for module in ranks:
            for name in ("running_mean", "running_var"):
                assert relerr(getattr(module.batch_norm, name),
                              getattr(ref.batch_norm, name)) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_of_one_through_the_split_ops_equals_the_plain_op(dtype, monkeypatch):
    torch.manual_seed(0)
    _, fused = make_models(P_OPTS, dtype)
    twin = copy.deepcopy(fused)
    monkeypatch.setattr(distributed, "all_gather_stats", lambda stats, group: stats[None])
    x = global_input(P_OPTS, [3], 0, dtype)
    c, bn, tb = fused.conv_transpose, fused.batch_norm, twin.batch_norm
    with torch.no_grad():
        out = distributed.synced_ct_bn_pool(
            x, c.weight, c.bias, P_OPTS.scale, bn.weight, bn.bias, bn.running_mean,
            bn.running_var, 0.3, bn.eps, algo="auto", process_group=None, **conv_options(c))
        plain = fused_ops.ct_bn_pool(x, c.weight, c.bias, P_OPTS.scale, tb.weight, tb.bias,
                                     tb.running_mean, tb.running_var, True, 0.3, tb.eps,
                                     **conv_options(c))
    assert relerr(out, plain) <= TOL[dtype]
    assert relerr(bn.running_mean, tb.running_mean) <= TOL[dtype]
    assert relerr(bn.running_var, tb.running_var) <= TOL[dtype]


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.float64,) * 2] + [
    (t, p) for t in HALF_TYPES for p in (t, torch.float32)],
    ids=lambda d: "-".join(str(t).removeprefix("torch.") for t in d))
def test_split_ops_in_every_dtype_equal_the_plain_op(dtypes, monkeypatch):
    """The synced path for a group of one (the all-gather simulated) in every dtype pair:
    the output in x's dtype, the running statistics in theirs, equal to the plain op's; the
    statistics of ct_bn_pool_stats in float64."""
    conv_dtype, bn_dtype = dtypes
    _, fused = make_dtype_models(P_OPTS, conv_dtype, bn_dtype, beta="random")
    twin = copy.deepcopy(fused)
    monkeypatch.setattr(distributed, "all_gather_stats", lambda stats, group: stats[None])
    x = global_input(P_OPTS, [3], 0, torch.float64).to(conv_dtype)
    c, bn, tb = fused.conv_transpose, fused.batch_norm, twin.batch_norm
    sums, stats = torch.ops.fused_ops.ct_bn_pool_stats(x, c.weight.detach(), **conv_options(c))
    assert sums.dtype == stats.dtype == torch.float64
    assert sums.shape == (3, 6) and stats.shape == (3, 6)
    with torch.no_grad():
        out = distributed.synced_ct_bn_pool(
            x, c.weight, c.bias, P_OPTS.scale, bn.weight, bn.bias, bn.running_mean,
            bn.running_var, 0.1, bn.eps, algo="auto", process_group=None, **conv_options(c))
        plain = fused_ops.ct_bn_pool(x, c.weight, c.bias, P_OPTS.scale, tb.weight, tb.bias,
                                     tb.running_mean, tb.running_var, True, 0.1, tb.eps,
                                     **conv_options(c))
    assert out.dtype == conv_dtype
    assert relerr(out, plain) <= OUT_TOL[conv_dtype]
    for name in ("running_mean", "running_var"):
        assert getattr(bn, name).dtype == bn_dtype
        assert relerr(getattr(bn, name), getattr(tb, name)) <= OUT_TOL[bn_dtype]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_synced_step_without_running_stats(compiled, monkeypatch):
    """track_running_stats=False in a group: the synced step takes ct_bn_pool_apply.no_stats,
    which mutates nothing (inductor fails on the mutating overload when both of its mutable
    arguments are None), and equals the plain op's batch statistics and float64 BatchNorm."""
    torch.manual_seed(0)
    ref, fused = make_models(P_OPTS, torch.float32)
    ref.batch_norm.track_running_stats = False
    ref.batch_norm.running_mean = ref.batch_norm.running_var = None
    monkeypatch.setattr(distributed, "all_gather_stats", lambda stats, group: stats[None])
    c, bn = fused.conv_transpose, fused.batch_norm
    x = global_input(P_OPTS, [3], 0, torch.float32)

    def step(x, weight, bias, bn_weight, bn_bias):
        return distributed.synced_ct_bn_pool(
            x, weight, bias, P_OPTS.scale, bn_weight, bn_bias, None, None, 0.1, bn.eps,
            algo="auto", process_group="group", **conv_options(c))

    if compiled:
        step = torch.compile(step, backend="inductor", fullgraph=True)
    with torch.no_grad():
        out = step(x, c.weight, c.bias, bn.weight, bn.bias)
        plain = fused_ops.ct_bn_pool(x, c.weight, c.bias, P_OPTS.scale, bn.weight, bn.bias,
                                     None, None, True, 0.1, bn.eps, **conv_options(c))
        expected = ref.train()(x.double())
    assert relerr(out, plain) <= 1e-6
    assert relerr(out, expected) <= 1e-6


def _simulate_group_of_one(monkeypatch):
    """Both collectives of the synced path for a group of one; returns the list that
    records the shape of every all-reduced tensor."""
    reduced = []

    def all_reduce(sums, process_group):
        reduced.append(tuple(sums.shape))
        return sums
    monkeypatch.setattr(distributed, "all_gather_stats", lambda stats, group: stats[None])
    monkeypatch.setattr(distributed, "all_reduce_sums", all_reduce)
    return reduced


def _synced_call(fused, x, scale):
    c, bn = fused.conv_transpose, fused.batch_norm
    return distributed.synced_ct_bn_pool(
        x, c.weight, c.bias, scale, bn.weight, bn.bias, bn.running_mean, bn.running_var, 0.1,
        bn.eps, algo="auto", process_group="group", **conv_options(c))


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.float64,) * 2] + [
    (t, torch.float32) for t in HALF_TYPES],
    ids=lambda d: "-".join(str(t).removeprefix("torch.") for t in d))
def test_synced_backward_for_a_group_of_one_matches_float64(dtypes, monkeypatch):
    """The synced path's backward (docs/math.md §6.2.1) for a group of one, the collectives
    simulated: every gradient against the float64 unfused modules' on the same rounded
    values within GRAD_TOL, each in its tensor's dtype, after one all-reduce of [2, C]."""
    conv_dtype, bn_dtype = dtypes
    ref, fused = make_dtype_models(P_OPTS, conv_dtype, bn_dtype)
    reduced = _simulate_group_of_one(monkeypatch)
    x = global_input(P_OPTS, [3], 0, torch.float64).to(conv_dtype).requires_grad_()
    grad_out = torch.randn(3, P_OPTS.out_channels, 1, 1, 1, dtype=torch.float64)
    _synced_call(fused, x, P_OPTS.scale).backward(grad_out.to(conv_dtype))
    x64 = x.detach().double().requires_grad_()
    ref.train()(x64).backward(grad_out)
    got = {"x": x.grad, **{n: q.grad for n, q in fused.named_parameters()}}
    want = {"x": x64.grad, **{n: q.grad for n, q in ref.named_parameters()}}
    for name, grad in got.items():
        assert grad.dtype == (bn_dtype if name.startswith("batch_norm.") else conv_dtype), name
    assert_gradients_match(got, want, GRAD_TOL[conv_dtype])
    assert not fused.conv_transpose.bias.grad.any()  # the batch mean removes the bias
    assert reduced == [(2, P_OPTS.out_channels)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
def test_synced_step_under_autocast_casts_as_the_op(device, dtype, monkeypatch):
    """The synced path calls the split ops from Python, which have no autocast kernels: under
    torch.autocast it casts x, the weight and the conv bias itself, as the op's autocast kernel
    does (fused_ops/_autocast.py). Output, gradients and running statistics equal those of the
    same path on inputs cast by hand with autocast off, in the dtype of the unfused chain's
    output under autocast (the collectives simulated for a group of one)."""
    _simulate_group_of_one(monkeypatch)
    ref, fused = make_models(P_OPTS, torch.float32, device)
    ref = ref.float().to(device)
    twin = copy.deepcopy(fused)
    x = global_input(P_OPTS, [3], 0, torch.float32).to(device)

    def step(m, x, cast):
        c, bn = m.conv_transpose, m.batch_norm
        out = distributed.synced_ct_bn_pool(
            cast(x), cast(c.weight), cast(c.bias), P_OPTS.scale, bn.weight, bn.bias,
            bn.running_mean, bn.running_var, 0.1, bn.eps, algo="auto", process_group="group",
            **conv_options(c))
        return out, torch.autograd.grad((out.float() ** 2).sum(), (x, c.weight, bn.weight))

    with torch.autocast(device, dtype=dtype):
        chain_dtype = ref.train()(x).dtype
        out, grads = step(fused, x.clone().requires_grad_(), lambda t: t)
    want, want_grads = step(twin, x.clone().requires_grad_(), lambda t: t.to(dtype))
    assert out.dtype == chain_dtype
    assert torch.equal(out, want.to(chain_dtype))
    for got, expected in zip(grads, want_grads):
        assert torch.equal(got, expected)
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(fused.batch_norm, name), getattr(twin.batch_norm, name))


# Problems of the backward's conv-free routes (docs/dispatch.md): P is stride 1 without
# padding; kernel = stride has one tap per output position.
ROUTE_PROBLEMS = {"spectral": P, "gram": Problem(0, 4, 6, (3, 2, 4), (2, 2, 2), scale=-1.5,
                                                 conv_kwargs=dict(stride=2, groups=2))}


@pytest.mark.parametrize("route", list(ROUTE_PROBLEMS))
def test_synced_backward_on_a_conv_free_route_matches_float64(route, monkeypatch):
    """test_synced_backward_for_a_group_of_one_matches_float64 with the route forced: the
    group's statistics and the one all-reduce reach the conv-free formulas."""
    p = ROUTE_PROBLEMS[route]
    ref, fused = make_models(p, torch.float32)
    reduced = _simulate_group_of_one(monkeypatch)
    x = global_input(p, [3], 0, torch.float64).float().requires_grad_()
    grad_out = torch.randn(3, p.out_channels, 1, 1, 1, dtype=torch.float64)
    with fused_ops.testing.route(backward=route):
        _synced_call(fused, x, p.scale).backward(grad_out.float())
    x64 = x.detach().double().requires_grad_()
    ref.train()(x64).backward(grad_out)
    got = {"x": x.grad, **{n: q.grad for n, q in fused.named_parameters()}}
    want = {"x": x64.grad, **{n: q.grad for n, q in ref.named_parameters()}}
    assert_gradients_match(got, want, GRAD_TOL[torch.float32])
    assert reduced == [(2, p.out_channels)]


@pytest.mark.parametrize("requested, reductions", [
    (("x",), 1), (("weight",), 1), (("bias", "bn_weight", "bn_bias"), 0)], ids=lambda r: str(r))
def test_synced_backward_sums_over_the_group_only_for_x_and_the_weight(requested, reductions,
                                                                        monkeypatch):
    """The group's sums enter x's and the weight's gradients alone: a backward for the
    others makes no collective, and each gradient is the one computed with all of them."""
    _, fused = make_models(P_OPTS, torch.float64)
    reduced = _simulate_group_of_one(monkeypatch)
    x = global_input(P_OPTS, [3], 0, torch.float64)
    params = dict(weight=fused.conv_transpose.weight, bias=fused.conv_transpose.bias,
                  bn_weight=fused.batch_norm.weight, bn_bias=fused.batch_norm.bias)
    grad_out = torch.randn(3, P_OPTS.out_channels, 1, 1, 1, dtype=torch.float64)
    inputs = {"x": x.requires_grad_(), **params}
    everything = dict(zip(inputs, torch.autograd.grad(_synced_call(fused, x, P_OPTS.scale),
                                                      list(inputs.values()), grad_out)))
    del reduced[:]
    x.requires_grad_("x" in requested)
    for name, param in params.items():
        param.requires_grad_(name in requested)
    alone = torch.autograd.grad(_synced_call(fused, x, P_OPTS.scale),
                                [inputs[n] for n in requested], grad_out)
    assert len(reduced) == reductions
    for name, grad in zip(requested, alone):
        torch.testing.assert_close(grad, everything[name], rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss", ["linear", "square"])
def test_synced_backward_with_create_graph_raises(loss, monkeypatch):
    """The all-reduce has no derivative here: a backward building a graph for a second one
    raises, whether or not the output's gradient requires grad, instead of returning
    gradients that lack the group's part of their own derivative."""
    _, fused = make_models(P, torch.float64)
    _simulate_group_of_one(monkeypatch)
    x = global_input(P, [3], 0, torch.float64).requires_grad_()
    out = _synced_call(fused, x, P.scale)
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(out.sum() if loss == "linear" else out.square().sum(), x,
                            create_graph=True)


# --- Arguments and the single-process cases ---------------------------------------------------

def test_bad_process_group_is_named():
    torch.manual_seed(0)
    _, fused = make_models(P, torch.float32)
    c, bn = fused.conv_transpose, fused.batch_norm
    x = global_input(P, [2], 0, torch.float32)
    args = (x, c.weight, c.bias, 2.0, bn.weight, bn.bias, bn.running_mean, bn.running_var, True)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        fused_ops.ct_bn_pool(*args, process_group="world")
    with pytest.raises(ValueError, match="not a member of process_group"):
        fused_ops.ct_bn_pool(*args, process_group=dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(TypeError, match="process_group"):
        fused_ops.ConvTransposeBNPool3d(3, 5, 2, 2.0, process_group=0)
    with pytest.raises(TypeError, match="batch_norm must be an nn.BatchNorm3d or nn.SyncBatchNorm"):
        fused_ops.ConvTransposeBNPool3d.from_modules(nn.ConvTranspose3d(3, 5, 2), 2.0,
                                                     nn.BatchNorm2d(5))


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs no process group")
@pytest.mark.parametrize("convert", ["before_fuse", "after_fuse", "from_modules"])
def test_sync_batch_norm_without_a_process_group_is_batch_norm(convert):
    """As nn.SyncBatchNorm: uninitialized torch.distributed means this process's batch."""
    torch.manual_seed(0)
    ref, fused = make_models(P, torch.float64)
    model = copy.deepcopy(ref)
    if convert == "before_fuse":
        model = fused_ops.fuse(nn.SyncBatchNorm.convert_sync_batchnorm(model))
    elif convert == "after_fuse":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(fused_ops.fuse(model))
    else:
        model = fused_ops.ConvTransposeBNPool3d.from_modules(
            model.conv_transpose, P.scale,
            nn.SyncBatchNorm.convert_sync_batchnorm(model.batch_norm))
    sync_bn = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    assert len(sync_bn) == 1
    for step, mode in enumerate(MODES):
        model.train(mode == "train")
        ref.train(mode == "train")
        x = global_input(P, [3], step, torch.float64)
        with torch.no_grad():
            assert relerr(model(x), ref(x)) <= 1e-10, mode
    if convert != "from_modules":
        assert len([m for m in model.modules() if isinstance(m, _FusedChain)]) == 1
    # The fused op used the SyncBatchNorm the model holds (converted after fuse too): it
    # counted the training calls.
    assert int(sync_bn[0].num_batches_tracked) == MODES.count("train")
    for key, value in ref.state_dict().items():
        got = model.state_dict()[key]
        assert relerr(got, value) <= 1e-10 if value.is_floating_point() else torch.equal(got, value)


# --- Real process groups: gloo on loopback ----------------------------------------------------

def _count_collectives(calls):
    """Wraps torch.distributed's collectives so that each call is recorded in `calls`;
    returns the originals by name."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, original in originals.items():

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    return originals


@contextlib.contextmanager
def _uncounted(originals):
    """torch.distributed's own collectives inside the block."""
    counted = {name: getattr(dist, name) for name in originals}
    for name, original in originals.items():
        setattr(dist, name, original)
    try:
        yield
    finally:
        for name, wrapper in counted.items():
            setattr(dist, name, wrapper)


def _run_steps(model, p, batches, rank, dtype, calls, compiled):
    """Outputs and collectives per step of MODES on this rank's shards."""
    outs, collectives = [], []
    for step, mode in enumerate(MODES):
        model.train(mode == "train")
        x = global_input(p, batches, step, dtype).split(batches)[rank]
        del calls[:]
        # Grad mode, parameters requiring grad (the default), as in training. Compiled,
        # no_grad: with grad the synced step is an autograd.Function, inside which Dynamo
        # cannot trace the counting wrappers' side effect (the compiled gradient scenario
        # runs without them).
        with torch.set_grad_enabled(not compiled):
            outs.append(model(x).detach())
        collectives.append(list(calls))
    return outs, collectives


def _scenario_model(name, world_group):
    """The model of one SCENARIOS entry on this rank (seeded as reference_run seeds)."""
    _, p, dtype, seed = next(entry for entry in SCENARIOS if entry[0] == name)
    torch.manual_seed(seed)
    ref, fused = make_models(p, dtype)
    if name in ("explicit", "compiled"):
        model = fused_ops.ConvTransposeBNPool3d.from_modules(
            fused.conv_transpose, p.scale, fused.batch_norm, process_group=world_group)
        if name == "explicit":
            return model
        # aot_eager: the fake kernels and the traced collective, without inductor's compile time.
        return torch.compile(model, backend="aot_eager", fullgraph=True)
    if name == "convert_then_fuse":
        return fused_ops.fuse(nn.SyncBatchNorm.convert_sync_batchnorm(ref.to(dtype)))
    return nn.SyncBatchNorm.convert_sync_batchnorm(fused_ops.fuse(ref.to(dtype)))


def _group_of_one(rank, world, results):
    """A group of one process is the plain op; its one-value error leaves the stats alone."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    torch.manual_seed(0)
    _, fused = make_models(P, torch.float64)
    c, bn = fused.conv_transpose, fused.batch_norm
    stats = [bn.running_mean.clone(), bn.running_var.clone()]
    x = global_input(P, [2], rank, torch.float64)
    args = (c.weight, c.bias, 2.0, bn.weight, bn.bias)
    with torch.no_grad():
        synced = fused_ops.ct_bn_pool(x, *args, bn.running_mean, bn.running_var, True,
                                      process_group=groups[rank])
        plain = fused_ops.ct_bn_pool(x, *args, *stats, True)
    results["group_of_one"] = (synced, plain, bn.running_mean.clone(), stats[0])
    one = torch.randn(1, 3, 1, 1, 1, dtype=torch.float64)
    point = fused_ops.ConvTransposeBNPool3d(3, 5, 1, 2.0, process_group=groups[rank]).double()
    before = {k: v.clone() for k, v in point.state_dict().items()}
    try:
        point(one)
        results["one_value_error"] = None
    except ValueError as e:
        results["one_value_error"] = str(e)
    results["one_value_state_unchanged"] = all(
        torch.equal(v, before[k]) for k, v in point.state_dict().items())


def _functional_eval(calls):
    """Collectives made by the functional in eval mode with a process group of several."""
    torch.manual_seed(0)
    _, fused = make_models(P, torch.float32)
    c, bn = fused.conv_transpose, fused.batch_norm
    del calls[:]
    fused_ops.ct_bn_pool(torch.randn(2, 3, 3, 4, 5), c.weight.detach(), c.bias.detach(), 2.0,
                         bn.weight.detach(), bn.bias.detach(), bn.running_mean, bn.running_var,
                         False, process_group=dist.group.WORLD)
    return list(calls)


def grad_inputs(name, p, batches, dtype):
    """Every rank's x and the gradient of its output, in rank order, for a GRAD_SCENARIOS
    entry (drawn in float64, then rounded to dtype)."""
    if name == "empty_rank":
        batches = [*batches[:-1], 0]
    g = torch.Generator().manual_seed(200)
    if name == "unequal_sizes":
        xs = [torch.randn(b, p.in_channels, *RANK_SIZES[r], generator=g, dtype=torch.float64)
              for r, b in enumerate(batches)]
    else:
        xs = torch.randn(sum(batches), p.in_channels, *p.size, generator=g,
                         dtype=torch.float64).split(batches)
    grads = torch.randn(sum(batches), p.out_channels, 1, 1, 1, generator=g,
                        dtype=torch.float64).split(batches)
    return [x.to(dtype) for x in xs], [grad.to(dtype) for grad in grads]


def _grad_model(name, p, dtype, seed, group):
    """(the forward of a GRAD_SCENARIOS entry on this rank, the module holding its
    parameters under the unfused pattern's names), seeded as reference_grads seeds."""
    torch.manual_seed(seed)
    ref, fused = make_models(p, dtype)
    if name == "convert_then_fuse":
        model = fused_ops.fuse(nn.SyncBatchNorm.convert_sync_batchnorm(ref.to(dtype)))
        return model, model
    c, bn = fused.conv_transpose, fused.batch_norm
    if name == "functional":
        def forward(x):
            return fused_ops.ct_bn_pool(x, c.weight, c.bias, p.scale, bn.weight, bn.bias,
                                        bn.running_mean, bn.running_var, True,
                                        process_group=group, **conv_transpose_options(c))
        return forward, fused
    model = fused_ops.ConvTransposeBNPool3d.from_modules(c, p.scale, bn, process_group=group)
    if name == "ddp":
        return nn.parallel.DistributedDataParallel(model), model
    if name == "compiled":
        return torch.compile(model, backend="aot_eager", fullgraph=True), model
    return model, model


def _gradient_step(rank, batches, calls, originals, name, p, dtype, seed):
    """A training step's gradients on this rank (loss sum(out * g)) and the collectives
    of its forward and of its backward (compiled: not counted, as Dynamo cannot trace the
    counting wrappers' side effect inside the step's autograd.Function)."""
    forward, module = _grad_model(name, p, dtype, seed, dist.group.WORLD)
    xs, grads = grad_inputs(name, p, batches, dtype)
    x = xs[rank].requires_grad_()
    with _uncounted(originals) if name == "compiled" else contextlib.nullcontext():
        del calls[:]
        out = forward(x)
        collectives = [list(calls)]
        del calls[:]
        out.backward(grads[rank])
        collectives.append(list(calls))
    return dict(grads={"x": x.grad, **{n: q.grad for n, q in module.named_parameters()}},
                collectives=collectives)


def _eval_backward_collectives(calls):
    """Collectives of an eval-mode forward and backward of a module with a process group."""
    torch.manual_seed(0)
    _, fused = make_models(P, torch.float32)
    model = fused_ops.ConvTransposeBNPool3d.from_modules(
        fused.conv_transpose, P.scale, fused.batch_norm, process_group=dist.group.WORLD).eval()
    x = global_input(P, [2], 0, torch.float32).requires_grad_()
    del calls[:]
    model(x).sum().backward()
    return list(calls)


# Seconds a gloo group may take, and its collectives wait (run_group).
GROUP_TIMEOUT_S = 300


def _worker(rank, world, port, batches, out_dir):
    if os.path.isdir("/sys/class/net/lo"):  # gloo's transport on loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A collective waits for the slowest rank's compile (see run_group).
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        calls = []
        originals = _count_collectives(calls)
        results = {}
        for name, p, dtype, _ in SCENARIOS:
            model = _scenario_model(name, dist.group.WORLD)
            outs, collectives = _run_steps(model, p, batches, rank, dtype, calls,
                                           compiled=name == "compiled")
            state = getattr(model, "_orig_mod", model).state_dict()  # compiled: the module's
            results[name] = dict(outs=outs, collectives=collectives,
                                 state={k: v.clone() for k, v in state.items()})
        _group_of_one(rank, world, results)
        results["functional_eval_collectives"] = _functional_eval(calls)
        results["grads"] = {entry[0]: _gradient_step(rank, batches, calls, originals, *entry)
                            for entry in GRAD_SCENARIOS}
        results["eval_backward_collectives"] = _eval_backward_collectives(calls)
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_group(batches, out_dir, timeout_s=GROUP_TIMEOUT_S):
    """Runs _worker on len(batches) processes; fails instead of hanging. A group compiles
    models on every rank: alone it takes well under a minute, but beside a pytest-xdist run of
    the whole suite (the GPU machine's) it took more than two."""
    # The store's server lives here, on a port the OS picked (bound to port 0).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    world = len(batches)
    context = mp.spawn(_worker, args=(world, store.port, batches, str(out_dir)), nprocs=world,
                       join=False)
    try:
        for _ in range(timeout_s):
            if context.join(timeout=1):
                break
        else:
            pytest.fail(f"gloo group of {world} did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    return [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(world)]


def reference_run(p, dtype, seed, batches):
    """Outputs per step and final state of the float64 unfused pattern on the whole batch."""
    torch.manual_seed(seed)
    ref, _ = make_models(p, dtype)
    outs = []
    for step, mode in enumerate(MODES):
        ref.train(mode == "train")
        with torch.no_grad():
            outs.append(ref(global_input(p, batches, step, dtype).double()))
    return outs, ref.state_dict()


@pytest.fixture(scope="module", params=[[3, 5], [1, 4, 2]], ids=["2ranks", "3ranks"])
def group_run(request, tmp_path_factory):
    batches = request.param
    return batches, run_group(batches, tmp_path_factory.mktemp(f"gloo{len(batches)}"))


@pytest.mark.slow
@pytest.mark.parametrize("name, p, dtype, seed", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_gloo_group_matches_the_concatenated_batch(group_run, name, p, dtype, seed):
    batches, results = group_run
    expected_outs, expected_state = reference_run(p, dtype, seed, batches)
    offsets = [sum(batches[:r]) for r in range(len(batches))]
    for rank, result in enumerate(results):
        got = result[name]
        for step, mode in enumerate(MODES):
            want = expected_outs[step][offsets[rank]:offsets[rank] + batches[rank]]
            assert relerr(got["outs"][step], want) <= TOL[dtype], (rank, step, mode)
            # One collective per training call, none in eval.
            assert got["collectives"][step] == (["all_gather_into_tensor"] if mode == "train" else [])
        for key, value in expected_state.items():
            state = got["state"][key]
            if value.is_floating_point():
                assert relerr(state, value) <= TOL[dtype], (rank, key)
            else:
                assert torch.equal(state, value), (rank, key)
            # Every rank updates its running statistics from the same global ones.
            assert torch.equal(state, results[0][name]["state"][key]), (rank, key)


@pytest.mark.slow
def test_gloo_group_of_one_is_the_plain_op(group_run):
    _, results = group_run
    for result in results:
        synced, plain, synced_mean, plain_mean = result["group_of_one"]
        assert torch.equal(synced, plain) and torch.equal(synced_mean, plain_mean)
        assert "Expected more than 1 value per channel when training" in result["one_value_error"]
        assert result["one_value_state_unchanged"]


@pytest.mark.slow
def test_gloo_eval_mode_makes_no_collective(group_run):
    _, results = group_run
    for result in results:
        assert result["functional_eval_collectives"] == []


def reference_outputs(ref, xs):
    """Each rank's output of the unfused pattern `ref` whose BatchNorm normalizes over the
    union of the ranks' batches `xs`: run on the concatenated batch where the spatial sizes
    agree, else side by side (side_by_side_outputs)."""
    if len({x.shape[2:] for x in xs}) == 1:
        return ref(torch.cat(xs)).split([len(x) for x in xs])
    return side_by_side_outputs(ref, xs)


def side_by_side_outputs(ref, xs):
    """reference_outputs with every rank's values laid side by side along one dimension,
    which BatchNorm3d's statistics (over every dimension but the channels') treat as one
    batch: the ranks' spatial sizes may differ."""
    zs = [ref.conv_transpose(x) * ref.scale_factor for x in xs]
    flat = torch.cat([z.transpose(0, 1).flatten(1) for z in zs], 1)  # [C, n]
    normalized = ref.batch_norm(flat[None, :, :, None, None])[0, :, :, 0, 0]
    parts = normalized.split([z[:, 0].numel() for z in zs], 1)
    return [ref.global_avg_pool(part.reshape(z.shape[1], z.shape[0], *z.shape[2:]).transpose(0, 1))
            for part, z in zip(parts, zs)]


def reference_grads(name, p, dtype, seed, batches):
    """(x's gradient on every rank, every parameter's gradient) of the float64 unfused
    pattern, with the fused modules' rounded values, for the loss sum over ranks of
    sum(out_r * g_r)."""
    torch.manual_seed(seed)
    ref, fused = make_models(p, dtype)
    ref.load_state_dict(fused.state_dict())  # the rounded values, back in float64
    xs, grads = grad_inputs(name, p, batches, dtype)
    xs = [x.double().requires_grad_() for x in xs]
    torch.autograd.backward(reference_outputs(ref.train(), xs), [g.double() for g in grads])
    return [x.grad for x in xs], {n: q.grad for n, q in ref.named_parameters()}


def test_side_by_side_reference_is_the_concatenated_batch():
    """The reference for unequal spatial sizes equals the unfused pattern on the
    concatenated batch where both apply."""
    torch.manual_seed(0)
    ref, _ = make_models(P, torch.float64)
    xs, _ = grad_inputs("module", P, [2, 3], torch.float64)
    got = torch.cat(side_by_side_outputs(ref.train(), xs))
    assert relerr(got, ref(torch.cat(xs))) <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("name, p, dtype, seed", GRAD_SCENARIOS, ids=[s[0] for s in GRAD_SCENARIOS])
def test_gloo_group_gradients_match_the_concatenated_batch(group_run, name, p, dtype, seed):
    """Training over the group, one step: x's gradient on each rank is its part of the
    float64 reference's (the unfused pattern on the whole batch, the loss the sum over ranks
    of each rank's sum(out_r g_r)), and each parameter's reference gradient is the SUM over
    ranks of the ranks' gradients: as nn.SyncBatchNorm's, each rank's is the part of its
    own batch (DDP averages them: each rank then holds the reference's over the group's size).
    The forward makes one all-gather, the backward one all-reduce."""
    batches, results = group_run
    want_x, want_params = reference_grads(name, p, dtype, seed, batches)
    world = len(results)
    for rank, result in enumerate(results):
        got = result["grads"][name]
        assert got["grads"]["x"].dtype == dtype
        assert relerr(got["grads"]["x"], want_x[rank]) <= GRAD_TOL[dtype], rank
        if name == "ddp":  # the averaged gradients, on every rank
            assert_gradients_match({n: got["grads"][n] * world for n in want_params},
                                   want_params, GRAD_TOL[dtype])
        elif name != "compiled":  # (DDP may add collectives of its own; compiled: uncounted)
            assert got["collectives"] == [["all_gather_into_tensor"], ["all_reduce"]], rank
    if name != "ddp":
        summed = {n: sum(r["grads"][name]["grads"][n] for r in results) for n in want_params}
        assert_gradients_match(summed, want_params, GRAD_TOL[dtype])


@pytest.mark.slow
def test_gloo_eval_backward_makes_no_collective(group_run):
    _, results = group_run
    for result in results:
        assert result["eval_backward_collectives"] == []
