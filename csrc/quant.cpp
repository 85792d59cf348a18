// The quantization operators flcomm::quantize, flcomm::dequantize and
// flcomm::quantize_error_feedback (see quant.h for the formats and the layout): the CPU kernels,
// and, with FLCOMM_WITH_CUDA, the CUDA implementations, which check the same arguments and launch
// quant_cuda.cu's kernels (cuda_kernels.h) on torch's current stream under a device guard.
//
// Parallelism: at::parallel_for over whole blocks (int8/fp8) or element ranges (casts).
// Vector units: AVX-512 (F+BW; int8/fp8) and AVX2 (+F16C) paths chosen at run time; a portable
// scalar path otherwise. FLCOMM_CPU_VEC caps the choice ("0": scalar, "avx2"); it is read at
// every call, so tests can switch paths within one process. Every path gives the same bits as
// the plain-torch reference in flcomm/kernels.py: the same products (x * (qmax/absmax),
// q * scale), round-half-even, and no fused multiply-add (setup.py builds with
// -ffp-contract=off: the AVX-512 functions have FMA enabled, and GCC would contract a * b + c).
//
// NOTE: vector code lives in functions with __attribute__((target)) instead of -mavx2 /
// -mavx512f build flags, so the extension still loads on any x86-64 CPU.
// Non-finite and tiny blocks follow the rule in quant.h, on every path: the absmax is an integer
// max over the bits of |y|, so the NaN/Inf check costs nothing extra per element.
//
// Speed (int8/fp8): one sweep over memory. Blocks go in groups of at least 256 elements (one
// block when B >= 256): pass 1 reads a group for the blocks' absmaxes and prefetches 8 KiB ahead,
// pass 2 encodes it from L1. A sweep larger than a last-level cache writes its output with
// streaming stores (the quantized payload, dequantize's fp32).
// NOTE: ATen's tensor and the op registry only (no torch/extension.h): it compiles several times
// faster without the C++ frontend and pybind11.
#include "quant_checks.h"

#include <ATen/Parallel.h>
#ifdef FLCOMM_WITH_CUDA
#include "cuda_kernels.h"
// NOTE: not ATen/cuda/CUDAContext.h: it pulls in cusparse.h, which this toolkit lacks.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
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
// Elements per group of blocks of the vector quantizers (1 KiB of fp32 at least: in L1 between
// the two passes), the most blocks in one group, and how far ahead pass 1 prefetches (8 KiB: the
// hardware prefetcher alone leaves a core's reads latency-bound; measured on a 2-core Xeon VM,
// 64 MiB of int8 quantize took 12% less time with it and streaming stores than with the previous
// layout of 4 KiB groups prefetched from pass 2).
// NOTE: a group of small blocks, not one block, per pass: the divisions of the block constants
// then overlap (independent), and pass 1 streams with no dependency on the previous block.
constexpr int64_t kGroupElems = 256;
constexpr int64_t kMaxGroup = 64;
constexpr int64_t kPrefetchElems = 2048;
// fp32 bytes swept from which the output is written with streaming stores: dequantize's fp32
// output (not accumulate's), quantize's payload when its fp32 input is this large.
// NOTE: a sweep this large does not leave its output in a last-level cache of 32 MiB anyway, and
// plain stores first read every line they write (read for ownership): 4 bytes read per fp32
// written, which makes dequantize move 1.8x the bytes of a copy, and quantize 1.2x its own.
// Below it, plain stores, which leave the output in cache for its next reader.
constexpr int64_t kStreamBytes = int64_t{32} << 20;

// Vector paths, in order: each level's CPU features include the ones below it.
enum class Vec : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Vec cpu_vec() {
  static const Vec v = [] {
#ifdef FLCOMM_QUANT_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return Vec::kScalar;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? Vec::kAvx512 : Vec::kAvx2;
#else
    return Vec::kScalar;
#endif
  }();
  return v;
}

