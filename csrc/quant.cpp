// CPU quantization kernels (torch operators flcomm::quantize, flcomm::dequantize,
// flcomm::quantize_error_feedback), see quant.h for the formats and the layout.
//
// Parallelism: at::parallel_for over whole blocks (int8/fp8) or element ranges (casts).
// Vector units: AVX2 (+F16C) paths chosen at run time; a portable scalar path otherwise (or with
// FLCOMM_CPU_VEC=0). Both give the same bits as the plain-torch reference in flcomm/kernels.py:
// the same products (x * (qmax/absmax), q * scale), round-half-even, and no fused multiply-add
// (these functions are never compiled for FMA, so nothing gets contracted).
//
// NOTE: AVX2 code lives in functions with __attribute__((target)) instead of a -mavx2 build
// flag, so the extension still loads on CPUs without AVX2 and setup.py needs no per-file flags.
// Non-finite and tiny blocks follow the rule in quant.h, on both paths: the absmax is an integer
// max over the bits of |y|, so the NaN/Inf check costs nothing extra per element.
//
// Speed (int8/fp8): one sweep over memory per block. Pass 1 reads the block (1 KiB at block 256)
// for its absmax; pass 2 re-reads it from L1 and writes the encoding. FLCOMM_CPU_VEC=0 forces the
// scalar path; it is read at every call, so tests can switch paths within one process.
// NOTE: not common.h (torch/extension.h, pybind11): this file needs ATen and the op registry
// only, and compiles several times faster without them.
#include "quant.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define FLCOMM_QUANT_X86 1
#endif

namespace flcomm {
namespace quant {
namespace {

// Elements per parallel task: big enough that the OpenMP fork is amortized.
constexpr int64_t kGrainElems = 1 << 16;

bool cpu_has_avx2() {
  static const bool ok = [] {
#ifdef FLCOMM_QUANT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
  }();
  return ok;
}

// NOTE: getenv at every call (~100 ns against kernels of microseconds at least), so the tests can
// force the scalar path in-process (Python's os.environ writes through to the C environment).
bool use_avx2() {
  if (!cpu_has_avx2()) return false;
  const char* env = std::getenv("FLCOMM_CPU_VEC");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

inline uint8_t fp8_bits(float v) { return c10::Float8_e4m3fn(v).x; }

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

// The per-block constants of the rule in quant.h, from the bits of the absmax.
struct BlockScale {
  float scale;  // stored; absmax / qmax, NaN for a non-finite block
  float inv;    // qmax / (absmax * pre); 0 for a zero or non-finite block
  float pre;    // kTinyPrescale for a tiny block, else 1 (and then unused)
  bool bad;     // a NaN or an Inf in the block
  bool tiny;
};

template <Fmt F>
inline BlockScale block_scale(uint32_t amax_bits) {
  constexpr float qmax = F == Fmt::kInt8 ? kInt8Max : kFp8Max;
  if (amax_bits >= kInfBits) return {from_bits(kNaNBits), 0.f, 1.f, true, false};
  const float amax = from_bits(amax_bits);
  const bool tiny = amax > 0.f && amax < kTinyAbsmax;
  const float pre = tiny ? kTinyPrescale : 1.f;
  return {amax / qmax, amax > 0.f ? qmax / (amax * pre) : 0.f, pre, false, tiny};
}

// One element: the byte, and `d` the decoded value before * scale.
template <Fmt F>
inline uint8_t quant_elem(float y, const BlockScale& bs, float& d) {
  constexpr float qmax = F == Fmt::kInt8 ? kInt8Max : kFp8Max;
  const float yy = bs.tiny ? y * bs.pre : y;
  const float v = std::min(std::max(yy * bs.inv, -qmax), qmax);
  if constexpr (F == Fmt::kInt8) {
    d = std::nearbyint(v);
    return static_cast<uint8_t>(static_cast<int8_t>(d));
  } else {
    const uint8_t b = fp8_bits(v);
    d = fp8_table()[b];
    return b;
  }
}

// Elements [i0, i1) of a block: encode with the block's constants (rule 2: payload 0 when bad).
template <Fmt F, bool kEF>
inline void quant_tail(const float* x, float* r, uint8_t* q, const BlockScale& bs, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float y = kEF ? x[i] + r[i] : x[i];
    float d = 0.f;
    q[i] = bs.bad ? 0 : quant_elem<F>(y, bs, d);
    if constexpr (kEF) r[i] = y - d * bs.scale;
  }
}

// ---------------------------------------------------------------------------------------------
// Scalar kernels. `r` (residual) is only touched when kEF: y = x + r; r = y - D(Q(y)).
// ---------------------------------------------------------------------------------------------
template <Fmt F, bool kEF>
void quant_blocks_scalar(const float* x, float* r, uint8_t* q, float* s, int64_t n, int64_t B,
                         int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * B, hi = std::min(n, lo + B);
    uint32_t amax_bits = 0;
    for (int64_t i = lo; i < hi; ++i) amax_bits = std::max(amax_bits, abs_bits(kEF ? x[i] + r[i] : x[i]));
    const BlockScale bs = block_scale<F>(amax_bits);
    quant_tail<F, kEF>(x, r, q, bs, lo, hi);
    s[b] = bs.scale;
  }
}

template <Fmt F, bool kAcc>
void dequant_blocks_scalar(const uint8_t* q, const float* s, float* out, int64_t n, int64_t B, int64_t b0,
                           int64_t b1) {
  const auto& lut = fp8_table();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * B, hi = std::min(n, lo + B);
    const float scale = s[b];
    for (int64_t i = lo; i < hi; ++i) {
      const float d = (F == Fmt::kInt8 ? static_cast<float>(static_cast<int8_t>(q[i])) : lut[q[i]]) * scale;
      out[i] = kAcc ? out[i] + d : d;
    }
  }
}

template <Fmt F, bool kEF>
void cast_range_scalar(const float* x, float* r, uint16_t* p, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float y = kEF ? x[i] + r[i] : x[i];
    float d;
    if constexpr (F == Fmt::kBf16) {
      const c10::BFloat16 h(y);
      p[i] = h.x;
      d = static_cast<float>(h);
    } else {
      const c10::Half h(y);
      p[i] = h.x;
      d = static_cast<float>(h);
    }
    if constexpr (kEF) r[i] = y - d;
  }
}

