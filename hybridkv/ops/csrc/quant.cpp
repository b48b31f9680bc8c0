// GGUF weight-block kernels (PyTorch twins and Python signatures: hybridkv/ops/quant/int8_dot.py).
//
// llama.cpp's decode scheme for the 32-weight types (Q8_0, and the fallbacks Q5_0, Q4_0, IQ4_NL,
// whose vec_dot type is Q8_0; Q4_1, Q5_1, with a min, whose vec_dot type is Q8_1): each activation
// row is quantized once into 8-bit blocks of 32 (d = max|x|/127 kept in float32); a weight block
// (f16 d, then its codes, read in place from the file's rows and unpacked to 32 int8 in registers)
// and an activation block meet as one exact integer dot product, then one float multiply by d_w·d_x
// (plus m_w·d_x·Σq_x for a block with a min). Three code paths give the same integer sums: AVX-512
// VNNI or AVX-VNNI (`dpbusd`; 1-3 activation rows on 512-bit vectors where the CPU has AVX-512, 4+
// rows with the lanes being 8 weight rows), AVX2 (`maddubs` + `madd`), and a plain loop; `isa`
// picks one, so the tests run each that this CPU has. Built with -march=native, so the VNNI path
// exists only where the CPU has it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "experts.h"
#include "ops.h"
#include "parallel.h"
#include "simd.h"

namespace {

using hybridkv::fp16;
#ifdef __AVX2__
using hybridkv::hsum_f32;
using hybridkv::hsum_i32;
#endif

constexpr int QK8 = 32;

enum class Isa { Scalar, Avx2, Vnni };

std::vector<std::string> q8_isas() {
  std::vector<std::string> isas;
#ifdef HYBRIDKV_VNNI
  isas.push_back("vnni");
#endif
#ifdef __AVX2__
  isas.push_back("avx2");
#endif
  isas.push_back("scalar");
  return isas;
}

Isa parse_isa(const std::string& name) {
  const std::string pick = hybridkv::pick_isa(q8_isas(), name);
  return pick == "vnni" ? Isa::Vnni : pick == "avx2" ? Isa::Avx2 : Isa::Scalar;
}

// The 32-weight block types: bytes per block, and their 32 codes (weight = d·code, + m for Q4_1, Q5_1).
constexpr int8_t IQ4_NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The codes of a nibble type (Q4_0, Q4_1, Q5_0, Q5_1) from its layout constants below: nibble j of
// qs (low nibbles weights 0-15, high 16-31), bit j of qh as bit 4 for the five-bit types, less OFFSET.
template <typename B>
void nibble_codes(const uint8_t* b, int8_t* q) {
  uint32_t qh = 0;
  if constexpr (B::QH_AT != 0) std::memcpy(&qh, b + B::QH_AT, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((b[B::QS_AT + j] & 15) | ((qh >> j) & 1) << 4) - B::OFFSET);
    q[j + 16] = static_cast<int8_t>(((b[B::QS_AT + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - B::OFFSET);
  }
}

// QS_AT: where the codes (or the nibbles) start; QH_AT: the five-bit types' high bits; OFFSET: what is
// taken off a nibble (or five bits) to make the code; HAS_MIN: an f16 m after d, weight = d·code + m.
struct Q8_0Block {  // f16 d; i8 q[32]
  static constexpr int ID = 8, BYTES = 34, QS_AT = 2, QH_AT = 0, OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  static constexpr const char* NAME = "Q8_0";
  static void codes(const uint8_t* b, int8_t* q) { std::memcpy(q, b + 2, QK8); }
};
struct Q4_0Block {  // f16 d; u8 qs[16]: low nibbles weights 0-15, high 16-31; code = nibble - 8
  static constexpr int ID = 2, BYTES = 18, QS_AT = 2, QH_AT = 0, OFFSET = 8;
  static constexpr bool HAS_MIN = false;
  static constexpr const char* NAME = "Q4_0";
  static void codes(const uint8_t* b, int8_t* q) { nibble_codes<Q4_0Block>(b, q); }
};
struct Q5_0Block {  // f16 d; u32 qh (bit j: bit 4 of weight j); u8 qs[16] as Q4_0; code = q - 16
  static constexpr int ID = 6, BYTES = 22, QS_AT = 6, QH_AT = 2, OFFSET = 16;
  static constexpr bool HAS_MIN = false;
  static constexpr const char* NAME = "Q5_0";
  static void codes(const uint8_t* b, int8_t* q) { nibble_codes<Q5_0Block>(b, q); }
};
struct IQ4_NLBlock {  // f16 d; u8 qs[16] as Q4_0; code = a non-linear level of the nibble
  static constexpr int ID = 20, BYTES = 18, QS_AT = 2, QH_AT = 0, OFFSET = 0;
  static constexpr bool HAS_MIN = false;
  static constexpr const char* NAME = "IQ4_NL";
  static void codes(const uint8_t* b, int8_t* q) {
    for (int j = 0; j < 16; ++j) {
      q[j] = IQ4_NL_LEVELS[b[2 + j] & 15];
      q[j + 16] = IQ4_NL_LEVELS[b[2 + j] >> 4];
    }
  }
};

struct Q4_1Block {  // f16 d; f16 m; u8 qs[16] as Q4_0; code = nibble (0..15)
  static constexpr int ID = 3, BYTES = 20, QS_AT = 4, QH_AT = 0, OFFSET = 0;
  static constexpr bool HAS_MIN = true;
  static constexpr const char* NAME = "Q4_1";
  static void codes(const uint8_t* b, int8_t* q) { nibble_codes<Q4_1Block>(b, q); }
};
struct Q5_1Block {  // f16 d; f16 m; u32 qh as Q5_0; u8 qs[16] as Q4_0; code = q (0..31)
  static constexpr int ID = 7, BYTES = 24, QS_AT = 8, QH_AT = 4, OFFSET = 0;
  static constexpr bool HAS_MIN = true;
  static constexpr const char* NAME = "Q5_1";
  static void codes(const uint8_t* b, int8_t* q) { nibble_codes<Q5_1Block>(b, q); }
};

// x [K] → K/32 blocks: d = max|x|/127, q = round(x·(1/d)) ties to even (the default rounding mode),
// 0 where d = 0. |x·(1/d)| exceeds 127 by at most a few ulps, so q fits in int8.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d) {
  for (int64_t b = 0; b < K / QK8; ++b) {
    const float* xb = x + b * QK8;
    float amax = 0.f;
    for (int j = 0; j < QK8; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / 127.f;
    const float inv = db != 0.f ? 1.f / db : 0.f;
    for (int j = 0; j < QK8; ++j) q[b * QK8 + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
    d[b] = db;
  }
}

// Not auto-vectorized: GCC 12 at -O3 -march=native on an AVX512-VNNI CPU turns this signed x signed
// byte dot product into vpdpbusd, which multiplies its first operand as unsigned (wrong sums;
// reproduced with GCC 12.2 on Zen 4). The vector paths below do the sign handling themselves.
template <typename B>
__attribute__((optimize("no-tree-vectorize"))) inline int32_t block_sum_scalar(const uint8_t* blk, const int8_t* a) {
  int8_t q[QK8];
  B::codes(blk, q);
  int32_t s = 0;
  for (int j = 0; j < QK8; ++j) s += static_cast<int32_t>(q[j]) * a[j];
  return s;
}

#ifdef __AVX2__
// A block's 32 codes as int8 lanes.
template <typename B>
inline __m256i unpack(const uint8_t* blk) {
  if constexpr (B::ID == Q8_0Block::ID) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + B::QS_AT));
    const __m128i low = _mm_set1_epi8(15);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
    if constexpr (B::ID == IQ4_NLBlock::ID) {
      const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_NL_LEVELS));
      return _mm256_shuffle_epi8(_mm256_set_m128i(levels, levels), nib);
    } else if constexpr (B::QH_AT == 0) {  // Q4_0, Q4_1
      return B::OFFSET ? _mm256_sub_epi8(nib, _mm256_set1_epi8(B::OFFSET)) : nib;
    } else {  // Q5_0, Q5_1: byte j of qh's bits spread to 32 bytes, 0x10 where bit j is set
      uint32_t qh;
      std::memcpy(&qh, blk + B::QH_AT, 4);
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int>(qh)),
          _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
      const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
      const __m256i q = _mm256_or_si256(nib, high);
      return B::OFFSET ? _mm256_sub_epi8(q, _mm256_set1_epi8(B::OFFSET)) : q;
    }
  }
}

