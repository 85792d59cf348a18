// CUDA quantization kernels behind the torch operators flcomm::quantize, flcomm::dequantize and
// flcomm::quantize_error_feedback (quant.cpp checks the tensors and calls the launchers at the
// end of this file on torch's current stream); see quant.h for the formats and the layout.
//
// Loads and stores are vectorized (float4 / 16-byte words) when the pointers are 16-byte aligned
// and the block size allows it, with a scalar fallback. The arithmetic uses explicitly rounded
// intrinsics (__fdiv_rn, __fmul_rn, __fadd_rn, rintf) so that FMA contraction cannot change the
// result, and setup.py builds without flush-to-zero (-ftz=false; tests/test_native.py checks the
// PTX): the bits match the CPU kernels and the plain-torch reference, subnormals and the
// non-finite / tiny-block rule of quant.h included.
//
// Alignment: the operators check (check_args) that the encoded buffer is 4-byte (int8, fp8) or
// 2-byte (casts) aligned, which the scalar fallbacks' float / uint16 accesses need; the vector
// paths are only taken for 16-byte aligned pointers.
//
// NOTE: no ATen / torch headers (they cost nvcc minutes); only c10's header-only scalar types,
// whose conversions the CPU kernels and the reference use too.
#include "common.h"
#include "cuda_kernels.h"
#include "quant.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace flcomm {
namespace quant {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535LL * 16;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int grid_for(int64_t work_items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxBlocks, (work_items + kThreads - 1) / kThreads)));
}

template <Fmt F>
__device__ __forceinline__ float qmax_of() {
  return F == Fmt::kInt8 ? kInt8Max : kFp8Max;
}

// The per-block constants of the rule in quant.h, from the bits of the absmax.
struct BlockScale {
  float scale, inv, pre;
  bool bad, tiny;
};

template <Fmt F>
__device__ __forceinline__ BlockScale block_scale(uint32_t amax_bits) {
  const float qmax = qmax_of<F>();
  if (amax_bits >= kInfBits) return {__uint_as_float(kNaNBits), 0.f, 1.f, true, false};
  const float amax = __uint_as_float(amax_bits);
  const bool tiny = amax > 0.f && amax < kTinyAbsmax;
  const float pre = tiny ? kTinyPrescale : 1.f;
  return {__fdiv_rn(amax, qmax), amax > 0.f ? __fdiv_rn(qmax, __fmul_rn(amax, pre)) : 0.f, pre, false, tiny};
}

// One element of a blocked format: returns the byte, `d` gets the decoded value (before * scale).
template <Fmt F>
__device__ __forceinline__ uint8_t quant_elem(float y, const BlockScale& bs, float& d) {
  if (bs.bad) {  // rule 2: payload 0 (y * 0 would be NaN for NaN / Inf elements)
    d = 0.f;
    return 0;
  }
  const float qmax = qmax_of<F>();
  const float yy = bs.tiny ? __fmul_rn(y, bs.pre) : y;
  const float v = fminf(fmaxf(__fmul_rn(yy, bs.inv), -qmax), qmax);
  if constexpr (F == Fmt::kInt8) {
    d = rintf(v);
    return static_cast<uint8_t>(static_cast<int8_t>(d));
  } else {
    const c10::Float8_e4m3fn h(v);
    d = static_cast<float>(h);
    return h.x;
  }
}

__device__ __forceinline__ uint32_t abs_bits(float y) { return __float_as_uint(y) & 0x7fffffffu; }

template <Fmt F>
__device__ __forceinline__ float dequant_elem(uint8_t b) {
  if constexpr (F == Fmt::kInt8) {
    return static_cast<float>(static_cast<int8_t>(b));
  } else {
    return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
  }
}

