// The sparse top-k operators flcomm::topk_encode and flcomm::topk_decode (see sparse.h for the
// layout and the rule): the CPU kernels, and, with FLCOMM_WITH_CUDA, the CUDA implementations,
// which check the same arguments and launch sparse_cuda.cu's kernels on torch's current stream.
//
// CPU: at::parallel_for over whole blocks. Per block, one pass computes y (x + residual) and its
// keys, std::nth_element finds the cnt-th largest key T, and one more pass in index order keeps
// every key above T and the first (lowest-index) keys equal to T until cnt are kept: the indices
// come out ascending without a sort. Every product and quotient is rounded on its own
// (setup.py builds with -ffp-contract=off), so the bits are the plain-torch reference's.
#include "quant_checks.h"
#include "sparse.h"

#include <ATen/Parallel.h>
#ifdef FLCOMM_WITH_CUDA
#include "cuda_kernels.h"
// NOTE: not ATen/cuda/CUDAContext.h: it pulls in cusparse.h, which this toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace flcomm {
namespace sparse {
namespace {

// ---- argument checks (both devices) ----
void check_params(int64_t block, int64_t k, int64_t bits) {
  TORCH_CHECK(block >= 1 && block <= kMaxBlock, "block must be in [1, ", kMaxBlock,
              "] (an index in a block is a uint16), got ", block);
  TORCH_CHECK(k >= 1 && k <= block, "k must be in [1, block=", block, "], got ", k);
  TORCH_CHECK(valid_bits(bits), "bits must be 2, 4 or 8, got ", bits);
}

using quant::check_fp32;

void check_buf(const at::Tensor& fp32, const char* fp32_name, const at::Tensor& buf, int64_t block, int64_t k,
               int64_t bits) {
  check_params(block, k, bits);
  check_fp32(fp32, fp32_name);
  TORCH_CHECK(buf.scalar_type() == at::kByte, "the encoded buffer must be uint8, got ", buf.scalar_type());
  TORCH_CHECK(buf.is_contiguous(), "the encoded buffer must be contiguous");
  const auto addr = reinterpret_cast<uintptr_t>(buf.data_ptr());
  TORCH_CHECK(buf.numel() == 0 || addr % 4 == 0,
              "the encoded buffer must start at a 4-byte aligned address (float32 scales), got address ", addr,
              " (a uint8 view at an odd offset?)");
  TORCH_CHECK(buf.device() == fp32.device(), "the encoded buffer and ", fp32_name, " must be on one device, got ",
              buf.device(), " and ", fp32.device());
  const int64_t want = encoded_nbytes(fp32.numel(), block, k, bits);
  TORCH_CHECK(buf.numel() == want, "the encoded buffer of ", fp32.numel(), " elements (block ", block, ", k ", k,
              ", bits ", bits, ") must hold ", want, " bytes, got ", buf.numel());
}

void check_residual(const at::Tensor& x, const std::optional<at::Tensor>& residual) {
  if (residual.has_value()) quant::check_residual(x, *residual);
}

// ---- the CPU kernels ----
inline uint32_t abs_bits(float y) {
  uint32_t u;
  std::memcpy(&u, &y, 4);
  return u & 0x7fffffffu;
}

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bool sign_bit(float y) {
  uint32_t u;
  std::memcpy(&u, &y, 4);
  return (u >> 31) != 0;
}

// The step between magnitude levels of a block (rule 3): 0 when the block has one level.
inline float level_step(float lo, float hi, int64_t levels) {
  return levels > 1 ? (hi - lo) / static_cast<float>(levels - 1) : 0.f;
}

inline float decode_code(uint32_t code, float lo, float step, int64_t bits) {
  const uint32_t levels = 1u << (bits - 1);
  const float m = lo + static_cast<float>(code & (levels - 1)) * step;
  return (code >> (bits - 1)) & 1u ? -m : m;
}

struct Layout {
  int64_t n, block, k, bits, nb, cb;
  float* scales;
  uint16_t* idx;
  uint8_t* codes;
};

Layout layout(uint8_t* buf, int64_t n, int64_t block, int64_t k, int64_t bits) {
  const Regions r = regions(n, block, k);
  return {n,     block, k, bits, r.nb, code_bytes(k, bits), reinterpret_cast<float*>(buf),
          reinterpret_cast<uint16_t*>(buf + r.indices), buf + r.codes};
}

// Block b: select, quantize and pack; with a residual, also the new residual. `keys` and `tmp`
// are scratch of at least `block` elements.
void encode_block(const Layout& L, const float* x, float* r, int64_t b, uint32_t* keys, uint32_t* tmp) {
  const int64_t lo_i = b * L.block, len = std::min(L.block, L.n - lo_i), cnt = std::min(L.k, len);
  const float* xb = x + lo_i;
  float* rb = r != nullptr ? r + lo_i : nullptr;
  for (int64_t i = 0; i < len; ++i) {
    const float y = rb != nullptr ? xb[i] + rb[i] : xb[i];
    keys[i] = abs_bits(y);
    if (rb != nullptr) rb[i] = y;  // NOTE: rule 5: y where nothing is kept; the kept get theirs below
  }
  std::copy(keys, keys + len, tmp);
  std::nth_element(tmp, tmp + (len - cnt), tmp + len);
  const uint32_t T = tmp[len - cnt];
  int64_t above = 0;
  for (int64_t i = 0; i < len; ++i) above += keys[i] > T;
  int64_t ties = cnt - above;
  uint16_t* idx = L.idx + b * L.k;
  int64_t j = 0;
  uint32_t hi_bits = 0;
  for (int64_t i = 0; i < len && j < cnt; ++i) {
    const bool take = keys[i] > T || (keys[i] == T && ties > 0);
    if (!take) continue;
    ties -= keys[i] == T;
    idx[j++] = static_cast<uint16_t>(i);
    hi_bits = std::max(hi_bits, keys[i]);
  }
  const bool bad = hi_bits >= kInfBits;
  const float lo = bad ? from_bits(kSparseNaNBits) : from_bits(T);
  const float hi = bad ? from_bits(kSparseNaNBits) : from_bits(hi_bits);
  L.scales[2 * b] = lo;
  L.scales[2 * b + 1] = hi;
  const int64_t levels = int64_t{1} << (L.bits - 1);
  const float step = level_step(lo, hi, levels);
  uint8_t* codes = L.codes + b * L.cb;
  for (int64_t s = 0; s < cnt; ++s) {
    const int64_t i = idx[s];
    const float y = rb != nullptr ? rb[i] : xb[i];
    uint32_t code = 0;
    if (!bad) {
      uint32_t q = 0;
      if (step > 0.f) q = static_cast<uint32_t>(std::min<float>(levels - 1, std::nearbyint((std::fabs(y) - lo) / step)));
      code = (static_cast<uint32_t>(sign_bit(y)) << (L.bits - 1)) | q;
    }
    codes[(s * L.bits) / 8] |= static_cast<uint8_t>(code << ((s * L.bits) % 8));
    if (rb != nullptr) rb[i] = bad ? from_bits(kSparseNaNBits) : y - decode_code(code, lo, step, L.bits);
  }
}

void encode_cpu(const float* x, float* r, uint8_t* buf, int64_t nbytes, int64_t n, int64_t block, int64_t k,
                int64_t bits) {
  std::memset(buf, 0, nbytes);
  const Layout L = layout(buf, n, block, k, bits);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / block);
  at::parallel_for(0, L.nb, grain, [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> keys(block), tmp(block);
    for (int64_t b = b0; b < b1; ++b) encode_block(L, x, r, b, keys.data(), tmp.data());
  });
}

template <bool kAcc>
void decode_cpu(const uint8_t* buf, float* out, int64_t n, int64_t block, int64_t k, int64_t bits) {
  const Layout L = layout(const_cast<uint8_t*>(buf), n, block, k, bits);
  const int64_t levels = int64_t{1} << (bits - 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / block);
  at::parallel_for(0, L.nb, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo_i = b * block, len = std::min(block, n - lo_i), cnt = std::min(k, len);
      float* ob = out + lo_i;
      if (!kAcc) std::fill(ob, ob + len, 0.f);
      const float lo = L.scales[2 * b], step = level_step(lo, L.scales[2 * b + 1], levels);
      const uint16_t* idx = L.idx + b * k;
      const uint8_t* codes = L.codes + b * L.cb;
      for (int64_t s = 0; s < cnt; ++s) {
        if (idx[s] >= len) continue;  // NOTE: rule 5: not written by an encoder
        const uint32_t code = (codes[(s * bits) / 8] >> ((s * bits) % 8)) & ((1u << bits) - 1);
        const float v = decode_code(code, lo, step, bits);
        if (kAcc) {
          ob[idx[s]] += v;
        } else {
          ob[idx[s]] = v;
        }
      }
    }
  });
}

