"""Issue #5: opcheck, torch.compile and torch.export for every configuration family
(stride, padding, output_padding, dilation, groups, bias=False, affine=False,
track_running_stats=False, momentum=None), eval and train, every algorithm, on the module
and on the functional, against PyTorch's modules run in float64.

tests/test_tooling.py and tests/test_autograd.py test the default configuration and one
combined one; this file goes through the families one at a time.
"""
import pytest
import torch
from torch import nn

import fused_ops
from conftest import (DEVICES, Problem, Reference, has_padding, make_input, make_models,
                      relerr, skip_unless_algo_covers)

BASE = dict(batch=2, in_channels=4, out_channels=6, size=(3, 4, 5), kernel=(2, 3, 2))
FAMILIES = {
    "plain": Problem(**BASE),
    "stride": Problem(**BASE, conv_kwargs=dict(stride=(2, 1, 3))),
    "padding": Problem(**BASE, conv_kwargs=dict(padding=(1, 0, 1))),
    "output_padding": Problem(**BASE, conv_kwargs=dict(stride=2, output_padding=(1, 0, 1))),
    "dilation": Problem(**BASE, conv_kwargs=dict(dilation=(2, 1, 3))),
    "groups": Problem(**BASE, conv_kwargs=dict(groups=2)),
    "no_bias": Problem(**BASE, conv_kwargs=dict(bias=False)),
    "no_affine": Problem(**BASE, bn_kwargs=dict(affine=False)),
    "untracked": Problem(**BASE, bn_kwargs=dict(track_running_stats=False)),
    "momentum_none": Problem(**BASE, momentum=None),
    "everything": Problem(3, 4, 6, (4, 3, 5), (3, 2, 3), scale=-0.75, eps=1e-3, momentum=0.3,
                          conv_kwargs=dict(stride=(1, 2, 3), padding=(1, 0, 2),
                                           output_padding=(0, 1, 2), dilation=(2, 1, 1),
                                           groups=2, bias=False),
                          bn_kwargs=dict(affine=False)),
}
# Modes: eval (algo ignored), and training with each algorithm ("fft" where it applies:
# CUDA, no padding; with "auto" it is the FFT path wherever it applies).
MODES = [("eval", "auto"), ("train", "auto"), ("train", "direct"), ("train", "sliced_conv"),
         ("train", "fft"), ("train", "correlation"), ("train", "cross_spectrum"),
         ("train", "border")]


# torch.compile and export trace much more slowly than the op runs: every family in eval and
# in training with the default algorithm, in both forms; the other algorithms on two.
TRACE_CASES = ([(f, m, form) for f in FAMILIES for m in MODES[:2]
                for form in ("module", "functional")]
               + [(f, m, "module") for f in ("plain", "everything") for m in MODES[2:]])


def trace_id(case):
    family, (mode, algo), form = case
    return f"{family}-{mode}-{algo}-{form}"


def xfail_where_pytorch_cannot(problem, training, trace):
    """nn.BatchNorm3d(momentum=None) in training computes 1 / float(num_batches_tracked),
    a data-dependent float: torch 2.14 can neither compile it with fullgraph=True nor export
    it. Where PyTorch's own modules fail so, ours are not required to work (xfail); where
    PyTorch's work, ours must."""
    if not (training and problem.momentum is None
            and problem.bn_kwargs.get("track_running_stats", True)):
        return
    ref = Reference(problem.in_channels, problem.out_channels, problem.kernel, problem.scale,
                    problem.eps, problem.momentum, problem.conv_kwargs,
                    problem.bn_kwargs).double().train()
    try:
        trace(ref, make_input(problem, torch.float64))
    except Exception as error:  # noqa: BLE001 (whatever PyTorch raises)
        pytest.xfail("PyTorch's own BatchNorm3d(momentum=None) fails here too: "
                     f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")


def compile_and_run(module, x):
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, fullgraph=True)(x)
    torch._dynamo.reset()


def export_and_run_once(module, x):
    with torch.no_grad():
        torch.export.export(module, (x,)).module()(x)


def fft_applies(problem, device, dtype=torch.float32):
    return (torch.device(device).type == "cuda" and dtype != torch.float64
            and not has_padding(problem))


def skip_unless_applies(problem, algo, device, dtype=torch.float32):
    if algo == "fft" and not fft_applies(problem, device, dtype):
        pytest.skip("algo='fft' covers CUDA, no float64, padding 0 only "
                    "(tests/test_fft_energy.py checks the refusal)")
    skip_unless_algo_covers(problem, algo)


