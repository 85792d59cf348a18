// The CUDA kernels' host entry points: raw pointers, sizes and a stream, no torch types, so the
// .cu files compile without torch's headers. The operators (quant.cpp, reorder.cpp, sparse.cpp,
// apply.cpp) check the tensors, set the device and pass torch's current stream; each launcher
// throws (common.h) on a launch error.
#pragma once

#include "quant.h"
#include "sparse.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flcomm {
namespace cuda {

// quant_cuda.cu. quantize: `n` floats of `x` (plus `residual` for error feedback, else nullptr,
// which then gets the new residual) into the encoded buffer `buf` of encoded_nbytes(n, f, block)
// bytes. dequantize: `buf` into (accumulate: onto) the `n` floats of `out`.
void quantize(quant::Fmt f, const float* x, float* residual, uint8_t* buf, int64_t n, int64_t block,
              cudaStream_t stream);
void dequantize(quant::Fmt f, const uint8_t* buf, float* out, int64_t n, int64_t block, bool accumulate,
                cudaStream_t stream);

// reorder_cuda.cu: [rows, cols] chunks of `chunk_bytes` bytes of `in` to [cols, rows] in `out`
// (chunk_bytes > 0; in and out do not overlap).
void shard_transpose(const void* in, void* out, int64_t rows, int64_t cols, int64_t chunk_bytes,
                     cudaStream_t stream);

// sparse_cuda.cu (layout and rule in sparse.h). topk_encode: the n floats of `x` (plus
// `residual` for error feedback, else nullptr; it then gets the new residual) into the encoded
// buffer `buf` of sparse::encoded_nbytes(n, block, k, bits) bytes, every byte of it written.
// topk_decode: `buf` into (accumulate: onto) the n floats of `out`.
void topk_encode(const float* x, float* residual, uint8_t* buf, int64_t n, int64_t block, int64_t k,
                 int64_t bits, cudaStream_t stream);
void topk_decode(const uint8_t* buf, float* out, int64_t n, int64_t block, int64_t k, int64_t bits,
                 bool accumulate, cudaStream_t stream);

// apply_cuda.cu (what it computes: apply.cpp): where *ok (in device memory) holds, over the n
// elements (float, or double with fp64) of mean, anchor and target: anchor += mean, and target =
// anchor - target (correction: the new anchor less target) or the new anchor.
void apply_average(bool fp64, const void* mean, void* anchor, void* target, int64_t n, const bool* ok,
                   bool correction, cudaStream_t stream);

}  // namespace cuda
}  // namespace flcomm