// ---- the operators ----
void topk_encode_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual, at::Tensor& out, int64_t block,
                     int64_t k, int64_t bits) {
  check_buf(x, "x", out, block, k, bits);
  check_residual(x, residual);
  if (out.numel() == 0) return;
  encode_cpu(x.data_ptr<float>(), residual.has_value() ? residual->data_ptr<float>() : nullptr,
             out.data_ptr<uint8_t>(), out.numel(), x.numel(), block, k, bits);
}

void topk_decode_cpu(const at::Tensor& buf, at::Tensor& out, int64_t block, int64_t k, int64_t bits,
                     bool accumulate) {
  check_buf(out, "out", buf, block, k, bits);
  if (out.numel() == 0) return;
  if (accumulate) {
    decode_cpu<true>(buf.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), block, k, bits);
  } else {
    decode_cpu<false>(buf.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), block, k, bits);
  }
}

}  // namespace
}  // namespace sparse
}  // namespace flcomm

TORCH_LIBRARY_IMPL(flcomm, CPU, m) {
  m.impl("topk_encode", &flcomm::sparse::topk_encode_cpu);
  m.impl("topk_decode", &flcomm::sparse::topk_decode_cpu);
}

#ifdef FLCOMM_WITH_CUDA
namespace flcomm {
namespace sparse {
namespace {

void topk_encode_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual, at::Tensor& out,
                      int64_t block, int64_t k, int64_t bits) {
  check_buf(x, "x", out, block, k, bits);
  check_residual(x, residual);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::topk_encode(x.data_ptr<float>(), residual.has_value() ? residual->data_ptr<float>() : nullptr,
                    out.data_ptr<uint8_t>(), x.numel(), block, k, bits,
                    c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

void topk_decode_cuda(const at::Tensor& buf, at::Tensor& out, int64_t block, int64_t k, int64_t bits,
                      bool accumulate) {
  check_buf(out, "out", buf, block, k, bits);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::topk_decode(buf.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), block, k, bits, accumulate,
                    c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
}

}  // namespace
}  // namespace sparse
}  // namespace flcomm

TORCH_LIBRARY_IMPL(flcomm, CUDA, m) {
  m.impl("topk_encode", &flcomm::sparse::topk_encode_cuda);
  m.impl("topk_decode", &flcomm::sparse::topk_decode_cuda);
}
#endif  // FLCOMM_WITH_CUDA
