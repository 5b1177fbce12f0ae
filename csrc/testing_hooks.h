#pragma once
// The testing hook behind fused_ops.testing (docs/design.md, "Testing hooks"): a test forces a
// kernel route that the dispatch would not take for its problem, or shrinks a size limit so a
// small problem reaches a branch meant for large ones. Process-wide settings, set from Python
// through the ops _set_route and _set_limit (ops.cpp); the launchers read them as plain loads,
// never the environment. Every route computes the same function: only the kernel changes.
#include <cstdint>
#include <string>

namespace fused_ops {

// What a test can force, and the routes it can force them to (Route::Auto: the dispatch's
// choice, the default).
enum class Knob { Direct, SStage, Contraction, Overlap };
enum class Route { Auto, Mma, Simt, Gemm, Off };
Route forced_route(Knob knob);

// Sizes a test can shrink; `builtin` is the product's value, returned unless a test set one.
enum class Limit { SliceBytes, FinalizeTerms };
int64_t limit_or(Limit limit, int64_t builtin);

// The ops' implementations: set a knob (by name) to a route (by name), or a limit (0: the
// built-in value), and return the previous setting. An unknown name is an error that names it
// and what is accepted; nothing changes then.
std::string set_route(const std::string& knob, const std::string& route);
int64_t set_limit(const std::string& name, int64_t value);

}  // namespace fused_ops
