// The shard reorder of the hierarchical collectives: the operators flcomm::shard_transpose(_out),
// CPU kernel and, with FLCOMM_WITH_CUDA, the CUDA implementation (the same checks, then
// reorder_cuda.cu's kernel on torch's current stream under a device guard, so it is ordered with
// FSDP's own streams like any other op).
//
// `shard_transpose` views a flat buffer as [rows, cols, chunk] and writes its transpose
// [cols, rows, chunk]: block (i, j) moves to position (j, i). With rows = nodes and
// cols = ranks per node it turns the flat reduce-scatter layout (chunk r = node * L + local for
// rank r) into the local-major layout the intra-node stage needs; with rows and cols swapped it
// is its own inverse, which the all-gather uses to restore the flat layout.
//
// The kernel moves whole chunks as bytes, so it is dtype-agnostic (FSDP2 all-gathers uint8
// buffers when parameters have mixed dtypes).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#ifdef FLCOMM_WITH_CUDA
#include "cuda_kernels.h"
// NOTE: not ATen/cuda/CUDAContext.h: it pulls in cusparse.h, which this toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cstring>

// Input checks that name what was expected and what came.
#define FLCOMM_CHECK_CONTIGUOUS(t) \
  TORCH_CHECK((t).is_contiguous(), #t " must be contiguous, got strides ", (t).strides())
#define FLCOMM_CHECK_SAME_DEVICE(a, b)                                                  \
  TORCH_CHECK((a).device() == (b).device(), #a " and " #b " must be on one device, got ", \
              (a).device(), " and ", (b).device())

namespace flcomm {
namespace {

// The operands of shard_transpose_out, on either device.
void check_shard_transpose(const at::Tensor& input, int64_t rows, int64_t cols,
                           const at::Tensor& out) {
  TORCH_CHECK(rows >= 1 && cols >= 1, "shard_transpose: rows and cols must be >= 1, got rows=", rows,
              " cols=", cols);
  FLCOMM_CHECK_CONTIGUOUS(input);
  FLCOMM_CHECK_CONTIGUOUS(out);
  FLCOMM_CHECK_SAME_DEVICE(input, out);
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "shard_transpose: out must have the dtype of input (",
              input.scalar_type(), "), got ", out.scalar_type());
  TORCH_CHECK(out.numel() == input.numel(), "shard_transpose: out must have as many elements as input (",
              input.numel(), "), got ", out.numel());
  TORCH_CHECK(input.numel() % (rows * cols) == 0, "shard_transpose: input of ", input.numel(),
              " elements does not split into rows*cols = ", rows, "*", cols, " = ", rows * cols,
              " equal chunks");
  if (input.numel() > 0) {
    const auto nbytes = static_cast<int64_t>(input.numel()) * input.element_size();
    const char* a = static_cast<const char*>(input.const_data_ptr());
    const char* b = static_cast<const char*>(out.const_data_ptr());
    TORCH_CHECK(a + nbytes <= b || b + nbytes <= a,
                "shard_transpose: out must not overlap input (the transpose is out of place)");
  }
}

// NOTE: a task is a piece of at most kPiece bytes of one chunk, so a few large chunks (e.g.
// 2 nodes x 2 ranks of a 100 MB gradient bucket) still spread over every core.
constexpr int64_t kPiece = 256 * 1024;

at::Tensor& shard_transpose_out_cpu(const at::Tensor& input, int64_t rows, int64_t cols, at::Tensor& out) {
  check_shard_transpose(input, rows, cols, out);
  const int64_t blocks = rows * cols;
  const int64_t chunk_bytes = input.numel() / blocks * static_cast<int64_t>(input.element_size());
  if (chunk_bytes == 0) return out;
  const char* src = static_cast<const char*>(input.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t pieces = (chunk_bytes + kPiece - 1) / kPiece;
  const int64_t grain = std::max<int64_t>(1, kPiece / chunk_bytes);
  at::parallel_for(0, blocks * pieces, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / pieces, p = t - b * pieces;
      const int64_t i = b / cols, j = b - i * cols;
      const int64_t off = p * kPiece;
      const int64_t len = std::min(kPiece, chunk_bytes - off);
      std::memcpy(dst + (j * rows + i) * chunk_bytes + off, src + b * chunk_bytes + off,
                  static_cast<size_t>(len));
    }
  });
  return out;
}

// NOTE: new_empty (a Tensor method) rather than at::empty_like: the same contiguous tensor of
// input's dtype and device, without ATen/ops/empty_like.h, which adds most of ATen's headers.
at::Tensor empty_out(const at::Tensor& input) { return input.new_empty(input.sizes()); }

at::Tensor shard_transpose_cpu(const at::Tensor& input, int64_t rows, int64_t cols) {
  auto out = empty_out(input);
  shard_transpose_out_cpu(input, rows, cols, out);
  return out;
}

#ifdef FLCOMM_WITH_CUDA
at::Tensor& shard_transpose_out_cuda(const at::Tensor& input, int64_t rows, int64_t cols, at::Tensor& out) {
  check_shard_transpose(input, rows, cols, out);
  const int64_t chunk_bytes = input.numel() / (rows * cols) * static_cast<int64_t>(input.element_size());
  if (chunk_bytes == 0) return out;
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  cuda::shard_transpose(input.const_data_ptr(), out.data_ptr(), rows, cols, chunk_bytes,
                        c10::cuda::getCurrentCUDAStream(input.device().index()).stream());
  return out;
}

at::Tensor shard_transpose_cuda(const at::Tensor& input, int64_t rows, int64_t cols) {
  auto out = empty_out(input);
  shard_transpose_out_cuda(input, rows, cols, out);
  return out;
}
#endif  // FLCOMM_WITH_CUDA

}  // namespace

TORCH_LIBRARY_IMPL(flcomm, CPU, m) {
  m.impl("shard_transpose", &shard_transpose_cpu);
  m.impl("shard_transpose_out", &shard_transpose_out_cpu);
}

#ifdef FLCOMM_WITH_CUDA
TORCH_LIBRARY_IMPL(flcomm, CUDA, m) {
  m.impl("shard_transpose", &shard_transpose_cuda);
  m.impl("shard_transpose_out", &shard_transpose_out_cuda);
}
#endif

}  // namespace flcomm