template <Fmt F, bool kAcc>
void uncast_range_scalar(const uint16_t* p, float* out, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float d = F == Fmt::kBf16 ? static_cast<float>(c10::BFloat16(p[i], c10::BFloat16::from_bits()))
                                    : static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
    out[i] = kAcc ? out[i] + d : d;
  }
}

#ifdef FLCOMM_QUANT_X86
// ---------------------------------------------------------------------------------------------
// AVX2 kernels (32 elements per step; a block's remainder goes through the scalar code).
// ---------------------------------------------------------------------------------------------
#define FLCOMM_AVX2 __attribute__((target("avx2,f16c")))

// Four vectors of int32 in [0, 255] or [-127, 127] -> 32 bytes in element order.
template <bool kSigned>
FLCOMM_AVX2 inline void store_bytes(uint8_t* dst, __m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = kSigned ? _mm256_packs_epi32(a, b) : _mm256_packus_epi32(a, b);
  const __m256i cd = kSigned ? _mm256_packs_epi32(c, d) : _mm256_packus_epi32(c, d);
  __m256i v = kSigned ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
}

// fp32 (|v| <= 448) -> e4m3fn bits, round to nearest even: c10's fp8_e4m3fn_from_fp32_value,
// lane-parallel (the normal and the denormal path both computed, then blended).
FLCOMM_AVX2 inline __m256i fp8_encode(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(int(0x80000000u)));
  const __m256i a = _mm256_xor_si256(bits, sign);
  const __m256i denorm_mask = _mm256_set1_epi32(141 << 23);
  const __m256i dn = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm_mask))), denorm_mask);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i nm = _mm256_add_epi32(a, _mm256_set1_epi32(int((uint32_t(7 - 127) << 23) + 0x7FFFFu)));
  nm = _mm256_srli_epi32(_mm256_add_epi32(nm, odd), 20);
  const __m256i is_dn = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a);
  const __m256i res = _mm256_blendv_epi8(nm, dn, is_dn);
  return _mm256_and_si256(_mm256_or_si256(res, _mm256_srli_epi32(sign, 24)), _mm256_set1_epi32(0xFF));
}