// The path of this call: the CPU's best, capped by FLCOMM_CPU_VEC ("0": scalar, "avx2": at most
// AVX2; unset or anything else: the best).
// NOTE: getenv at every call (~100 ns against kernels of microseconds at least), so the tests can
// force each path in-process (Python's os.environ writes through to the C environment).
Vec use_vec() {
  const char* env = std::getenv("FLCOMM_CPU_VEC");
  Vec cap = Vec::kAvx512;
  if (env != nullptr && std::strcmp(env, "0") == 0) cap = Vec::kScalar;
  if (env != nullptr && std::strcmp(env, "avx2") == 0) cap = Vec::kAvx2;
  return std::min(cpu_vec(), cap);
}

bool use_avx2() { return use_vec() >= Vec::kAvx2; }

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
// kNT: a streaming store (dst 32-byte aligned).
template <bool kSigned, bool kNT>
FLCOMM_AVX2 inline void store_bytes(uint8_t* dst, __m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = kSigned ? _mm256_packs_epi32(a, b) : _mm256_packus_epi32(a, b);
  const __m256i cd = kSigned ? _mm256_packs_epi32(c, d) : _mm256_packus_epi32(c, d);
  __m256i v = kSigned ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (kNT) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  }
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

// e4m3fn bits (int32 lanes in [0, 255]) -> fp32, the values of fp8_table() (c10's conversion)
// computed instead of gathered: normal: the exponent rebiased (+120) and the mantissa moved up;
// subnormal (exponent 0): m * 2^-9 (exact); 0x7f / 0xff: NaN 0x7ff00000 as c10 gives it.
// tests/test_kernels.py checks all 256 bytes against the table.
FLCOMM_AVX2 inline __m256 fp8_decode(__m256i b) {
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256i nm = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256i dn = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f)));
  __m256i v = _mm256_blendv_epi8(nm, dn, _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7ff00000), _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
  return _mm256_castsi256_ps(_mm256_or_si256(v, sign));
}

template <bool kEF>
FLCOMM_AVX2 inline __m256 load_y(const float* x, const float* r, int64_t i) {
  const __m256 y = _mm256_loadu_ps(x + i);
  return kEF ? _mm256_add_ps(y, _mm256_loadu_ps(r + i)) : y;
}

FLCOMM_AVX2 inline uint32_t hmax_u32(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// NOTE: addresses as integers: past the end of the tensor they are no pointers (a prefetch of
// any address is harmless).
inline void prefetch_at(const float* p, int64_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + 4 * uintptr_t(i)), _MM_HINT_T0);
}

// Software prefetch of the 32 elements (two lines of x, and of r) kPrefetchElems ahead of i.
template <bool kEF>
inline void prefetch_ahead(const float* x, const float* r, int64_t i) {
  prefetch_at(x, i + kPrefetchElems);
  prefetch_at(x, i + kPrefetchElems + 16);
  if (kEF) {
    prefetch_at(r, i + kPrefetchElems);
    prefetch_at(r, i + kPrefetchElems + 16);
  }
}

// Rule 1 of quant.h for elements [lo, hi): the max of the bits of |y|. Pass 1, the first touch of
// the elements: it prefetches.
// NOTE: |y| as int32 orders like the float for finite values, and Inf and NaN bits are larger
// than every finite one (NaN's the largest): the NaN/Inf check is part of the one max.
template <bool kEF>
FLCOMM_AVX2 inline uint32_t absmax_bits_avx2(const float* x, const float* r, int64_t lo, int64_t hi) {
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  __m256i m[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    prefetch_ahead<kEF>(x, r, i);
    for (int k = 0; k < 4; ++k) {
      m[k] = _mm256_max_epi32(m[k], _mm256_and_si256(_mm256_castps_si256(load_y<kEF>(x, r, i + 8 * k)), absmask));
    }
  }
  uint32_t amax = hmax_u32(_mm256_max_epi32(_mm256_max_epi32(m[0], m[1]), _mm256_max_epi32(m[2], m[3])));
  for (; i < hi; ++i) amax = std::max(amax, abs_bits(kEF ? x[i] + r[i] : x[i]));
  return amax;
}

