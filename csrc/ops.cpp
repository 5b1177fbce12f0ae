// Declares the operator schema and its autograd behaviour, and makes this
// library importable as the Python module fused_ops._C.
#include <Python.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "fused_ops_build_info.h"  // written by setup.py
#include "testing_hooks.h"

extern "C" {
// Importing fused_ops._C loads the library, whose static initializers register
// the ops; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace fused_ops {
namespace {

std::string build_info() { return FUSED_OPS_BUILD_INFO; }
std::string set_route_op(std::string knob, std::string route) { return set_route(knob, route); }
int64_t set_limit_op(std::string name, int64_t value) { return set_limit(name, value); }

// ct_bn_pool's arguments, shared with the overloads its Autograd kernel calls (below).
const std::string kCtBnPoolArguments =
    "(Tensor x, Tensor weight, Tensor? bias, float scale, Tensor? bn_weight, Tensor? bn_bias, "
    "Tensor(a!)? running_mean, Tensor(b!)? running_var, bool training, float momentum=0.1, "
    "float eps=1e-05, *, int[3] stride=1, int[3] padding=0, int[3] output_padding=0, "
    "int[3] dilation=1, int groups=1, str algo=\"auto\") -> Tensor";
const std::string kNoStatsArguments =
    "(Tensor x, Tensor weight, Tensor? bias, float scale, Tensor? bn_weight, Tensor? bn_bias, "
    "float eps=1e-05, *, int[3] stride=1, int[3] padding=0, int[3] output_padding=0, "
    "int[3] dilation=1, int groups=1, str algo=\"auto\") -> Tensor";

}  // namespace

TORCH_LIBRARY(fused_ops, m) {
  m.def(("ct_bn_pool" + kCtBnPoolArguments).c_str());
  // Batch statistics and no running statistics (BatchNorm's track_running_stats=False),
  // as aten's _native_batch_norm_legit.no_stats: an overload that mutates nothing, so
  // that torch.compile does not functionalize a call that has no mutated tensor (inductor,
  // torch 2.14, fails on such a call of the default overload).
  m.def(("ct_bn_pool.no_stats" + kNoStatsArguments).c_str());
  // The two halves of ct_bn_pool's training mode, for statistics merged across
  // processes in between (fused_ops/distributed.py, docs/math.md §4.1).
  m.def(
      "ct_bn_pool_stats(Tensor x, Tensor weight, *, int[3] stride=1, int[3] padding=0, "
      "int[3] output_padding=0, int[3] dilation=1, int groups=1, str algo=\"auto\") "
      "-> (Tensor sample_sums, Tensor stats)");
  m.def(
      "ct_bn_pool_apply(Tensor sample_sums, Tensor stats, int spatial, Tensor? bias, float scale, "
      "Tensor? bn_weight, Tensor? bn_bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "float momentum, float eps, ScalarType dtype) -> Tensor");
  // ct_bn_pool_apply without running statistics, for the reason of ct_bn_pool.no_stats.
  m.def(
      "ct_bn_pool_apply.no_stats(Tensor sample_sums, Tensor stats, int spatial, Tensor? bias, "
      "float scale, Tensor? bn_weight, Tensor? bn_bias, float eps, ScalarType dtype) -> Tensor");
  // Training mode's "kept" route (fused_ops/_kept_output.py, docs/math.md §6.2.4): the
  // convolution output y with the statistics ct_bn_pool_stats gives, and the backward from the
  // kept y, or without y from the statistics where one tap reaches each output position
  // (output_mask: the gradients of x and the weight wanted). Called by ct_bn_pool's autograd
  // formula; no autograd of their own.
  m.def(
      "_ct_bn_pool_kept_stats(Tensor x, Tensor weight, *, int[3] stride=1, int[3] padding=0, "
      "int[3] output_padding=0, int[3] dilation=1, int groups=1) "
      "-> (Tensor y, Tensor sample_sums, Tensor stats)");
  m.def(
      "_ct_bn_pool_kept_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? bn_weight, "
      "Tensor? y, Tensor sample_sums, Tensor stats, float scale, float eps, *, int[3] stride, "
      "int[3] padding, int[3] output_padding, int[3] dilation, int groups, bool[2] output_mask) "
      "-> (Tensor grad_x, Tensor grad_weight, Tensor grad_bn_weight, Tensor grad_bn_bias)");
  // Training mode's conv-free backward (fused_ops/_spectral_backward.py, docs/math.md §6.2.2):
  // the DFT on the grid 2k - 1 of x's channel cross-correlation at the kernel's lags, centred
  // on its grid mean (§3.5), of a stride-1, padding-0 problem whose kernel and channels the
  // weight gives, and x's spectrum on the full output's grid that it is made from (the
  // backward's x gradient is made over it: one FFT of x for both). No autograd of its own.
  m.def(
      "_ct_bn_pool_lag_spectrum(Tensor x, Tensor weight, *, int[3] dilation=1, int groups=1) "
      "-> (Tensor lags, Tensor x_spectrum)");
  // ct_bn_pool as its autograd formula sees it: the Autograd kernel of ct_bn_pool calls these
  // when a gradient can flow (below), and fused_ops/_autograd.py registers the formula on
  // them. Below autograd they are ct_bn_pool itself.
  m.def(("_ct_bn_pool_differentiable" + kCtBnPoolArguments).c_str());
  m.def(("_ct_bn_pool_differentiable.no_stats" + kNoStatsArguments).c_str());
  m.def("build_info() -> str", &build_info);
  // The testing hook behind fused_ops.testing (testing_hooks.h): not for production use.
  m.def("_set_route(str knob, str route) -> str", &set_route_op);
  m.def("_set_limit(str name, int value) -> int", &set_limit_op);
}

namespace {

// The ADInplaceOrView kernel of the ops that write the running stats (schema `Tensor(a!)?`):
// after the call, bumps the version counters of the arguments it wrote, as every in-place op
// does, so that autograd detects a saved tensor changed under it. ct_bn_pool writes them in
// training mode only (eval reads them); ct_bn_pool_apply always. A rejected call bumps
// nothing. In C++ because it runs on every call, also under no_grad: a Python kernel here
// would be a large share of a small eval call's host time. (PyTorch's
// autogradNotImplementedInplaceOrViewFallback leaves ct_bn_pool_apply's optional written
// arguments as they were.)
template <bool kTrainingOnly>
void bump_written_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                           torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  // Read before the call replaces the arguments.
  const auto args = stack->end() - arguments.size();
  // ct_bn_pool's `training`: its argument after the running stats (ops.cpp's schema).
  const bool writes = !kTrainingOnly || args[8].toBool();
  std::vector<at::Tensor> written;
  for (size_t i = 0; writes && i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite() && args[i].isTensor()) written.push_back(args[i].toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const auto& t : written) {
    if (t.defined()) torch::autograd::impl::bump_version(t);
  }
}

// Whether a gradient can flow out of a call with these arguments: grad mode on and some
// tensor argument requiring grad.
bool gradient_can_flow(torch::jit::Stack* stack, size_t count) {
  if (!c10::GradMode::is_enabled()) return false;
  for (auto it = stack->end() - count; it != stack->end(); ++it) {
    if (it->isTensor() && it->toTensor().requires_grad()) return true;
  }
  return false;
}

// ct_bn_pool's Autograd kernel. Without a gradient to flow (every inference call, also
// under no_grad) the call goes below autograd in C++; a Python kernel would run on every
// call, a large share of a small call's host time. Otherwise the formula: the
// _ct_bn_pool_differentiable overload of the same name, whose Autograd kernel is Python's.
void ct_bn_pool_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (gradient_can_flow(stack, op.schema().arguments().size())) {
    static const c10::OperatorHandle with_formula[2] = {
        c10::Dispatcher::singleton().findSchemaOrThrow("fused_ops::_ct_bn_pool_differentiable", ""),
        c10::Dispatcher::singleton().findSchemaOrThrow("fused_ops::_ct_bn_pool_differentiable", "no_stats")};
    with_formula[op.schema().overload_name() == "no_stats"].callBoxed(stack);
    return;
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// ct_bn_pool_apply's Autograd kernel. It has no backward (fused_ops/distributed.py
// differentiates the synchronized step as a whole) and writes the running stats: refused at
// once, before anything is written, where a gradient could flow; otherwise below autograd
// with ADInplaceOrView kept, whose kernel bumps the running stats' versions (PyTorch's
// not-implemented fallback redispatches past it).
void apply_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  TORCH_CHECK(!gradient_can_flow(stack, op.schema().arguments().size()), op.schema().name(),
              " is not implemented for inputs that require grad: the synchronized step's halves "
              "have no backward (fused_ops.distributed differentiates the whole step); call it "
              "under torch.no_grad()");
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// _ct_bn_pool_differentiable below autograd (its formula's forward calls ct_bn_pool itself;
// this serves any other path there, fake tensors included): ct_bn_pool of the same overload.
void differentiable_below_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorHandle plain[2] = {
      c10::Dispatcher::singleton().findSchemaOrThrow("fused_ops::ct_bn_pool", ""),
      c10::Dispatcher::singleton().findSchemaOrThrow("fused_ops::ct_bn_pool", "no_stats")};
  plain[op.schema().overload_name() == "no_stats"].callBoxed(stack);
}

}  // namespace