// NOTE: an unsigned max over the bits of |y|: NaN > Inf > every finite value (rule 1), where
// fmaxf would drop a NaN.
__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- blocked formats: one warp per block (absmax by warp shuffle, then quantize) ----
template <Fmt F, bool kEF, bool kVec>
__global__ void quant_blocks_kernel(const float* __restrict__ x, float* __restrict__ r, uint8_t* __restrict__ q,
                                    float* __restrict__ s, int64_t n, int64_t B, int64_t nb) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  constexpr int V = kVec ? 4 : 1;
  for (int64_t b = warp; b < nb; b += nwarps) {
    const int64_t lo = b * B, hi = min(n, lo + B);
    uint32_t amax_bits = 0;
    for (int64_t i = lo + lane * V; i < hi; i += 32 * V) {
      if (kVec && i + 4 <= hi) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        if (kEF) {
          const float4 rv = *reinterpret_cast<const float4*>(r + i);
          v.x = __fadd_rn(v.x, rv.x); v.y = __fadd_rn(v.y, rv.y);
          v.z = __fadd_rn(v.z, rv.z); v.w = __fadd_rn(v.w, rv.w);
        }
        amax_bits = max(amax_bits, max(max(abs_bits(v.x), abs_bits(v.y)), max(abs_bits(v.z), abs_bits(v.w))));
      } else {
        for (int64_t k = i; k < min(hi, i + V); ++k) {
          amax_bits = max(amax_bits, abs_bits(kEF ? __fadd_rn(x[k], r[k]) : x[k]));
        }
      }
    }
    const BlockScale bs = block_scale<F>(warp_max(amax_bits));
    const float scale = bs.scale;
    for (int64_t i = lo + lane * V; i < hi; i += 32 * V) {
      if (kVec && i + 4 <= hi) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        float4 rv;
        if (kEF) {
          rv = *reinterpret_cast<const float4*>(r + i);
          v.x = __fadd_rn(v.x, rv.x); v.y = __fadd_rn(v.y, rv.y);
          v.z = __fadd_rn(v.z, rv.z); v.w = __fadd_rn(v.w, rv.w);
        }
        float d0, d1, d2, d3;
        const uint32_t w = static_cast<uint32_t>(quant_elem<F>(v.x, bs, d0)) |
                           (static_cast<uint32_t>(quant_elem<F>(v.y, bs, d1)) << 8) |
                           (static_cast<uint32_t>(quant_elem<F>(v.z, bs, d2)) << 16) |
                           (static_cast<uint32_t>(quant_elem<F>(v.w, bs, d3)) << 24);
        *reinterpret_cast<uint32_t*>(q + i) = w;
        if (kEF) {
          rv.x = __fsub_rn(v.x, __fmul_rn(d0, scale)); rv.y = __fsub_rn(v.y, __fmul_rn(d1, scale));
          rv.z = __fsub_rn(v.z, __fmul_rn(d2, scale)); rv.w = __fsub_rn(v.w, __fmul_rn(d3, scale));
          *reinterpret_cast<float4*>(r + i) = rv;
        }
      } else {
        for (int64_t k = i; k < min(hi, i + V); ++k) {
          const float y = kEF ? __fadd_rn(x[k], r[k]) : x[k];
          float d;
          q[k] = quant_elem<F>(y, bs, d);
          if (kEF) r[k] = __fsub_rn(y, __fmul_rn(d, scale));
        }
      }
    }
    if (lane == 0) s[b] = scale;
  }
}

// ---- blocked formats, decode: V elements per thread (16: one 16-byte load of the payload) ----
template <Fmt F, bool kAcc, int V>
__global__ void dequant_blocks_kernel(const uint8_t* __restrict__ q, const float* __restrict__ s,
                                      float* __restrict__ out, int64_t n, int64_t B) {
  const int64_t groups = (n + V - 1) / V;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = g * V;
    if (V == 16 && i + 16 <= n) {
      // NOTE: V divides B here, so the 16 elements share one scale.
      const float scale = s[i / B];
      const uint4 w = *reinterpret_cast<const uint4*>(q + i);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float4 o;
        o.x = __fmul_rn(dequant_elem<F>(words[k] & 0xff), scale);
        o.y = __fmul_rn(dequant_elem<F>((words[k] >> 8) & 0xff), scale);
        o.z = __fmul_rn(dequant_elem<F>((words[k] >> 16) & 0xff), scale);
        o.w = __fmul_rn(dequant_elem<F>(words[k] >> 24), scale);
        float4* dst = reinterpret_cast<float4*>(out + i) + k;
        if (kAcc) {
          const float4 a = *dst;
          o.x = __fadd_rn(a.x, o.x); o.y = __fadd_rn(a.y, o.y); o.z = __fadd_rn(a.z, o.z); o.w = __fadd_rn(a.w, o.w);
        }
        *dst = o;
      }
    } else {
      for (int64_t k = i; k < min(n, i + V); ++k) {
        const float d = __fmul_rn(dequant_elem<F>(q[k]), s[k / B]);
        out[k] = kAcc ? __fadd_rn(out[k], d) : d;
      }
    }
  }
}

// ---- casts (bf16, fp16): V = 8 elements per thread (two float4 in, one 16-byte word out) ----
template <Fmt F>
__device__ __forceinline__ float uncast_elem(uint16_t b) {
  if constexpr (F == Fmt::kBf16) {
    return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
  } else {
    return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
  }
}

// NOTE: a NaN gets the CPU's NaN bits (quant.h kBf16NaNBits / kFp16NaNBits), not CUDA's 0x7fff,
// so the encoded bytes are the CPU's bit for bit.
template <Fmt F>
__device__ __forceinline__ uint16_t nan_bits(float y) {
  if constexpr (F == Fmt::kBf16) {
    return kBf16NaNBits;
  } else {
    return static_cast<uint16_t>(((__float_as_uint(y) >> 16) & kFp16SignBit) | kFp16NaNBits);
  }
}