// Encodes elements [lo, hi) of one finite block (not rule 2) with its constants; kNT: the payload
// with streaming stores (q + lo 32-byte aligned).
template <Fmt F, bool kEF, bool kTiny, bool kNT = false>
FLCOMM_AVX2 void encode_block_avx2(const float* x, float* r, uint8_t* q, const BlockScale& bs, int64_t lo,
                                   int64_t hi) {
  constexpr float qmax = F == Fmt::kInt8 ? kInt8Max : kFp8Max;
  const __m256 vlo = _mm256_set1_ps(-qmax), vhi = _mm256_set1_ps(qmax);
  const __m256 vinv = _mm256_set1_ps(bs.inv), vscale = _mm256_set1_ps(bs.scale), vpre = _mm256_set1_ps(bs.pre);
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    __m256i qi[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 y = load_y<kEF>(x, r, i + 8 * k);
      const __m256 v = _mm256_mul_ps(kTiny ? _mm256_mul_ps(y, vpre) : y, vinv);
      __m256 d;
      if constexpr (F == Fmt::kInt8) {
        // NOTE: no clamp to [-127, 127] (the scalar code's and the reference's is a no-op):
        // |y| <= absmax, so |v| <= 127 (1 + 2^-24)^2 < 127.5, and rint(v) is in [-127, 127].
        d = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[k] = _mm256_cvtps_epi32(d);  // exact: d is integral
      } else {
        qi[k] = fp8_encode(_mm256_min_ps(_mm256_max_ps(v, vlo), vhi));
        if (kEF) d = fp8_decode(qi[k]);
      }
      if (kEF) _mm256_storeu_ps(r + i + 8 * k, _mm256_sub_ps(y, _mm256_mul_ps(d, vscale)));
    }
    store_bytes<F == Fmt::kInt8, kNT>(q + i, qi[0], qi[1], qi[2], qi[3]);
  }
  quant_tail<F, kEF>(x, r, q, bs, i, hi);
}

// Blocks [b0, b1) in groups of about kGroupElems elements: pass 1 reads a group from memory for
// its blocks' absmaxes, pass 2 encodes it from L1. kNT: streaming stores of the payload (q
// 32-byte aligned, B a multiple of 32); the caller fences.
template <Fmt F, bool kEF, bool kNT = false>
FLCOMM_AVX2 void quant_blocks_avx2(const float* x, float* r, uint8_t* q, float* s, int64_t n, int64_t B,
                                   int64_t b0, int64_t b1) {
  const int64_t G = std::clamp<int64_t>(kGroupElems / B, 1, kMaxGroup);
  BlockScale bs[kMaxGroup];
  for (int64_t g0 = b0; g0 < b1; g0 += G) {
    const int64_t g1 = std::min(b1, g0 + G);
    for (int64_t b = g0; b < g1; ++b) {
      bs[b - g0] = block_scale<F>(absmax_bits_avx2<kEF>(x, r, b * B, std::min(n, b * B + B)));
    }
    for (int64_t b = g0; b < g1; ++b) {
      const BlockScale& c = bs[b - g0];
      const int64_t lo = b * B, hi = std::min(n, lo + B);
      s[b] = c.scale;
      if (c.bad) {  // rule 2 (rare): the scalar code
        quant_tail<F, kEF>(x, r, q, c, lo, hi);
      } else if (c.tiny) {
        encode_block_avx2<F, kEF, true, kNT>(x, r, q, c, lo, hi);
      } else {
        encode_block_avx2<F, kEF, false, kNT>(x, r, q, c, lo, hi);
      }
    }
  }
}

template <Fmt F, bool kAcc, bool kNT = false>
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
        d = fp8_decode(_mm256_cvtepu8_epi32(b8));
      }
      d = _mm256_mul_ps(d, vs);
      if (kAcc) d = _mm256_add_ps(_mm256_loadu_ps(out + i), d);
      if (kNT) {
        _mm256_stream_ps(out + i, d);
      } else {
        _mm256_storeu_ps(out + i, d);
      }
    }
    for (; i < hi; ++i) {
      const float d = (F == Fmt::kInt8 ? static_cast<float>(static_cast<int8_t>(q[i])) : lut[q[i]]) * scale;
      out[i] = kAcc ? out[i] + d : d;
    }
  }
  if (kNT) _mm_sfence();
}

