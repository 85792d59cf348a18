// CUDA kernels of the sparse top-k format behind the torch operators flcomm::topk_encode and
// flcomm::topk_decode (sparse.cpp checks the tensors and calls the launchers at the end of this
// file on torch's current stream); sparse.h holds the layout and the rule, and flcomm/sparse.py
// the plain-torch reference whose bits these kernels give.
//
// Encoding: one CTA per block of the format (grid-stride over the blocks), 64 to 512 threads.
//   0. y = x + residual, copied into shared memory when the block fits there (with the code
//      staging, under 44 KiB: blocks up to about 11K elements), else re-read from global memory
//      and recomputed, identically, in every pass below.
//   1. Radix select on the keys (|y| as uint32), 8 bits per pass from the top, with one shared
//      256-bin histogram of the keys that match the digits chosen so far: it yields a prefix
//      (the high bits of the cnt-th largest key T) and `need`, how many keys matching it are kept
//      (the lowest-index ones; every key above the prefix is kept). It stops as soon as every
//      key of the chosen bin is kept: no pass at all when the whole block is kept.
//   2. Each warp counts, over its own contiguous segment of the block, the keys above the prefix
//      and those matching it, with their min and max (lo and hi); the warps' counts give each
//      warp its first slot.
//   3. Each warp walks its segment again in index order; ballots and popc give every kept
//      element its slot. The index goes straight to global memory; the code is OR-ed into a
//      shared copy of the block's code bytes (2 and 4 bits; 8 bits stores the byte), copied out
//      at the end; with error feedback the residual is written. Slots from cnt on get index 0 and
//      code 0, and CTA 0 zeroes the padding of the three regions, so every byte is written.
// Decoding: one CTA per block: zero the block (unless accumulating), a barrier, then a thread per
// slot writes (adds) its value.
//
// Every float operation is an explicitly rounded intrinsic (__fdiv_rn, __fmul_rn, __fadd_rn,
// __fsub_rn, rintf), so FMA contraction cannot change a result, and setup.py builds without
// flush-to-zero (tests/system/test_ptx_ftz.py checks the PTX). The operations that can meet a NaN
// (y = x + residual, y - decoded, the step, the decoded value, the accumulation) give the NaN of
// torch's CPU kernels (the reference) rather than CUDA's canonical 0x7fffffff: the NaN operand
// made quiet, the second one when both are (torch's a + b and a - b are a fused b * +-1 + a), and
// x86's default NaN for an invalid operation (Inf - Inf, 0 * Inf). Residuals and decoded values
// are then the reference's bits, NaN included.
//
// NOTE: no ATen / torch headers (they cost nvcc minutes).
#include "common.h"
#include "cuda_kernels.h"
#include "sparse.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace flcomm {
namespace sparse {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int kDecodeThreads = 256;
constexpr int64_t kMaxGrid = 65535LL * 16;
// NOTE: the encode kernel's dynamic shared memory (code staging, then y) stays, with its ~1.3 KiB
// of static arrays, under the 48 KiB a launch gets without opting in. The staging alone is at
// most 32 KiB (k = 65536 at 4 bits), so every k fits.
constexpr int64_t kDynSmemBytes = 44 * 1024;
constexpr uint32_t kQuietBit = 0x00400000u;
constexpr uint32_t kX86DefaultNaN = 0xffc00000u;
constexpr uint32_t kNoBin = 256;

__device__ __forceinline__ uint32_t abs_bits(float y) { return __float_as_uint(y) & 0x7fffffffu; }

// The NaN torch's CPU kernels give when `a op b` is NaN: `first` if it is a NaN, else `second`,
// made quiet; x86's default NaN when neither is (an invalid operation).
__device__ __forceinline__ float cpu_nan(float first, float second) {
  if (isnan(first)) return __uint_as_float(__float_as_uint(first) | kQuietBit);
  if (isnan(second)) return __uint_as_float(__float_as_uint(second) | kQuietBit);
  return __uint_as_float(kX86DefaultNaN);
}

__device__ __forceinline__ float add_cpu(float a, float b) {
  const float s = __fadd_rn(a, b);
  return isnan(s) ? cpu_nan(b, a) : s;
}

__device__ __forceinline__ float sub_cpu(float a, float b) {
  const float s = __fsub_rn(a, b);
  return isnan(s) ? cpu_nan(b, a) : s;
}

// NOTE: mul_cpu and div_cpu only see one operand that can be NaN (q and L - 1 are finite),
// where torch's choice between two NaNs differs between its vector and scalar paths.
__device__ __forceinline__ float mul_cpu(float a, float b) {
  const float s = __fmul_rn(a, b);
  return isnan(s) ? cpu_nan(a, b) : s;
}

__device__ __forceinline__ float div_cpu(float a, float b) {
  const float s = __fdiv_rn(a, b);
  return isnan(s) ? cpu_nan(a, b) : s;
}

// Unary minus as the CPU does it: the sign bit flipped, NaN included.
__device__ __forceinline__ float neg(float a) { return __uint_as_float(__float_as_uint(a) ^ 0x80000000u); }

// Rule 3: the step between the 2^(bits-1) magnitude levels of a block.
__device__ __forceinline__ float level_step(float lo, float hi, int bits) {
  return div_cpu(sub_cpu(hi, lo), static_cast<float>((1 << (bits - 1)) - 1));
}

__device__ __forceinline__ float decode_value(uint32_t code, float lo, float step, int bits) {
  const uint32_t q = code & ((1u << (bits - 1)) - 1);
  const float m = add_cpu(lo, mul_cpu(static_cast<float>(q), step));
  return (code >> (bits - 1)) & 1u ? neg(m) : m;
}

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ uint32_t warp_min(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct EncodeArgs {
  const float* x;
  float* r;
  uint8_t* buf;
  int64_t n, block, nb;
  int64_t indices, codes;  // byte offsets of the regions
  int64_t tail_at[3];      // the zero padding of the three regions: where it starts, its bytes
  int tail_len[3];
  int k, bits, cb;
  int stage_words;  // words of code staging in shared memory (0 at 8 bits), a multiple of 4
  bool cache_y;
};

// The radix-select state of the block in progress (shared).
struct Select {
  uint32_t prefix, mask, need, done;
};

// One radix step, by warp 0: the digit (at `shift`) of the need-th largest key among those the
// histogram counted, from the top bin down; zeroes the histogram for the next pass. Lane l holds
// bins 255 - 8l .. 248 - 8l, so an inclusive scan over the lanes counts from the top.
__device__ __forceinline__ void select_digit(uint32_t* hist, int shift, int lane, Select& st) {
  const uint32_t want = st.need;
  uint32_t c[8], sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int d = 255 - 8 * lane - j;
    c[j] = hist[d];
    hist[d] = 0;
    sum += c[j];
  }
  uint32_t incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  __syncwarp();  // NOTE: every lane has read st.need before one lane writes st
  uint32_t acc = incl - sum;
  if (acc < want && want <= incl) {  // exactly one lane: the histogram counts at least `want` keys
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (acc + c[j] >= want) {
        st.prefix |= static_cast<uint32_t>(255 - 8 * lane - j) << shift;
        st.mask |= 0xffu << shift;
        st.need = want - acc;
        st.done = c[j] == want - acc || shift == 0;
        break;
      }
      acc += c[j];
    }
  }
}

