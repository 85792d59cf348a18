// The argument checks of the quantization operators (quant.cpp, both devices), on top of the
// torch-free formats and layout of quant.h.
#pragma once

#include "quant.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace flcomm {
namespace quant {

inline Fmt parse_fmt(std::string_view s) {
  if (s == "int8") return Fmt::kInt8;
  if (s == "fp8") return Fmt::kFp8;
  if (s == "bf16") return Fmt::kBf16;
  if (s == "fp16") return Fmt::kFp16;
  TORCH_CHECK(false, "quantization format must be one of int8, fp8, bf16, fp16, got '", std::string(s), "'");
}

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
  const auto addr = reinterpret_cast<uintptr_t>(buf.data_ptr());
  TORCH_CHECK(buf.numel() == 0 || addr % buf_alignment(f) == 0, "the encoded buffer must start at a ",
              buf_alignment(f), "-byte aligned address for ", fmt, ", got address ", addr,
              " (a uint8 view at an odd offset?)");
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
