#pragma once
// Asynchronous copies global -> shared memory (cp.async, sm_80 and later) for every kernel
// that stages its operands: a stage's copies are all in flight at once and bypass the
// registers, where a load and a store each would wait on the load. The one wrapper for
// the direct, FFT and cross-spectrum kernels.
#include <cstdint>

namespace fused_ops {

// Copies kBytes (4, 8 or 16) from src to dst, or zeros where !valid (src is then not read,
// but must be a valid address). 16-byte copies go through L2 only (.cg: data other blocks,
// not this one, read again; .cg takes 16 bytes only), smaller ones through L1 as well (.ca).
template <int kBytes>
__device__ __forceinline__ void copy_async_bytes(void* dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(kBytes),
                 "r"(valid ? kBytes : 0));
  }
}

// One value of type T (4, 8 or 16 bytes), as copy_async_bytes.
template <typename T>
__device__ __forceinline__ void copy_async(T* dst, const T* src, bool valid) {
  copy_async_bytes<sizeof(T)>(dst, src, valid);
}

// Closes the group of copies issued since the last commit.
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most kPending of this thread's committed groups are still in flight (0: all
// done). The block needs a barrier after it before reading other threads' copies.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace fused_ops