// One block pair's dot product as 8 int32 lanes (lane i: weights 4i..4i+3), from |w| and x·sign(w).
// Both instructions take unsigned × signed bytes, so the weight's sign moves onto the activation:
// |w| read as unsigned is exact even for −128, and a·sign(w) cannot overflow since |a| <= 127 —
// exact for any block bytes.
template <Isa I>
inline __m256i signed_dot(__m256i w_abs, __m256i x_signed) {
#ifdef HYBRIDKV_VNNI
  if constexpr (I == Isa::Vnni) return hybridkv::dpbusd(_mm256_setzero_si256(), w_abs, x_signed);
#endif
  // Byte pairs into int16 (|pair| <= 2·128·127 < 2^15: no saturation), then int16 pairs into int32.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x_signed), _mm256_set1_epi16(1));
}

template <Isa I, typename B>
inline __m256i block_dot(const uint8_t* blk, const int8_t* a) {
  const __m256i w = unpack<B>(blk);
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return signed_dot<I>(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

#ifdef HYBRIDKV_ZMM
// Two consecutive blocks' codes in one 512-bit vector (the first in the low half).
template <typename B>
inline __m512i pair_codes(const uint8_t* blk) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(unpack<B>(blk)), unpack<B>(blk + B::BYTES), 1);
}

// A block pair's codes as unsigned w + 128 (`pair_codes` xor 0x80), for `pair_dot`.
template <typename B>
inline __m512i pair_codes_u8(const uint8_t* blk) {
  return _mm512_xor_si512(pair_codes<B>(blk), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// A block pair's 16 int32 sums Σ w·x over each 4 codes: w + 128 (wu) against x (a), from
// off = −128·Σx of those 4 activation codes (`lane_offsets`). The same integers as |w| against
// x·sign(w) (`signed_dot`) in two instructions where that takes four (an abs, a sign mask and a
// masked negate before the dot).
inline __m512i pair_dot(__m512i wu, const int32_t* off, const int8_t* a) {
  return _mm512_dpbusd_epi32(_mm512_loadu_si512(off), wu, _mm512_loadu_si512(a));
}

// The scales of 8 blocks (lanes 0-7 of scale8) spread over block pair p's lanes: block 2p's over
// lanes 0-7, block 2p + 1's over lanes 8-15.
inline __m512 pair_scale(__m512 scale8, int p) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(2 * p)), scale8);
}
#endif

// Activation rows rows[0..R) (of nb blocks each, at a and dx; sx: their blocks' d·Σq for the types
// with a min) against one weight row → out[rows[r]·N]: each block unpacked once and met by every
// row, its 8 int32 lanes scaled into a float accumulator per row (llama.cpp's order), summed at the end.
// off: the activation rows' `lane_offsets` (read by the 512-bit path).
template <Isa I, typename B, int R>
void row_dots(const uint8_t* w, const float* dw, const int8_t* a, const float* dx, const float* sx, int64_t nb,
              const int64_t* rows, float* out, int64_t N, const int32_t* off) {
  __m256 acc[R];
  float mins[R] = {}, wide[R] = {};
  const int8_t* ar[R];
  const float* dr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    ar[r] = a + rows[r] * nb * QK8;
    dr[r] = dx + rows[r] * nb;
  }
  int64_t b = 0;
