#pragma once
// Geometry-only tables of the training paths (lag phases, tap slots), built on the
// device once per geometry, device and stream and then reused: building them takes
// about a hundred ATen ops per call, host time that the cross-spectrum path's eager
// loop pays on every call (docs/performance.md). Per stream, so that a table is only
// ever read behind the kernels that wrote it; never filled while the stream is being
// captured into a CUDA graph, whose kernels run only when it replays.
#include <ATen/ATen.h>

#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace fused_ops {

template <typename Tables>
class TableCache {
 public:
  // The tables under `key` on `device`, made by build() on a miss; `stream` < 0 (the
  // stream is capturing): built for this call alone. A full cache drops its oldest entry:
  // its tensors were allocated on their key's stream and only used there, so the
  // allocator hands their memory out again only behind that use.
  template <typename Build>
  Tables get(std::vector<int64_t> key, const at::Device& device, int64_t stream, Build&& build) {
    if (stream < 0) return build();
    key.insert(key.end(), {static_cast<int64_t>(device.type()), device.index(), stream});
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = entries_.find(key);
      if (it != entries_.end()) return it->second;
    }
    Tables tables = build();
    const std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.emplace(key, tables).second) {
      order_.push_back(std::move(key));
      if (order_.size() > kMaxEntries) {
        entries_.erase(order_.front());
        order_.pop_front();
      }
    }
    return tables;
  }

 private:
  static constexpr size_t kMaxEntries = 64;
  std::mutex mutex_;
  std::map<std::vector<int64_t>, Tables> entries_;
  std::deque<std::vector<int64_t>> order_;  // keys, oldest first
};

}  // namespace fused_ops
