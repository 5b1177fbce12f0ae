#include "testing_hooks.h"

#include <ATen/ATen.h>

#include "message.h"

#include <array>
#include <atomic>
#include <initializer_list>

namespace fused_ops {
namespace {

struct KnobSpec {
  const char* name;
  std::initializer_list<Route> routes;  // besides Route::Auto
};
const std::array<KnobSpec, 4> kKnobs = {{
    {"direct", {Route::Mma, Route::Simt}},
    {"s_stage", {Route::Simt}},
    {"contraction", {Route::Gemm}},
    {"overlap", {Route::Off}},
}};
const std::array<const char*, 5> kRouteNames = {"auto", "mma", "simt", "gemm", "off"};
const std::array<const char*, 2> kLimitNames = {"slice_bytes", "finalize_terms"};

std::array<std::atomic<int>, kKnobs.size()> g_routes{};
std::array<std::atomic<int64_t>, kLimitNames.size()> g_limits{};

template <size_t N>
int index_of(const std::array<const char*, N>& names, const std::string& name) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

Route forced_route(Knob knob) {
  return static_cast<Route>(g_routes[static_cast<int>(knob)].load(std::memory_order_relaxed));
}

int64_t limit_or(Limit limit, int64_t builtin) {
  const int64_t v = g_limits[static_cast<int>(limit)].load(std::memory_order_relaxed);
  return v > 0 ? v : builtin;
}

std::string set_route(const std::string& knob, const std::string& route) {
  int k = -1;
  std::string knobs;
  for (size_t i = 0; i < kKnobs.size(); ++i) {
    if (knob == kKnobs[i].name) k = static_cast<int>(i);
    knobs += std::string(i ? ", '" : "'") + kKnobs[i].name + "'";
  }
  TORCH_CHECK(k >= 0, "fused_ops.testing.route: unknown knob '", knob, "'; knobs: ", knobs);
  const int r = index_of(kRouteNames, route);
  std::string accepted = "'auto'";
  bool ok = r == 0;
  for (const Route allowed : kKnobs[k].routes) {
    accepted += std::string(", '") + kRouteNames[static_cast<int>(allowed)] + "'";
    ok = ok || r == static_cast<int>(allowed);
  }
  TORCH_CHECK(ok, "fused_ops.testing.route: ", knob, " must be one of ", accepted, ", got '", route, "'");
  return kRouteNames[g_routes[k].exchange(r)];
}

int64_t set_limit(const std::string& name, int64_t value) {
  const int l = index_of(kLimitNames, name);
  TORCH_CHECK(l >= 0, "fused_ops.testing.limit: unknown limit '", name, "'; limits: 'slice_bytes', 'finalize_terms'");
  TORCH_CHECK(value >= 0, "fused_ops.testing.limit: ", name, " must be >= 0 (0: the built-in value), got ", to_str(value));
  return g_limits[l].exchange(value);
}

}  // namespace fused_ops