#ifdef HYBRIDKV_ZMM
  if constexpr (I == Isa::Vnni) {  // two blocks per 512-bit vector, 8 at a time, as `row_dot`
    __m512 acc2[R];
    for (int r = 0; r < R; ++r) acc2[r] = _mm512_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
      __m512 scale[R];
      for (int r = 0; r < R; ++r)
        scale[r] = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(dw + b), _mm256_loadu_ps(dr[r] + b)));
      for (int p = 0; p < 4; ++p) {
        const int64_t c = b + 2 * p;
        const __m512i wu = pair_codes_u8<B>(w + c * B::BYTES);
        for (int r = 0; r < R; ++r) {
          const __m512i sums = pair_dot(wu, off + (rows[r] * nb + c) * 8, ar[r] + c * QK8);
          acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), pair_scale(scale[r], p), acc2[r]);
        }
      }
      if constexpr (B::HAS_MIN)
        for (int64_t c = b; c < b + 8; ++c) {
          const float m = fp16(w + c * B::BYTES + 2);
          for (int r = 0; r < R; ++r) mins[r] += m * sx[rows[r] * nb + c];
        }
    }
    for (int r = 0; r < R; ++r) wide[r] = _mm512_reduce_add_ps(acc2[r]);
  }
#endif
  for (; b < nb; ++b) {
    const __m256i wq = unpack<B>(w + b * B::BYTES);
    const __m256i w_abs = _mm256_sign_epi8(wq, wq);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar[r] + b * QK8));
      const __m256 sums = _mm256_cvtepi32_ps(signed_dot<I>(w_abs, _mm256_sign_epi8(x, wq)));
      acc[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(dw[b] * dr[r][b]), acc[r]);
    }
    if constexpr (B::HAS_MIN) {
      const float m = fp16(w + b * B::BYTES + 2);
      for (int r = 0; r < R; ++r) mins[r] += m * sx[rows[r] * nb + b];
    }
  }
  for (int r = 0; r < R; ++r) out[rows[r] * N] = hsum_f32(acc[r]) + wide[r] + mins[r];
}

// The sums of 8 consecutive block pairs, one per lane: three rounds of pairwise adds transpose the
// 8 x 8 lanes (hadd works within 128-bit halves, the last step adds the halves).
template <Isa I, typename B>
inline __m256i block_sums8(const uint8_t* w, const int8_t* a) {
  __m256i s[8];
  for (int i = 0; i < 8; ++i) s[i] = block_dot<I, B>(w + i * B::BYTES, a + i * QK8);
  const __m256i h01 = _mm256_hadd_epi32(s[0], s[1]), h23 = _mm256_hadd_epi32(s[2], s[3]);
  const __m256i h45 = _mm256_hadd_epi32(s[4], s[5]), h67 = _mm256_hadd_epi32(s[6], s[7]);
  const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

#endif

// Block sums of one weight row (nb blocks at w) with one activation row (q at a) into out[nb].
template <Isa I, typename B>
void row_block_sums(const uint8_t* w, const int8_t* a, int64_t nb, int32_t* out) {
  int64_t b = 0;
#ifdef __AVX2__
  if constexpr (I != Isa::Scalar) {
    for (; b + 8 <= nb; b += 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b), block_sums8<I, B>(w + b * B::BYTES, a + b * QK8));
    for (; b < nb; ++b) out[b] = hsum_i32(block_dot<I, B>(w + b * B::BYTES, a + b * QK8));
  }
#endif
  for (; b < nb; ++b) out[b] = block_sum_scalar<B>(w + b * B::BYTES, a + b * QK8);
}

#if defined(__AVX2__) && defined(__F16C__)
// The f16 fields at byte `at` of 8 consecutive blocks (0: the scales d, 2: the mins m) as floats,
// read from the blocks themselves.
template <typename B>
inline __m256 halves8(const uint8_t* w, int at = 0) {
  uint16_t bits[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&bits[i], w + i * B::BYTES + at, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)));
}
#endif

// The min term of block b, m_w·(d_x·Σq_x), for the types with one (0 otherwise).
template <typename B>
inline float min_term(const uint8_t* w, const float* sx, int64_t b) {
  if constexpr (B::HAS_MIN) return fp16(w + b * B::BYTES + 2) * sx[b];
  return 0.f;
}

// Σ_b block_sum_b · (dw[b]·dx[b]) (+ m_b·sx[b] for the types with a min) for one weight row and one
// activation row; dw null: the scales read from the blocks as they are met (one pass over the row
// instead of two).
// off: that activation row's `lane_offsets` (read by the 512-bit path; null where there are none).
template <Isa I, typename B>
float row_dot(const uint8_t* w, const float* dw, const int8_t* a, const float* dx, const float* sx, int64_t nb,
              const int32_t* off) {
  int64_t b = 0;
  float s = 0.f;
#if defined(HYBRIDKV_ZMM)
  if constexpr (I == Isa::Vnni) {
    // Two blocks per 512-bit vector (`pair_dot`): a block pair's 16 int32 lanes are scaled in float
    // by their blocks' d_w·d_x (spread over the halves by one permute) into one accumulator.
    __m512 acc = _mm512_setzero_ps();
    __m256 mins = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
      const __m256 dw8 = dw ? _mm256_loadu_ps(dw + b) : halves8<B>(w + b * B::BYTES);
      const __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(dw8, _mm256_loadu_ps(dx + b)));
      for (int p = 0; p < 4; ++p) {
        const int64_t c = b + 2 * p;
        const __m512i sums = pair_dot(pair_codes_u8<B>(w + c * B::BYTES), off + c * 8, a + c * QK8);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), pair_scale(scale, p), acc);
      }
      if constexpr (B::HAS_MIN) mins = _mm256_fmadd_ps(halves8<B>(w + b * B::BYTES, 2), _mm256_loadu_ps(sx + b), mins);
    }
    s = _mm512_reduce_add_ps(acc) + hsum_f32(mins);
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (I != Isa::Scalar) {
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
      const __m256 dw8 = dw ? _mm256_loadu_ps(dw + b) : halves8<B>(w + b * B::BYTES);
      const __m256 scale = _mm256_mul_ps(dw8, _mm256_loadu_ps(dx + b));
      const __m256 sums = _mm256_cvtepi32_ps(block_sums8<I, B>(w + b * B::BYTES, a + b * QK8));
      acc = _mm256_fmadd_ps(sums, scale, acc);
      if constexpr (B::HAS_MIN) acc = _mm256_fmadd_ps(halves8<B>(w + b * B::BYTES, 2), _mm256_loadu_ps(sx + b), acc);
    }
    s += hsum_f32(acc);  // (after the 512-bit loop, where it ran, this one has nothing left)
    for (; b < nb; ++b)
      s += static_cast<float>(hsum_i32(block_dot<I, B>(w + b * B::BYTES, a + b * QK8))) *
               ((dw ? dw[b] : fp16(w + b * B::BYTES)) * dx[b]) +
           min_term<B>(w, sx, b);
  }