template <Fmt F>
FLCOMM_AVX2 inline __m128i cast8(__m256 y) {
  if constexpr (F == Fmt::kFp16) {
    return _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    // round to nearest even on the bits; NaN -> kBf16NaNBits (as c10::BFloat16)
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i t = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    t = _mm256_blendv_epi8(t, _mm256_set1_epi32(kBf16NaNBits), nan);
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

// ---------------------------------------------------------------------------------------------
// AVX-512 kernels (int8/fp8 only; 64 elements per quantize step, 16 per dequantize step): the
// AVX2 steps above with twice the lanes, the remainder of a block through the AVX2 code.
// NOTE: the same operations in the same order as the AVX2 and scalar code (mul, round to
// nearest even, compare, no FMA), so the same bits; only the width differs.
// ---------------------------------------------------------------------------------------------
#define FLCOMM_AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw")))
// NOTE: GCC 12 warns of an uninitialized variable inside its own AVX-512 intrinsics (the
// _mm512_undefined_* pass-through operand; GCC bug 105593): silenced for this section only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

template <bool kEF>
FLCOMM_AVX512 inline __m512 load_y16(const float* x, const float* r, int64_t i) {
  const __m512 y = _mm512_loadu_ps(x + i);
  return kEF ? _mm512_add_ps(y, _mm512_loadu_ps(r + i)) : y;
}

// Four vectors of int32 in [0, 255] or [-127, 127] -> 64 bytes in element order; kNT: a
// streaming store (dst 64-byte aligned).
template <bool kSigned, bool kNT>
FLCOMM_AVX512 inline void store_bytes64(uint8_t* dst, __m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = kSigned ? _mm512_packs_epi32(a, b) : _mm512_packus_epi32(a, b);
  const __m512i cd = kSigned ? _mm512_packs_epi32(c, d) : _mm512_packus_epi32(c, d);
  const __m512i v = kSigned ? _mm512_packs_epi16(ab, cd) : _mm512_packus_epi16(ab, cd);
  // per 128-bit lane k: dwords a_k b_k c_k d_k; element order wants a_0..a_3 b_0..b_3 ...
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  if (kNT) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_permutexvar_epi32(order, v));
  } else {
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi32(order, v));
  }
}

// fp8_encode, 16 lanes.
FLCOMM_AVX512 inline __m512i fp8_encode16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u)));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __m512i denorm_mask = _mm512_set1_epi32(141 << 23);
  const __m512i dn = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm_mask))), denorm_mask);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i nm = _mm512_add_epi32(a, _mm512_set1_epi32(int((uint32_t(7 - 127) << 23) + 0x7FFFFu)));
  nm = _mm512_srli_epi32(_mm512_add_epi32(nm, odd), 20);
  const __mmask16 is_dn = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(121 << 23), a);
  const __m512i res = _mm512_mask_blend_epi32(is_dn, nm, dn);
  return _mm512_and_si512(_mm512_or_si512(res, _mm512_srli_epi32(sign, 24)), _mm512_set1_epi32(0xFF));
}

// fp8_decode, 16 lanes.
FLCOMM_AVX512 inline __m512 fp8_decode16(__m512i b) {
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512i nm = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512i dn = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f)));
  __m512i v = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32(8), mag), nm, dn);
  v = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), v,
                              _mm512_set1_epi32(0x7ff00000));
  return _mm512_castsi512_ps(_mm512_or_si512(v, sign));
}

template <bool kEF>
FLCOMM_AVX512 inline uint32_t absmax_bits_avx512(const float* x, const float* r, int64_t lo, int64_t hi) {
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  __m512i m[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  int64_t i = lo;
  for (; i + 64 <= hi; i += 64) {
    prefetch_ahead<kEF>(x, r, i);
    prefetch_ahead<kEF>(x, r, i + 32);
    for (int k = 0; k < 4; ++k) {
      m[k] = _mm512_max_epu32(m[k], _mm512_and_si512(_mm512_castps_si512(load_y16<kEF>(x, r, i + 16 * k)), absmask));
    }
  }
  const uint32_t amax = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(m[0], m[1]), _mm512_max_epu32(m[2], m[3])));
  return i < hi ? std::max(amax, absmax_bits_avx2<kEF>(x, r, i, hi)) : amax;
}

