#pragma once
// The float64 tensor cores of sm_90 (mma.sync.m16n8k8.f64), shared by the kernels that use
// them (cross_spectrum_s_stage_mma.cu, cross_spectrum_quad_form_mma.cu), and the check their launchers make first.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <utility>

namespace fused_ops {

// The MMA's K: mma.m16n8k8 issues half the instructions of m16n8k4 for the same products, in
// kernels bound by issuing them (docs/performance.md).
constexpr int kMmaK = 8;

// d += a b, a 16 x 8 by 8 x 8 product on the float64 tensor cores (PTX ISA, mma.m16n8k8
// .f64): a[v] is row lane/4 + 8 (v % 2), column lane%4 + 4 (v / 2); b[v] row lane%4 + 4 v,
// column lane/4; d0, d1 row lane/4, columns 2 (lane%4) and + 1; d2, d3 8 rows below.
__device__ __forceinline__ void mma_f64(double (&d)[4], const double (&a)[kMmaK / 2], const double (&b)[kMmaK / 4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#else
  __trap();  // compiled_for_sm90 keeps other architectures out
#endif
}

// Whether the binary of `kernel` that runs on `device` comes from compute_90 or later: a PTX
// of an older architecture, JIT-compiled there, holds no mma.f64 of this shape. Asked once
// per kernel and device.
inline bool compiled_for_sm90(const void* kernel, const at::Device& device) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> ptx_versions;  // 0: not asked yet
  const std::lock_guard<std::mutex> lock(mutex);
  int& version = ptx_versions[{kernel, device.index()}];
  if (version == 0) {
    const c10::cuda::CUDAGuard guard(device);
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    version = attr.ptxVersion;
  }
  return version >= 90;
}

}  // namespace fused_ops