#endif
  for (; b < nb; ++b)
    s += static_cast<float>(block_sum_scalar<B>(w + b * B::BYTES, a + b * QK8)) *
             ((dw ? dw[b] : fp16(w + b * B::BYTES)) * dx[b]) +
         min_term<B>(w, sx, b);
  return s;
}

// f16 scales of a row of nb blocks.
template <typename B>
inline void row_scales(const uint8_t* wr, int64_t nb, float* dw) {
  for (int64_t b = 0; b < nb; ++b) dw[b] = fp16(wr + b * B::BYTES);
}

// `pair_dot`'s offsets for activation rows a [T, nb·32] on the 512-bit path: −128·Σ of each 4 codes,
// [T, nb·8] (an empty vector elsewhere, where `signed_dot` takes x·sign(w) against |w|).
template <Isa I>
std::vector<int32_t> lane_offsets(const int8_t* a, int64_t T, int64_t nb) {
  std::vector<int32_t> off;
#ifdef HYBRIDKV_ZMM
  if constexpr (I == Isa::Vnni) {
    off.resize(T * nb * 8);
    for (int64_t i = 0; i < T * nb * 8; ++i) off[i] = -128 * (a[4 * i] + a[4 * i + 1] + a[4 * i + 2] + a[4 * i + 3]);
  }
#endif
  return off;
}

// y[rows[i]·N] for the n activation rows rows[0..n) against one weight row: four at a time where
// the CPU has the vector paths (each block unpacked once for all four), one by one otherwise.
// dw: room for the row's nb scales, filled here when several rows share them.
template <Isa I, typename B>
void rows_dot(const uint8_t* w, float* dw, const int8_t* a, const float* dx, const float* sx, int64_t nb,
              const int64_t* rows, int64_t n, float* y, int64_t N, const int32_t* off) {
  auto sx_of = [&](int64_t row) { return B::HAS_MIN ? sx + row * nb : nullptr; };
  auto off_of = [&](int64_t row) { return off ? off + row * nb * 8 : nullptr; };
  if (n == 1) {  // the scales read in the same pass
    y[rows[0] * N] = row_dot<I, B>(w, nullptr, a + rows[0] * nb * QK8, dx + rows[0] * nb, sx_of(rows[0]), nb, off_of(rows[0]));
    return;
  }
  row_scales<B>(w, nb, dw);
  int64_t i = 0;
#ifdef __AVX2__
  if constexpr (I != Isa::Scalar) {
    if (n > 1) {
      for (; i + 4 <= n; i += 4) row_dots<I, B, 4>(w, dw, a, dx, sx, nb, rows + i, y, N, off);
      if (n - i == 3) {
        row_dots<I, B, 3>(w, dw, a, dx, sx, nb, rows + i, y, N, off);
        i += 3;
      } else if (n - i == 2) {
        row_dots<I, B, 2>(w, dw, a, dx, sx, nb, rows + i, y, N, off);
        i += 2;
      }
    }
  }
#endif
  for (; i < n; ++i)
    y[rows[i] * N] = row_dot<I, B>(w, dw, a + rows[i] * nb * QK8, dx + rows[i] * nb, sx_of(rows[i]), nb, off_of(rows[i]));
}