template <Fmt F>
__device__ __forceinline__ uint16_t cast_elem(float y, float& d) {
  uint16_t bits;
  if (isnan(y)) {
    bits = nan_bits<F>(y);
  } else if constexpr (F == Fmt::kBf16) {
    bits = c10::BFloat16(y).x;
  } else {
    bits = c10::Half(y).x;
  }
  d = uncast_elem<F>(bits);
  return bits;
}

template <Fmt F, bool kEF, int V>
__global__ void cast_kernel(const float* __restrict__ x, float* __restrict__ r, uint16_t* __restrict__ p, int64_t n) {
  const int64_t groups = (n + V - 1) / V;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = g * V;
    if (V == 8 && i + 8 <= n) {
      float y[8], d[8];
      const float4 a = reinterpret_cast<const float4*>(x + i)[0], b = reinterpret_cast<const float4*>(x + i)[1];
      y[0] = a.x; y[1] = a.y; y[2] = a.z; y[3] = a.w; y[4] = b.x; y[5] = b.y; y[6] = b.z; y[7] = b.w;
      if (kEF) {
        const float4 ra = reinterpret_cast<const float4*>(r + i)[0], rb = reinterpret_cast<const float4*>(r + i)[1];
        const float rr[8] = {ra.x, ra.y, ra.z, ra.w, rb.x, rb.y, rb.z, rb.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = __fadd_rn(y[k], rr[k]);
      }
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        w[k] = static_cast<uint32_t>(cast_elem<F>(y[2 * k], d[2 * k])) |
               (static_cast<uint32_t>(cast_elem<F>(y[2 * k + 1], d[2 * k + 1])) << 16);
      }
      *reinterpret_cast<uint4*>(p + i) = make_uint4(w[0], w[1], w[2], w[3]);
      if (kEF) {
        float4* rd = reinterpret_cast<float4*>(r + i);
        rd[0] = make_float4(__fsub_rn(y[0], d[0]), __fsub_rn(y[1], d[1]), __fsub_rn(y[2], d[2]), __fsub_rn(y[3], d[3]));
        rd[1] = make_float4(__fsub_rn(y[4], d[4]), __fsub_rn(y[5], d[5]), __fsub_rn(y[6], d[6]), __fsub_rn(y[7], d[7]));
      }
    } else {
      for (int64_t k = i; k < min(n, i + V); ++k) {
        const float y = kEF ? __fadd_rn(x[k], r[k]) : x[k];
        float d;
        p[k] = cast_elem<F>(y, d);
        if (kEF) r[k] = __fsub_rn(y, d);
      }
    }
  }
}

template <Fmt F, bool kAcc, int V>
__global__ void uncast_kernel(const uint16_t* __restrict__ p, float* __restrict__ out, int64_t n) {
  const int64_t groups = (n + V - 1) / V;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = g * V;
    if (V == 8 && i + 8 <= n) {
      const uint4 w = *reinterpret_cast<const uint4*>(p + i);
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
      float d[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        d[2 * k] = uncast_elem<F>(static_cast<uint16_t>(ws[k] & 0xffff));
        d[2 * k + 1] = uncast_elem<F>(static_cast<uint16_t>(ws[k] >> 16));
      }
      float4* o = reinterpret_cast<float4*>(out + i);
      float4 o0 = make_float4(d[0], d[1], d[2], d[3]), o1 = make_float4(d[4], d[5], d[6], d[7]);
      if (kAcc) {
        const float4 a0 = o[0], a1 = o[1];
        o0 = make_float4(__fadd_rn(a0.x, o0.x), __fadd_rn(a0.y, o0.y), __fadd_rn(a0.z, o0.z), __fadd_rn(a0.w, o0.w));
        o1 = make_float4(__fadd_rn(a1.x, o1.x), __fadd_rn(a1.y, o1.y), __fadd_rn(a1.z, o1.z), __fadd_rn(a1.w, o1.w));
      }
      o[0] = o0;
      o[1] = o1;
    } else {
      for (int64_t k = i; k < min(n, i + V); ++k) {
        const float d = uncast_elem<F>(p[k]);
        out[k] = kAcc ? __fadd_rn(out[k], d) : d;
      }
    }
  }
}