// ct_bn_pool's autograd formula is registered in Python (fused_ops/_autograd.py) on
// _ct_bn_pool_differentiable, which ct_bn_pool's Autograd kernel calls when a gradient can flow.
// The two halves of the synchronized training step have no backward: one through
// ct_bn_pool_stats raises, naming the op, instead of returning wrong gradients (as one through
// the kept route's two ops, which only the formula calls); ct_bn_pool_apply, which writes the
// running stats, refuses inputs requiring grad at the call, and its writes bump the versions.
TORCH_LIBRARY_IMPL(fused_ops, Autograd, m) {
  for (const char* op : {"ct_bn_pool", "ct_bn_pool.no_stats"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&ct_bn_pool_autograd>());
  }
  for (const char* op :
       {"ct_bn_pool_stats", "_ct_bn_pool_kept_stats", "_ct_bn_pool_kept_backward",
        "_ct_bn_pool_lag_spectrum"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
  for (const char* op : {"ct_bn_pool_apply", "ct_bn_pool_apply.no_stats"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&apply_autograd>());
  }
}
TORCH_LIBRARY_IMPL(fused_ops, CompositeExplicitAutograd, m) {
  for (const char* op : {"_ct_bn_pool_differentiable", "_ct_bn_pool_differentiable.no_stats"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&differentiable_below_autograd>());
  }
}
TORCH_LIBRARY_IMPL(fused_ops, ADInplaceOrView, m) {
  // Also on _ct_bn_pool_differentiable: a kernel here keeps ADInplaceOrView in the key set its
  // Python formula redispatches ct_bn_pool with (the dispatcher leaves out a key whose kernel
  // falls through), so that ct_bn_pool's bump runs on that path too.
  for (const char* op : {"ct_bn_pool", "_ct_bn_pool_differentiable"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_written_versions<true>>());
  }
  m.impl("ct_bn_pool_apply", torch::CppFunction::makeFromBoxedFunction<&bump_written_versions<false>>());
  for (const char* op : {"ct_bn_pool_stats", "ct_bn_pool_apply.no_stats", "_ct_bn_pool_kept_stats",
                         "_ct_bn_pool_kept_backward", "_ct_bn_pool_lag_spectrum"}) {
    m.impl(op, torch::autograd::autogradNotImplementedInplaceOrViewFallback());
  }
}

}  // namespace fused_ops