template <bool kEF>
__device__ __forceinline__ float load_y(const float* __restrict__ xb, const float* rb, int i) {
  if constexpr (kEF) {
    return add_cpu(xb[i], rb[i]);
  } else {
    return xb[i];
  }
}

template <bool kEF>
__global__ void __launch_bounds__(kMaxThreads) topk_encode_kernel(const EncodeArgs a) {
  __shared__ uint32_t hist[256];
  __shared__ uint32_t w_above[kMaxWarps], w_match[kMaxWarps], w_lo[kMaxWarps], w_hi[kMaxWarps];
  __shared__ Select st;
  extern __shared__ __align__(16) uint32_t dyn[];
  uint32_t* stage = dyn;
  float* ys = reinterpret_cast<float*>(dyn + a.stage_words);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x, nwarps = nt >> 5;
  const int bits = a.bits;
  const uint32_t lanes_below = (1u << lane) - 1;
  for (int i = tid; i < 256; i += nt) hist[i] = 0;
  if (blockIdx.x == 0) {
    for (int t = 0; t < 3; ++t) {
      if (tid < a.tail_len[t]) a.buf[a.tail_at[t] + tid] = 0;
    }
  }
  float* scales = reinterpret_cast<float*>(a.buf);

  for (int64_t b = blockIdx.x; b < a.nb; b += gridDim.x) {
    const int64_t base = b * a.block;
    const int len = static_cast<int>(min(a.block, a.n - base));
    const int cnt = min(a.k, len);
    const float* xb = a.x + base;
    float* rb = kEF ? a.r + base : nullptr;
    uint16_t* idx = reinterpret_cast<uint16_t*>(a.buf + a.indices) + b * a.k;
    uint8_t* codes = a.buf + a.codes + b * a.cb;

    for (int w = tid; w < a.stage_words; w += nt) stage[w] = 0;
    if (a.cache_y) {
      const uintptr_t addr = reinterpret_cast<uintptr_t>(xb) | (kEF ? reinterpret_cast<uintptr_t>(rb) : 0);
      const int nv = (addr & 15) == 0 ? len / 4 : 0;
      for (int v = tid; v < nv; v += nt) {
        float4 y = reinterpret_cast<const float4*>(xb)[v];
        if constexpr (kEF) {
          const float4 rv = reinterpret_cast<const float4*>(rb)[v];
          y.x = add_cpu(y.x, rv.x); y.y = add_cpu(y.y, rv.y); y.z = add_cpu(y.z, rv.z); y.w = add_cpu(y.w, rv.w);
        }
        reinterpret_cast<float4*>(ys)[v] = y;
      }
      for (int i = 4 * nv + tid; i < len; i += nt) ys[i] = load_y<kEF>(xb, rb, i);
    }
    auto y_at = [&](int i) { return a.cache_y ? ys[i] : load_y<kEF>(xb, rb, i); };
    if (tid == 0) st = {0u, 0u, static_cast<uint32_t>(cnt), cnt == len ? 1u : 0u};
    __syncthreads();

    // 1. radix select
    for (int shift = 24; shift >= 0; shift -= 8) {
      if (st.done) break;
      const uint32_t prefix = st.prefix, mask = st.mask;
      for (int i0 = tid - lane; i0 < len; i0 += nt) {
        const int i = i0 + lane;
        uint32_t bin = kNoBin;
        if (i < len) {
          const uint32_t key = abs_bits(y_at(i));
          if ((key & mask) == prefix) bin = (key >> shift) & 0xffu;
        }
        // NOTE: one atomic for a warp whose 32 keys share a bin (runs of zeros, constant data),
        // which would otherwise serialize on one address
        const uint32_t first = __shfl_sync(0xffffffffu, bin, 0);
        if (__all_sync(0xffffffffu, bin == first)) {
          if (lane == 0 && first != kNoBin) atomicAdd(&hist[first], 32u);
        } else if (bin != kNoBin) {
          atomicAdd(&hist[bin], 1u);
        }
      }
      __syncthreads();
      if (warp == 0) select_digit(hist, shift, lane, st);
      __syncthreads();
    }
    const uint32_t prefix = st.prefix, mask = st.mask, need = st.need;

    // 2. per-warp counts over contiguous segments (a multiple of 32 elements each)
    const int seg = (len + nwarps * 32 - 1) / (nwarps * 32) * 32;
    const int s0 = min(len, warp * seg), s1 = min(len, s0 + seg);
    uint32_t na = 0, nm = 0, klo = 0xffffffffu, khi = 0;
    for (int i = s0 + lane; i < s1; i += 32) {
      const uint32_t key = abs_bits(y_at(i)), m = key & mask;
      if (m >= prefix) {
        na += m > prefix;
        nm += m == prefix;
        klo = min(klo, key);
        khi = max(khi, key);
      }
    }
    na = warp_sum(na);
    nm = warp_sum(nm);
    klo = warp_min(klo);
    khi = warp_max(khi);
    if (lane == 0) {
      w_above[warp] = na;
      w_match[warp] = nm;
      w_lo[warp] = klo;
      w_hi[warp] = khi;
    }
    __syncthreads();
    uint32_t above_base = 0, match_base = 0, lo_key = 0xffffffffu, hi_key = 0;
    for (int w = 0; w < nwarps; ++w) {
      if (w < warp) {
        above_base += w_above[w];
        match_base += w_match[w];
      }
      lo_key = min(lo_key, w_lo[w]);
      hi_key = max(hi_key, w_hi[w]);
    }
    // NOTE: the keys matching the prefix are all kept (an early stop) or all equal T, so lo is
    // the min over the keys above or matching it, and hi, the block's largest key, is always kept
    const bool bad = hi_key >= kInfBits;
    const float lo = __uint_as_float(bad ? kSparseNaNBits : lo_key);
    const float hi = __uint_as_float(bad ? kSparseNaNBits : hi_key);
    const float step = level_step(lo, hi, bits);
    const float qmax = static_cast<float>((1 << (bits - 1)) - 1);

    // 3. slots in index order: ballots within the warp, the bases from step 2 across warps
    uint32_t m_run = match_base, k_run = above_base + min(match_base, need);
    for (int i0 = s0; i0 < s1; i0 += 32) {
      const int i = i0 + lane;
      const bool valid = i < s1;
      const float y = valid ? y_at(i) : 0.f;
      const uint32_t key = abs_bits(y), m = key & mask;
      const bool above = valid && m > prefix, match = valid && m == prefix;
      const uint32_t mb = __ballot_sync(0xffffffffu, match);
      const bool kept = above || (match && m_run + __popc(mb & lanes_below) < need);
      const uint32_t kb = __ballot_sync(0xffffffffu, kept);
      const uint32_t slot = k_run + __popc(kb & lanes_below);
      m_run += __popc(mb);
      k_run += __popc(kb);
      if (kept) {
        idx[slot] = static_cast<uint16_t>(i);
        uint32_t code = 0;
        if (!bad) {
          uint32_t q = 0;
          if (step > 0.f) {
            q = static_cast<uint32_t>(fminf(rintf(__fdiv_rn(__fsub_rn(__uint_as_float(key), lo), step)), qmax));
          }
          code = ((__float_as_uint(y) >> 31) << (bits - 1)) | q;
        }
        if (bits == 8) {
          codes[slot] = static_cast<uint8_t>(code);
        } else {
          atomicOr(&stage[(slot * bits) >> 5], code << ((slot * bits) & 31));
        }
        if constexpr (kEF) rb[i] = sub_cpu(y, decode_value(code, lo, step, bits));
      } else if (kEF && valid) {
        rb[i] = y;
      }
    }
    for (int s = cnt + tid; s < a.k; s += nt) {
      idx[s] = 0;
      if (bits == 8) codes[s] = 0;
    }
    if (tid == 0) {
      scales[2 * b] = lo;
      scales[2 * b + 1] = hi;
    }
    if (bits != 8) {
      __syncthreads();
      for (int j = tid; j < a.cb; j += nt) codes[j] = static_cast<uint8_t>(stage[j >> 2] >> ((j & 3) * 8));
    }
    __syncthreads();
  }
}

