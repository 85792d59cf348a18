// Shared macros of flcomm's native code: every CUDA / NCCL return code goes through one macro
// that throws with file:line and the library's own message.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#ifdef FLCOMM_WITH_CUDA
#include <cuda_runtime.h>
#endif
#ifdef FLCOMM_WITH_NCCL
#include <nccl.h>
#endif

namespace flcomm {

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

// Input checks that name what was expected and what came.
#define FLCOMM_CHECK_CONTIGUOUS(t) \
  TORCH_CHECK((t).is_contiguous(), #t " must be contiguous, got strides ", (t).strides())
#define FLCOMM_CHECK_DTYPE(t, dt) \
  TORCH_CHECK((t).scalar_type() == (dt), #t " must be ", (dt), ", got ", (t).scalar_type())
#define FLCOMM_CHECK_SAME_DEVICE(a, b)                                                  \
  TORCH_CHECK((a).device() == (b).device(), #a " and " #b " must be on one device, got ", \
              (a).device(), " and ", (b).device())

#ifdef FLCOMM_WITH_CUDA
#define FLCOMM_CUDA_CHECK(expr)                                                         \
  do {                                                                                  \
    cudaError_t err_ = (expr);                                                          \
    if (err_ != cudaSuccess) {                                                          \
      std::ostringstream os_;                                                           \
      os_ << "CUDA error at " << __FILE__ << ":" << __LINE__ << " in `" #expr "`: "     \
          << cudaGetErrorName(err_) << ": " << cudaGetErrorString(err_);                \
      throw std::runtime_error(os_.str());                                              \
    }                                                                                   \
  } while (0)
#endif

#ifdef FLCOMM_WITH_NCCL
// `comm` may be nullptr (before a communicator exists); ncclGetLastError then reports the
// last error of the calling thread.
#define FLCOMM_NCCL_CHECK(expr, comm)                                                   \
  do {                                                                                  \
    ncclResult_t res_ = (expr);                                                         \
    if (res_ != ncclSuccess && res_ != ncclInProgress) {                                \
      std::ostringstream os_;                                                           \
      os_ << "NCCL error at " << __FILE__ << ":" << __LINE__ << " in `" #expr "`: "     \
          << ncclGetErrorString(res_);                                                  \
      const char* last_ = ncclGetLastError(comm);                                       \
      if (last_ != nullptr && last_[0] != '\0') os_ << " (" << last_ << ")";            \
      throw std::runtime_error(os_.str());                                              \
    }                                                                                   \
  } while (0)
#endif

}  // namespace flcomm
