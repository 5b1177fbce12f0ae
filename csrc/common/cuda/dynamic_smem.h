#pragma once
// Dynamic shared memory past the 48 KB a launch gets by default: the most a block may
// have on the current device (with the opt-in), and the opt-in for one kernel.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>

namespace fused_ops {

inline int64_t dynamic_smem_limit() {
  return static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
}

// A bound on the static shared memory of the kernels that use allow_dynamic_smem: the 48 KiB a
// launch gets without the opt-in hold the static and the dynamic bytes together (dynamic bytes
// under 48 KiB that do not fit beside the static ones fail the launch as an invalid argument).
constexpr int64_t kMaxStaticSmem = int64_t(8) << 10;

template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, int64_t bytes) {
  if (bytes + kMaxStaticSmem > (48 << 10)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}

}  // namespace fused_ops