#ifdef HYBRIDKV_VNNI
// Eight weight rows at once, lanes = weight rows (llama.cpp's repacked gemm, without repacking the
// file): a block of each of the 8 rows is unpacked and transposed so that vector j holds bytes
// 4j..4j+3 of every row, then each activation row's 4-byte groups are broadcast against them —
// 8 dot instructions give the 8 rows' block sums with no horizontal add. dpbusd multiplies unsigned
// by signed bytes: the weight codes are shifted to w + 128 (one xor, unsigned) and 128·Σx, the same
// for the 8 weight rows (`xsum128`, once per activation block), is taken off, so each block sum is
// the exact integer Σ x·w. Then one float multiply-add per block scales the 8 sums by d_w (a
// vector) · d_x.
// w: 8 rows of row_bytes; dw8 [nb][8] their scales (dm8: their mins, for the types with one; sx the
// activation blocks' d·Σq); rows[0..M) activation rows; y[rows[r]·N + 0..8) receives the 8
// results; ahead: the next 8 rows to prefetch during this pass, or nullptr.
template <typename B, int M>
void rows8_dot_m(const uint8_t* w, int64_t row_bytes, const float* dw8, const float* dm8, const int8_t* a,
                 const int32_t* xsum128, const float* dx, const float* sx, int64_t nb, const int64_t* rows, float* y,
                 int64_t N, const uint8_t* ahead) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead != nullptr)  // the next 8 rows' same blocks, spread over this pass
      hybridkv::prefetch_rows(ahead + b * B::BYTES, 8, row_bytes, B::BYTES);
    __m256i t[8];
    for (int i = 0; i < 8; ++i) t[i] = unpack<B>(w + i * row_bytes + b * B::BYTES);
    hybridkv::transpose8(t);  // t[j] lane i = row i's bytes 4j..4j+3
    for (int j = 0; j < 8; ++j) t[j] = _mm256_xor_si256(t[j], bias);  // w + 128, unsigned
    const __m256 dw = _mm256_loadu_ps(dw8 + b * 8);
    for (int r = 0; r < M; ++r) {
      // A 4-byte group broadcast straight from memory (a load, not a move through a register).
      const float* x = reinterpret_cast<const float*>(a + (rows[r] * nb + b) * QK8);
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int j = 0; j < 8; j += 2) {
        s0 = hybridkv::dpbusd(s0, t[j], _mm256_castps_si256(_mm256_broadcast_ss(x + j)));
        s1 = hybridkv::dpbusd(s1, t[j + 1], _mm256_castps_si256(_mm256_broadcast_ss(x + j + 1)));
      }
      const __m256i offset = _mm256_set1_epi32(xsum128[rows[r] * nb + b]);
      const __m256i sums = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), offset);
      const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(dx + rows[r] * nb + b));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
      if constexpr (B::HAS_MIN)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(dm8 + b * 8), _mm256_broadcast_ss(sx + rows[r] * nb + b), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) _mm256_storeu_ps(y + rows[r] * N, acc[r]);
}

#endif

#ifdef HYBRIDKV_ZMM
// `rows8_dot_m` on 512-bit vectors: 16 weight rows a pass (two 8-row transposes joined), so each
// broadcast 4-byte activation group and each block's offset and scale steps serve 16 rows. The
// same exact block sums; the 128·Σx offset starts the sum instead of being taken off after.
// dw16, dm16: [nb][16] the rows' scales (mins); y[rows[r]·N + 0..16) receives the 16 results.
template <typename B, int M>
void rows16_dot_m(const uint8_t* w, int64_t row_bytes, const float* dw16, const float* dm16, const int8_t* a,
                  const int32_t* xsum128, const float* dx, const float* sx, int64_t nb, const int64_t* rows, float* y,
                  int64_t N, const uint8_t* ahead) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead != nullptr)  // the next 16 rows' same blocks, spread over this pass
      hybridkv::prefetch_rows(ahead + b * B::BYTES, 16, row_bytes, B::BYTES);
    __m256i lo[8], hi[8];
    for (int i = 0; i < 8; ++i) {
      lo[i] = unpack<B>(w + i * row_bytes + b * B::BYTES);
      hi[i] = unpack<B>(w + (8 + i) * row_bytes + b * B::BYTES);
    }
    __m512i t[8];  // t[j] lane i: row i's bytes 4j..4j+3, shifted to unsigned
    hybridkv::transpose8x16(lo, hi, t);
    for (int j = 0; j < 8; ++j) t[j] = _mm512_xor_si512(t[j], bias);
    const __m512 dw = _mm512_loadu_ps(dw16 + b * 16);
    for (int r = 0; r < M; ++r) {
      const int64_t at = rows[r] * nb + b;
      const int32_t* x = reinterpret_cast<const int32_t*>(a + at * QK8);
      __m512i s0 = _mm512_set1_epi32(-xsum128[at]), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, t[j], _mm512_set1_epi32(x[j]));
        s1 = _mm512_dpbusd_epi32(s1, t[j + 1], _mm512_set1_epi32(x[j + 1]));
      }
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[r]);
      if constexpr (B::HAS_MIN)
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(dm16 + b * 16), _mm512_set1_ps(sx[at]), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + rows[r] * N, acc[r]);
}
#endif

#ifdef HYBRIDKV_VNNI
// `rows8_dot_m` (L = 8) or `rows16_dot_m` (L = 16) over activation rows rows[0..n), 8 at a time.
template <typename B, int L>
void rows_l_dot(const uint8_t* w, int64_t row_bytes, const float* dw, const float* dm, const int8_t* a,
                const int32_t* xsum128, const float* dx, const float* sx, int64_t nb, const int64_t* rows, int64_t n,
                float* y, int64_t N, const uint8_t* ahead) {
  auto run = [&](auto m, const int64_t* rs, const uint8_t* pf) {
    constexpr int M = decltype(m)::value;
#ifdef HYBRIDKV_ZMM
    if constexpr (L == 16) return rows16_dot_m<B, M>(w, row_bytes, dw, dm, a, xsum128, dx, sx, nb, rs, y, N, pf);
#endif
    if constexpr (L == 8) return rows8_dot_m<B, M>(w, row_bytes, dw, dm, a, xsum128, dx, sx, nb, rs, y, N, pf);
  };
  for (int64_t r0 = 0; r0 < n; r0 += 8) {
    const int64_t* rs = rows + r0;
    const uint8_t* pf = r0 == 0 ? ahead : nullptr;
    switch (std::min<int64_t>(n - r0, 8)) {
      case 8: run(std::integral_constant<int, 8>{}, rs, pf); break;
      case 7: run(std::integral_constant<int, 7>{}, rs, pf); break;
      case 6: run(std::integral_constant<int, 6>{}, rs, pf); break;
      case 5: run(std::integral_constant<int, 5>{}, rs, pf); break;
      case 4: run(std::integral_constant<int, 4>{}, rs, pf); break;
      case 3: run(std::integral_constant<int, 3>{}, rs, pf); break;
      case 2: run(std::integral_constant<int, 2>{}, rs, pf); break;
      default: run(std::integral_constant<int, 1>{}, rs, pf); break;
    }
  }
}
#endif