// 32 elements at x + i (+ r + i): max of the bits of |y| into m.
template <bool kEF>
FLCOMM_AVX2 inline __m256i absmax32(const float* x, const float* r, int64_t i, __m256i m) {
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = m;
  __m256i m1 = _mm256_setzero_si256();
  for (int k = 0; k < 4; k += 2) {
    __m256 y0 = _mm256_loadu_ps(x + i + 8 * k), y1 = _mm256_loadu_ps(x + i + 8 * k + 8);
    if (kEF) {
      y0 = _mm256_add_ps(y0, _mm256_loadu_ps(r + i + 8 * k));
      y1 = _mm256_add_ps(y1, _mm256_loadu_ps(r + i + 8 * k + 8));
    }
    // NOTE: |y| as int32 orders like the float for finite values, and Inf and NaN bits are
    // larger than every finite one (NaN's the largest): rule 1 of quant.h in one max.
    m0 = _mm256_max_epi32(m0, _mm256_and_si256(_mm256_castps_si256(y0), absmask));
    m1 = _mm256_max_epi32(m1, _mm256_and_si256(_mm256_castps_si256(y1), absmask));
  }
  return _mm256_max_epi32(m0, m1);
}

FLCOMM_AVX2 inline uint32_t hmax_u32(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

template <Fmt F, bool kEF>
FLCOMM_AVX2 void quant_blocks_avx2(const float* x, float* r, uint8_t* q, float* s, int64_t n, int64_t B,
                                   int64_t b0, int64_t b1) {
  constexpr float qmax = F == Fmt::kInt8 ? kInt8Max : kFp8Max;
  const float* lut = fp8_table().data();
  const __m256 vlo = _mm256_set1_ps(-qmax), vhi = _mm256_set1_ps(qmax);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * B, hi = std::min(n, lo + B);
    const int64_t vend = lo + (hi - lo) / 32 * 32;
    // pass 1: the absmax (rule 1), reading the block from memory
    __m256i m = _mm256_setzero_si256();
    for (int64_t i = lo; i < vend; i += 32) m = absmax32<kEF>(x, r, i, m);
    uint32_t amax_bits = hmax_u32(m);
    for (int64_t i = vend; i < hi; ++i) amax_bits = std::max(amax_bits, abs_bits(kEF ? x[i] + r[i] : x[i]));
    const BlockScale bs = block_scale<F>(amax_bits);
    s[b] = bs.scale;
    if (bs.bad) {  // rule 2 (rare): the scalar code
      quant_tail<F, kEF>(x, r, q, bs, lo, hi);
      continue;
    }
    // pass 2: encode from L1
    const __m256 vinv = _mm256_set1_ps(bs.inv), vscale = _mm256_set1_ps(bs.scale), vpre = _mm256_set1_ps(bs.pre);
    int64_t i = lo;
    for (; i < vend; i += 32) {
      __m256i qi[4];
      for (int k = 0; k < 4; ++k) {
        __m256 y = _mm256_loadu_ps(x + i + 8 * k);
        if (kEF) y = _mm256_add_ps(y, _mm256_loadu_ps(r + i + 8 * k));
        const __m256 yy = bs.tiny ? _mm256_mul_ps(y, vpre) : y;
        const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(yy, vinv), vlo), vhi);
        __m256 d;
        if constexpr (F == Fmt::kInt8) {
          d = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          qi[k] = _mm256_cvtps_epi32(d);  // exact: d is integral
        } else {
          qi[k] = fp8_encode(v);
          if (kEF) d = _mm256_i32gather_ps(lut, qi[k], 4);
        }
        if (kEF) _mm256_storeu_ps(r + i + 8 * k, _mm256_sub_ps(y, _mm256_mul_ps(d, vscale)));
      }
      store_bytes<F == Fmt::kInt8>(q + i, qi[0], qi[1], qi[2], qi[3]);
    }
    quant_tail<F, kEF>(x, r, q, bs, i, hi);
  }
}

