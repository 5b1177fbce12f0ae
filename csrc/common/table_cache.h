#pragma once
// Geometry-only tables of the training paths (lag phases, tap slots, masks), built on the
// device once per geometry and device and then reused: building them takes about a hundred
// ATen ops per call, host time that an eager loop would pay on every call
// (docs/performance.md).
//
// A cached table outlives the call that made it, so the backend builds it apart
// (Backend::build_tables_apart: CUDA on a thread and a stream of the library's own, waited
// for, so that any stream may read it and no CUDA graph's memory pool holds it) and refuses
// while the current stream is being captured into a CUDA graph: then the tables are built for
// that call alone, inside the graph.
#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace fused_ops {

// Runs `build` so that what it allocates belongs to no CUDA graph and its work is complete
// on return; false, without running it, while `device`'s current stream is being captured.
using BuildApart = bool (*)(const at::Device& device, c10::function_ref<void()> build);

template <typename Tables>
class TableCache {
 public:
  // The tables under `key` on `device`, made by build() on a miss. A full cache keeps what it
  // has (an evicted table could still be read by queued kernels of any stream) and builds
  // beyond it for the call alone, as during capture.
  template <typename Build>
  Tables get(std::vector<int64_t> key, const at::Device& device, BuildApart apart, Build&& build) {
    key.insert(key.end(), {static_cast<int64_t>(device.type()), device.index()});
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = entries_.find(key);
      if (it != entries_.end()) return it->second;
      if (entries_.size() >= kMaxEntries) return build();
    }
    std::optional<Tables> made;
    if (!apart(device, [&] { made.emplace(build()); })) return build();
    const std::lock_guard<std::mutex> lock(mutex_);
    // Another thread may have filled the key meanwhile: every caller reads the one kept, and
    // the copy dropped here was read by nothing but its own (finished) build.
    return entries_.emplace(std::move(key), std::move(*made)).first->second;
  }

 private:
  static constexpr size_t kMaxEntries = 64;
  std::mutex mutex_;
  std::map<std::vector<int64_t>, Tables> entries_;
};

}  // namespace fused_ops