// f(Block{}) for the block type `id`; an unknown type is an error naming the ones there are.
template <typename F>
auto visit_block(int64_t id, F&& f) {
  switch (id) {
    case Q8_0Block::ID: return f(Q8_0Block{});
    case Q4_0Block::ID: return f(Q4_0Block{});
    case Q5_0Block::ID: return f(Q5_0Block{});
    case IQ4_NLBlock::ID: return f(IQ4_NLBlock{});
    case Q4_1Block::ID: return f(Q4_1Block{});
    case Q5_1Block::ID: return f(Q5_1Block{});
  }
  TORCH_CHECK(false, "ggml type ", id,
              " has no 8-bit-activation kernel here (Q8_0 8, Q4_0 2, Q5_0 6, IQ4_NL 20, Q4_1 3, Q5_1 7)");
}

// f(Block{}, integral_constant<Isa>) for the block type `id` and the code path `isa`.
template <typename F>
void dispatch(int64_t id, const std::string& isa, F&& f) {
  const Isa path = parse_isa(isa);
  visit_block(id, [&](auto block) {
    switch (path) {
      case Isa::Vnni: return f(block, std::integral_constant<Isa, Isa::Vnni>{});
      case Isa::Avx2: return f(block, std::integral_constant<Isa, Isa::Avx2>{});
      case Isa::Scalar: return f(block, std::integral_constant<Isa, Isa::Scalar>{});
    }
  });
}

// Checks the row bytes of w (last dimension) against K activation features of block type `id`.
void check_row_bytes(const at::Tensor& w, int64_t K, int64_t id, const char* op) {
  visit_block(id, [&](auto block) {
    using B = decltype(block);
    TORCH_CHECK(K % QK8 == 0 && w.size(-1) == K / QK8 * B::BYTES, op, ": activations of ", K, " features need ",
                B::NAME, " rows of ", K / QK8 * B::BYTES, " bytes (K a multiple of 32), got ", w.size(-1));
  });
}

int64_t check_rows(const at::Tensor& w, int64_t K, int64_t id, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": rows must be a contiguous uint8 [N, K/32*bytes] tensor, got ", w.scalar_type(), " ", w.sizes());
  check_row_bytes(w, K, id, op);
  return w.size(0);
}

// x [T, K] float32 → (q int8 [T, K], d float32 [T, K/32]).
std::tuple<at::Tensor, at::Tensor> quantize_rows_q8(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % QK8 == 0, "quantize_rows_q8: x must be [T, K] with K a multiple of 32, got ",
              x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({T, K}, x.options().dtype(at::kChar)), d = at::empty({T, K / QK8}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) quantize_row(xp + t * K, K, qp + t * K, dp + t * (K / QK8));
  });
  return {q, d};
}

// For the types with a min: each activation block's d·Σq [T, nb] (llama.cpp's Q8_1 `s`, in float32
// from the exact integer sum); empty for the others.
template <typename B>
std::vector<float> block_sums_of(const at::Tensor& q, const at::Tensor& d) {
  if constexpr (!B::HAS_MIN) return {};
  const int64_t blocks = d.numel();
  std::vector<float> sx(blocks);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  for (int64_t i = 0; i < blocks; ++i) {
    int32_t sum = 0;
    for (int j = 0; j < QK8; ++j) sum += qp[i * QK8 + j];
    sx[i] = static_cast<float>(sum) * dp[i];
  }
  return sx;
}

template <Isa I, typename B>
void block_sums_impl(const int8_t* a, int64_t T, const uint8_t* w, int64_t N, int64_t nb, int32_t* out) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t t = 0; t < T; ++t)
        row_block_sums<I, B>(w + n * nb * B::BYTES, a + t * nb * QK8, nb, out + (t * N + n) * nb);
  });
}

// The integer block sums of activation blocks q [T, K] with rows w [N, K/32*bytes] of block type
// `ggml_type` → int32 [T, N, K/32].
at::Tensor q8_block_sums(const at::Tensor& q_in, const at::Tensor& w, int64_t ggml_type, const std::string& isa) {
  TORCH_CHECK(q_in.scalar_type() == at::kChar && q_in.dim() == 2, "q8_block_sums: q must be int8 [T, K]");
  const at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), K = q.size(1), N = check_rows(w, K, ggml_type, "q8_block_sums"), nb = K / QK8;
  at::Tensor out = at::empty({T, N, nb}, q.options().dtype(at::kInt));
  dispatch(ggml_type, isa, [&](auto block, auto path) {
    block_sums_impl<decltype(path)::value, decltype(block)>(q.data_ptr<int8_t>(), T, w.data_ptr<uint8_t>(), N, nb,
                                                            out.data_ptr<int32_t>());
  });
  return out;
}

#ifdef HYBRIDKV_VNNI
// From this many activation rows on, `matmul_impl` takes the weight rows 8 or 16 at a time
// (`rows_l_dot`): its transposes pay off once several activation rows share them.
constexpr int64_t ROWS8_FROM = 4;