// Zeroes p[0, len) with 16-byte stores where the address allows (p is 4-byte aligned).
__device__ __forceinline__ void zero_fill(float* p, int len) {
  const int head = min(len, static_cast<int>(((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / 4));
  const int nv = (len - head) / 4;
  for (int i = threadIdx.x; i < head; i += blockDim.x) p[i] = 0.f;
  float4* v = reinterpret_cast<float4*>(p + head);
  for (int i = threadIdx.x; i < nv; i += blockDim.x) v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i = head + 4 * nv + threadIdx.x; i < len; i += blockDim.x) p[i] = 0.f;
}

struct DecodeArgs {
  const uint8_t* buf;
  float* out;
  int64_t n, block, nb, indices, codes;
  int k, bits, cb;
};

template <bool kAcc>
__global__ void __launch_bounds__(kDecodeThreads) topk_decode_kernel(const DecodeArgs a) {
  const float* scales = reinterpret_cast<const float*>(a.buf);
  const int bits = a.bits;
  const uint32_t code_mask = (1u << bits) - 1;
  for (int64_t b = blockIdx.x; b < a.nb; b += gridDim.x) {
    const int64_t base = b * a.block;
    const int len = static_cast<int>(min(a.block, a.n - base));
    const int cnt = min(a.k, len);
    float* ob = a.out + base;
    if constexpr (!kAcc) {
      zero_fill(ob, len);
      __syncthreads();
    }
    const float lo = scales[2 * b], step = level_step(lo, scales[2 * b + 1], bits);
    const uint16_t* idx = reinterpret_cast<const uint16_t*>(a.buf + a.indices) + b * a.k;
    const uint8_t* codes = a.buf + a.codes + b * a.cb;
    for (int s = threadIdx.x; s < cnt; s += blockDim.x) {
      const int i = idx[s];
      // NOTE: an index past the block (not from the encoder: its indices are in range and
      // distinct) is skipped rather than written out of bounds
      if (i >= len) continue;
      const uint32_t code = (codes[(s * bits) >> 3] >> ((s * bits) & 7)) & code_mask;
      const float v = decode_value(code, lo, step, bits);
      ob[i] = kAcc ? add_cpu(ob[i], v) : v;
    }
  }
}

// ---- host side ----
void check_launch(const char* what, int64_t n, int64_t block, int64_t k, int64_t bits) {
  if (n < 0 || block < 1 || block > kMaxBlock || k < 1 || k > block || !valid_bits(bits)) {
    throw std::invalid_argument(std::string(what) + ": needs n >= 0, 1 <= block <= " + std::to_string(kMaxBlock) +
                                ", 1 <= k <= block and bits 2, 4 or 8, got n=" + std::to_string(n) +
                                " block=" + std::to_string(block) + " k=" + std::to_string(k) +
                                " bits=" + std::to_string(bits));
  }
}

int grid_for(int64_t nb) { return static_cast<int>(std::min<int64_t>(kMaxGrid, nb)); }

// About 8 elements per thread, 64 to 512 threads.
int encode_threads(int64_t block) {
  const int64_t t = ((block + 7) / 8 + 31) / 32 * 32;
  return static_cast<int>(std::clamp<int64_t>(t, 64, kMaxThreads));
}

// About 16 elements per thread for the zeroing, 64 to 256 threads.
int decode_threads(int64_t block) {
  const int64_t t = ((block + 15) / 16 + 31) / 32 * 32;
  return static_cast<int>(std::clamp<int64_t>(t, 64, kDecodeThreads));
}

}  // namespace
}  // namespace sparse

