#pragma once
// FO_HD marks helpers shared by the CPU kernels and the CUDA kernels, so the
// algebra is written once (see docs/math.md).
#if defined(__CUDACC__)
#define FO_HD __host__ __device__ __forceinline__
#else
#define FO_HD inline
#endif

// Unrolled loops in the shared routines (the host compiler ignores the hint).
#if defined(__CUDACC__)
#define FO_UNROLL _Pragma("unroll")
#define FO_PRAGMA(text) _Pragma(#text)
#define FO_UNROLL_BY(n) FO_PRAGMA(unroll n)
#else
#define FO_UNROLL
#define FO_UNROLL_BY(n)
#endif
