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
//
// Non-finite and tiny values: ONE rule, implemented by the plain-torch reference
// (flcomm/kernels.py, whose docstring states it too), the AVX2 and the scalar CPU paths
// (quant.cpp) and the CUDA kernels (quant_cuda.cu); tests/test_kernels.py checks each:
//   1. absmax is the largest |y| of the block, with NaN > +Inf > every finite value: it is
//      computed as an unsigned max of the bits of |y| (absmax_bits), which orders exactly so;
//   2. a block whose absmax is not finite (a NaN or an Inf in it) gets payload 0 and scale NaN
//      (kNaNBits): it decodes as NaN, and error feedback leaves y - decoded = NaN as residual;
//   3. a block with 0 < absmax < kTinyAbsmax (2^-64) is multiplied by kTinyPrescale (2^64)
//      before `* inv`, with inv = qmax / (absmax * 2^64): both exact, so inv never overflows and
//      the elements encode as if they were of normal size; scale = absmax / qmax as always;
//   4. absmax == 0: scale 0, inv 0, payload 0 (-0.0 encodes as fp8 0x80, as the casts do);
//   5. casts keep NaN and +-Inf (c10's conversions).
// No path may flush subnormals to zero (setup.py builds the CUDA code with -ftz=false).
//
// Alignment: the encoded buffer must start at a 4-byte (int8, fp8: float32 scales) or 2-byte
// (bf16, fp16) aligned address; check_args rejects others before any launch.
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
constexpr float kTinyAbsmax = 0x1p-64f;
constexpr float kTinyPrescale = 0x1p64f;
constexpr uint32_t kInfBits = 0x7f800000u;  // absmax bits at or above it: not finite (rule 2)
constexpr uint32_t kNaNBits = 0x7fc00000u;  // the scale of a non-finite block (torch's NaN)

inline int64_t buf_alignment(Fmt f) { return blocked(f) ? 4 : 2; }

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