namespace cuda {

void topk_encode(const float* x, float* residual, uint8_t* buf, int64_t n, int64_t block, int64_t k, int64_t bits,
                 cudaStream_t stream) {
  using namespace sparse;
  check_launch("topk_encode", n, block, k, bits);
  if (n == 0) return;
  const Regions rg = regions(n, block, k);
  EncodeArgs a{};
  a.x = x;
  a.r = residual;
  a.buf = buf;
  a.n = n;
  a.block = block;
  a.nb = rg.nb;
  a.indices = rg.indices;
  a.codes = rg.codes;
  a.k = static_cast<int>(k);
  a.bits = static_cast<int>(bits);
  a.cb = static_cast<int>(code_bytes(k, bits));
  const int64_t ends[3] = {8 * rg.nb, rg.indices + 2 * rg.nb * k, rg.codes + rg.nb * a.cb};
  const int64_t next[3] = {rg.indices, rg.codes, encoded_nbytes(n, block, k, bits)};
  for (int t = 0; t < 3; ++t) {
    a.tail_at[t] = ends[t];
    a.tail_len[t] = static_cast<int>(next[t] - ends[t]);
  }
  a.stage_words = bits == 8 ? 0 : static_cast<int>((a.cb + 15) / 16 * 4);
  a.cache_y = 4 * (a.stage_words + block) <= kDynSmemBytes;
  const size_t smem = 4 * static_cast<size_t>(a.stage_words + (a.cache_y ? block : 0));
  const int grid = grid_for(rg.nb), threads = encode_threads(block);
  if (residual != nullptr) {
    topk_encode_kernel<true><<<grid, threads, smem, stream>>>(a);
  } else {
    topk_encode_kernel<false><<<grid, threads, smem, stream>>>(a);
  }
  FLCOMM_CUDA_CHECK(cudaGetLastError());
}

void topk_decode(const uint8_t* buf, float* out, int64_t n, int64_t block, int64_t k, int64_t bits, bool accumulate,
                 cudaStream_t stream) {
  using namespace sparse;
  check_launch("topk_decode", n, block, k, bits);
  if (n == 0) return;
  const Regions rg = regions(n, block, k);
  const DecodeArgs a{buf,  out, n, block, rg.nb, rg.indices, rg.codes, static_cast<int>(k), static_cast<int>(bits),
                     static_cast<int>(code_bytes(k, bits))};
  const int grid = grid_for(rg.nb), threads = decode_threads(block);
  if (accumulate) {
    topk_decode_kernel<true><<<grid, threads, 0, stream>>>(a);
  } else {
    topk_decode_kernel<false><<<grid, threads, 0, stream>>>(a);
  }
  FLCOMM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace cuda
}  // namespace flcomm
