// The CUDA implementations of the torch operators (schemas in bindings.cpp): the tensor checks
// (shared with the CPU implementations), the device guard and torch's current stream here; the
// kernels (quant_cuda.cu, reorder_cuda.cu) take raw pointers and that stream (cuda_kernels.h).
// Compiled with FLCOMM_WITH_CUDA only.
#ifdef FLCOMM_WITH_CUDA

#include "cuda_kernels.h"
#include "quant_checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
// NOTE: not ATen/cuda/CUDAContext.h: it pulls in cusparse.h, which this toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

namespace flcomm {

// Defined in reorder.cpp.
void check_shard_transpose(const at::Tensor& input, int64_t rows, int64_t cols, const at::Tensor& out);

namespace {

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// ---- quantization (quant_cuda.cu) ----
void quantize_cuda(const at::Tensor& x, at::Tensor& out, c10::string_view fmt, int64_t block_size) {
  const quant::Fmt f = quant::check_args(x, "x", out, fmt, block_size);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::quantize(f, x.data_ptr<float>(), nullptr, out.data_ptr<uint8_t>(), x.numel(), block_size,
                 current_stream(x));
}

void dequantize_cuda(const at::Tensor& buf, at::Tensor& out, c10::string_view fmt, int64_t block_size,
                     bool accumulate) {
  const quant::Fmt f = quant::check_args(out, "out", buf, fmt, block_size);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::dequantize(f, buf.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), block_size, accumulate,
                   current_stream(out));
}

void quantize_error_feedback_cuda(const at::Tensor& x, at::Tensor& residual, at::Tensor& out,
                                  c10::string_view fmt, int64_t block_size) {
  const quant::Fmt f = quant::check_args(x, "x", out, fmt, block_size);
  quant::check_residual(x, residual);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::quantize(f, x.data_ptr<float>(), residual.data_ptr<float>(), out.data_ptr<uint8_t>(), x.numel(),
                 block_size, current_stream(x));
}

// ---- shard reorder (reorder_cuda.cu) ----
at::Tensor& shard_transpose_out_cuda(const at::Tensor& input, int64_t rows, int64_t cols, at::Tensor& out) {
  check_shard_transpose(input, rows, cols, out);
  const int64_t chunk_bytes = input.numel() / (rows * cols) * static_cast<int64_t>(input.element_size());
  if (chunk_bytes == 0) return out;
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  cuda::shard_transpose(input.const_data_ptr(), out.data_ptr(), rows, cols, chunk_bytes, current_stream(input));
  return out;
}

at::Tensor shard_transpose_cuda(const at::Tensor& input, int64_t rows, int64_t cols) {
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  shard_transpose_out_cuda(input, rows, cols, out);
  return out;
}

}  // namespace
}  // namespace flcomm

TORCH_LIBRARY_IMPL(flcomm, CUDA, m) {
  m.impl("quantize", &flcomm::quantize_cuda);
  m.impl("dequantize", &flcomm::dequantize_cuda);
  m.impl("quantize_error_feedback", &flcomm::quantize_error_feedback_cuda);
  m.impl("shard_transpose", &flcomm::shard_transpose_cuda);
  m.impl("shard_transpose_out", &flcomm::shard_transpose_out_cuda);
}

#endif  // FLCOMM_WITH_CUDA
