// Quantization formats: the encoded-buffer layout, the non-finite / tiny-block rule and its
// constants, shared by the CPU (quant.cpp) and CUDA (quant_cuda.cu) kernels. No torch headers:
// nvcc compiles this into the kernels (quant_checks.h has the tensor checks). The layout must
// match flcomm/kernels.py:
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
//   5. casts keep NaN and +-Inf (c10's conversions), with the NaN bits below.
// No path may flush subnormals to zero (setup.py builds the CUDA code with -ftz=false).
//
// Alignment: the encoded buffer must start at a 4-byte (int8, fp8: float32 scales) or 2-byte
// (bf16, fp16) aligned address; check_args (quant_checks.h) rejects others before any launch.
#pragma once

#include <cstdint>

namespace flcomm {
namespace quant {

enum class Fmt : int { kInt8 = 0, kFp8 = 1, kBf16 = 2, kFp16 = 3 };

constexpr bool blocked(Fmt f) { return f == Fmt::kInt8 || f == Fmt::kFp8; }
constexpr int64_t itemsize(Fmt f) { return blocked(f) ? 1 : 2; }
constexpr int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
constexpr int64_t num_blocks(int64_t numel, int64_t block) { return (numel + block - 1) / block; }
constexpr int64_t payload_nbytes(int64_t numel, Fmt f) { return align16(numel * itemsize(f)); }
constexpr int64_t encoded_nbytes(int64_t numel, Fmt f, int64_t block) {
  return payload_nbytes(numel, f) + (blocked(f) ? align16(4 * num_blocks(numel, block)) : 0);
}
constexpr int64_t buf_alignment(Fmt f) { return blocked(f) ? 4 : 2; }

constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;
constexpr float kTinyAbsmax = 0x1p-64f;
constexpr float kTinyPrescale = 0x1p64f;
constexpr uint32_t kInfBits = 0x7f800000u;  // absmax bits at or above it: not finite (rule 2)
constexpr uint32_t kNaNBits = 0x7fc00000u;  // the scale of a non-finite block (torch's NaN)

// The NaN of the 16-bit casts (quantize fmt "bf16" / "fp16"), as the CPU writes it: c10's host
// conversions, which the plain-torch reference and quant.cpp's scalar path use, and quant.cpp's
// AVX2 path for torch's NaN (0x7fc00000 and its negation).
//   bf16: every NaN is kBf16NaNBits (sign and payload dropped; c10::BFloat16, torch's CPU cast);
//   fp16: a NaN is its sign | kFp16NaNBits (payload dropped; c10::Half without F16C).
// CUDA's conversions (__float2bfloat16, __float2half, which c10 calls in device code) write 0x7fff
// instead, so quant_cuda.cu writes these constants itself.
// NOTE: two gaps remain for fp16. quant.cpp's AVX2 cast (F16C) keeps the top 9 payload bits of a
// NaN, where c10 without F16C drops them, so the CPU paths differ for NaNs with a payload. And the
// sign of a NaN made by arithmetic (error feedback's x + r) differs by device: CUDA's is its
// canonical positive NaN, x86 keeps a NaN operand's sign and makes inf - inf negative. Dropping
// the sign too (every NaN -> 0x7e00, as bf16 does) on every path would close both.
constexpr uint16_t kBf16NaNBits = 0x7fc0;
constexpr uint16_t kFp16NaNBits = 0x7e00;
constexpr uint16_t kFp16SignBit = 0x8000;

}  // namespace quant
}  // namespace flcomm
