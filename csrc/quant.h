// Quantization kernels: formats, the encoded-buffer layout and the argument checks shared by the
// CPU (quant.cpp) and CUDA (quant_cuda.cu) implementations. The layout must match
// flcomm/kernels.py:
//
//   [ payload: numel * itemsize bytes, zero-padded to a multiple of 16 ]
//   [ scales:  ceil(numel / block_size) float32, zero-padded to a multiple of 16 ]  (int8, fp8)
//
// int8: scale = absmax / 127, q = clamp(rint(x * (127 / absmax)), -127, 127)   (0 for a zero block)
// fp8:  scale = absmax / 448, q = e4m3fn(clamp(x * (448 / absmax), -448, 448))
// bf16, fp16: round-to-nearest-even casts, no scales.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string_view>

namespace flcomm {
namespace quant {

enum class Fmt : int { kInt8 = 0, kFp8 = 1, kBf16 = 2, kFp16 = 3 };

inline Fmt parse_fmt(std::string_view s) {
  if (s == "int8") return Fmt::kInt8;
  if (s == "fp8") return Fmt::kFp8;
  if (s == "bf16") return Fmt::kBf16;
  if (s == "fp16") return Fmt::kFp16;
  TORCH_CHECK(false, "quantization format must be one of int8, fp8, bf16, fp16, got '", std::string(s), "'");
}

inline bool blocked(Fmt f) { return f == Fmt::kInt8 || f == Fmt::kFp8; }
inline int64_t itemsize(Fmt f) { return blocked(f) ? 1 : 2; }
inline int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
inline int64_t num_blocks(int64_t numel, int64_t block) { return (numel + block - 1) / block; }
inline int64_t payload_nbytes(int64_t numel, Fmt f) { return align16(numel * itemsize(f)); }
inline int64_t encoded_nbytes(int64_t numel, Fmt f, int64_t block) {
  int64_t n = payload_nbytes(numel, f);
  if (blocked(f)) n += align16(4 * num_blocks(numel, block));
  return n;
}

constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;

inline void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

// Checks of one kernel call; returns the parsed format.
inline Fmt check_args(const at::Tensor& fp32, const char* fp32_name, const at::Tensor& buf,
                      std::string_view fmt, int64_t block_size) {
  Fmt f = parse_fmt(fmt);
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  check_fp32(fp32, fp32_name);
  TORCH_CHECK(buf.scalar_type() == at::kByte, "the encoded buffer must be uint8, got ", buf.scalar_type());
  TORCH_CHECK(buf.is_contiguous(), "the encoded buffer must be contiguous");
  TORCH_CHECK(buf.device() == fp32.device(), "the encoded buffer and ", fp32_name,
              " must be on one device, got ", buf.device(), " and ", fp32.device());
  const int64_t want = encoded_nbytes(fp32.numel(), f, block_size);
  TORCH_CHECK(buf.numel() == want, "the encoded buffer of ", fp32.numel(), " elements (", fmt,
              ", block ", block_size, ") must hold ", want, " bytes, got ", buf.numel());
  return f;
}

inline void check_residual(const at::Tensor& x, const at::Tensor& residual) {
  check_fp32(residual, "residual");
  TORCH_CHECK(residual.numel() == x.numel(), "residual must have ", x.numel(), " elements like x, got ",
              residual.numel());
  TORCH_CHECK(residual.device() == x.device(), "residual and x must be on one device, got ",
              residual.device(), " and ", x.device());
}

}  // namespace quant
}  // namespace flcomm