template <Fmt F, bool kAcc>
FLCOMM_AVX2 void dequant_blocks_avx2(const uint8_t* q, const float* s, float* out, int64_t n, int64_t B,
                                     int64_t b0, int64_t b1) {
  const float* lut = fp8_table().data();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * B, hi = std::min(n, lo + B);
    const float scale = s[b];
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      __m256 d;
      if constexpr (F == Fmt::kInt8) {
        d = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
      } else {
        d = _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(b8), 4);
      }
      d = _mm256_mul_ps(d, vs);
      if (kAcc) d = _mm256_add_ps(_mm256_loadu_ps(out + i), d);
      _mm256_storeu_ps(out + i, d);
    }
    for (; i < hi; ++i) {
      const float d = (F == Fmt::kInt8 ? static_cast<float>(static_cast<int8_t>(q[i])) : lut[q[i]]) * scale;
      out[i] = kAcc ? out[i] + d : d;
    }
  }
}

template <Fmt F>
FLCOMM_AVX2 inline __m128i cast8(__m256 y) {
  if constexpr (F == Fmt::kFp16) {
    return _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    // round to nearest even on the bits; NaN -> 0x7fc0 (as c10::BFloat16)
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    t = _mm256_blendv_epi8(t, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i p = _mm256_packus_epi32(t, t);  // lanes: t0-3 t0-3 | t4-7 t4-7
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
  }
}

template <Fmt F>
FLCOMM_AVX2 inline __m256 uncast8(__m128i h) {
  if constexpr (F == Fmt::kFp16) {
    return _mm256_cvtph_ps(h);
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <Fmt F, bool kEF>
FLCOMM_AVX2 void cast_range_avx2(const float* x, float* r, uint16_t* p, int64_t i0, int64_t i1) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 y = _mm256_loadu_ps(x + i);
    if (kEF) y = _mm256_add_ps(y, _mm256_loadu_ps(r + i));
    const __m128i h = cast8<F>(y);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i), h);
    if (kEF) _mm256_storeu_ps(r + i, _mm256_sub_ps(y, uncast8<F>(h)));
  }
  cast_range_scalar<F, kEF>(x, r, p, i, i1);
}

template <Fmt F, bool kAcc>
FLCOMM_AVX2 void uncast_range_avx2(const uint16_t* p, float* out, int64_t i0, int64_t i1) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    __m256 d = uncast8<F>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    if (kAcc) d = _mm256_add_ps(_mm256_loadu_ps(out + i), d);
    _mm256_storeu_ps(out + i, d);
  }
  uncast_range_scalar<F, kAcc>(p, out, i, i1);
}
#endif  // FLCOMM_QUANT_X86

// ---------------------------------------------------------------------------------------------
// Dispatch: format x (error feedback | accumulate) x (AVX2 | scalar), parallel over the CPU.
// ---------------------------------------------------------------------------------------------
template <Fmt F, bool kEF>
void run_quant(const float* x, float* r, uint8_t* buf, int64_t n, int64_t B) {
  const int64_t pay = payload_nbytes(n, F);
  if constexpr (F == Fmt::kInt8 || F == Fmt::kFp8) {
    const int64_t nb = num_blocks(n, B);
    float* s = reinterpret_cast<float*>(buf + pay);
    std::memset(buf + n, 0, pay - n);
    std::memset(reinterpret_cast<uint8_t*>(s + nb), 0, align16(4 * nb) - 4 * nb);
    auto fn = quant_blocks_scalar<F, kEF>;
#ifdef FLCOMM_QUANT_X86
    if (use_avx2()) fn = quant_blocks_avx2<F, kEF>;
#endif
    at::parallel_for(0, nb, std::max<int64_t>(1, kGrainElems / B),
                     [&](int64_t b0, int64_t b1) { fn(x, r, buf, s, n, B, b0, b1); });
  } else {
    std::memset(buf + 2 * n, 0, pay - 2 * n);
    uint16_t* p = reinterpret_cast<uint16_t*>(buf);
    auto fn = cast_range_scalar<F, kEF>;
#ifdef FLCOMM_QUANT_X86
    if (use_avx2()) fn = cast_range_avx2<F, kEF>;
#endif
    at::parallel_for(0, n, kGrainElems, [&](int64_t i0, int64_t i1) { fn(x, r, p, i0, i1); });
  }
}

