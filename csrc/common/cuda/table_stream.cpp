#include "common/cuda/table_stream.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

namespace fused_ops {

// cudaStreamIsCapturing is one of the calls capture allows.
int64_t table_stream_cuda(const at::Device& device) {
  const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  return status == cudaStreamCaptureStatusNone ? stream.id() : -1;
}

}  // namespace fused_ops