// Weight rows [n0, n0 + groups·L) of `matmul_impl` by `rows_l_dot`, threads splitting the groups.
template <typename B, int L>
void matmul_groups(const int8_t* a, const float* dx, const float* sx, const int32_t* xsum128, int64_t T,
                   const uint8_t* w, int64_t n0, int64_t groups, int64_t N, int64_t nb, float* y,
                   const int64_t* all_rows) {
  // Many activation rows (prefill) are taken TILE_T at a time against GROUPS groups of weight rows,
  // so both stay in L2: the weights are read from memory once, the activations once per GROUPS groups.
  constexpr int64_t GROUPS = 64 / L, TILE_T = 64;
  const int64_t row_bytes = nb * B::BYTES;
  hybridkv::claimed_for((groups + GROUPS - 1) / GROUPS, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> dw(GROUPS * nb * L), dm(B::HAS_MIN ? GROUPS * nb * L : 0);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g0 = c * GROUPS, g1 = std::min(groups, g0 + GROUPS);
      for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
        for (int64_t u = g0; u < g1; ++u) {
          const uint8_t* wr = w + (n0 + u * L) * row_bytes;
          float *d = dw.data() + (u - g0) * nb * L, *m = dm.data() + (B::HAS_MIN ? (u - g0) * nb * L : 0);
          if (t0 == 0) {  // the group's scales, widened once for all tiles
            for (int64_t b = 0; b < nb; ++b)
              for (int i = 0; i < L; ++i) d[b * L + i] = fp16(wr + i * row_bytes + b * B::BYTES);
            if constexpr (B::HAS_MIN)
              for (int64_t b = 0; b < nb; ++b)
                for (int i = 0; i < L; ++i) m[b * L + i] = fp16(wr + i * row_bytes + b * B::BYTES + 2);
          }
          // L short strided streams defeat the hardware prefetcher: the first pass over a group
          // fetches the next one, so its scales and codes are in cache when their turn comes.
          const uint8_t* ahead = t0 == 0 && u + 1 < groups ? wr + L * row_bytes : nullptr;
          rows_l_dot<B, L>(wr, row_bytes, d, m, a, xsum128, dx, sx, nb, all_rows + t0, std::min(TILE_T, T - t0),
                           y + n0 + u * L, N, ahead);
        }
      }
    }
  });
}

// `matmul_impl` by `matmul_groups`: W's rows in groups of 16 (512-bit vectors), then of 8, the
// last N % 8 one by one.
template <typename B>
void matmul_by_groups(const int8_t* a, const float* dx, const float* sx, int64_t T, const uint8_t* w, int64_t N,
                  int64_t nb, float* y, const int64_t* all_rows) {
  std::vector<int32_t> xsum128(T * nb);  // 128·Σq of each activation block
  for (int64_t i = 0; i < T * nb; ++i) {
    int32_t sum = 0;
    for (int j = 0; j < QK8; ++j) sum += a[i * QK8 + j];
    xsum128[i] = 128 * sum;
  }
  int64_t done = 0;
#ifdef HYBRIDKV_ZMM
  matmul_groups<B, 16>(a, dx, sx, xsum128.data(), T, w, 0, N / 16, N, nb, y, all_rows);
  done = N / 16 * 16;
#endif
  matmul_groups<B, 8>(a, dx, sx, xsum128.data(), T, w, done, (N - done) / 8, N, nb, y, all_rows);
  done += (N - done) / 8 * 8;
  const std::vector<int32_t> off = lane_offsets<Isa::Vnni>(a, done < N ? T : 0, nb);
  at::parallel_for(done, N, 1, [&](int64_t n0, int64_t n1) {  // the last N % 8 rows one by one
    std::vector<float> dw(nb);
    for (int64_t n = n0; n < n1; ++n)
      rows_dot<Isa::Vnni, B>(w + n * nb * B::BYTES, dw.data(), a, dx, sx, nb, all_rows, T, y + n, N,
                             off.empty() ? nullptr : off.data());
  });
}
#endif

// y [T, N] = x @ W.T: threads split W's rows; each weight row is read once from memory and its
// f16 scales widened once, then dotted with every activation row while it sits in L1. Each thread
// reads one contiguous stream. Whether software fetches each row ROW_AHEAD bytes on at one
// activation row is measured when a model loads (`hybridkv::stream_ahead_flag`): on Zen 4 (2
// threads, same-process A/B) the 248k-row Q8_0 head at 1-3 rows ran 12-40% faster without (a MoE
// Q8_0 decode step 9-18%), its hardware prefetcher following the stream better alone; on a Zen 5
// host the head at one row read 45.6 GB/s without, 51.0 with, and the 0.8B Q8_0 decode step
// 1.09-1.11x (at 3 rows 2-4% slower: not done there).
constexpr int64_t ROW_AHEAD = 4096;
template <Isa I, typename B>
void matmul_impl(const int8_t* a, const float* dx, const float* sx, int64_t T, const uint8_t* w, int64_t N, int64_t nb,
                 float* y) {
  std::vector<int64_t> all_rows(T);
  for (int64_t t = 0; t < T; ++t) all_rows[t] = t;
#ifdef HYBRIDKV_VNNI
  if constexpr (I == Isa::Vnni) {
    if (T >= ROWS8_FROM && N >= 8) return matmul_by_groups<B>(a, dx, sx, T, w, N, nb, y, all_rows.data());
  }
#endif
  const std::vector<int32_t> off = lane_offsets<I>(a, T, nb);
  const bool fetch_ahead = T == 1 && hybridkv::stream_ahead_flag().load(std::memory_order_relaxed);
  hybridkv::claimed_for(N, hybridkv::claim_items(nb * B::BYTES), [&](int64_t n0, int64_t n1) {
    std::vector<float> dw(nb);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * nb * B::BYTES;
#if defined(__x86_64__)
      if (fetch_ahead)  // past the end of a thread's share or of the tensor only costs a line
        for (int64_t line = 0; line < nb * B::BYTES; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wr + ROW_AHEAD + line), _MM_HINT_T0);
#endif
      rows_dot<I, B>(wr, dw.data(), a, dx, sx, nb, all_rows.data(), T, y + n, N, off.empty() ? nullptr : off.data());
    }
  });
}