template <Fmt F, bool kAcc>
void run_dequant(const uint8_t* buf, float* out, int64_t n, int64_t B) {
  if constexpr (F == Fmt::kInt8 || F == Fmt::kFp8) {
    const float* s = reinterpret_cast<const float*>(buf + payload_nbytes(n, F));
    auto fn = dequant_blocks_scalar<F, kAcc>;
#ifdef FLCOMM_QUANT_X86
    if (use_avx2()) fn = dequant_blocks_avx2<F, kAcc>;
#endif
    at::parallel_for(0, num_blocks(n, B), std::max<int64_t>(1, kGrainElems / B),
                     [&](int64_t b0, int64_t b1) { fn(buf, s, out, n, B, b0, b1); });
  } else {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(buf);
    auto fn = uncast_range_scalar<F, kAcc>;
#ifdef FLCOMM_QUANT_X86
    if (use_avx2()) fn = uncast_range_avx2<F, kAcc>;
#endif
    at::parallel_for(0, n, kGrainElems, [&](int64_t i0, int64_t i1) { fn(p, out, i0, i1); });
  }
}

template <bool kEF>
void quant_dispatch(Fmt f, const float* x, float* r, uint8_t* buf, int64_t n, int64_t B) {
  switch (f) {
    case Fmt::kInt8: return run_quant<Fmt::kInt8, kEF>(x, r, buf, n, B);
    case Fmt::kFp8: return run_quant<Fmt::kFp8, kEF>(x, r, buf, n, B);
    case Fmt::kBf16: return run_quant<Fmt::kBf16, kEF>(x, r, buf, n, B);
    case Fmt::kFp16: return run_quant<Fmt::kFp16, kEF>(x, r, buf, n, B);
  }
}

template <bool kAcc>
void dequant_dispatch(Fmt f, const uint8_t* buf, float* out, int64_t n, int64_t B) {
  switch (f) {
    case Fmt::kInt8: return run_dequant<Fmt::kInt8, kAcc>(buf, out, n, B);
    case Fmt::kFp8: return run_dequant<Fmt::kFp8, kAcc>(buf, out, n, B);
    case Fmt::kBf16: return run_dequant<Fmt::kBf16, kAcc>(buf, out, n, B);
    case Fmt::kFp16: return run_dequant<Fmt::kFp16, kAcc>(buf, out, n, B);
  }
}

// ---- the operators ----
void quantize_cpu(const at::Tensor& x, at::Tensor& out, c10::string_view fmt, int64_t block_size) {
  const Fmt f = check_args(x, "x", out, fmt, block_size);
  if (x.numel() == 0 && out.numel() == 0) return;
  quant_dispatch<false>(f, x.data_ptr<float>(), nullptr, out.data_ptr<uint8_t>(), x.numel(), block_size);
}

void dequantize_cpu(const at::Tensor& buf, at::Tensor& out, c10::string_view fmt, int64_t block_size,
                    bool accumulate) {
  const Fmt f = check_args(out, "out", buf, fmt, block_size);
  if (out.numel() == 0) return;
  if (accumulate) {
    dequant_dispatch<true>(f, buf.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), block_size);
  } else {
    dequant_dispatch<false>(f, buf.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), block_size);
  }
}

void quantize_error_feedback_cpu(const at::Tensor& x, at::Tensor& residual, at::Tensor& out,
                                 c10::string_view fmt, int64_t block_size) {
  const Fmt f = check_args(x, "x", out, fmt, block_size);
  check_residual(x, residual);
  if (x.numel() == 0) return;
  quant_dispatch<true>(f, x.data_ptr<float>(), residual.data_ptr<float>(), out.data_ptr<uint8_t>(), x.numel(),
                       block_size);
}

}  // namespace
}  // namespace quant
}  // namespace flcomm

TORCH_LIBRARY_IMPL(flcomm, CPU, m) {
  m.impl("quantize", &flcomm::quant::quantize_cpu);
  m.impl("dequantize", &flcomm::quant::dequantize_cpu);
  m.impl("quantize_error_feedback", &flcomm::quant::quantize_error_feedback_cpu);
}
