#pragma once
// Sums across the lanes of a warp by butterfly shuffles, shared by the kernels that reduce
// per-lane partial sums: after the call every lane of a group holds the group's sum, so no
// broadcast follows. Block-wide sums stage these per-warp sums in shared memory; reductions
// of whole rows (the weight sums) use CUB's WarpReduce (sums/cuda/weight_sums.cuh).

namespace fused_ops {

// Adds v over the lanes whose index differs only in the bits kFirst .. kLast (powers of two):
// kFirst 1, kLast 16 sums the whole warp; kFirst 1, kLast n / 2 sums aligned groups of n
// lanes; kFirst 4, kLast 16 sums the lanes of one lane % 4 (an mma fragment's column).
template <int kFirst, int kLast, typename T>
__device__ __forceinline__ T butterfly_sum(T v) {
  static_assert(kFirst > 0 && (kFirst & (kFirst - 1)) == 0 && (kLast & (kLast - 1)) == 0 && kLast <= 16,
                "offsets are powers of two below 32");
#pragma unroll
  for (int offset = kLast; offset >= kFirst; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum over all 32 lanes, in every lane.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  return butterfly_sum<1, 16>(v);
}

}  // namespace fused_ops