template <Fmt F, bool kEF, bool kTiny, bool kNT>
FLCOMM_AVX512 void encode_block_avx512(const float* x, float* r, uint8_t* q, const BlockScale& bs, int64_t lo,
                                       int64_t hi) {
  constexpr float qmax = F == Fmt::kInt8 ? kInt8Max : kFp8Max;
  const __m512 vlo = _mm512_set1_ps(-qmax), vhi = _mm512_set1_ps(qmax);
  const __m512 vinv = _mm512_set1_ps(bs.inv), vscale = _mm512_set1_ps(bs.scale), vpre = _mm512_set1_ps(bs.pre);
  int64_t i = lo;
  for (; i + 64 <= hi; i += 64) {
    __m512i qi[4];
    for (int k = 0; k < 4; ++k) {
      const __m512 y = load_y16<kEF>(x, r, i + 16 * k);
      const __m512 v = _mm512_mul_ps(kTiny ? _mm512_mul_ps(y, vpre) : y, vinv);
      __m512 d;
      if constexpr (F == Fmt::kInt8) {  // NOTE: no clamp, as in encode_block_avx2
        // rint in the conversion itself (embedded rounding), and the integral value back from it
        qi[k] = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (kEF) d = _mm512_cvtepi32_ps(qi[k]);  // exact: |qi| <= 127
      } else {
        qi[k] = fp8_encode16(_mm512_min_ps(_mm512_max_ps(v, vlo), vhi));
        if (kEF) d = fp8_decode16(qi[k]);
      }
      if (kEF) _mm512_storeu_ps(r + i + 16 * k, _mm512_sub_ps(y, _mm512_mul_ps(d, vscale)));
    }
    store_bytes64<F == Fmt::kInt8, kNT>(q + i, qi[0], qi[1], qi[2], qi[3]);
  }
  if (i < hi) encode_block_avx2<F, kEF, kTiny>(x, r, q, bs, i, hi);  // NOTE: plain stores: a partial block
}

template <Fmt F, bool kEF, bool kNT = false>
FLCOMM_AVX512 void quant_blocks_avx512(const float* x, float* r, uint8_t* q, float* s, int64_t n, int64_t B,
                                       int64_t b0, int64_t b1) {
  const int64_t G = std::clamp<int64_t>(kGroupElems / B, 1, kMaxGroup);
  BlockScale bs[kMaxGroup];
  for (int64_t g0 = b0; g0 < b1; g0 += G) {
    const int64_t g1 = std::min(b1, g0 + G);
    for (int64_t b = g0; b < g1; ++b) {
      bs[b - g0] = block_scale<F>(absmax_bits_avx512<kEF>(x, r, b * B, std::min(n, b * B + B)));
    }
    for (int64_t b = g0; b < g1; ++b) {
      const BlockScale& c = bs[b - g0];
      const int64_t lo = b * B, hi = std::min(n, lo + B);
      s[b] = c.scale;
      if (c.bad) {
        quant_tail<F, kEF>(x, r, q, c, lo, hi);
      } else if (c.tiny) {
        encode_block_avx512<F, kEF, true, kNT>(x, r, q, c, lo, hi);
      } else {
        encode_block_avx512<F, kEF, false, kNT>(x, r, q, c, lo, hi);
      }
    }
  }
}

template <Fmt F, bool kAcc, bool kNT = false>
FLCOMM_AVX512 void dequant_blocks_avx512(const uint8_t* q, const float* s, float* out, int64_t n, int64_t B,
                                         int64_t b0, int64_t b1) {
  const float* lut = fp8_table().data();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * B, hi = std::min(n, lo + B);
    const float scale = s[b];
    const __m512 vs = _mm512_set1_ps(scale);
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
      const __m128i b16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
      __m512 d = F == Fmt::kInt8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b16)) : fp8_decode16(_mm512_cvtepu8_epi32(b16));
      d = _mm512_mul_ps(d, vs);
      if (kAcc) d = _mm512_add_ps(_mm512_loadu_ps(out + i), d);
      if (kNT) {
        _mm512_stream_ps(out + i, d);
      } else {
        _mm512_storeu_ps(out + i, d);
      }
    }
    for (; i < hi; ++i) {
      const float d = (F == Fmt::kInt8 ? static_cast<float>(static_cast<int8_t>(q[i])) : lut[q[i]]) * scale;
      out[i] = kAcc ? out[i] + d : d;
    }
  }
  if (kNT) _mm_sfence();
}
#pragma GCC diagnostic pop
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
    [[maybe_unused]] bool fence = false;
