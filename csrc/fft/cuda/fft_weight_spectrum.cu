// The weight's spectrum over H and W (docs/math.md §3.3), for a range of fh:
// each weight[ci, co, kd] slice has only kH * kW taps, so its DFT at (Lh, Lw) is
// computed directly and separably (first over kw, then kh), never by padding
// the weight to the output size. The depth DFT is left to the consumer
// (fft_spectral_energy.cu), which keeps this buffer small enough to stay in L2.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "fft/cuda/fft.h"
#include "common/cuda/complex.cuh"

namespace fused_ops {
namespace {

constexpr int kThreads = 256;

struct WeightSpectrumArgs {
  const float* w;  // [Ci, Cog, kD, kH, kW]: rows of kH * kW taps, one per (ci, co, kd)
  float2* out;     // [count, Lwf, Ci, Cog, kD]: the rows in the weight's order
  int64_t rows, kh, kw;
  int64_t Lh, Lw, Lwf, dh, dw;
  int64_t fh0, count;
};

// Block (i, fw): rows [i * kThreads, (i + 1) * kThreads) at frequency fw, each
// thread one row; the block's rows are contiguous in the weight, so they are
// staged in shared memory with coalesced loads first.
__global__ void __launch_bounds__(kThreads) weight_spectrum_kernel(const WeightSpectrumArgs a) {
  extern __shared__ float2 smem[];
  const int64_t fw = blockIdx.y, taps = a.kh * a.kw;
  float2* tw_w = smem;              // [kw]
  float2* tw_h = tw_w + a.kw;       // [count][kh]
  float* rows = reinterpret_cast<float*>(tw_h + a.count * a.kh);  // [kThreads][taps]
  for (int64_t i = threadIdx.x; i < a.kw; i += blockDim.x) tw_w[i] = twiddle(fw, i * a.dw, a.Lw);
  for (int64_t i = threadIdx.x; i < a.count * a.kh; i += blockDim.x) {
    tw_h[i] = twiddle(a.fh0 + i / a.kh, (i % a.kh) * a.dh, a.Lh);
  }
  const int64_t first = blockIdx.x * int64_t(kThreads);
  const int64_t n = min(int64_t(kThreads), a.rows - first);
  for (int64_t i = threadIdx.x; i < n * taps; i += blockDim.x) rows[i] = a.w[first * taps + i];
  __syncthreads();
  if (threadIdx.x >= n) return;
  const float* w = rows + threadIdx.x * taps;
  // The kw-DFT of each kh row; unrolled to the bound so `row` stays in registers.
  float2 row[kMaxFftKernel];
#pragma unroll
  for (int kh = 0; kh < kMaxFftKernel; ++kh) {
    float2 acc = make_float2(0.f, 0.f);
    if (kh < a.kh) {
      for (int64_t kw = 0; kw < a.kw; ++kw) {
        const float v = w[kh * a.kw + kw];
        acc.x = fmaf(v, tw_w[kw].x, acc.x);
        acc.y = fmaf(v, tw_w[kw].y, acc.y);
      }
    }
    row[kh] = acc;
  }
  for (int64_t fh = 0; fh < a.count; ++fh) {
    float2 acc = make_float2(0.f, 0.f);
#pragma unroll
    for (int kh = 0; kh < kMaxFftKernel; ++kh) {
      if (kh < a.kh) cfma(acc, row[kh], tw_h[fh * a.kh + kh]);
    }
    a.out[(fh * a.Lwf + fw) * a.rows + first + threadIdx.x] = acc;
  }
}

}  // namespace

int64_t weight_spectrum_smem_bytes(const ConvGeometry& g, int64_t fh_count) {
  return (g.kernel[2] + fh_count * g.kernel[1]) * sizeof(float2) +
         kThreads * g.kernel[1] * g.kernel[2] * sizeof(float);
}

void weight_spectrum_cuda(const at::Tensor& weight, const ConvGeometry& g,
                          const SpectrumGeometry& s, int64_t fh0, int64_t count, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(weight.device());
  WeightSpectrumArgs a;
  a.w = weight.data_ptr<float>();
  a.out = reinterpret_cast<float2*>(out.data_ptr());
  a.rows = g.in_channels * g.out_group_channels() * g.kernel[0];
  a.kh = g.kernel[1];
  a.kw = g.kernel[2];
  a.Lh = s.L[1];
  a.Lw = s.L[2];
  a.Lwf = s.Lwf;
  a.dh = g.dilation[1];
  a.dw = g.dilation[2];
  a.fh0 = fh0;
  a.count = count;
  const dim3 grid(static_cast<unsigned>((a.rows + kThreads - 1) / kThreads),
                  static_cast<unsigned>(s.Lwf));
  const size_t smem = weight_spectrum_smem_bytes(g, count);
  C10_CUDA_CHECK(cudaFuncSetAttribute(weight_spectrum_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  weight_spectrum_kernel<<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fused_ops