// ---- host side ----
template <Fmt F, bool kEF>
void launch_quant(const float* x, float* r, uint8_t* buf, int64_t n, int64_t B, cudaStream_t st) {
  const int64_t pay = payload_nbytes(n, F);
  if constexpr (F == Fmt::kInt8 || F == Fmt::kFp8) {
    const int64_t nb = num_blocks(n, B);
    float* s = reinterpret_cast<float*>(buf + pay);
    // zero the padding: the payload tail and the scales tail
    if (pay > n) FLCOMM_CUDA_CHECK(cudaMemsetAsync(buf + n, 0, pay - n, st));
    const int64_t stail = align16(4 * nb) - 4 * nb;
    if (stail > 0) FLCOMM_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<uint8_t*>(s + nb), 0, stail, st));
    const int grid = grid_for(nb * 32);
    const bool vec = B % 4 == 0 && aligned16(x) && aligned16(buf) && (!kEF || aligned16(r));
    if (vec) {
      quant_blocks_kernel<F, kEF, true><<<grid, kThreads, 0, st>>>(x, r, buf, s, n, B, nb);
    } else {
      quant_blocks_kernel<F, kEF, false><<<grid, kThreads, 0, st>>>(x, r, buf, s, n, B, nb);
    }
  } else {
    if (pay > 2 * n) FLCOMM_CUDA_CHECK(cudaMemsetAsync(buf + 2 * n, 0, pay - 2 * n, st));
    uint16_t* p = reinterpret_cast<uint16_t*>(buf);
    if (aligned16(x) && aligned16(buf) && (!kEF || aligned16(r))) {
      cast_kernel<F, kEF, 8><<<grid_for((n + 7) / 8), kThreads, 0, st>>>(x, r, p, n);
    } else {
      cast_kernel<F, kEF, 1><<<grid_for(n), kThreads, 0, st>>>(x, r, p, n);
    }
  }
  FLCOMM_CUDA_CHECK(cudaGetLastError());
}

template <Fmt F, bool kAcc>
void launch_dequant(const uint8_t* buf, float* out, int64_t n, int64_t B, cudaStream_t st) {
  if constexpr (F == Fmt::kInt8 || F == Fmt::kFp8) {
    const float* s = reinterpret_cast<const float*>(buf + payload_nbytes(n, F));
    if (B % 16 == 0 && aligned16(out) && aligned16(buf)) {
      dequant_blocks_kernel<F, kAcc, 16><<<grid_for((n + 15) / 16), kThreads, 0, st>>>(buf, s, out, n, B);
    } else {
      dequant_blocks_kernel<F, kAcc, 1><<<grid_for(n), kThreads, 0, st>>>(buf, s, out, n, B);
    }
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(buf);
    if (aligned16(out) && aligned16(buf)) {
      uncast_kernel<F, kAcc, 8><<<grid_for((n + 7) / 8), kThreads, 0, st>>>(p, out, n);
    } else {
      uncast_kernel<F, kAcc, 1><<<grid_for(n), kThreads, 0, st>>>(p, out, n);
    }
  }
  FLCOMM_CUDA_CHECK(cudaGetLastError());
}

template <bool kEF>
void quant_dispatch(Fmt f, const float* x, float* r, uint8_t* buf, int64_t n, int64_t B, cudaStream_t st) {
  switch (f) {
    case Fmt::kInt8: return launch_quant<Fmt::kInt8, kEF>(x, r, buf, n, B, st);
    case Fmt::kFp8: return launch_quant<Fmt::kFp8, kEF>(x, r, buf, n, B, st);
    case Fmt::kBf16: return launch_quant<Fmt::kBf16, kEF>(x, r, buf, n, B, st);
    case Fmt::kFp16: return launch_quant<Fmt::kFp16, kEF>(x, r, buf, n, B, st);
  }
}

template <bool kAcc>
void dequant_dispatch(Fmt f, const uint8_t* buf, float* out, int64_t n, int64_t B, cudaStream_t st) {
  switch (f) {
    case Fmt::kInt8: return launch_dequant<Fmt::kInt8, kAcc>(buf, out, n, B, st);
    case Fmt::kFp8: return launch_dequant<Fmt::kFp8, kAcc>(buf, out, n, B, st);
    case Fmt::kBf16: return launch_dequant<Fmt::kBf16, kAcc>(buf, out, n, B, st);
    case Fmt::kFp16: return launch_dequant<Fmt::kFp16, kAcc>(buf, out, n, B, st);
  }
}

}  // namespace
}  // namespace quant

namespace cuda {

void quantize(quant::Fmt f, const float* x, float* residual, uint8_t* buf, int64_t n, int64_t block,
              cudaStream_t stream) {
  if (residual != nullptr) {
    quant::quant_dispatch<true>(f, x, residual, buf, n, block, stream);
  } else {
    quant::quant_dispatch<false>(f, x, nullptr, buf, n, block, stream);
  }
}

void dequantize(quant::Fmt f, const uint8_t* buf, float* out, int64_t n, int64_t block, bool accumulate,
                cudaStream_t stream) {
  if (accumulate) {
    quant::dequant_dispatch<true>(f, buf, out, n, block, stream);
  } else {
    quant::dequant_dispatch<false>(f, buf, out, n, block, stream);
  }
}

}  // namespace cuda
}  // namespace flcomm
