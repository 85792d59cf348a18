// The sparse top-k format: the encoded-buffer layout and the selection and quantization rule,
// shared by the CPU (sparse.cpp) and CUDA (sparse_cuda.cu) kernels. No torch headers: nvcc
// compiles this into the kernels. flcomm/sparse.py states the same rule and holds the plain-torch
// reference every kernel matches bit for bit.
//
// Parameters: `block` B elements per block (1 .. 65536: an index in a block fits 16 bits), `k`
// K elements kept per block (1 .. B), `bits` b of each kept value (2, 4 or 8).
//
// Layout of the encoding of n fp32 elements, nb = ceil(n / B) blocks; three regions, each
// zero-padded to a multiple of 16 bytes:
//
//   [ scales:  nb pairs of float32 (lo, hi)                                   ]
//   [ indices: nb * K uint16, a block's K slots together                      ]
//   [ codes:   nb * CB bytes, CB = ceil(K * b / 8), a block's codes together   ]
//
// The rule, per block of len = min(B, n - block_start) elements y (y = x + residual with error
// feedback), cnt = min(K, len) of which are kept:
//   1. selection: the cnt elements with the largest key, key = the bits of |y| as uint32 (so NaN >
//      +Inf > every finite value, as quant.h's absmax); equal keys go to the lower index. Slot
//      j < cnt holds the j-th kept index in ascending order; the slots from cnt on (only in a
//      last, partial block) hold 0 with code 0 and are not decoded.
//   2. scales: lo and hi are the smallest and largest |y| kept. A block whose hi is not finite
//      (a NaN or an Inf kept) has lo = hi = NaN (kSparseNaNBits) and codes 0: its kept elements
//      decode as NaN, and error feedback sets their residual to kSparseNaNBits.
//   3. a code is sign << (b - 1) | q, sign the sign bit of y, q in [0, L - 1], L = 2^(b - 1):
//      step = (hi - lo) / (L - 1), q = min(L - 1, rint((|y| - lo) / step)) (round half to even)
//      when step > 0, else 0. The value decoded is +-(lo + q * step): each operation rounded to
//      fp32 on its own (no fused multiply-add), with the division a true division.
//   4. code j of a block sits at bits [j * b, (j + 1) * b) of the block's CB bytes, byte
//      (j * b) / 8 from its bit (j * b) % 8 up (b divides 8: a code never straddles bytes).
//   5. decoding writes the kept values and zeros elsewhere; accumulating adds the kept values
//      only; an index at or past the block's length (a buffer not made by an encoder) is
//      skipped. Error feedback's new residual is y - decoded: y where nothing was kept.
// No path may flush subnormals to zero (setup.py builds the CUDA code with -ftz=false).
// NOTE: the NaN bits of y = x + r follow each device's addition, which sparse_cuda.cu makes
// the CPU's (x86: one NaN operand is kept, quieted; of two, torch's CPU add keeps r's); they
// decide the order of NaNs by key, and the residual where a NaN was not kept.
//
// Alignment: the encoded buffer must start at a 4-byte aligned address (the float32 scales);
// the operators reject others before any launch.
#pragma once

#include <cstdint>

namespace flcomm {
namespace sparse {

constexpr int64_t kMaxBlock = 65536;
constexpr uint32_t kInfBits = 0x7f800000u;        // key at or above it: not finite (rule 2)
constexpr uint32_t kSparseNaNBits = 0x7fc00000u;  // lo and hi of a non-finite block

constexpr int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
constexpr int64_t num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }
constexpr int64_t code_bytes(int64_t k, int64_t bits) { return (k * bits + 7) / 8; }
constexpr int64_t scales_nbytes(int64_t nb) { return align16(8 * nb); }
constexpr int64_t indices_nbytes(int64_t nb, int64_t k) { return align16(2 * nb * k); }
constexpr int64_t codes_nbytes(int64_t nb, int64_t k, int64_t bits) { return align16(nb * code_bytes(k, bits)); }
constexpr int64_t encoded_nbytes(int64_t n, int64_t block, int64_t k, int64_t bits) {
  return scales_nbytes(num_blocks(n, block)) + indices_nbytes(num_blocks(n, block), k) +
         codes_nbytes(num_blocks(n, block), k, bits);
}
constexpr bool valid_bits(int64_t bits) { return bits == 2 || bits == 4 || bits == 8; }

// Where the three regions of an encoding of n elements start.
struct Regions {
  int64_t nb, indices, codes;  // blocks; byte offsets of the indices and the codes
};
constexpr Regions regions(int64_t n, int64_t block, int64_t k) {
  const int64_t nb = num_blocks(n, block);
  return {nb, scales_nbytes(nb), scales_nbytes(nb) + indices_nbytes(nb, k)};
}

}  // namespace sparse
}  // namespace flcomm