#ifdef FLCOMM_QUANT_X86
    const Vec v = use_vec();
    if (v == Vec::kAvx2) fn = quant_blocks_avx2<F, kEF>;
    if (v == Vec::kAvx512) fn = quant_blocks_avx512<F, kEF>;
    // streaming stores need every vector of the payload aligned: buf, and every block's start
    const int64_t vbytes = v == Vec::kAvx512 ? 64 : 32;
    if (v != Vec::kScalar && 4 * n >= kStreamBytes && B % vbytes == 0 &&
        reinterpret_cast<uintptr_t>(buf) % vbytes == 0) {
      fn = v == Vec::kAvx512 ? quant_blocks_avx512<F, kEF, true> : quant_blocks_avx2<F, kEF, true>;
      fence = true;
    }
#endif
    at::parallel_for(0, nb, std::max<int64_t>(1, kGrainElems / B), [&](int64_t b0, int64_t b1) {
      fn(x, r, buf, s, n, B, b0, b1);
#ifdef FLCOMM_QUANT_X86
      if (fence) _mm_sfence();  // NOTE: streaming stores are weakly ordered: fence on the thread that made them
#endif
    });
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
    const Vec v = use_vec();
    if (v == Vec::kAvx2) fn = dequant_blocks_avx2<F, kAcc>;
    if (v == Vec::kAvx512) fn = dequant_blocks_avx512<F, kAcc>;
    // streaming stores need 64-byte aligned vectors: out aligned, and every block starts so
    if (!kAcc && 4 * n >= kStreamBytes && B % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
      if (v == Vec::kAvx2) fn = dequant_blocks_avx2<F, kAcc, true>;
      if (v == Vec::kAvx512) fn = dequant_blocks_avx512<F, kAcc, true>;
    }
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

#ifdef FLCOMM_WITH_CUDA
namespace flcomm {
namespace quant {
namespace {

void quantize_cuda(const at::Tensor& x, at::Tensor& out, c10::string_view fmt, int64_t block_size) {
  const Fmt f = check_args(x, "x", out, fmt, block_size);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::quantize(f, x.data_ptr<float>(), nullptr, out.data_ptr<uint8_t>(), x.numel(), block_size,
                 c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

void dequantize_cuda(const at::Tensor& buf, at::Tensor& out, c10::string_view fmt, int64_t block_size,
                     bool accumulate) {
  const Fmt f = check_args(out, "out", buf, fmt, block_size);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  cuda::dequantize(f, buf.data_ptr<uint8_t>(), out.data_ptr<float>(), out.numel(), block_size, accumulate,
                   c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
}

void quantize_error_feedback_cuda(const at::Tensor& x, at::Tensor& residual, at::Tensor& out,
                                  c10::string_view fmt, int64_t block_size) {
  const Fmt f = check_args(x, "x", out, fmt, block_size);
  check_residual(x, residual);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cuda::quantize(f, x.data_ptr<float>(), residual.data_ptr<float>(), out.data_ptr<uint8_t>(), x.numel(),
                 block_size, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

}  // namespace
}  // namespace quant
}  // namespace flcomm

TORCH_LIBRARY_IMPL(flcomm, CUDA, m) {
  m.impl("quantize", &flcomm::quant::quantize_cuda);
  m.impl("dequantize", &flcomm::quant::dequantize_cuda);
  m.impl("quantize_error_feedback", &flcomm::quant::quantize_error_feedback_cuda);
}
#endif  // FLCOMM_WITH_CUDA
