// The fused apply of FedAvg's exchange: the CUDA kernel (see apply.cpp for what it computes).
// apply.cpp checks the tensors and calls apply_average here with torch's current stream under a
// device guard. Every thread reads `ok` in device memory and returns when it is false, so a
// refused bucket costs a launch and the host never reads the flag.
//
// The arithmetic is one explicitly rounded add or subtract per element (__fadd_rn / __dadd_rn),
// so the bits match the CPU kernel and the plain-torch reference.
// NOTE: no torch headers (they cost nvcc minutes): raw pointers and a stream only.
#include "common.h"
#include "cuda_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace flcomm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535LL * 16;

__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

template <typename T, bool kCorrection>
__global__ void apply_average_kernel(const T* __restrict__ m, T* __restrict__ a, T* __restrict__ t, int64_t n,
                                     const bool* __restrict__ ok) {
  if (!*ok) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T v = add_rn(a[i], m[i]);
    a[i] = v;
    t[i] = kCorrection ? sub_rn(v, t[i]) : v;
  }
}

template <typename T>
void launch(const void* mean, void* anchor, void* target, int64_t n, const bool* ok, bool correction,
            cudaStream_t stream) {
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads)));
  const T* m = static_cast<const T*>(mean);
  T* a = static_cast<T*>(anchor);
  T* t = static_cast<T*>(target);
  if (correction) {
    apply_average_kernel<T, true><<<grid, kThreads, 0, stream>>>(m, a, t, n, ok);
  } else {
    apply_average_kernel<T, false><<<grid, kThreads, 0, stream>>>(m, a, t, n, ok);
  }
  FLCOMM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void apply_average(bool fp64, const void* mean, void* anchor, void* target, int64_t n, const bool* ok,
                   bool correction, cudaStream_t stream) {
  if (fp64) {
    launch<double>(mean, anchor, target, n, ok, correction, stream);
  } else {
    launch<float>(mean, anchor, target, n, ok, correction, stream);
  }
}

}  // namespace cuda
}  // namespace flcomm
