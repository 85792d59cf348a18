// The shard reorder of the hierarchical collectives: the CUDA kernel (see reorder.cpp for what it
// computes). reorder.cpp checks the tensors and calls shard_transpose here with torch's current
// stream under a device guard, so it is ordered with FSDP's own streams like any other op.
// NOTE: no torch headers (they cost nvcc minutes): raw pointers and a stream only.
#include "common.h"
#include "cuda_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace flcomm {
namespace cuda {
namespace {

// Copies block b = i * cols + j of `in` ([rows, cols, cw] vectors of V) to block j * rows + i of
// `out`. blockIdx.y walks the blocks, blockIdx.x / threadIdx.x the vectors of one chunk, so no
// per-element division is needed.
template <typename V>
__global__ void shard_transpose_kernel(const V* __restrict__ in, V* __restrict__ out, int64_t rows,
                                       int64_t cols, int64_t cw) {
  const int64_t blocks = rows * cols;
  for (int64_t b = blockIdx.y; b < blocks; b += gridDim.y) {
    const int64_t i = b / cols, j = b - i * cols;
    const V* src = in + b * cw;
    V* dst = out + (j * rows + i) * cw;
    for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < cw;
         k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[k] = src[k];
    }
  }
}

template <typename V>
void launch(const void* in, void* out, int64_t rows, int64_t cols, int64_t chunk_bytes,
            cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t cw = chunk_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t blocks = rows * cols;
  // NOTE: about 4 waves of 256-thread CTAs over 132 SMs is enough to saturate HBM; more CTAs
  // only add scheduling overhead for a pure copy.
  const int64_t want_x = std::max<int64_t>(1, std::min<int64_t>((cw + kThreads - 1) / kThreads,
                                                                std::max<int64_t>(1, 2048 / blocks)));
  const dim3 grid(static_cast<unsigned>(want_x), static_cast<unsigned>(std::min<int64_t>(blocks, 65535)));
  shard_transpose_kernel<V><<<grid, kThreads, 0, stream>>>(static_cast<const V*>(in), static_cast<V*>(out),
                                                          rows, cols, cw);
  FLCOMM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void shard_transpose(const void* src, void* dst, int64_t rows, int64_t cols, int64_t chunk_bytes,
                     cudaStream_t stream) {
  // The widest vector that divides the chunk and both base addresses: 16-byte loads for the
  // usual case (fp32 chunks of a multiple of 4 elements).
  const auto align = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst) |
                     static_cast<std::uintptr_t>(chunk_bytes);
  if (align % 16 == 0) {
    launch<uint4>(src, dst, rows, cols, chunk_bytes, stream);
  } else if (align % 8 == 0) {
    launch<uint2>(src, dst, rows, cols, chunk_bytes, stream);
  } else if (align % 4 == 0) {
    launch<uint32_t>(src, dst, rows, cols, chunk_bytes, stream);
  } else if (align % 2 == 0) {
    launch<uint16_t>(src, dst, rows, cols, chunk_bytes, stream);
  } else {
    launch<uint8_t>(src, dst, rows, cols, chunk_bytes, stream);
  }
}

}  // namespace cuda
}  // namespace flcomm