def module_op_arguments(fused, x):
    """The (args, kwargs) that fused.forward(x) passes to torch.ops.fused_ops.ct_bn_pool
    (fused_ops/modules.py, ct_bn_pool_by_module), the tensors detached."""
    conv, bn = fused.conv_transpose, fused.batch_norm
    training = fused.training
    counting = training and bn.track_running_stats
    momentum = (bn.momentum if bn.momentum is not None
                else 1.0 / float(bn.num_batches_tracked + 1) if counting else 0.0)
    track = not training or bn.track_running_stats

    def d(t):
        return None if t is None else t.detach()

    args = (x, d(conv.weight), d(conv.bias), fused.scale_factor, d(bn.weight), d(bn.bias),
            bn.running_mean if track else None, bn.running_var if track else None,
            training or bn.running_mean is None, momentum, bn.eps)
    kwargs = dict(stride=list(conv.stride), padding=list(conv.padding),
                  output_padding=list(conv.output_padding), dilation=list(conv.dilation),
                  groups=conv.groups, algo=fused.algo)
    return args, kwargs


def ids(value):
    return value if isinstance(value, str) else "-".join(value)


# ---------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES, ids=ids)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_opcheck_every_family(family, mode, device):
    problem = FAMILIES[family]
    skip_unless_applies(problem, mode[1], device)
    _, fused = make_models(problem, torch.float32, device, algo=mode[1])
    fused.train(mode[0] == "train")
    if mode[0] == "train" and problem.momentum is None:
        fused.batch_norm.num_batches_tracked.fill_(3)  # a momentum of 1/4, not 1
    args, kwargs = module_op_arguments(fused, make_input(problem, torch.float32, device))
    torch.library.opcheck(torch.ops.fused_ops.ct_bn_pool.default, args, kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_opcheck_every_family_with_inputs_requiring_grad(family, training, device):
    """Includes test_autograd_registration and test_aot_dispatch_dynamic (float64: the
    backward's convolutions follow PyTorch's TF32 flags)."""
    problem = FAMILIES[family]
    _, fused = make_models(problem, torch.float64, device)
    fused.train(training)
    args, kwargs = module_op_arguments(fused, make_input(problem, torch.float64, device))
    args = tuple(a.detach().clone().requires_grad_() if i in (0, 1, 2, 4, 5) and a is not None
                 else a for i, a in enumerate(args))
    torch.library.opcheck(torch.ops.fused_ops.ct_bn_pool.default, args, kwargs)


# ------------------------------------------------------------------ compile and export


class FunctionalModel(nn.Module):
    """The functional form inside a model, with the module's parameters and buffers, in
    its mode (the way a user calls fused_ops.ct_bn_pool from a forward)."""

    def __init__(self, fused):
        super().__init__()
        self.conv_transpose, self.batch_norm = fused.conv_transpose, fused.batch_norm
        self.scale_factor, self.algo = fused.scale_factor, fused.algo

    def forward(self, x):
        conv, bn = self.conv_transpose, self.batch_norm
        if self.training and bn.track_running_stats:
            bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            momentum = 1.0 / float(bn.num_batches_tracked) if self.training else 0.0
        else:
            momentum = bn.momentum
        use_running = not self.training and bn.running_mean is not None
        track = not self.training or bn.track_running_stats
        return fused_ops.ct_bn_pool(
            x, conv.weight, conv.bias, self.scale_factor, bn.weight, bn.bias,
            bn.running_mean if track else None, bn.running_var if track else None,
            not use_running, momentum, bn.eps, stride=conv.stride, padding=conv.padding,
            output_padding=conv.output_padding, dilation=conv.dilation, groups=conv.groups,
            algo=self.algo)


def models(problem, form, device, training, algo="auto"):
    """(float64 CPU reference, the fused model (module or functional) on device/float32)."""
    ref, fused = make_models(problem, torch.float32, device, algo=algo)
    model = fused if form == "module" else FunctionalModel(fused)
    return ref.train(training), model.train(training)


def assert_matches_reference(model, ref, inputs):
    """Runs model and ref on each input; outputs and the final state agree."""
    for x in inputs:
        with torch.no_grad():
            assert relerr(model(x), ref(x.double().cpu())) <= 1e-6
    assert_state_matches(model, ref)


def assert_state_matches(model, ref):
    state = {k.removeprefix("_orig_mod."): v for k, v in model.state_dict().items()}
    for key, value in ref.state_dict().items():
        got = state[key]
        if value.is_floating_point():
            assert relerr(got, value) <= 1e-6, key
        else:
            assert torch.equal(got.cpu(), value), key



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", TRACE_CASES, ids=trace_id)
def test_compile_fullgraph_every_family(case, device):
    """fullgraph=True: a graph break raises. Same outputs as PyTorch's modules, running
    statistics and num_batches_tracked updated, over three calls."""
    family, mode, form = case
    problem = FAMILIES[family]
    skip_unless_applies(problem, mode[1], device)
    xfail_where_pytorch_cannot(problem, mode[0] == "train", compile_and_run)
    ref, model = models(problem, form, device, mode[0] == "train", mode[1])
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    assert_matches_reference(compiled, ref, [make_input(problem, torch.float32, device)
                                             for _ in range(3)])
    if mode[0] == "train" and problem.bn_kwargs.get("track_running_stats", True):
        assert int(model.batch_norm.num_batches_tracked) == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["module", "functional"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", ["plain", "momentum_none", "untracked", "everything"])
def test_compile_dynamic_every_size_without_recompiling(family, training, form, device):
    """dynamic=True: batch and spatial sizes change without a recompile."""
    problem = FAMILIES[family]
    xfail_where_pytorch_cannot(problem, training, compile_and_run)
    ref, model = models(problem, form, device, training)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    # The first sizes all differ (from each other and from the channel count, which the
    # weight fixes): equal sizes would be duck-sized into one symbol and guarded equal.
    sizes = [(3, (5, 7, 8)), (2, (9, 6, 11)), (6, (3, 10, 5)), (5, (7, 12, 9))]
    inputs = [torch.randn(b, problem.in_channels, *s, device=device) for b, s in sizes]
    with torch.no_grad():
        assert relerr(compiled(inputs[0]), ref(inputs[0].double().cpu())) <= 1e-6
        with torch._dynamo.config.patch(error_on_recompile=True):
            for x in inputs[1:]:
                assert relerr(compiled(x), ref(x.double().cpu())) <= 1e-6
    assert_state_matches(model, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", TRACE_CASES, ids=trace_id)
def test_export_every_family(case, device):
    """The exported program matches PyTorch's modules, and its module's buffers (running
    statistics, num_batches_tracked) are updated in training as the modules' are."""
    family, mode, form = case
    problem = FAMILIES[family]
    skip_unless_applies(problem, mode[1], device)
    xfail_where_pytorch_cannot(problem, mode[0] == "train", export_and_run_once)
    ref, model = models(problem, form, device, mode[0] == "train", mode[1])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exported = torch.export.export(model, (make_input(problem, torch.float32, device),))
    for key, value in model.state_dict().items():  # exporting runs nothing
        assert torch.equal(value, before[key]), key
    assert_matches_reference(exported.module(), ref, [
        make_input(problem, torch.float32, device) for _ in range(3)])


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", ["plain", "untracked", "momentum_none", "everything"])
def test_export_treats_buffers_as_pytorchs_batch_norm_does(family, training):
    """What torch.export does with nn.BatchNorm3d's buffers (training: mutated buffers,
    written back by ExportedProgram.module(); eval: read only), it does with ours: same
    graph signature kinds of buffer mutation, same buffers after the calls."""
    problem = FAMILIES[family]
    xfail_where_pytorch_cannot(problem, training, export_and_run_once)
    ref, model = models(problem, "module", "cpu", training)
    x = make_input(problem, torch.float64)
    ref_exported = torch.export.export(ref, (x,))
    ours = torch.export.export(model, (x.float(),))
    assert (sorted(ref_exported.graph_signature.buffers_to_mutate.values())
            == sorted(ours.graph_signature.buffers_to_mutate.values()))
    ref_module, our_module = ref_exported.module(), ours.module()
    for _ in range(3):
        x = make_input(problem, torch.float64)
        with torch.no_grad():
            assert relerr(our_module(x.float()), ref_module(x)) <= 1e-6
    assert_state_matches(our_module, ref_module)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_exported_program_with_dynamic_batch(training):
    problem = FAMILIES["everything"]
    ref, model = models(problem, "module", "cpu", training)
    example = make_input(problem)
    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    module = exported.module()
    for b in (2, 5, 9):
        x = torch.randn(b, *example.shape[1:])
        with torch.no_grad():
            assert relerr(module(x), ref(x.double())) <= 1e-6
    assert_state_matches(module, ref)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_exported_program_saves_and_loads(training, tmp_path):
    problem = FAMILIES["everything"]
    ref, model = models(problem, "module", "cpu", training)
    exported = torch.export.export(model, (make_input(problem),))
    torch.export.save(exported, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    assert_matches_reference(loaded, ref, [make_input(problem) for _ in range(2)])
