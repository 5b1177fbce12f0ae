"""The op under torch.compile and torch.export: fake tensors, fullgraph compilation with
static and dynamic shapes, compiled backward, exported programs (buffers, dynamic batch,
save/load), every configuration family in eval and train, on the module and on the
functional, against PyTorch's modules run in float64."""
import contextlib

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fused_ops
import fused_ops.testing
from conftest import (DEVICES, FAMILIES, Problem, Reference, TOL, assert_gradients_match,
                      make_input, make_models, relerr, run_backward, skip_unless_algo_covers,
                      twin_modules)

# Modes: eval (algo ignored), and training with each algorithm.
MODES = [("eval", "auto"), ("train", "auto"), ("train", "direct"), ("train", "sliced_conv"),
         ("train", "fft"), ("train", "correlation"), ("train", "cross_spectrum"),
         ("train", "border")]
# The functional as a user calls it needs a fixed momentum and running statistics.
FUNCTIONAL_FAMILIES = [f for f in FAMILIES if f not in ("momentum_none", "untracked")]
# torch.compile and export trace much more slowly than the op runs: every family in eval and
# in training with the default algorithm, in both forms; the other algorithms on two.
TRACE_CASES = ([(f, m, form) for f in FAMILIES for m in MODES[:2]
                for form in ("module", "functional") if form == "module" or f in FUNCTIONAL_FAMILIES]
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


class FunctionalModel(nn.Module):
    """fused_ops.ct_bn_pool called from a forward, as a user writes it, with the module's
    parameters and buffers (a fixed momentum; the batch count kept by the model)."""

    def __init__(self, fused):
        super().__init__()
        self.conv_transpose, self.batch_norm = fused.conv_transpose, fused.batch_norm
        self.scale_factor, self.algo = fused.scale_factor, fused.algo

    def forward(self, x):
        conv, bn = self.conv_transpose, self.batch_norm
        if self.training:
            bn.num_batches_tracked.add_(1)
        return fused_ops.ct_bn_pool(
            x, conv.weight, conv.bias, self.scale_factor, bn.weight, bn.bias, bn.running_mean,
            bn.running_var, self.training, bn.momentum, bn.eps, stride=conv.stride,
            padding=conv.padding, output_padding=conv.output_padding, dilation=conv.dilation,
            groups=conv.groups, algo=self.algo)


def models(problem, form, device, training, algo="auto"):
    """(float64 CPU reference, the fused model (module or functional) on device/float32)."""
    ref, fused = make_models(problem, torch.float32, device, algo=algo, beta="random")
    model = fused if form == "module" else FunctionalModel(fused)
    return ref.train(training), model.train(training)


def assert_matches_reference(model, ref, inputs):
    """Runs model and ref on each input; outputs and the final state agree."""
    for x in inputs:
        with torch.no_grad():
            assert relerr(model(x), ref(x.double().cpu())) <= TOL[torch.float32]
    assert_state_matches(model, ref)


def assert_state_matches(model, ref):
    state = {k.removeprefix("_orig_mod."): v for k, v in model.state_dict().items()}
    for key, value in ref.state_dict().items():
        got = state[key]
        if value.is_floating_point():
            assert relerr(got, value) <= TOL[torch.float32], key
        else:
            assert torch.equal(got.cpu(), value), key


def test_fake_tensor_gives_the_output_shape():
    problem = FAMILIES["groups"]
    _, fused = make_models(problem)
    c, bn = fused.conv_transpose, fused.batch_norm
    args = (make_input(problem), c.weight.detach(), c.bias.detach(), 2.0, bn.weight.detach(),
            bn.bias.detach(), bn.running_mean, bn.running_var, True, 0.1, 1e-5)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.fused_ops.ct_bn_pool.default(*fake, groups=2)
    assert tuple(out.shape) == (2, 6, 1, 1, 1) and out.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", TRACE_CASES, ids=trace_id)
def test_compile_fullgraph_every_family(case, device):
    """fullgraph=True: a graph break raises. Same outputs as PyTorch's modules, running
    statistics and num_batches_tracked updated, over three calls."""
    family, mode, form = case
    problem = FAMILIES[family]
    skip_unless_algo_covers(problem, mode[1], device)
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
    if form == "functional" and family not in FUNCTIONAL_FAMILIES:
        pytest.skip("the functional form takes a fixed momentum and running statistics")
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
        assert relerr(compiled(inputs[0]), ref(inputs[0].double().cpu())) <= TOL[torch.float32]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for x in inputs[1:]:
                assert relerr(compiled(x), ref(x.double().cpu())) <= TOL[torch.float32]
    assert_state_matches(model, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", TRACE_CASES, ids=trace_id)
def test_export_every_family(case, device):
    """The exported program matches PyTorch's modules, and its module's buffers (running
    statistics, num_batches_tracked) are updated in training as the modules' are."""
    family, mode, form = case
    problem = FAMILIES[family]
    skip_unless_algo_covers(problem, mode[1], device)
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
            assert relerr(our_module(x.float()), ref_module(x)) <= TOL[torch.float32]
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
            assert relerr(module(x), ref(x.double())) <= TOL[torch.float32]
    assert_state_matches(module, ref)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_exported_program_saves_and_loads(training, tmp_path):
    problem = FAMILIES["everything"]
    ref, model = models(problem, "module", "cpu", training)
    exported = torch.export.export(model, (make_input(problem),))
    torch.export.save(exported, tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    assert_matches_reference(loaded, ref, [make_input(problem) for _ in range(2)])


# --- Compiled backward ------------------------------------------------------------------------

@contextlib.contextmanager
def fresh_compile():
    """No compiled artifact from an earlier run: PyTorch's caches key on the traced graph,
    not on the Python autograd kernel (fused_ops/_autograd.py) that produced its backward."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


COMPILE_PROBLEM = Problem(2, 4, 6, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(stride=2, padding=1))


def assert_compiled_trains_like_eager(problem, training, device, batches, **compile_options):
    eager, module = twin_modules(problem, torch.float64, device, training)
    assert all(p.requires_grad for p in module.parameters())  # nn.Module's default
    with fresh_compile():
        compiled = torch.compile(module, fullgraph=True, **compile_options)
        for batch in batches:
            x = torch.randn(batch, *make_input(problem).shape[1:], dtype=torch.float64,
                            device=device)
            grad_out = torch.randn(batch, problem.out_channels, 1, 1, 1, dtype=torch.float64,
                                   device=device)
            out, grads = run_backward(compiled, x, grad_out)
            eager_out, eager_grads = run_backward(eager, x, grad_out)
            assert relerr(out, eager_out) <= TOL[torch.float64]
            assert_gradients_match(grads, eager_grads, TOL[torch.float64])
    for key, value in eager.state_dict().items():
        got = module.state_dict()[key]
        assert (relerr(got, value) <= TOL[torch.float64] if value.is_floating_point()
                else torch.equal(got, value)), key
    assert int(module.batch_norm.num_batches_tracked) == (len(batches) if training else 0)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_compiled_module_with_parameters_requiring_grad_trains(training, device):
    assert_compiled_trains_like_eager(COMPILE_PROBLEM, training, device, batches=(2, 2),
                                      backend="inductor")


# The conv-free routes: kernel = stride, one tap per output position ("gram"); stride 1
# without padding ("spectral").
CONV_FREE_PROBLEMS = {
    "gram": Problem(2, 3, 16, (3, 4, 5), (2, 2, 2), conv_kwargs=dict(stride=2)),
    "spectral": Problem(2, 3, 5, (3, 4, 5), (2, 3, 2), conv_kwargs=dict(dilation=(1, 2, 1))),
}


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", list(CONV_FREE_PROBLEMS))
def test_compiled_conv_free_training_step_matches_float64(route, device):
    """The conv-free routes under torch.compile (fullgraph, inductor): the forward's
    ct_bn_pool_stats and ct_bn_pool_apply, whose statistics the backward reads without y
    ("gram": _ct_bn_pool_kept_backward; "spectral": its slabs, x's gradient spectrum written
    over x's); output and every gradient against the float64 unfused modules."""
    problem = CONV_FREE_PROBLEMS[route]
    reference, module = make_models(problem, torch.float64, device)
    x = make_input(problem, torch.float64, offset=2.0)
    grad_out = torch.randn(x.shape[0], problem.out_channels, 1, 1, 1, dtype=torch.float64)
    want_out, want = run_backward(reference, x, grad_out)
    with fresh_compile(), fused_ops.testing.route(backward=route):
        out, got = run_backward(torch.compile(module, fullgraph=True), x.to(device),
                                grad_out.to(device))
    assert relerr(out.cpu(), want_out) <= TOL[torch.float64]
    assert_gradients_match(got, want, TOL[torch.float64])


@pytest.mark.cuda
def test_compiled_cuda_training_step_is_float32_exact_with_tf32_on():
    """"kept" (a padded CUDA problem) under torch.compile: its op forms the convolution output
    with TF32 off whatever the run's flags, so the compiled step's output and running
    statistics stay float32-exact with PyTorch's TF32 convolution default on. The backward's
    convolution follows the flags, as PyTorch's own does (test_gradients): TF32's rounding."""
    reference, module = twin_modules(COMPILE_PROBLEM, torch.float64, "cuda", True)
    module.float()
    x = torch.randn(4, *make_input(COMPILE_PROBLEM).shape[1:], dtype=torch.float64, device="cuda")
    grad_out = torch.randn(4, COMPILE_PROBLEM.out_channels, 1, 1, 1, dtype=torch.float64,
                           device="cuda")
    with fresh_compile(), torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        out, grads = run_backward(torch.compile(module, fullgraph=True), x.float(),
                                  grad_out.float())
    want_out, want_grads = run_backward(reference, x, grad_out)
    assert relerr(out, want_out) <= TOL[torch.float32]
    assert_gradients_match(grads, want_grads, 1e-2)
    for name in ("running_mean", "running_var"):
        assert relerr(getattr(module.batch_norm, name),
                      getattr(reference.batch_norm, name)) <= TOL[torch.float32], name


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_compiled_backward_with_dynamic_shapes(training):
    assert_compiled_trains_like_eager(COMPILE_PROBLEM, training, "cpu", batches=(2, 3, 5),
                                      backend="inductor", dynamic=True)