// Rows ids of 32-weight-type rows w [V, K/32·bytes] as float32 [n, K]: an embedding lookup on a
// file's blocks, bit-identical to `QuantizedWeight.dequantize` of those rows (d·code, + m for the
// types with a min: d·code is exact in float32, so a fused multiply-add rounds the sum alike).
at::Tensor q8_dequantize_rows(const at::Tensor& w, const at::Tensor& ids_in, int64_t ggml_type) {
  at::Tensor out;
  visit_block(ggml_type, [&](auto block) {
    using B = decltype(block);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) % B::BYTES == 0,
                "q8_dequantize_rows: rows must be a contiguous uint8 [V, K/32*", B::BYTES, "] tensor, got ",
                w.scalar_type(), " ", w.sizes());
    const at::Tensor ids = ids_in.to(at::kLong).contiguous();
    const int64_t n = ids.numel(), V = w.size(0), nb = w.size(1) / B::BYTES;
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < V, "q8_dequantize_rows: row ", id[i], " out of range for ", V, " rows");
    out = at::empty({n, nb * QK8}, w.options().dtype(at::kFloat));
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, n * nb, 1024, [&](int64_t b0, int64_t b1) {
      int8_t q[QK8];
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = wp + (id[b / nb] * nb + b % nb) * B::BYTES;
        B::codes(blk, q);
        const float d = fp16(blk), m = B::HAS_MIN ? fp16(blk + 2) : 0.f;
        float* dst = op + b * QK8;
        for (int j = 0; j < QK8; ++j) dst[j] = B::HAS_MIN ? static_cast<float>(q[j]) * d + m : static_cast<float>(q[j]) * d;
      }
    });
  });
  return out;
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2, "q8_matmul: x must be [T, K], got ", x.sizes());
  const int64_t T = x.size(0), K = x.size(1), N = check_rows(w, K, ggml_type, "q8_matmul"), nb = K / QK8;
  const auto [q, d] = quantize_rows_q8(x);
  at::Tensor y = at::empty({T, N}, x.options().dtype(at::kFloat));
  dispatch(ggml_type, isa, [&](auto block, auto path) {
    using B = decltype(block);
    const std::vector<float> sx = block_sums_of<B>(q, d);
    matmul_impl<decltype(path)::value, B>(q.data_ptr<int8_t>(), d.data_ptr<float>(), sx.data(), T,
                                          w.data_ptr<uint8_t>(), N, nb, y.data_ptr<float>());
  });
  return y;
}

// y [P, N]: row p of x times expert ids[p]'s weight, w [E, N, K/32*bytes] (MoE decode: one call per
// projection for every (token, expert) pair). The pairs are grouped by expert and threads split
// each expert's rows: a row is read once for all the tokens routed to its expert.
template <Isa I, typename B>
void experts_impl(const int8_t* a, const float* dx, const float* sx, int64_t P, const uint8_t* w, const int64_t* ids,
                  int64_t N, int64_t nb, float* y) {
  const int64_t row_bytes = nb * B::BYTES;
  std::vector<int64_t> pairs, start;
  hybridkv::group_by_expert(ids, P, pairs, start);
  const int64_t G = static_cast<int64_t>(start.size()) - 1;
  const std::vector<int32_t> off = lane_offsets<I>(a, P, nb);
  hybridkv::claimed_for(G * N, hybridkv::claim_items(row_bytes), [&](int64_t u0, int64_t u1) {
    std::vector<float> dw(nb);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / N, n = u % N;
      const uint8_t* wr = w + (ids[pairs[start[g]]] * N + n) * row_bytes;
      rows_dot<I, B>(wr, dw.data(), a, dx, sx, nb, pairs.data() + start[g], start[g + 1] - start[g], y + n, N,
                     off.empty() ? nullptr : off.data());
    }
  });
}

at::Tensor q8_experts_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids_in, int64_t ggml_type,
                             const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "q8_experts_matmul: x must be [T, K] and w contiguous uint8 [E, N, K/32*bytes]");
  const int64_t T = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1), nb = K / QK8, P = ids_in.numel();
  check_row_bytes(w, K, ggml_type, "q8_experts_matmul");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  TORCH_CHECK(T > 0 ? P % T == 0 : P == 0, "q8_experts_matmul: the ", P, " expert ids must be a multiple of x's ", T,
              " rows (row t serves ids t·P/T ..)");
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "q8_experts_matmul: expert ", idp[p], " out of range");
  auto [q, d] = quantize_rows_q8(x);
  if (P > T) {  // each row quantized once, its blocks then read by each of its pairs
    q = q.repeat_interleave(P / T, 0);
    d = d.repeat_interleave(P / T, 0);
  }
  at::Tensor y = at::empty({P, N}, x.options().dtype(at::kFloat));
  dispatch(ggml_type, isa, [&](auto block, auto path) {
    using B = decltype(block);
    const std::vector<float> sx = block_sums_of<B>(q, d);
    experts_impl<decltype(path)::value, B>(q.data_ptr<int8_t>(), d.data_ptr<float>(), sx.data(), P,
                                           w.data_ptr<uint8_t>(), idp, N, nb, y.data_ptr<float>());
  });
  return y;
}

}  // namespace

namespace hybridkv::ops {  // for layer.cpp (ops.h)
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, const std::string& isa) {
  return ::q8_matmul(x, w, ggml_type, isa);
}
at::Tensor q8_experts_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, int64_t ggml_type,
                             const std::string& isa) {
  return ::q8_experts_matmul(x, w, ids, ggml_type, isa);
}
}  // namespace hybridkv::ops

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("q8_isas() -> str[]", q8_isas);  // no tensor to dispatch on: one kernel for every backend
  m.def("q8_experts_matmul(Tensor x, Tensor w, Tensor ids, int ggml_type, str isa) -> Tensor");
  m.def("quantize_rows_q8(Tensor x) -> (Tensor, Tensor)");
  m.def("q8_block_sums(Tensor q, Tensor w, int ggml_type, str isa) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor w, int ggml_type, str isa) -> Tensor");
  m.def("q8_dequantize_rows(Tensor w, Tensor ids, int ggml_type) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridkv, CPU, m) {
  m.impl("quantize_rows_q8", quantize_rows_q8);
  m.impl("q8_block_sums", q8_block_sums);
  m.impl("q8_matmul", q8_matmul);
  m.impl("q8_dequantize_rows", q8_dequantize_rows);
  m.impl("q8_experts_matmul", q8_experts_matmul);
}
