// K-quant decode kernels: Q4_K / Q5_K / Q6_K weights × Q8_K activations (PyTorch twin and Python
// signatures: hybridkv/ops/quant/k_dot.py).
//
// llama.cpp's scheme (ggml-cpu `ggml_vec_dot_q*_K_q8_K`): each activation row is quantized once into
// Q8_K super-blocks of 256 (f32 d, i8 q[256], i16 bsums[16]); a weight super-block, read in place
// from the file's rows, meets one as two exact integers, S = Σ_j sc_j·(q·x)_j over its sub-blocks
// and M = Σ_j m_j·bsum_j, and the row sum takes (d_w·d_x)·S − (dmin_w·d_x)·M: one float multiply-add
// per super-block. Q6_K's codes are unsigned with m_j = 32·sc_j in units of d: (d_w·d_x)·(S − M).
// Two code paths give the same integers: AVX2 (`maddubs`: u8 code × s8 activation into i16 pairs,
// then `madd` by the i16 scale into i32; with several activation rows each weight super-block is
// unpacked once for all of them) and a plain loop; `isa` picks one, so the tests run both. On VNNI,
// prefill-sized products (32+ activation rows) take 8 weight rows at a time with the lanes being
// weight rows (`rows8_kdot`): there the per-sub-block i32 multiply is shared by 8 rows; on AVX-512,
// products of 16+ rows take 16 (`rows16_kdot`), the next 16 prefetched during the pass; both meet
// the activation rows four at a time (`kdot8_rows`, `kdot16_rows`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "experts.h"
#include "ops.h"
#include "parallel.h"
#include "simd.h"

// The per-super-block functions run inside the row loops: a call would spill the vectors.
#define ALWAYS_INLINE inline __attribute__((always_inline))

namespace {

using hybridkv::fp16;
#ifdef __AVX2__
using hybridkv::hsum_f32;
using hybridkv::hsum_i32;
#endif

constexpr int QK_K = 256;
constexpr int kPrefetch = 4096;  // bytes of weights fetched ahead of the super-block being read
constexpr int64_t kQ4KR = 1012;  // Q4_K repacked at load (`Q4KR`): hybridkv's id, never in a file
constexpr int64_t kQ4KT = 1013;  // Q4_K tiled by 16 rows at load (below): the same
constexpr int64_t kQ6KT = 1014;  // Q6_K tiled by 16 rows at load (below): the same

enum class Isa { Scalar, Avx2 };


std::vector<std::string> kq_isas() {
  std::vector<std::string> isas;
#ifdef __AVX2__
  isas.push_back("avx2");
#endif
  isas.push_back("scalar");
  return isas;
}

Isa parse_isa(const std::string& name) {
  const std::string pick = hybridkv::pick_isa(kq_isas(), name);
  return pick == "avx2" ? Isa::Avx2 : Isa::Scalar;
}

// x [256] → Q8_K as `quantize_row_q8_K_ref`: the first element of largest |x| maps to −127 exactly
// (iscale = −127/max), so d = 1/iscale has the opposite sign of max. The product is rounded to
// float before nearbyint (ties to even), as the reference's separate `nearest_int` does.
void quantize_superblock(const float* x, int8_t* q, float* d, int16_t* bsums) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // The same integers 16 at a time (a vector is one bsum's group): |x|'s maximum (a NaN lane never
  // wins, as with `>`), then its first lane; the product rounded to nearest even (as nearbyint),
  // at most 127, converted with saturation (in range: |iscale·x| <= 127 rounds to at most 127).
  __m512 vmax = _mm512_setzero_ps();
  for (int j = 0; j < QK_K; j += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), vmax);
  const float amax = _mm512_reduce_max_ps(vmax);
  if (amax == 0.f) {
    std::memset(q, 0, QK_K);
    std::memset(bsums, 0, QK_K / 16 * sizeof(int16_t));
    *d = 0.f;
    return;
  }
  float peak = 0.f;
  for (int j = 0; j < QK_K; j += 16) {
    const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
    if (at) {
      peak = x[j + __builtin_ctz(at)];
      break;
    }
  }
  const float iscale = -127.f / peak;
  const __m512 vs = _mm512_set1_ps(iscale), top = _mm512_set1_ps(127.f);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int g = 0; g < QK_K / 16; ++g) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(vs, _mm512_loadu_ps(x + 16 * g)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i b = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(v, top)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * g), b);
    // Σ of the 16 codes: their unsigned (+128) bytes summed by sad, less 16 · 128.
    const __m128i sad = _mm_sad_epu8(_mm_xor_si128(b, flip), _mm_setzero_si128());
    bsums[g] = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_add_epi64(sad, _mm_unpackhi_epi64(sad, sad))) - 2048);
  }
  *d = 1.f / iscale;
#else
  float amax = 0.f, peak = 0.f;
  for (int j = 0; j < QK_K; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) amax = ax, peak = x[j];
  }
  if (amax == 0.f) {
    std::memset(q, 0, QK_K);
    std::memset(bsums, 0, QK_K / 16 * sizeof(int16_t));
    *d = 0.f;
    return;
  }
  const float iscale = -127.f / peak;
  for (int j = 0; j < QK_K; ++j) {
    const float v = iscale * x[j];
    q[j] = static_cast<int8_t>(std::min(127.f, std::nearbyint(v)));
  }
  for (int g = 0; g < QK_K / 16; ++g) {
    int s = 0;
    for (int j = 0; j < 16; ++j) s += q[g * 16 + j];
    bsums[g] = static_cast<int16_t>(s);
  }
  *d = 1.f / iscale;
#endif
}

// Q4_K/Q5_K's 12 scale bytes → 8 scales then 8 mins (6 bits each) as bytes of u[0..3], llama.cpp's
// word-wide `get_scale_min_k4`.
inline void k4_scales_mins(const uint8_t* scales, uint32_t u[4]) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  std::memcpy(u, scales, 12);
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t mins_lo = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = mins_lo;
  u[0] &= kmask1;
}

struct Sums {
  int32_t s, m;
};

// Each type: its block layout, where its d (and dmin) sit, and the integer sums of one super-block
// pair — `scalar` plainly, `avx2` as 8 lanes of S and of M (the lanes add up to S and M).
struct Q4K {
  static constexpr int bytes = 144, d_at = 0, dmin_at = 2, scale_codes = 32;  // codes a scale covers
  static constexpr bool mins_in_d = false, permuted = false;

  // The activation sums the mins multiply: [0 x 8 | sub-block j's sum, a pair of bsums, x 8].
  static void min_sums(const int16_t* bsums, int16_t* xs) {
    for (int j = 0; j < 8; ++j) xs[j] = 0, xs[8 + j] = static_cast<int16_t>(bsums[2 * j] + bsums[2 * j + 1]);
  }

  ALWAYS_INLINE static Sums scalar(const uint8_t* w, const int8_t* a, const int16_t* xs) {
    uint32_t u[4];
    k4_scales_mins(w + 4, u);
    const auto* sc = reinterpret_cast<const uint8_t*>(u);
    const uint8_t* qs = w + 16;
    Sums r{0, 0};
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in low nibbles, 2c+1 in high
      int32_t lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        lo += (qs[32 * c + l] & 15) * a[64 * c + l];
        hi += (qs[32 * c + l] >> 4) * a[64 * c + 32 + l];
      }
      r.s += sc[2 * c] * lo + sc[2 * c + 1] * hi;
    }
    for (int j = 8; j < 16; ++j) r.m += sc[j] * xs[j];
    return r;
  }
#ifdef __AVX2__
  ALWAYS_INLINE static void avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m);
#endif
};

struct Q5K {
  static constexpr int bytes = 176, d_at = 0, dmin_at = 2, scale_codes = 32;
  static constexpr bool mins_in_d = false, permuted = false;

  static void min_sums(const int16_t* bsums, int16_t* xs) { Q4K::min_sums(bsums, xs); }

  ALWAYS_INLINE static Sums scalar(const uint8_t* w, const int8_t* a, const int16_t* xs) {
    uint32_t u[4];
    k4_scales_mins(w + 4, u);
    const auto* sc = reinterpret_cast<const uint8_t*>(u);
    const uint8_t *qh = w + 16, *qs = w + 48;
    Sums r{0, 0};
    for (int j = 0; j < 8; ++j) {  // bit j of qh[l] is bit 4 of weight l of sub-block j
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15) | (((qh[l] >> j) & 1) << 4);
        dot += q * a[32 * j + l];
      }
      r.s += sc[j] * dot;
      r.m += sc[8 + j] * xs[8 + j];
    }
    return r;
  }
#ifdef __AVX2__
  ALWAYS_INLINE static void avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m);
#endif
};

struct Q6K {
  static constexpr int bytes = 210, d_at = 208, dmin_at = -1, scale_codes = 16;
  static constexpr bool mins_in_d = true, permuted = false;

  static void min_sums(const int16_t* bsums, int16_t* xs) { std::memcpy(xs, bsums, 16 * sizeof(int16_t)); }

  ALWAYS_INLINE static Sums scalar(const uint8_t* w, const int8_t* a, const int16_t* xs) {
    const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
    int32_t dot[16];
    for (int h = 0; h < 2; ++h) {  // per half: weight 32i + l from ql[l + 32(i&1)] nibble i/2, qh[l] bits 2i
      const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
      for (int i = 0; i < 4; ++i)
        for (int half = 0; half < 2; ++half) {  // one sub-block of 16: fixed shifts in the inner loop
          int32_t sum = 0;
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int q = ((ql[l + 32 * (i & 1)] >> (4 * (i >> 1))) & 15) | (((qh[l] >> (2 * i)) & 3) << 4);
            sum += q * a[128 * h + 32 * i + l];
          }
          dot[8 * h + 2 * i + half] = sum;
        }
    }
    Sums r{0, 0};
    for (int j = 0; j < 16; ++j) r.s += sc[j] * dot[j], r.m += 32 * sc[j] * xs[j];
    return r;
  }
#ifdef __AVX2__
  ALWAYS_INLINE static void avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m);
#endif
};

// Q2_K and Q3_K hold weight 128h + 32j + l (l < 32) in bits 2j, 2j+1 of qs byte 32h + l: the code's
// low 2 bits (`dequantize_row_q2_K`, `_q3_K`).
inline int k2_code(const uint8_t* qs, int i) {
  return (qs[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
}

// Q3_K's 12 scale bytes → its 16 signed scales (the stored 6 bits less 32): scale j's low 4 bits are
// the low (j < 8) or high (j >= 8) nibble of byte j % 8, its top 2 bits bits 2·(j / 4) of byte
// 8 + j % 4; four at a time in 32-bit words, as llama.cpp's kmask shuffle.
inline void q3k_scales(const uint8_t* s, int8_t* sc) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  uint32_t u[4];
  std::memcpy(u, s, 12);
  const uint32_t top = u[2];
  u[2] = ((u[0] >> 4) & kmask2) | (((top >> 4) & kmask1) << 4);
  u[3] = ((u[1] >> 4) & kmask2) | (((top >> 6) & kmask1) << 4);
  u[0] = (u[0] & kmask2) | ((top & kmask1) << 4);
  u[1] = (u[1] & kmask2) | (((top >> 2) & kmask1) << 4);
  std::memcpy(sc, u, 16);
  for (int j = 0; j < 16; ++j) sc[j] = static_cast<int8_t>(sc[j] - 32);
}

// S = Σ_j sc_j·(codes·a)_j and M = Σ_j m_j·xs_j over 16 sub-blocks of 16, code(i) weight i's
// unsigned code: Q2_K's and Q3_K's plain sums.
template <class Code>
inline Sums sums16(Code code, const int* sc, const int* m, const int8_t* a, const int16_t* xs) {
  Sums r{0, 0};
  for (int j = 0; j < 16; ++j) {
    int32_t dot = 0;
    for (int i = 16 * j; i < 16 * j + 16; ++i) dot += code(i) * a[i];
    r.s += sc[j] * dot;
    r.m += m[j] * xs[j];
  }
  return r;
}

// Q2_K: u8 scales[16] (sub-block j's scale in the low nibble, its min in the high one), u8 qs[64],
// f16 d, f16 dmin; 16 sub-blocks of 16, weight (d·sc_j)·q − dmin·m_j with q in 0..3.
struct Q2K {
  static constexpr int bytes = 84, d_at = 80, dmin_at = 82, scale_codes = 16;
  static constexpr bool mins_in_d = false, permuted = false;

  static void min_sums(const int16_t* bsums, int16_t* xs) { Q6K::min_sums(bsums, xs); }  // one per 16 weights

  ALWAYS_INLINE static Sums scalar(const uint8_t* w, const int8_t* a, const int16_t* xs) {
    int sc[16], m[16];
    for (int j = 0; j < 16; ++j) sc[j] = w[j] & 15, m[j] = w[j] >> 4;
    return sums16([w](int i) { return k2_code(w + 16, i); }, sc, m, a, xs);
  }
#ifdef __AVX2__
  ALWAYS_INLINE static void avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m);
#endif
};

// Q3_K: u8 hmask[32] (bit 2 of weight 32b + l at bit b of byte l), u8 qs[64], u8 scales[12], f16 d;
// 16 sub-blocks of 16, weight d·sc_j·(q − 4) with q in 0..7 (llama.cpp subtracts 4 where the hmask
// bit is clear). As Q6_K: unsigned codes, the offset in M (m_j = 4·sc_j in units of d).
struct Q3K {
  static constexpr int bytes = 110, d_at = 108, dmin_at = -1, scale_codes = 16;
  static constexpr bool mins_in_d = true, permuted = false;

  static void min_sums(const int16_t* bsums, int16_t* xs) { Q6K::min_sums(bsums, xs); }

  static int code(const uint8_t* w, int i) { return k2_code(w + 32, i) | (((w[i % 32] >> (i / 32)) & 1) << 2); }

  ALWAYS_INLINE static Sums scalar(const uint8_t* w, const int8_t* a, const int16_t* xs) {
    int8_t packed[16];
    q3k_scales(w + 96, packed);
    int sc[16], m[16];
    for (int j = 0; j < 16; ++j) sc[j] = packed[j], m[j] = 4 * packed[j];
    return sums16([w](int i) { return code(w, i); }, sc, m, a, xs);
  }
#ifdef __AVX2__
  ALWAYS_INLINE static void avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m);
#endif
};

// Q4_K as repacked in memory at load (ggml type 12's bytes, never written to a file; id
// `kQ4KR`): d, dmin and the 12 scale bytes as in Q4_K, the 128 code bytes permuted in 4-byte
// groups so that a 32-byte chunk's lanes hold different sub-blocks. Chunk c's lane j (bytes
// 4j..4j+3) is Q4_K's chunk j%4, bytes 4·(2c + j/4)..+3: low nibbles sub-block 2·(j%4), high
// nibbles sub-block 2·(j%4)+1, positions 8c + 4·(j/4) + b. One-row products then take each
// sub-block's scale per lane (one i32 multiply per chunk half after `dpbusd`, instead of a scale
// shuffle, a `madd` and an add per 32 codes), on activations put in the same order once per row
// (`permute`); so do the 2-15-row products (`unpack_lanes`: per-lane scales). The 8- and 16-row
// products unpack the chunks back to Q4_K's order (`unpack`). The exact same integers S and M as Q4_K.
struct Q4KR {
  static constexpr int bytes = 144, d_at = 0, dmin_at = 2, scale_codes = 32;
  static constexpr bool mins_in_d = false, permuted = true;

  static void min_sums(const int16_t* bsums, int16_t* xs) { Q4K::min_sums(bsums, xs); }

  // Code of sub-block s at position p (0..31).
  static int code(const uint8_t* w, int s, int p) {
    const int c = p / 8, j = s / 2 + 4 * ((p % 8) / 4);
    return (w[16 + 32 * c + 4 * j + p % 4] >> (4 * (s % 2))) & 15;
  }

  // One activation super-block in the order the one-row product reads it: for chunk c, 32 bytes
  // against the low nibbles, then 32 against the high ones.
  static void permute(const int8_t* a, int8_t* ap) {
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < 8; ++j)
        for (int half = 0; half < 2; ++half)
          std::memcpy(ap + 64 * c + 32 * half + 4 * j, a + 32 * (2 * (j % 4) + half) + 8 * c + 4 * (j / 4), 4);
  }

  // On activations in Q4_K's order (the plain loop does not need them permuted).
  ALWAYS_INLINE static Sums scalar(const uint8_t* w, const int8_t* a, const int16_t* xs) {
    uint32_t u[4];
    k4_scales_mins(w + 4, u);
    const auto* sc = reinterpret_cast<const uint8_t*>(u);
    Sums r{0, 0};
    for (int s = 0; s < 8; ++s) {
      int32_t dot = 0;
      for (int p = 0; p < 32; ++p) dot += code(w, s, p) * a[32 * s + p];
      r.s += sc[s] * dot;
    }
    for (int j = 8; j < 16; ++j) r.m += sc[j] * xs[j];
    return r;
  }
#ifdef __AVX2__
  // a: `permute`d activations.
  ALWAYS_INLINE static void avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m);
#endif
};

#ifdef __AVX2__
inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// The i16 pair sums of codes (u8, below 64) × activations (s8): |pair| <= 2·63·128 < 2^15, exact.
inline __m256i times_scale(__m256i codes, const int8_t* a, __m256i scale16) {
  return _mm256_madd_epi16(scale16, _mm256_maddubs_epi16(codes, load(a)));
}

// Q6_K's 16 scales as i16 (sc16: sc_0..7 | sc_8..15), half h's 8 in both 128-bit lanes.
inline __m256i half_scales(__m256i sc16, int h) { return _mm256_permute4x64_epi64(sc16, h ? 0xEE : 0x44); }

// Scales 8h + 2i (i16 lanes 0–7) and 8h + 2i + 1 (lanes 8–15), the i16 factors of `q6_codes`'s
// q[i] in half h, from half_scales(.., h): one byte shuffle.
inline __m256i pair_of_half(__m256i half, int i) {
  const int lo = 4 * i, hi = 4 * i + 2;
  return _mm256_shuffle_epi8(half, _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
                                                    lo + 1, lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi,
                                                    hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1));
}

// acc + the i32 sums of codes (u8, below 64) × activations (s8) in i16 pairs, times scale16.
inline __m256i add_scaled(__m256i acc, __m256i codes, const int8_t* a, __m256i scale16) {
#ifdef HYBRIDKV_VNNI
  return hybridkv::dpwssd(acc, _mm256_maddubs_epi16(codes, load(a)), scale16);
#else
  return _mm256_add_epi32(acc, times_scale(codes, a, scale16));
#endif
}

// Q4_K/Q5_K's scales and mins as i16 [sc_0..7 | m_0..7]; their products with the mins' activation
// sums [0 x 8 | sums] give M in lanes 4–7. `k4_scales_mins` in byte shuffles: the low bits of
// sc_0..3 | sc_4..7 | m_0..3 | m_4..7 come from bytes 0–3 | 8–11 (low nibbles) | 4–7 | 8–11 (high
// nibbles); the top 2 bits of sc_4..7 and m_4..7 from the spare bits 6–7 of bytes 0–3 and 4–7.
inline __m256i k4_scales_mins16(const uint8_t* w) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 4));  // 12 scale bytes, 4 of qs
  const __m128i lo = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low_bits = _mm_or_si128(
      _mm_and_si128(lo, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
      _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
  // A 16-bit shift: bits leaking in from the neighbouring byte land outside the masks.
  const __m128i top_bits = _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30));
  return _mm256_cvtepu8_epi16(_mm_or_si128(low_bits, top_bits));
}

// Scale k of 8 (i16, in both 128-bit halves of `scales`) in every i16 lane.
inline __m256i scale_of(__m256i scales, int k) {
  return _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(((2 * k + 1) << 8) | (2 * k))));
}

ALWAYS_INLINE void Q4K::avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) {
  const __m256i sm = k4_scales_mins16(w);
  const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
  const __m256i m4 = _mm256_set1_epi8(15);
  s = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i bits = load(w + 16 + 32 * c);
    const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
    s = add_scaled(s, lo, a + 64 * c, scale_of(scales, 2 * c));
    s = add_scaled(s, hi, a + 64 * c + 32, scale_of(scales, 2 * c + 1));
  }
  m = _mm256_madd_epi16(sm, load(xs));
}

// Lanes j of `scales` (i16 sc_0..7 in the low half) as i32: sc_{2(j%4)+odd}.
inline __m256i lane_scales(__m256i scales, int odd) {
  const __m128i pick = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13);
  return _mm256_cvtepu16_epi32(
      _mm_shuffle_epi8(_mm256_castsi256_si128(scales), _mm_add_epi8(pick, _mm_set1_epi8(static_cast<char>(2 * odd)))));
}

// acc + the i32 sums of each 4 codes (u8) × activations (s8).
inline __m256i dot4(__m256i acc, __m256i codes, const int8_t* a) {
#ifdef HYBRIDKV_VNNI
  return hybridkv::dpbusd(acc, codes, load(a));
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, load(a)), _mm256_set1_epi16(1)));
#endif
}

// A super-block's codes and scales decoded into registers, then met by one activation row (`dot`:
// the type's S and M) or, where there are 32 vector registers, by a few (`rows_lanes`: per row only
// the dot instructions and the float step). Q4KR's here; Q6K's with the several-row forms below.
template <class KT>
struct Decoded;

template <>
struct Decoded<Q4KR> {
  static constexpr int64_t MAX_T = 15;  // rows `rows_lanes` takes: below the 16-weight-row form
  __m256i lo[4], hi[4], sc_even, sc_odd, sm;
  ALWAYS_INLINE explicit Decoded(const uint8_t* w) {
    const __m256i m4 = _mm256_set1_epi8(15);
    sm = k4_scales_mins16(w);
    for (int c = 0; c < 4; ++c) {
      const __m256i bits = load(w + 16 + 32 * c);
      lo[c] = _mm256_and_si256(bits, m4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
    }
    sc_even = lane_scales(sm, 0);
    sc_odd = lane_scales(sm, 1);
  }
  ALWAYS_INLINE void dot(const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) const {
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      even = dot4(even, lo[c], a + 64 * c);
      odd = dot4(odd, hi[c], a + 64 * c + 32);
    }
    s = _mm256_add_epi32(_mm256_mullo_epi32(even, sc_even), _mm256_mullo_epi32(odd, sc_odd));
    m = _mm256_madd_epi16(sm, load(xs));
  }
};

ALWAYS_INLINE void Q4KR::avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) {
  Decoded<Q4KR>(w).dot(a, xs, s, m);
}

ALWAYS_INLINE void Q5K::avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) {
  const __m256i sm = k4_scales_mins16(w);
  const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
  const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
  const __m256i qh = load(w + 16);
  s = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i bits = load(w + 48 + 32 * c);
    // Bit j of each qh byte moved to bit 4: a 16-bit shift is safe once the other bits are masked.
    const __m256i h_lo = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c), 4), bit4);
    const __m256i h_hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c + 1), 4), bit4);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(bits, m4), h_lo);
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h_hi);
    s = add_scaled(s, lo, a + 64 * c, scale_of(scales, 2 * c));
    s = add_scaled(s, hi, a + 64 * c + 32, scale_of(scales, 2 * c + 1));
  }
  m = _mm256_madd_epi16(sm, load(xs));
}

// Half h of a Q6_K super-block: its 128 codes (weights l, l+32, l+64, l+96 of the half in q[0..3]),
// the top 2 bits from qh bits 0–1, 2–3, 4–5, 6–7 moved to bits 4–5 (16-bit shifts: what crosses
// a byte lands outside the mask).
ALWAYS_INLINE void q6_codes(const uint8_t* w, int h, __m256i q[4]) {
  const __m256i m15 = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  const __m256i ql0 = load(w + 64 * h), ql1 = load(w + 64 * h + 32), qh = load(w + 128 + 32 * h);
  q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top));
  q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15), _mm256_and_si256(qh, top));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
}

ALWAYS_INLINE void Q6K::avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) {
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();  // two chains of dot instructions
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];
    q6_codes(w, h, q);
    const __m256i half = half_scales(sc16, h);
    s0 = add_scaled(s0, q[0], a + 128 * h, pair_of_half(half, 0));
    s1 = add_scaled(s1, q[1], a + 128 * h + 32, pair_of_half(half, 1));
    s0 = add_scaled(s0, q[2], a + 128 * h + 64, pair_of_half(half, 2));
    s1 = add_scaled(s1, q[3], a + 128 * h + 96, pair_of_half(half, 3));
  }
  s = _mm256_add_epi32(s0, s1);
  m = _mm256_slli_epi32(_mm256_madd_epi16(load(xs), sc16), 5);  // 32·Σ sc_j·bsum_j
}

// Several activation rows (T >= 2): each weight super-block is unpacked once into the same form
// for every type, then each row costs 8 x (maddubs + madd): codes in activation order, the i16
// scale of each 32 codes' 16 pairs, and the mins as i16 against the mins' activation sums (the
// same integers as the types' own `avx2`).
struct alignas(32) Unpacked {
  uint8_t codes[QK_K];
  int16_t scales[8][16];
  int16_t mins[16];
};

inline void store(void* p, __m256i v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }

// Four 32-byte code chunks (bits) and the scales of a Q4_K-format block → `Unpacked`: vector k's
// scale is sub-block k's (Q4_K's chunks), or with `lanes` (Q4KR's chunks, whose 4-byte lane j holds
// sub-block 2·(j%4) in its low nibbles and 2·(j%4)+1 in its high ones) that sub-block's per lane.
ALWAYS_INLINE void unpack_q4k(const uint8_t* w, const __m256i bits[4], Unpacked& u, bool lanes = false) {
  const __m256i sm = k4_scales_mins16(w);
  const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int c = 0; c < 4; ++c) {
    store(u.codes + 64 * c, _mm256_and_si256(bits[c], m4));
    store(u.codes + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(bits[c], 4), m4));
  }
  if (lanes) {
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8,
                                          9, 8, 9, 12, 13, 12, 13);
    const __m256i lo = _mm256_shuffle_epi8(scales, even);
    const __m256i hi = _mm256_shuffle_epi8(scales, _mm256_add_epi8(even, _mm256_set1_epi8(2)));
    for (int k = 0; k < 8; ++k) store(u.scales[k], k % 2 ? hi : lo);
  } else {
    for (int k = 0; k < 8; ++k) store(u.scales[k], scale_of(scales, k));
  }
  store(u.mins, sm);
}

ALWAYS_INLINE void unpack(Q4K, const uint8_t* w, Unpacked& u) {
  const __m256i bits[4] = {load(w + 16), load(w + 48), load(w + 80), load(w + 112)};
  unpack_q4k(w, bits, u);
}

// Q4KR's chunks back in Q4_K's order: lane j of chunk c is Q4_K chunk j%4's 4-byte group 2c + j/4,
// so after pairing lanes j, j+4 (group 2c, 2c+1 of chunk j%4: 8-byte group c), Q4_K chunk k is the
// 8-byte groups k of the four chunks.
ALWAYS_INLINE void unpack(Q4KR, const uint8_t* w, Unpacked& u) {
  const __m256i pair = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i g[4];
  for (int c = 0; c < 4; ++c) g[c] = _mm256_permutevar8x32_epi32(load(w + 16 + 32 * c), pair);
  const __m256i lo01 = _mm256_unpacklo_epi64(g[0], g[1]), hi01 = _mm256_unpackhi_epi64(g[0], g[1]);
  const __m256i lo23 = _mm256_unpacklo_epi64(g[2], g[3]), hi23 = _mm256_unpackhi_epi64(g[2], g[3]);
  const __m256i bits[4] = {
      _mm256_permute2x128_si256(lo01, lo23, 0x20), _mm256_permute2x128_si256(hi01, hi23, 0x20),
      _mm256_permute2x128_si256(lo01, lo23, 0x31), _mm256_permute2x128_si256(hi01, hi23, 0x31)};
  unpack_q4k(w, bits, u);
}

ALWAYS_INLINE void unpack(Q5K, const uint8_t* w, Unpacked& u) {
  const __m256i sm = k4_scales_mins16(w);
  const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
  const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
  const __m256i qh = load(w + 16);
  for (int c = 0; c < 4; ++c) {
    const __m256i bits = load(w + 48 + 32 * c);
    const __m256i h_lo = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c), 4), bit4);
    const __m256i h_hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c + 1), 4), bit4);
    store(u.codes + 64 * c, _mm256_or_si256(_mm256_and_si256(bits, m4), h_lo));
    store(u.codes + 64 * c + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), h_hi));
  }
  for (int k = 0; k < 8; ++k) store(u.scales[k], scale_of(scales, k));
  store(u.mins, sm);
}

ALWAYS_INLINE void unpack(Q6K, const uint8_t* w, Unpacked& u) {
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
  for (int h = 0; h < 2; ++h) {
    __m256i q[4];
    q6_codes(w, h, q);
    const __m256i half = half_scales(sc16, h);
    for (int i = 0; i < 4; ++i) {
      store(u.codes + 128 * h + 32 * i, q[i]);
      store(u.scales[4 * h + i], pair_of_half(half, i));
    }
  }
  store(u.mins, _mm256_slli_epi16(sc16, 5));  // 32·sc_j: |.| <= 4096 fits i16
}

// Q2_K / Q3_K: code vector 4h + j is qs bytes 32h..32h+31 (`bits`) shifted by 2j, and for Q3_K
// hmask bit 4h + j as bit 2; scales per 16 codes in Q6_K's pairs; mins Q2_K's high nibbles, Q3_K's 4·sc.
ALWAYS_INLINE __m256i k2_codes(__m256i bits, const uint8_t* hmask, int h, int j) {
  const __m256i c = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * j), _mm256_set1_epi8(3));
  if (hmask == nullptr) return c;
  const __m256i high = _mm256_slli_epi16(_mm256_srli_epi16(load(hmask), 4 * h + j), 2);
  return _mm256_or_si256(c, _mm256_and_si256(high, _mm256_set1_epi8(4)));
}

ALWAYS_INLINE void unpack_k2_codes(const uint8_t* qs, const uint8_t* hmask, Unpacked& u) {
  for (int h = 0; h < 2; ++h) {
    const __m256i bits = load(qs + 32 * h);
    for (int j = 0; j < 4; ++j) store(u.codes + 128 * h + 32 * j, k2_codes(bits, hmask, h, j));
  }
}

ALWAYS_INLINE void unpack_k2_scales(__m256i sc16, Unpacked& u) {
  for (int h = 0; h < 2; ++h) {
    const __m256i half = half_scales(sc16, h);
    for (int i = 0; i < 4; ++i) store(u.scales[4 * h + i], pair_of_half(half, i));
  }
}

ALWAYS_INLINE void unpack(Q2K, const uint8_t* w, Unpacked& u) {
  unpack_k2_codes(w + 16, nullptr, u);
  const __m256i packed = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  unpack_k2_scales(_mm256_and_si256(packed, _mm256_set1_epi16(15)), u);
  store(u.mins, _mm256_srli_epi16(packed, 4));
}

// Q3_K's 16 signed scales as i16.
ALWAYS_INLINE __m256i q3k_scales16(const uint8_t* w) {
  alignas(16) int8_t sc[16];
  q3k_scales(w + 96, sc);
  return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(sc)));
}

ALWAYS_INLINE void unpack(Q3K, const uint8_t* w, Unpacked& u) {
  unpack_k2_codes(w + 32, w, u);
  const __m256i sc16 = q3k_scales16(w);
  unpack_k2_scales(sc16, u);
  store(u.mins, _mm256_slli_epi16(sc16, 2));  // 4·sc_j
}

// What `unpacked_dot` meets `dot_order` activations with: `unpack`, or for a repacked type its
// chunks as they lie, each lane scaled by its own sub-block (no permutation back).
template <class KT>
ALWAYS_INLINE void unpack_lanes(const uint8_t* w, Unpacked& u) {
  if constexpr (KT::permuted) {
    const __m256i bits[4] = {load(w + 16), load(w + 48), load(w + 80), load(w + 112)};
    unpack_q4k(w, bits, u, true);
  } else {
    unpack(KT{}, w, u);
  }
}

// An unpacked super-block in registers: 8 vectors of 32 codes and their i16 scales. Held across
// the activation rows that meet it, it leaves each row's product 8 activation loads (with the
// codes and scales reloaded from memory for every row, the load ports were the limit).
struct Held {
  __m256i codes[8], scales[8];
};

ALWAYS_INLINE Held hold(const Unpacked& u) {
  Held h;
  for (int k = 0; k < 8; ++k) h.codes[k] = load(u.codes + 32 * k), h.scales[k] = load(u.scales[k]);
  return h;
}

// S (8 lanes) of an unpacked weight super-block with one activation super-block.
ALWAYS_INLINE __m256i unpacked_dot(const Held& h, const int8_t* a) {
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int k = 0; k < 8; k += 2) {
#ifdef HYBRIDKV_VNNI
    s0 = hybridkv::dpwssd(s0, h.scales[k], _mm256_maddubs_epi16(h.codes[k], load(a + 32 * k)));
    s1 = hybridkv::dpwssd(s1, h.scales[k + 1], _mm256_maddubs_epi16(h.codes[k + 1], load(a + 32 * k + 32)));
#else
    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(h.scales[k], _mm256_maddubs_epi16(h.codes[k], load(a + 32 * k))));
    s1 = _mm256_add_epi32(
        s1, _mm256_madd_epi16(h.scales[k + 1], _mm256_maddubs_epi16(h.codes[k + 1], load(a + 32 * k + 32))));
#endif
  }
  return _mm256_add_epi32(s0, s1);
}

// Q2_K's and Q3_K's one-row products: each 32 codes decoded in registers (Q3_K: hmask bit 4h + j
// as bit 2) and met by their per-16 scales as Q6_K's are (two chains of dot instructions).
ALWAYS_INLINE __m256i k2_dot(const uint8_t* qs, const uint8_t* hmask, __m256i sc16, const int8_t* a) {
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const __m256i bits = load(qs + 32 * h), half = half_scales(sc16, h);
    for (int j = 0; j < 4; ++j) {
      const __m256i c = k2_codes(bits, hmask, h, j);
      if (j % 2)
        s1 = add_scaled(s1, c, a + 128 * h + 32 * j, pair_of_half(half, j));
      else
        s0 = add_scaled(s0, c, a + 128 * h + 32 * j, pair_of_half(half, j));
    }
  }
  return _mm256_add_epi32(s0, s1);
}

ALWAYS_INLINE void Q2K::avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) {
  const __m256i packed = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  s = k2_dot(w + 16, nullptr, _mm256_and_si256(packed, _mm256_set1_epi16(15)), a);
  m = _mm256_madd_epi16(_mm256_srli_epi16(packed, 4), load(xs));
}

ALWAYS_INLINE void Q3K::avx2(const uint8_t* w, const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) {
  const __m256i sc16 = q3k_scales16(w);
  s = k2_dot(w + 32, w, sc16, a);
  m = _mm256_slli_epi32(_mm256_madd_epi16(load(xs), sc16), 2);  // 4·Σ sc_j·bsum_j
}

#ifdef HYBRIDKV_ZMM
// Q6K's codes and per-16 scales built in registers (17 of them: only with 32), in `Held`'s form,
// without `unpack`'s round trip through memory.
template <>
struct Decoded<Q6K> {
  // Decoding a Q6_K block costs three times a Q4KR one: from 5 rows, two decodes (3 + 2 rows) ran
  // 14% slower than `rows_dot_unpacked`'s one unpacking (Zen 4, 1 thread, 1024 x 4096 in L2).
  static constexpr int64_t MAX_T = 4;
  Held h;
  __m256i sc16;
  ALWAYS_INLINE explicit Decoded(const uint8_t* w) {
    sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
    for (int half = 0; half < 2; ++half) {
      q6_codes(w, half, h.codes + 4 * half);
      const __m256i sc = half_scales(sc16, half);
      for (int i = 0; i < 4; ++i) h.scales[4 * half + i] = pair_of_half(sc, i);
    }
  }
  ALWAYS_INLINE void dot(const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) const {
    s = unpacked_dot(h, a);
    m = _mm256_slli_epi32(_mm256_madd_epi16(load(xs), sc16), 5);
  }
};

// Q2_K's and Q3_K's codes and scales built in registers, as Q6_K's. Against `rows_dot_unpacked`
// (1 thread, 4096 x 1024 in L2): Q3_K 1.10x at 2 rows, 1.02x at 3, even at 4, 0.73-0.80x at 5-15
// (two or more decodes); Q2_K 1.09x, 1.07x, 1.03x, then 0.89-0.93x.
template <class KT>
struct DecodedK2 {
  static constexpr int64_t MAX_T = std::is_same_v<KT, Q3K> ? 3 : 4;
  Held h;
  __m256i sc16, mins;  // Q3_K: mins unused (M = 4·Σ sc·bsum)
  ALWAYS_INLINE explicit DecodedK2(const uint8_t* w) {
    constexpr bool q3 = std::is_same_v<KT, Q3K>;
    if constexpr (q3) {
      sc16 = q3k_scales16(w);
    } else {
      const __m256i packed = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
      sc16 = _mm256_and_si256(packed, _mm256_set1_epi16(15));
      mins = _mm256_srli_epi16(packed, 4);
    }
    for (int half = 0; half < 2; ++half) {
      const __m256i bits = load(w + (q3 ? 32 : 16) + 32 * half), sc = half_scales(sc16, half);
      for (int j = 0; j < 4; ++j) {
        h.codes[4 * half + j] = k2_codes(bits, q3 ? w : nullptr, half, j);
        h.scales[4 * half + j] = pair_of_half(sc, j);
      }
    }
  }
  ALWAYS_INLINE void dot(const int8_t* a, const int16_t* xs, __m256i& s, __m256i& m) const {
    s = unpacked_dot(h, a);
    if constexpr (std::is_same_v<KT, Q3K>)
      m = _mm256_slli_epi32(_mm256_madd_epi16(load(xs), sc16), 2);
    else
      m = _mm256_madd_epi16(mins, load(xs));
  }
};
template <>
struct Decoded<Q2K> : DecodedK2<Q2K> {
  using DecodedK2<Q2K>::DecodedK2;
};
template <>
struct Decoded<Q3K> : DecodedK2<Q3K> {
  using DecodedK2<Q3K>::DecodedK2;
};

template <class KT>
constexpr bool kDecoded = std::is_same_v<KT, Q4KR> || std::is_same_v<KT, Q6K> || std::is_same_v<KT, Q2K> ||
                          std::is_same_v<KT, Q3K>;
#endif

// acc + (d_w·d_x)·S − (dmin_w·d_x)·M, or (d_w·d_x)·(S − M) for a type whose mins are in d (Q6_K):
// one super-block pair's float step.
template <class KT>
ALWAYS_INLINE __m256 add_superblock(__m256 acc, __m256i s, __m256i m, float dw, float dminw, float dx) {
  const float d = dw * dx;
  if constexpr (KT::mins_in_d) return _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(s, m)), acc);
  acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc);
  return _mm256_fmadd_ps(_mm256_set1_ps(-(dminw * dx)), _mm256_cvtepi32_ps(m), acc);
}

// add_superblock with the block's d_w and dmin_w read from it: for a type with both (adjacent f16),
// one conversion of the pair and one multiply by d_x.
template <class KT>
ALWAYS_INLINE __m256 add_block(__m256 acc, __m256i s, __m256i m, const uint8_t* wb, const float* dx) {
#ifdef __F16C__
  if constexpr (!KT::mins_in_d) {
    static_assert(KT::dmin_at == KT::d_at + 2);
    uint32_t pair;
    std::memcpy(&pair, wb + KT::d_at, 4);
    const __m128 scaled = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair))), _mm_broadcast_ss(dx));
    acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(scaled), _mm256_cvtepi32_ps(s), acc);
    return _mm256_fnmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(scaled)), _mm256_cvtepi32_ps(m), acc);
  }
#endif
  return add_superblock<KT>(acc, s, m, fp16(wb + KT::d_at), KT::mins_in_d ? 0.f : fp16(wb + KT::dmin_at), *dx);
}

// A super-block's d_w and dmin_w (0 for a type whose mins are in d).
template <class KT>
ALWAYS_INLINE float weight_d(const uint8_t* wb) {
  return fp16(wb + KT::d_at);
}
template <class KT>
ALWAYS_INLINE float weight_dmin(const uint8_t* wb) {
  if constexpr (KT::mins_in_d) return 0.f;
  return fp16(wb + KT::dmin_at);
}

#endif

// Each super-block's activation sums for the mins (`KT::min_sums`): 16 i16 per super-block.
template <class KT>
std::vector<int16_t> min_sums_of(const int16_t* bsums, int64_t superblocks) {
  std::vector<int16_t> xs(superblocks * 16);
  for (int64_t i = 0; i < superblocks; ++i) KT::min_sums(bsums + i * 16, xs.data() + i * 16);
  return xs;
}

// The activation rows (`superblocks` of them in all, from a) in the order KT's `avx2` and
// `unpacked_dot` on `unpack_lanes` read them on code path I: a itself, or a copy in `buf` for a
// repacked type (`KT::permute`). The 8- and 16-weight-row products read a as it is.
template <class KT, Isa I>
const int8_t* dot_order(const int8_t* a, int64_t superblocks, std::vector<int8_t>& buf) {
  if constexpr (KT::permuted && I == Isa::Avx2) {
    buf.resize(superblocks * QK_K);
    for (int64_t i = 0; i < superblocks; ++i) KT::permute(a + i * QK_K, buf.data() + i * QK_K);
    return buf.data();
  }
  return a;
}

template <class KT, Isa I>
inline Sums superblock(const uint8_t* w, const int8_t* a, const int16_t* xs) {
#ifdef __AVX2__
  if constexpr (I == Isa::Avx2) {
    __m256i s, m;
    KT::avx2(w, a, xs, s, m);
    return {hsum_i32(s), hsum_i32(m)};
  }
#endif
  return KT::scalar(w, a, xs);
}

#ifdef __AVX2__
// One weight row (nb super-blocks at w) · one activation row (q at a, d at dx; xs: its mins' sums,
// `min_sums`), before the final horizontal sum: 8 float lanes whose sum is the product.
template <class KT>
ALWAYS_INLINE __m256 row_lanes(const uint8_t* w, const int8_t* a, const float* dx, const int16_t* xs, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * KT::bytes;
    // One stream of weights keeps too few cache misses in flight: fetch ahead, past the row's end.
    for (int line = 0; line < KT::bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + line), _MM_HINT_T0);
    __m256i s, m;
    KT::avx2(wb, a + b * QK_K, xs + b * 16, s, m);
    acc = add_block<KT>(acc, s, m, wb, dx + b);
  }
  return acc;
}

// The sums of 8 vectors of 8 floats → one vector, lane i the sum of v[i]: the horizontal sums of 8
// weight rows in 9 instructions instead of 8 each.
ALWAYS_INLINE __m256 hsum8_f32(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Eight consecutive weight rows (row_bytes apart) · one activation row → y[0..8): the rows' loops
// inlined one after the other (the constants stay in registers) and one horizontal sum for all.
// With K = 1024 a row is 4 super-blocks, and the per-row call and sum were a fifth of the time.
template <class KT>
void rows8_dot(const uint8_t* w, int64_t row_bytes, const int8_t* a, const float* dx, const int16_t* xs, int64_t nb,
               float* y) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = row_lanes<KT>(w + i * row_bytes, a, dx, xs, nb);
  _mm256_storeu_ps(y, hsum8_f32(acc));
}

#ifdef HYBRIDKV_ZMM
// R activation rows (row r: codes at a + rows[r]·K in `dot_order`, scales at dx + rows[r]·nb, mins'
// sums at xs + rows[r]·nb·16) · one weight row → acc[r], 8 lanes each: each super-block decoded
// once for the R rows (`Decoded`), instead of `rows_dot_unpacked`'s unpacked block stored and
// reloaded: Q4_K_R 16-18% faster at 2-3 rows, 11% at 8 (4 + 4), Q6_K 12% at 2-3 (Zen 4, 1 thread,
// 1024 x 4096 in L2).
template <class KT, int R>
ALWAYS_INLINE void rows_lanes(const uint8_t* w, const int8_t* a, int64_t K, const float* dx, const int16_t* xs,
                              int64_t nb, const int64_t* rows, __m256* acc) {
  const int8_t* ar[R];
  const float* dr[R];
  const int16_t* xr[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    ar[r] = a + rows[r] * K, dr[r] = dx + rows[r] * nb, xr[r] = xs + rows[r] * nb * 16;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * KT::bytes;
    for (int line = 0; line < KT::bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + line), _MM_HINT_T0);
    const Decoded<KT> dec(wb);
    const float dw = weight_d<KT>(wb), dminw = weight_dmin<KT>(wb);
    for (int r = 0; r < R; ++r) {
      __m256i s, m;
      dec.dot(ar[r] + b * QK_K, xr[r] + b * 16, s, m);
      acc[r] = add_superblock<KT>(acc[r], s, m, dw, dminw, dr[r][b]);
    }
  }
}

// y[rows[i]·N] for activation rows rows[0..n) (2 <= n <= Decoded<KT>::MAX_T) against one weight row
// (`rows_lanes`, four rows at a time: 5 as 3 + 2).
template <class KT>
void rows_dot_decoded(const uint8_t* w, const int8_t* a, int64_t K, const float* dx, const int16_t* xs, int64_t nb,
                      const int64_t* rows, int64_t n, float* y, int64_t N) {
  __m256 acc[4];
  for (int64_t i = 0; i < n;) {
    const int64_t left = n - i, take = left == 5 ? 3 : std::min<int64_t>(4, left);
    switch (take) {
      case 4: rows_lanes<KT, 4>(w, a, K, dx, xs, nb, rows + i, acc); break;
      case 3: rows_lanes<KT, 3>(w, a, K, dx, xs, nb, rows + i, acc); break;
      case 2: rows_lanes<KT, 2>(w, a, K, dx, xs, nb, rows + i, acc); break;
      default: rows_lanes<KT, 1>(w, a, K, dx, xs, nb, rows + i, acc); break;
    }
    for (int64_t r = 0; r < take; ++r) y[rows[i + r] * N] = hsum_f32(acc[r]);
    i += take;
  }
}
#endif
#endif

// One weight row (nb super-blocks at w) · one activation row (q at a, d at dx; xs: its mins' sums, `min_sums`).
template <class KT, Isa I>
float row_dot(const uint8_t* w, const int8_t* a, const float* dx, const int16_t* xs, int64_t nb) {
#ifdef __AVX2__
  if constexpr (I == Isa::Avx2) return hsum_f32(row_lanes<KT>(w, a, dx, xs, nb));
#endif
  float y = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * KT::bytes;
    const Sums r = KT::scalar(wb, a + b * QK_K, xs + b * 16);
    const float d = fp16(wb + KT::d_at) * dx[b];
    if constexpr (KT::mins_in_d) {
      y += d * static_cast<float>(r.s - r.m);
    } else {
      y += d * static_cast<float>(r.s) - (fp16(wb + KT::dmin_at) * dx[b]) * static_cast<float>(r.m);
    }
  }
  return y;
}

// An activation's Q8_K blocks: quants q [T, K], scales d [T, K/256] and the sums of each 16 quants
// bsums [T, K/16], in one allocation (three a call were ~290 of the ~470 tensors a 0.8B decode
// step allocated); q starts on a 64-byte boundary.
struct Q8K {
  at::Tensor owner;
  int64_t T = 0, K = 0;
  int8_t* q = nullptr;
  float* d = nullptr;
  int16_t* bsums = nullptr;
};

// T rows of K activations' Q8_K blocks, not yet filled: d, bsums and q in one buffer (q 64-byte aligned).
Q8K q8k_rows(int64_t T, int64_t K, const at::TensorOptions& options) {
  const int64_t d_bytes = T * (K / QK_K) * 4, q_at = (d_bytes + T * (K / 16) * 2 + 63) / 64 * 64;
  Q8K r;
  r.owner = at::empty({q_at + T * K}, options.dtype(at::kByte));
  uint8_t* base = r.owner.data_ptr<uint8_t>();
  r.T = T, r.K = K;
  r.d = reinterpret_cast<float*>(base);
  r.bsums = reinterpret_cast<int16_t*>(base + d_bytes);
  r.q = reinterpret_cast<int8_t*>(base + q_at);
  return r;
}

Q8K quantize(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % QK_K == 0,
              "quantize_rows_q8_k: x must be [T, K] with K a multiple of 256, got ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t T = x.size(0), K = x.size(1), nb = K / QK_K;
  Q8K r = q8k_rows(T, K, x.options());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, T * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_superblock(xp + i * QK_K, r.q + i * QK_K, r.d + i, r.bsums + i * 16);
  });
  return r;
}

// xq's rows each repeated `per` times in a row (a copy of the quantized bytes): row p of the
// result is row p / per of xq.
Q8K repeat_rows(const Q8K& xq, int64_t per) {
  if (per == 1) return xq;
  const int64_t nb = xq.K / QK_K, P = xq.T * per;
  Q8K r = q8k_rows(P, xq.K, xq.owner.options());
  for (int64_t p = 0; p < P; ++p) {
    const int64_t t = p / per;
    std::memcpy(r.d + p * nb, xq.d + t * nb, nb * sizeof(float));
    std::memcpy(r.bsums + p * (xq.K / 16), xq.bsums + t * (xq.K / 16), xq.K / 16 * sizeof(int16_t));
    std::memcpy(r.q + p * xq.K, xq.q + t * xq.K, xq.K);
  }
  return r;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_q8_k(const at::Tensor& x) {
  const Q8K r = quantize(x);
  const auto options = x.options();
  return {at::from_blob(r.q, {r.T, r.K}, options.dtype(at::kChar)).clone(),
          at::from_blob(r.d, {r.T, r.K / QK_K}, options.dtype(at::kFloat)).clone(),
          at::from_blob(r.bsums, {r.T, r.K / 16}, options.dtype(at::kShort)).clone()};
}

int block_bytes(int64_t ggml_type) {
  switch (ggml_type) {
    case 10: return Q2K::bytes;
    case 11: return Q3K::bytes;
    case 12: return Q4K::bytes;
    case 13: return Q5K::bytes;
    case 14: return Q6K::bytes;
    case kQ4KR: return Q4KR::bytes;
    case kQ4KT: return Q4K::bytes;
    case kQ6KT: return Q6K::bytes;
  }
  TORCH_CHECK(false, "K-quant kernels take ggml types 10 (Q2_K), 11 (Q3_K), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K), ",
              kQ4KR, " (Q4_K repacked at load), ", kQ4KT, " and ", kQ6KT, " (Q4_K, Q6_K tiled at load), not ", ggml_type);
  return 0;
}

int64_t check_rows(const at::Tensor& w, int64_t K, int64_t ggml_type, const char* op) {
  const int bytes = block_bytes(ggml_type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": weight rows must be a contiguous uint8 [N, K/256*", bytes, "] tensor, got ", w.scalar_type(), " ",
              w.sizes());
  TORCH_CHECK(K % QK_K == 0 && w.size(1) == K / QK_K * bytes, op, ": activations of ", K, " features need rows of ",
              K / QK_K * bytes, " bytes (K a multiple of 256), got ", w.size(1));
  TORCH_CHECK((ggml_type != kQ4KT && ggml_type != kQ6KT) || w.size(0) % 16 == 0, op,
              ": tiled rows come 16 at a time, got ", w.size(0));
  return w.size(0);
}

template <class KT, Isa I>
void sums_impl(const int8_t* a, const int16_t* bs, int64_t T, int64_t K, const uint8_t* w, int64_t N, int32_t* out) {
  const int64_t nb = K / QK_K;
  const std::vector<int16_t> xs = min_sums_of<KT>(bs, T * nb);
  std::vector<int8_t> buf;
  const int8_t* a1 = dot_order<KT, I>(a, T * nb, buf);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + (n * nb + b) * KT::bytes;
#ifdef __AVX2__
        if constexpr (I == Isa::Avx2) {
          if (T >= 2) {  // as matmul_impl
            Unpacked u;
            unpack_lanes<KT>(wb, u);
            const Held h = hold(u);
            for (int64_t t = 0; t < T; ++t) {
              int32_t* o = out + ((t * N + n) * nb + b) * 2;
              o[0] = hsum_i32(unpacked_dot(h, a1 + t * K + b * QK_K));
              o[1] = hsum_i32(_mm256_madd_epi16(load(u.mins), load(&xs[(t * nb + b) * 16])));
            }
            continue;
          }
        }
#endif
        for (int64_t t = 0; t < T; ++t) {
          const Sums r = superblock<KT, I>(wb, a1 + t * K + b * QK_K, &xs[(t * nb + b) * 16]);
          int32_t* o = out + ((t * N + n) * nb + b) * 2;
          o[0] = r.s, o[1] = r.m;
        }
      }
  });
}

#ifdef __AVX2__
// Activation rows rows[0..n) (row r: codes at a + rows[r]·K in `dot_order`, scales at dx + rows[r]·nb,
// mins' sums at xs + rows[r]·nb·16) against one weight row w of nb super-blocks → y[rows[r]·N]: each
// super-block unpacked once for all of them. acc: room for n accumulators; prefetch: fetch the row ahead.
template <class KT>
void rows_dot_unpacked(const uint8_t* w, int64_t nb, int64_t K, const int8_t* a, const float* dx, const int16_t* xs,
                       const int64_t* rows, int64_t n, float* y, int64_t N, __m256* acc, bool prefetch) {
  Unpacked u;
  for (int64_t r = 0; r < n; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * KT::bytes;
    if (prefetch)
      for (int line = 0; line < KT::bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + line), _MM_HINT_T0);
    unpack_lanes<KT>(wb, u);
    const Held h = hold(u);
    const __m256i mins = load(u.mins);
    const float dw = weight_d<KT>(wb), dminw = weight_dmin<KT>(wb);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = rows[r];
      const __m256i s = unpacked_dot(h, a + t * K + b * QK_K);
      const __m256i m = _mm256_madd_epi16(mins, load(&xs[(t * nb + b) * 16]));
      acc[r] = add_superblock<KT>(acc[r], s, m, dw, dminw, dx[t * nb + b]);
    }
  }
  for (int64_t r = 0; r < n; ++r) y[rows[r] * N] = hsum_f32(acc[r]);
}
#endif

#ifdef __AVX2__
#ifdef HYBRIDKV_VNNI
using hybridkv::dpbusd;
using hybridkv::dpwssd;
#else
// Without VNNI (AVX2 alone): the byte dot by maddubs, exact here as K-quant codes are at most 63,
// so a pair's two products sum within int16 (|63·128·2| < 32767), then widened and added.
ALWAYS_INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
ALWAYS_INLINE __m256i dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
using hybridkv::transpose8;

// The first pair p of a row's 16 i16 mins (mn[p]: mins 2p, 2p + 1) that can be nonzero: a type with
// a scale per 32 codes keeps its 8 scales in the first half and its activation sums there are 0
// (`min_sums`), so the pairs before 4 add nothing (4 of 8 word dot products a row saved).
template <class KT>
constexpr int first_min_pair() {
  return KT::scale_codes == 32 ? 4 : 0;
}

// R activation rows against 8 transposed weight rows' super-block b (`rows8_kdot`'s ct, scales, mn):
// each code vector is loaded once for the R rows, and a type whose scales cover 32 codes (Q4_K,
// Q5_K) multiplies once per 32 codes instead of once per 16. The same integers S and M.
// (`rows8_kdot` alone, the 16-row form switched off: a 56-token chunk 1.25x faster with R = 4.)
template <class KT, int R>
ALWAYS_INLINE void kdot8_rows(const __m256i* ct, const int32_t (*scales)[8], const __m256i* mn, __m256 dw, __m256 dmin,
                              const int8_t* a, int64_t K, int64_t b, int64_t nb, const float* dx, const int16_t* xs,
                              const int64_t* rows, __m256* acc) {
  constexpr int G = KT::scale_codes / 16;  // 16-code groups a scale covers
  const int32_t* x[R];
  for (int i = 0; i < R; ++i) x[i] = reinterpret_cast<const int32_t*>(a + rows[i] * K + b * QK_K);
  __m256i S[R];
  for (int i = 0; i < R; ++i) S[i] = _mm256_setzero_si256();
  for (int h = 0; h < 16; h += G) {
    __m256i s[R];
    for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
    for (int j = 0; j < 4 * G; ++j) {
      const __m256i c = ct[4 * h + j];
      for (int i = 0; i < R; ++i) s[i] = dpbusd(s[i], c, _mm256_set1_epi32(x[i][4 * h + j]));
    }
    const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(scales[h]));
    for (int i = 0; i < R; ++i) S[i] = _mm256_add_epi32(S[i], _mm256_mullo_epi32(s[i], sc));
  }
  __m256i M[R];
  for (int i = 0; i < R; ++i) M[i] = _mm256_setzero_si256();
  for (int p = first_min_pair<KT>(); p < 8; ++p)
    for (int i = 0; i < R; ++i) {
      const int32_t* xm = reinterpret_cast<const int32_t*>(xs + (rows[i] * nb + b) * 16);
      M[i] = dpwssd(M[i], mn[p], _mm256_set1_epi32(xm[p]));
    }
  for (int i = 0; i < R; ++i) {
    const float dxi = dx[rows[i] * nb + b];
    const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(dxi));
    if constexpr (KT::mins_in_d) {
      acc[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(S[i], M[i])), acc[i]);
    } else {
      const __m256 dm = _mm256_mul_ps(dmin, _mm256_set1_ps(dxi));
      acc[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(S[i]), acc[i]);
      acc[i] = _mm256_fnmadd_ps(dm, _mm256_cvtepi32_ps(M[i]), acc[i]);
    }
  }
}

// Eight weight rows at once, lanes = weight rows (llama.cpp's repacked GEMM, without repacking the
// file): each row's super-block is unpacked (`unpack`: codes in activation order, a scale per 16
// codes, the mins as i16), the codes transposed so that vector g holds codes 4g..4g+3 of every row,
// and each activation row's 4-byte groups are broadcast against them: 4 dot instructions give the
// 8 rows' sums over 16 codes, one i32 multiply scales them. The same integers S and M as
// `rows_dot_unpacked`, with no horizontal add; one float step per super-block for 8 rows.
// w: 8 rows of row_bytes; rows[0..n) activation rows (n <= TILE_T); y[rows[r]·N + 0..8). ahead:
// the next 8 rows, fetched into L2 during this pass (or nullptr): 1.14-1.43x on weights streaming
// from memory (AVX2 build, [8192, 2048] Q4_K_R and Q6_K at 32 and 56 rows).
template <class KT>
void rows8_kdot(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t K, const int8_t* a, const float* dx,
                const int16_t* xs, const int64_t* rows, int64_t n, float* y, int64_t N, __m256* acc,
                const uint8_t* ahead) {
  Unpacked u[8];
  alignas(32) int32_t scales[16][8];
  alignas(32) float dws[8], dmins[8];
  __m256i ct[64], mn[8];
  for (int64_t r = 0; r < n; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead != nullptr) hybridkv::prefetch_rows<true>(ahead + b * KT::bytes, 8, row_bytes, KT::bytes);
    for (int i = 0; i < 8; ++i) {
      const uint8_t* wb = w + i * row_bytes + b * KT::bytes;
      unpack(KT{}, wb, u[i]);
      for (int h = 0; h < 16; ++h) scales[h][i] = u[i].scales[h / 2][(h % 2) * 8];
      dws[i] = weight_d<KT>(wb);
      dmins[i] = weight_dmin<KT>(wb);
    }
    for (int c = 0; c < 8; ++c) {  // codes 32c..32c+31 of each row: groups 8c..8c+7
      for (int i = 0; i < 8; ++i) ct[8 * c + i] = load(u[i].codes + 32 * c);
      transpose8(ct + 8 * c);
    }
    for (int i = 0; i < 8; ++i) mn[i] = load(u[i].mins);
    transpose8(mn);  // mn[p] lane i: row i's mins 2p, 2p+1
    const __m256 dw = _mm256_load_ps(dws), dmin = _mm256_load_ps(dmins);
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) kdot8_rows<KT, 4>(ct, scales, mn, dw, dmin, a, K, b, nb, dx, xs, rows + r, acc + r);
    for (; r < n; ++r) kdot8_rows<KT, 1>(ct, scales, mn, dw, dmin, a, K, b, nb, dx, xs, rows + r, acc + r);
  }
  for (int64_t r = 0; r < n; ++r) _mm256_storeu_ps(y + rows[r] * N, acc[r]);
}

#ifdef HYBRIDKV_ZMM
// R activation rows against 16 transposed weight rows' super-block b (`rows16_kdot`'s ct, scales,
// mn): each code vector is loaded once for the R rows, and a type whose scales cover 32 codes
// (Q4_K, Q5_K) multiplies once per 32 codes instead of once per 16. The same integers S and M.
// Against one row at a time (each dot instruction with a code load of its own), R = 4 took a
// 0.8B Q4_K_M prefill chunk from 287 to 242 ms at 56 tokens (1.18x), 1.18x at 100, 1.10x at 16
// (Zen 4, 2 threads; R = 6 and 8 were 2-3% slower than 4).
template <class KT, int R>
ALWAYS_INLINE void kdot16_rows(const __m512i* ct, const __m512i* scales, const __m512i* mn, __m512 dw,
                               __m512 dmin, const int8_t* a, int64_t K, int64_t b, int64_t nb, const float* dx,
                               const int16_t* xs, const int64_t* rows, __m512* acc) {
  constexpr int G = KT::scale_codes / 16;  // 16-code groups a scale covers
  const int32_t* x[R];
  for (int i = 0; i < R; ++i) x[i] = reinterpret_cast<const int32_t*>(a + rows[i] * K + b * QK_K);
  __m512i S[R];
  for (int i = 0; i < R; ++i) S[i] = _mm512_setzero_si512();
  for (int h = 0; h < 16; h += G) {
    __m512i s[R];
    for (int i = 0; i < R; ++i) s[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4 * G; ++j) {
      const __m512i c = ct[4 * h + j];
      for (int i = 0; i < R; ++i) s[i] = _mm512_dpbusd_epi32(s[i], c, _mm512_set1_epi32(x[i][4 * h + j]));
    }
    for (int i = 0; i < R; ++i) S[i] = _mm512_add_epi32(S[i], _mm512_mullo_epi32(s[i], scales[h]));
  }
  __m512i M[R];
  for (int i = 0; i < R; ++i) M[i] = _mm512_setzero_si512();
  for (int p = first_min_pair<KT>(); p < 8; ++p)
    for (int i = 0; i < R; ++i) {
      const int32_t* xm = reinterpret_cast<const int32_t*>(xs + (rows[i] * nb + b) * 16);
      M[i] = _mm512_dpwssd_epi32(M[i], mn[p], _mm512_set1_epi32(xm[p]));
    }
  for (int i = 0; i < R; ++i) {
    const float dxi = dx[rows[i] * nb + b];
    const __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(dxi));
    if constexpr (KT::mins_in_d) {
      acc[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(S[i], M[i])), acc[i]);
    } else {
      const __m512 dm = _mm512_mul_ps(dmin, _mm512_set1_ps(dxi));
      acc[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(S[i]), acc[i]);
      acc[i] = _mm512_fnmadd_ps(dm, _mm512_cvtepi32_ps(M[i]), acc[i]);
    }
  }
}

// `rows8_kdot` on 512-bit vectors: 16 weight rows a pass (each 8-row transpose joined with the next
// 8 rows'), so each broadcast activation group, scale multiply and float step serve 16 rows. The
// same integers S and M. ahead: the next 16 rows, prefetched during this pass (or nullptr).
template <class KT>
void rows16_kdot(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t K, const int8_t* a, const float* dx,
                 const int16_t* xs, const int64_t* rows, int64_t n, float* y, int64_t N, __m512* acc,
                 const uint8_t* ahead) {
  alignas(64) int32_t scales[16][16];
  alignas(64) float dws[16], dmins[16];
  __m512i ct[64], mn[8], sc[16];
  for (int64_t r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead != nullptr) hybridkv::prefetch_rows<true>(ahead + b * KT::bytes, 16, row_bytes, KT::bytes);
    __m256i lo[8], hi[8];
    if constexpr (std::is_same_v<KT, Q4K> || std::is_same_v<KT, Q4KR>) {
      // The packed code bytes transposed as they lie (4 transposes, not 8 of unpacked codes), then
      // split into nibbles, each 4-byte group stored in the slot of its codes in activation order:
      // the same vectors as through `unpack`, 1.07x the product at 56 rows (1 thread).
      alignas(32) int16_t sm[16][16];
      for (int i = 0; i < 16; ++i) {
        const uint8_t* wb = w + i * row_bytes + b * KT::bytes;
        store(sm[i], k4_scales_mins16(wb));
        dws[i] = weight_d<KT>(wb);
        dmins[i] = weight_dmin<KT>(wb);
      }
      const __m512i m4 = _mm512_set1_epi8(15);
      for (int c = 0; c < 4; ++c) {
        const uint8_t* wc = w + b * KT::bytes + 16 + 32 * c;
        for (int i = 0; i < 8; ++i) lo[i] = load(wc + i * row_bytes), hi[i] = load(wc + (8 + i) * row_bytes);
        __m512i packed[8];
        hybridkv::transpose8x16(lo, hi, packed);
        for (int j = 0; j < 8; ++j) {
          // Q4_K: group j of chunk c holds codes 64c + 4j (low nibbles) and 64c + 32 + 4j (high);
          // Q4_K_R: Q4_K's chunk j % 4, group 2c + j / 4.
          const int slot = KT::permuted ? 16 * (j % 4) + 2 * c + j / 4 : 16 * c + j;
          ct[slot] = _mm512_and_si512(packed[j], m4);
          ct[slot + 8] = _mm512_and_si512(_mm512_srli_epi16(packed[j], 4), m4);
        }
      }
      for (int i = 0; i < 8; ++i) lo[i] = load(sm[i]), hi[i] = load(sm[8 + i]);
    } else if constexpr (std::is_same_v<KT, Q6K>) {
      // Q6_K's ql and qh bytes transposed as they lie (6 transposes, not 8 of unpacked codes and
      // 16 unpackings), the codes then built in place: weight 128h + 32i + l is nibble i / 2 of ql
      // byte 64h + 32(i % 2) + l with bits 2i, 2i + 1 of qh byte 32h + l above it. The same vectors
      // as through `unpack`; the product 1.2-1.4x at 16 rows, 1.10x at 56 (2 threads, in cache).
      alignas(32) int16_t sm[16][16];
      for (int i = 0; i < 16; ++i) {
        const uint8_t* wb = w + i * row_bytes + b * KT::bytes;
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192));
        store(sm[i], _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5));  // 32·sc_j, as `unpack`'s mins
        dws[i] = weight_d<KT>(wb);
        dmins[i] = weight_dmin<KT>(wb);
      }
      const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        __m512i ql[2][8], qh[8];
        for (int c = 0; c < 2; ++c) {
          const uint8_t* wc = w + b * KT::bytes + 64 * h + 32 * c;
          for (int i = 0; i < 8; ++i) lo[i] = load(wc + i * row_bytes), hi[i] = load(wc + (8 + i) * row_bytes);
          hybridkv::transpose8x16(lo, hi, ql[c]);
        }
        const uint8_t* wh = w + b * KT::bytes + 128 + 32 * h;
        for (int i = 0; i < 8; ++i) lo[i] = load(wh + i * row_bytes), hi[i] = load(wh + (8 + i) * row_bytes);
        hybridkv::transpose8x16(lo, hi, qh);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 8; ++j) {
            const __m512i q = i < 2 ? ql[i % 2][j] : _mm512_srli_epi16(ql[i % 2][j], 4);
            // qh bits 2i, 2i + 1 to bits 4, 5: a 16-bit shift, the neighbouring byte's bits masked off
            const __m512i top = 2 * i <= 4 ? _mm512_slli_epi16(qh[j], 4 - 2 * i) : _mm512_srli_epi16(qh[j], 2 * i - 4);
            ct[32 * h + 8 * i + j] = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_and_si512(top, m30));
          }
      }
      for (int i = 0; i < 8; ++i) lo[i] = load(sm[i]), hi[i] = load(sm[8 + i]);
    } else {
      Unpacked u[16];
      for (int i = 0; i < 16; ++i) {
        const uint8_t* wb = w + i * row_bytes + b * KT::bytes;
        unpack(KT{}, wb, u[i]);
        for (int h = 0; h < 16; ++h) scales[h][i] = u[i].scales[h / 2][(h % 2) * 8];
        dws[i] = weight_d<KT>(wb);
        dmins[i] = weight_dmin<KT>(wb);
      }
      for (int c = 0; c < 8; ++c) {  // codes 32c..32c+31 of each row: groups 8c..8c+7
        for (int i = 0; i < 8; ++i) lo[i] = load(u[i].codes + 32 * c), hi[i] = load(u[8 + i].codes + 32 * c);
        hybridkv::transpose8x16(lo, hi, ct + 8 * c);
      }
      for (int i = 0; i < 8; ++i) lo[i] = load(u[i].mins), hi[i] = load(u[8 + i].mins);
    }
    hybridkv::transpose8x16(lo, hi, mn);  // mn[p] lane i: row i's mins 2p, 2p+1
    if constexpr (std::is_same_v<KT, Q4K> || std::is_same_v<KT, Q4KR>) {
      // A row's 8 scales lead its 16 scale-and-min lanes, so mn[p] holds its scales 2p and 2p + 1
      // in the low and high halves of lane i: split by two vector ops instead of 128 scalar stores
      // and loads (1.04x the product at 16 rows, 1.01x at 64; 1 thread).
      for (int p = 0; p < 4; ++p) {
        sc[4 * p] = _mm512_and_si512(mn[p], _mm512_set1_epi32(0xFFFF));
        sc[4 * p + 2] = _mm512_srli_epi32(mn[p], 16);
      }
    } else if constexpr (std::is_same_v<KT, Q6K>) {
      // mn[p] lane i: row i's 32·sc_2p and 32·sc_2p+1 (i16): the scales back by arithmetic shifts
      for (int p = 0; p < 8; ++p) {
        sc[2 * p] = _mm512_srai_epi32(_mm512_slli_epi32(mn[p], 16), 21);
        sc[2 * p + 1] = _mm512_srai_epi32(mn[p], 21);
      }
    } else {
      for (int h = 0; h < 16; ++h) sc[h] = _mm512_load_si512(scales[h]);
    }
    const __m512 dw = _mm512_load_ps(dws), dmin = _mm512_load_ps(dmins);
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) kdot16_rows<KT, 4>(ct, sc, mn, dw, dmin, a, K, b, nb, dx, xs, rows + r, acc + r);
    for (; r < n; ++r) kdot16_rows<KT, 1>(ct, sc, mn, dw, dmin, a, K, b, nb, dx, xs, rows + r, acc + r);
  }
  for (int64_t r = 0; r < n; ++r) _mm512_storeu_ps(y + rows[r] * N, acc[r]);
}
#endif
#endif

// Activation rows taken at once against a weight row: their accumulators, and the rows of prefill
// products' tiles (64 rows of 2048 features: 128 KiB, in L2 with the weight rows they meet).
constexpr int64_t TILE_T = 64;
// From this many activation rows on, a product without AVX-512 takes weight rows 8 at a time
// (`rows8_kdot`; with it, the rows the 16-row form leaves), dense or each expert's: its
// per-super-block transposes pay off only over several rows. Measured with the next rows fetched
// into L2 (Zen 4, 2 threads, weights streaming from memory, the AVX2 and 256-bit VNNI builds of
// HYBRIDKV_ARCH, against the unpacked form): dense Q4_K_R and Q6_K at 16 rows 0.98-1.09x without
// VNNI and 1.14-1.24x with it, at 24 1.04-1.28x and 1.28-1.49x; 64 experts at 7 tokens each
// 0.97-1.03x and 0.94-1.13x, at 12 1.08-1.19x and 1.29-1.68x.
constexpr int64_t rows8_from(bool experts) {
#ifdef HYBRIDKV_VNNI
  return experts ? 8 : 16;
#else
  return experts ? 8 : 24;
#endif
}
// On AVX-512 the 16-row form (`rows16_kdot`) pays from 16 rows: 1.5-2.5x `rows_dot_unpacked` at 16,
// 2-3x at 32. Below, its unpacking and transposes of 16 rows are shared by fewer activation rows.
constexpr int64_t ROWS16_FROM = 16;

// Where the 16-row form takes over from the decoded and unpacked forms, by type: for a dense
// weight, or for each expert's rows of an expert-indexed product (`experts_impl`, whose decoded
// form pays per expert). Q4_K and Q6_K (both transposed as they lie) measured (Zen 4, 2 threads,
// weights streaming from memory, rows16 against the form it replaces): dense Q4_K_R 1.01-1.32x at
// 6 rows, 1.10-1.51x at 8; dense Q6_K 0.94-1.18x at 8, 1.13-1.35x at 12; 64 experts of Q4_K_R at
// c tokens each 0.87-1.13x at c = 3, 1.06-1.29x at 4, 1.27-1.57x at 5; of Q6_K 0.82-0.89x at 5,
// 1.07-1.17x at 8, 1.19-1.36x at 10. The other types keep ROWS16_FROM.
template <class KT>
constexpr int64_t rows16_from(bool experts) {
  if constexpr (std::is_same_v<KT, Q4K> || std::is_same_v<KT, Q4KR>) return experts ? 4 : 8;
  if constexpr (std::is_same_v<KT, Q6K>) return experts ? 8 : 12;
  return ROWS16_FROM;
}

// y [T, N] = x @ W.T: threads split W's rows; each weight row is read once from memory and dotted
// with every activation row while it sits in L1 (T >= 2: each super-block unpacked once for all).
template <class KT, Isa I>
void matmul_impl(const Q8K& xq, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  const int64_t T = xq.T, K = xq.K, nb = K / QK_K;
  const int8_t* a = xq.q;
  const float* dx = xq.d;
  const std::vector<int16_t> xs = min_sums_of<KT>(xq.bsums, T * nb);
  std::vector<int8_t> buf;
  const int8_t* a1 = dot_order<KT, I>(a, T * nb, buf);
#ifdef __AVX2__
  if constexpr (I == Isa::Avx2) {
#ifdef HYBRIDKV_ZMM
    if constexpr (kDecoded<KT>) {
      if (T >= 2 && T <= Decoded<KT>::MAX_T && T < rows16_from<KT>(false)) {  // a few rows (batched decode, a verify)
        int64_t all_rows[ROWS16_FROM];
        for (int64_t t = 0; t < T; ++t) all_rows[t] = t;
        hybridkv::claimed_for(N, hybridkv::claim_items(nb * KT::bytes), [&](int64_t n0, int64_t n1) {
          for (int64_t n = n0; n < n1; ++n)
            rows_dot_decoded<KT>(w + n * nb * KT::bytes, a1, K, dx, xs.data(), nb, all_rows, T, y + n, ldy);
        });
        return;
      }
    }
#endif
    if (T >= 2) {
      // Many activation rows (prefill) are taken TILE_T at a time against 16 weight rows, so both
      // stay in L2: the weights are read from memory once, the activations once per 16 rows.
      constexpr int64_t ROWS = 16;
      std::vector<int64_t> all_rows(T);
      for (int64_t t = 0; t < T; ++t) all_rows[t] = t;
      hybridkv::claimed_for((N + ROWS - 1) / ROWS, 1, [&](int64_t c0, int64_t c1) {
        __m256 acc[TILE_T];  // on the stack, as `experts_impl`'s
#ifdef HYBRIDKV_ZMM
        __m512 acc16[TILE_T];
#endif
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
            const int64_t tiles = std::min(TILE_T, T - t0), end = std::min(N, (c + 1) * ROWS);
            int64_t n = c * ROWS;
#ifdef HYBRIDKV_ZMM
            if (T >= rows16_from<KT>(false) && n + 16 <= end) {
              // The first tile fetches the next 16 rows: 16 short strided streams defeat the hardware prefetcher.
              const uint8_t* ahead = t0 == 0 && end + 16 <= N ? w + end * nb * KT::bytes : nullptr;
              rows16_kdot<KT>(w + n * nb * KT::bytes, nb * KT::bytes, nb, K, a, dx, xs.data(), all_rows.data() + t0,
                              tiles, y + n, ldy, acc16, ahead);
              n += 16;
            }
#endif
            if (T >= rows8_from(false))
              for (; n + 8 <= end; n += 8)
                rows8_kdot<KT>(w + n * nb * KT::bytes, nb * KT::bytes, nb, K, a, dx, xs.data(), all_rows.data() + t0,
                               tiles, y + n, ldy, acc, t0 == 0 && n + 16 <= N ? w + (n + 8) * nb * KT::bytes : nullptr);
            for (; n < end; ++n)
              rows_dot_unpacked<KT>(w + n * nb * KT::bytes, nb, K, a1, dx, xs.data(), all_rows.data() + t0, tiles,
                                    y + n, ldy, acc, t0 == 0);
          }
      });
      return;
    }
  }
#endif
  hybridkv::claimed_for(N, hybridkv::claim_items(nb * KT::bytes), [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
#ifdef __AVX2__
    if constexpr (I == Isa::Avx2)
      if (T == 1)
        for (; n + 8 <= n1; n += 8)
          rows8_dot<KT>(w + n * nb * KT::bytes, nb * KT::bytes, a1, dx, xs.data(), nb, y + n);
#endif
    for (; n < n1; ++n)
      for (int64_t t = 0; t < T; ++t)
        y[t * ldy + n] = row_dot<KT, I>(w + n * nb * KT::bytes, a1 + t * K, dx + t * nb, &xs[t * nb * 16], nb);
  });
}

// --- Q4_K tiled by 16 rows (`kQ4KT`) -------------------------------------------------------------
// The same bytes as 16 Q4_K rows, laid out at load so that the 16-row form needs no transposes:
// for each super-block b of a tile of rows 16i..16i+15, 2304 bytes:
//   [0, 32) the 16 rows' d (fp16), [32, 64) their dmin,
//   [64, 256) 16 values × 12 bytes: value v (sc_v for v < 8, m_{v-8} after) of row r at bits
//             6r..6r+5 (little-endian across the 12 bytes),
//   [256, 2304) codes: group (c, g) (c < 4, g < 8) at 256 + 64(8c + g), row r's 4 bytes at +4r:
//             Q4_K code bytes 32c + 4g .. +3, whose low nibbles are sub-block 2c's weights
//             4g..4g+3 and high nibbles sub-block 2c+1's.
// The tensor keeps its shape [N, nb·144] (N a multiple of 16): rows 16i..16i+15 hold tile i, so
// slices at multiples of 16 rows are tiles too. One 64-byte load is 16 rows × 8 weights, a lane
// per row: a dpbusd per 4 weights of every row, no unpacking but two masks.
constexpr int64_t kTileSB = 16 * 144;

// One row's Q4_K block (144 bytes at q) into tile super-block t as row r (whose scale bits start
// at zero), or back (`inverse`).
void tile_block(uint8_t* t, uint8_t* q, int r, bool inverse) {
  auto move = [&](uint8_t* tile_at, uint8_t* q_at, int n) {
    if (inverse) std::memcpy(q_at, tile_at, n); else std::memcpy(tile_at, q_at, n);
  };
  move(t + 2 * r, q, 2);
  move(t + 32 + 2 * r, q + 2, 2);
  for (int c = 0; c < 4; ++c)
    for (int g = 0; g < 8; ++g) move(t + 256 + 64 * (8 * c + g) + 4 * r, q + 16 + 32 * c + 4 * g, 4);
  const int bit = 6 * r;
  if (!inverse) {
    uint32_t u[4];
    k4_scales_mins(q + 4, u);
    const auto* v = reinterpret_cast<const uint8_t*>(u);  // sc_0..7, m_0..7
    for (int k = 0; k < 16; ++k) {
      uint8_t* s = t + 64 + 12 * k;
      for (int i = 0; i < 6; ++i) s[(bit + i) / 8] |= static_cast<uint8_t>(((v[k] >> i) & 1) << ((bit + i) % 8));
    }
    return;
  }
  uint8_t v[16];
  for (int k = 0; k < 16; ++k) {
    const uint8_t* s = t + 64 + 12 * k;
    v[k] = 0;
    for (int i = 0; i < 6; ++i) v[k] |= ((s[(bit + i) / 8] >> ((bit + i) % 8)) & 1) << i;
  }
  // Q4_K's packing (`get_scale_min_k4` undone): 6-bit sc_j and m_j, j < 4, in bytes j and j + 4,
  // their j + 4 twins' low nibbles in byte j + 8 and top bits in the bytes' bits 6-7.
  uint8_t* s = q + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(v[j] | ((v[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(v[8 + j] | ((v[8 + j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((v[j + 4] & 15) | ((v[8 + j + 4] & 15) << 4));
  }
}

// K-quant rows [N, nb·bytes] (N a multiple of 16) → tiled (a copy), or back (`inverse`), a row's
// block at a time by move(tile super-block, block, row, inverse); `name` (kq_tile_q4_k...) in errors.
template <int bytes, class Move>
at::Tensor tile_rows(const at::Tensor& rows_in, bool inverse, const char* name, Move move) {
  TORCH_CHECK(rows_in.scalar_type() == at::kByte && rows_in.dim() == 2 && rows_in.size(0) % 16 == 0 &&
                  rows_in.size(1) % bytes == 0,
              name, ": rows must be uint8 [N, nb * ", bytes, "] with N a multiple of 16, got ", rows_in.scalar_type(),
              " ", rows_in.sizes());
  const at::Tensor rows = rows_in.contiguous();
  at::Tensor out = inverse ? at::empty_like(rows) : at::zeros_like(rows);  // tiles: bits OR-ed in
  const int64_t nb = rows.size(1) / bytes, tiles = rows.size(0) / 16;
  uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles * nb, 64, [&](int64_t i0, int64_t i1) {
    uint8_t block[bytes];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tile = i / nb, b = i % nb;
      for (int r = 0; r < 16; ++r) {
        const int64_t q_at = ((tile * 16 + r) * nb + b) * bytes, t_at = i * 16 * bytes;
        if (inverse) {
          move(src + t_at, block, r, true);
          std::memcpy(dst + q_at, block, bytes);
        } else {
          std::memcpy(block, src + q_at, bytes);
          move(dst + t_at, block, r, false);
        }
      }
    }
  });
  return out;
}

at::Tensor tile_q4_k(const at::Tensor& rows, bool inverse) {
  return tile_rows<144>(rows, inverse, "kq_tile_q4_k", tile_block);
}

// Row `row`'s block b (`bytes` each, nb a row) from rows w tiled by `move` (tile_block, tile_block6) into q.
template <int bytes, class Move>
inline void untiled_block(const uint8_t* w, int64_t nb, int64_t row, int64_t b, uint8_t* q, Move move) {
  move(const_cast<uint8_t*>(w + ((row / 16) * nb + b) * 16 * bytes), q, static_cast<int>(row % 16), true);
}

// Q6_K tiled by 16 rows (kQ6KT), built at load from the file's rows as Q4_K's tiles are: per
// tile of 16 rows and super-block, 16 × 210 = 3360 bytes,
//   [0, 32)       the 16 rows' d (fp16),
//   [32, 288)     scales: sub-block j's 16 rows (int8) at 32 + 16j,
//   [288, 3360)   16 groups m of 192 bytes at 288 + 192m, in the order they are read (from memory
//                 a single stream): two of low 4 bits, n = 2m and 2m + 1 at +64(n - 2m), row r's 4
//                 bytes at +4r, byte i holding weight 4n + i in its low nibble and 128 + 4n + i in
//                 its high; then one of top 2 bits at +128, row r's 4 bytes at +4r, byte i holding
//                 at bits 2k, k < 4, those of weight 8m + i (k = 0), 8m + 4 + i (1), 128 + 8m + i
//                 (2), 128 + 8m + 4 + i (3).
// Each 64-byte load is again 16 rows × 4 weights a lane per row; a 6-bit code takes a shift, a
// mask and a ternary-logic op to assemble, for 2 nibble loads and one of top bits per 16 weights.
constexpr int64_t kTile6SB = 16 * 210;

// Row r's codes (256, 0..63) of one Q6_K block q (ggml's order: `dequantize_q6k`), or back.
void q6k_codes(uint8_t* q, uint8_t* codes, bool inverse) {
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) {
        uint8_t& lo = q[64 * h + l + 32 * (i & 1)];
        uint8_t& hi = q[128 + 32 * h + l];
        uint8_t& c = codes[128 * h + 32 * i + l];
        const int lo_shift = 4 * (i >> 1), hi_shift = 2 * i;
        if (!inverse) {
          c = static_cast<uint8_t>(((lo >> lo_shift) & 15) | (((hi >> hi_shift) & 3) << 4));
        } else {
          lo = static_cast<uint8_t>(lo | ((c & 15) << lo_shift));
          hi = static_cast<uint8_t>(hi | ((c >> 4) << hi_shift));
        }
      }
}

// One row's Q6_K block (210 bytes at q) into tile super-block t as row r, or back (`inverse`).
void tile_block6(uint8_t* t, uint8_t* q, int r, bool inverse) {
  uint8_t codes[QK_K];
  if (!inverse) {
    q6k_codes(q, codes, false);
    std::memcpy(t + 2 * r, q + 208, 2);
    for (int j = 0; j < 16; ++j) t[32 + 16 * j + r] = q[192 + j];
    for (int n = 0; n < 32; ++n)
      for (int i = 0; i < 4; ++i)
        t[288 + 192 * (n / 2) + 64 * (n % 2) + 4 * r + i] =
            static_cast<uint8_t>((codes[4 * n + i] & 15) | ((codes[128 + 4 * n + i] & 15) << 4));
    for (int m = 0; m < 16; ++m)
      for (int i = 0; i < 4; ++i) {
        const int w[4] = {8 * m + i, 8 * m + 4 + i, 128 + 8 * m + i, 128 + 8 * m + 4 + i};
        uint8_t v = 0;
        for (int k = 0; k < 4; ++k) v = static_cast<uint8_t>(v | ((codes[w[k]] >> 4) << (2 * k)));
        t[288 + 192 * m + 128 + 4 * r + i] = v;
      }
    return;
  }
  for (int n = 0; n < 32; ++n)
    for (int i = 0; i < 4; ++i) {
      const uint8_t v = t[288 + 192 * (n / 2) + 64 * (n % 2) + 4 * r + i];
      codes[4 * n + i] = v & 15;
      codes[128 + 4 * n + i] = v >> 4;
    }
  for (int m = 0; m < 16; ++m)
    for (int i = 0; i < 4; ++i) {
      const int w[4] = {8 * m + i, 8 * m + 4 + i, 128 + 8 * m + i, 128 + 8 * m + 4 + i};
      const uint8_t v = t[288 + 192 * m + 128 + 4 * r + i];
      for (int k = 0; k < 4; ++k) codes[w[k]] = static_cast<uint8_t>(codes[w[k]] | (((v >> (2 * k)) & 3) << 4));
    }
  std::memset(q, 0, 192);  // ql and qh: their bits OR-ed back in
  q6k_codes(q, codes, true);
  for (int j = 0; j < 16; ++j) q[192 + j] = t[32 + 16 * j + r];
  std::memcpy(q + 208, t + 2 * r, 2);
}

at::Tensor tile_q6_k(const at::Tensor& rows, bool inverse) {
  return tile_rows<210>(rows, inverse, "kq_tile_q6_k", tile_block6);
}

#if defined(HYBRIDKV_ZMM) && defined(__AVX512VBMI__)
#define HYBRIDKV_TILED 1
// The 16 rows' 6-bit value at v (12 bytes; the 16-byte load stays inside the super-block) as i32 lanes.
ALWAYS_INLINE __m512i tile_value(const uint8_t* v) {
  // qword 0 = bytes 0-7 (rows 0-7 at bits 6r), qword 1 = bytes 4-11 (rows 8-15 at bits 6r - 32)
  const __m128i x = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)), 0x94);
  const __m128i at = _mm_setr_epi8(0, 6, 12, 18, 24, 30, 36, 42, 16, 22, 28, 34, 40, 46, 52, 58);
  return _mm512_cvtepu8_epi32(_mm_and_si128(_mm_multishift_epi64_epi8(at, x), _mm_set1_epi8(63)));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc += codes · (the 4 activation bytes at p, in every lane), the broadcast taken by the dot
// product's own load ({1to16}) rather than by a `vpbroadcastd` of its own, which GCC emits for
// `_mm512_set1_epi32(load_i32(p))`: half the instructions of the products' inner loop; the same
// integers. The 0.8B Q4_K_M chat turn 1.013x (one process, alternating; Zen 4, 2 threads).
ALWAYS_INLINE __m512i dpbusd_at(__m512i acc, __m512i codes, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// A tiled super-block's scales in lanes, decoded once for all the activation rows that meet it:
// the sub-blocks' scales (the even ones times 16: their codes are the low nibbles, the odd ones'
// high nibbles are taken as they lie, 16 × the code), the mins in i16 pairs (m_2j, m_2j+1), d/16
// and dmin.
struct TileScales {
  __m512i sc[8], mins[4];
  __m512 d16, dmin;
  ALWAYS_INLINE TileScales(const uint8_t* tb, int64_t /* rows */) {
    for (int s = 0; s < 8; ++s) sc[s] = tile_value(tb + 64 + 12 * s);
    for (int s = 0; s < 8; s += 2) sc[s] = _mm512_slli_epi32(sc[s], 4);
    for (int j = 0; j < 4; ++j)
      mins[j] = _mm512_or_si512(tile_value(tb + 64 + 12 * (8 + 2 * j)),
                                _mm512_slli_epi32(tile_value(tb + 64 + 12 * (9 + 2 * j)), 16));
    d16 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb))), _mm512_set1_ps(1.f / 16));
    dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 32)));
  }
};

// G activation rows (a[t]: this super-block's 256 codes; xpair[t]: its sub-block sums in i16 pairs;
// dx[t]) against one tiled super-block of 16 rows: acc[t] (lane r: row r) += d·dx·S − dmin·dx·M,
// S taken 16 times and d/16 undoing it, exactly (a power of two; |16·S| < 2^31); `first`: = instead
// of += (the accumulators are not zeroed beforehand: GCC made that a memset, 1-2% of a 56-row product).
template <int G>
ALWAYS_INLINE void tiled_superblock(const uint8_t* tb, const TileScales& k, const int8_t* const* a,
                                    const int32_t* const* xpair, const float* dx, __m512* acc, bool first) {
  const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i S[G], M[G];
  for (int t = 0; t < G; ++t) S[t] = M[t] = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    __m512i lo[G], hi[G];
    for (int t = 0; t < G; ++t) lo[t] = hi[t] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      __m512i codes = _mm512_loadu_si512(tb + 256 + 64 * (8 * c + g));
      asm("" : "+v"(codes));  // loaded once: GCC otherwise folds the load into both masks
      const __m512i cl = _mm512_and_si512(codes, low), ch = _mm512_and_si512(codes, high);
      for (int t = 0; t < G; ++t) {
        lo[t] = dpbusd_at(lo[t], cl, a[t] + 64 * c + 4 * g);
        hi[t] = dpbusd_at(hi[t], ch, a[t] + 64 * c + 32 + 4 * g);
      }
    }
    for (int t = 0; t < G; ++t)
      S[t] = _mm512_add_epi32(S[t], _mm512_add_epi32(_mm512_mullo_epi32(lo[t], k.sc[2 * c]),
                                                     _mm512_mullo_epi32(hi[t], k.sc[2 * c + 1])));
  }
  for (int t = 0; t < G; ++t) {
    for (int j = 0; j < 4; ++j) M[t] = _mm512_dpwssd_epi32(M[t], k.mins[j], _mm512_set1_epi32(xpair[t][j]));
    const __m512 x = _mm512_set1_ps(dx[t]);
    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(k.d16, x), _mm512_cvtepi32_ps(S[t]), first ? _mm512_setzero_ps() : acc[t]);
    acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(k.dmin, x), _mm512_cvtepi32_ps(M[t]), acc[t]);
  }
}

// Q6_K's G activation rows against one tiled super-block of 16 rows: acc[t] (lane r: row r) +=
// d·dx·(S − 32·M), S = Σ_j sc_j·(q·x)_j over the 16 sub-blocks (q the unsigned 6-bit codes) and
// M = Σ_j sc_j·bsum_j, the codes' −32 (|S| < 2^31: 16·128·16·63·127); `first`: = instead of +=.
// Group m's four vectors of 6-bit codes (weights 8m.., 8m + 4.., 128 + 8m.., 128 + 8m + 4..):
// (A & 15) | X with X's bits only at 0x30, ternary-logic table 0xEA = (a & b) | c.
ALWAYS_INLINE void tile6_codes(const uint8_t* tb, int m, __m512i* c) {
  const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  const uint8_t* g = tb + 288 + 192 * m;
  const __m512i A0 = _mm512_loadu_si512(g), A1 = _mm512_loadu_si512(g + 64), H = _mm512_loadu_si512(g + 128);
  c[0] = _mm512_ternarylogic_epi32(A0, low, _mm512_and_si512(_mm512_slli_epi16(H, 4), top), 0xEA);
  c[1] = _mm512_ternarylogic_epi32(A1, low, _mm512_and_si512(_mm512_slli_epi16(H, 2), top), 0xEA);
  c[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(A0, 4), low, _mm512_and_si512(H, top), 0xEA);
  c[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(A1, 4), low, _mm512_and_si512(_mm512_srli_epi16(H, 2), top), 0xEA);
}

// A tiled Q6_K super-block's scales, decoded once for all the activation rows that meet it: the
// sub-blocks' scales as i16 pairs (2i, 2i+1) for the mins' dpwssd, and d; for more than 4 rows
// (prefill) its codes too, assembled once into 4 KiB that stay in L1 (else per 4 rows, as met).
struct Tile6Scales {
  __m512i pair[8];
  __m512 d;
  bool expanded;
  __m512i codes[64];
  ALWAYS_INLINE Tile6Scales(const uint8_t* tb, int64_t rows) : expanded(rows > 4) {
    if (expanded)
      for (int m = 0; m < 16; ++m) tile6_codes(tb, m, codes + 4 * m);
    for (int i = 0; i < 8; ++i) {
      const __m512i even = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 32 + 32 * i)));
      const __m512i odd = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 48 + 32 * i)));
      pair[i] = _mm512_or_si512(_mm512_and_si512(even, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(odd, 16));
    }
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)));
  }
};

template <int G>
ALWAYS_INLINE void tiled6_superblock(const uint8_t* tb, const Tile6Scales& k, const int8_t* const* a,
                                     const int32_t* const* xpair, const float* dx, __m512* acc, bool first) {
  __m512i S[G], M[G];
  for (int t = 0; t < G; ++t) S[t] = M[t] = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) {  // sub-blocks j (weights 16j..) and 8 + j (128 + 16j..)
    __m512i P[G], Q[G];
    for (int t = 0; t < G; ++t) P[t] = Q[t] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const int m = 2 * j + h, n = 2 * m;  // group m: nibble groups n, n + 1 and their top bits
      __m512i own[4];
      const __m512i* c = k.codes + 4 * m;
      if (!k.expanded) {
        tile6_codes(tb, m, own);
        c = own;
      }
      for (int t = 0; t < G; ++t) {
        P[t] = dpbusd_at(P[t], c[0], a[t] + 4 * n);
        P[t] = dpbusd_at(P[t], c[1], a[t] + 4 * n + 4);
        Q[t] = dpbusd_at(Q[t], c[2], a[t] + 128 + 4 * n);
        Q[t] = dpbusd_at(Q[t], c[3], a[t] + 128 + 4 * n + 4);
      }
    }
    const __m512i sl = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 32 + 16 * j)));
    const __m512i sh = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 32 + 16 * (8 + j))));
    for (int t = 0; t < G; ++t)
      S[t] = _mm512_add_epi32(S[t], _mm512_add_epi32(_mm512_mullo_epi32(P[t], sl), _mm512_mullo_epi32(Q[t], sh)));
  }
  for (int t = 0; t < G; ++t) {
    for (int i = 0; i < 8; ++i) M[t] = _mm512_dpwssd_epi32(M[t], k.pair[i], _mm512_set1_epi32(xpair[t][i]));
    const __m512i diff = _mm512_sub_epi32(S[t], _mm512_slli_epi32(M[t], 5));
    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(k.d, _mm512_set1_ps(dx[t])), _mm512_cvtepi32_ps(diff),
                             first ? _mm512_setzero_ps() : acc[t]);
  }
}

// The two tiled types as `tiled_matmul` reads them: bytes per tile super-block, the activations'
// i16 sum pairs per super-block (Q4_K: its 8 sub-blocks of 32 from bsums' 16; Q6_K: bsums as they
// lie), and the product of G rows.
struct Tile4 {
  static constexpr int64_t bytes = kTileSB, pairs = 4;
  static int32_t pair(const int16_t* bs, int64_t i) {  // sub-blocks 2i, 2i+1 of a super-block's 8
    const uint32_t even = static_cast<uint16_t>(bs[4 * i] + bs[4 * i + 1]);
    const uint32_t odd = static_cast<uint16_t>(bs[4 * i + 2] + bs[4 * i + 3]);
    return static_cast<int32_t>(even | (odd << 16));
  }
  using Scales = TileScales;
  template <int G>
  ALWAYS_INLINE static void superblock(const uint8_t* tb, const Scales& k, const int8_t* const* a,
                                       const int32_t* const* xp, const float* dx, __m512* acc, bool first) {
    tiled_superblock<G>(tb, k, a, xp, dx, acc, first);
  }
};
struct Tile6 {
  static constexpr int64_t bytes = kTile6SB, pairs = 8;
  static int32_t pair(const int16_t* bs, int64_t i) {
    const uint32_t even = static_cast<uint16_t>(bs[2 * i]), odd = static_cast<uint16_t>(bs[2 * i + 1]);
    return static_cast<int32_t>(even | (odd << 16));
  }
  using Scales = Tile6Scales;
  template <int G>
  ALWAYS_INLINE static void superblock(const uint8_t* tb, const Scales& k, const int8_t* const* a,
                                       const int32_t* const* xp, const float* dx, __m512* acc, bool first) {
    tiled6_superblock<G>(tb, k, a, xp, dx, acc, first);
  }
};

// Each pair of sub-blocks' activation sums (|sum| <= 32·128) as one i32: the even one's in the low
// 16 bits, the odd one's in the high (`_mm512_dpwssd_epi32`'s pairs), P a super-block.
template <class TT>
std::vector<int32_t> tile_pairs(const Q8K& xq) {
  const int64_t sbs = xq.T * (xq.K / QK_K), P = TT::pairs;
  std::vector<int32_t> xpair(sbs * P);
  for (int64_t sb = 0; sb < sbs; ++sb)
    for (int64_t i = 0; i < P; ++i) xpair[sb * P + i] = TT::pair(xq.bsums + 16 * sb, i);
  return xpair;
}

// Decode streams the weights once at a few operations a cache line: on a Zen 5 host too few
// lines were in flight for the read bandwidth when only the out-of-order window asked (a tiled
// product at one row read 21 GB/s on one core, where a sum reads 41). There, each super-block met
// by at most STREAM_ROWS activation rows asking for the bytes STREAM_AHEAD past it into L1 (1-4
// KiB: the same within noise; past the end of a thread's share or of the tensor only costs a
// line) took 1 row, 2 threads from 37 to 51 GB/s (Q6_K), 38 to 56 (Q4_K); 8 rows Q6_K 26 → 31,
// Q4_K the same; 16 rows nothing; the 0.8B Q4_K_M decode step 1.27x. On a Zen 4 host a software
// prefetch of these streams (then the next tile, into L2) made decode slower (0.88x; its hardware
// prefetcher followed them better alone) and so did the Q8_0 products' 4 KiB fetch, so whether to
// ask is `hybridkv::stream_ahead_flag()`: `ops.quant.stream.tune` measures both on the model's
// largest streamed weight when a model loads. Into L2 (T1, as `ahead`) or a tile on (9-32 KiB):
// less than this on the Zen 5 host.
constexpr int64_t STREAM_AHEAD = 2048, STREAM_ROWS = 8;
ALWAYS_INLINE void stream_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + STREAM_AHEAD + line), _MM_HINT_T0);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define HYBRIDKV_AMX 1
// Intel AMX (Sapphire Rapids on): one tile instruction multiplies 16 rows × 64 signed bytes by
// 64 × 16 bytes (in 4-byte groups a row) into 16 × 16 i32 sums, 16,384 products where a
// `vpdpbusd` does 64. Tiled Q4_K products of 16+ activation rows (prefill chunks, chat turns)
// run on it: A = 16 activation rows' Q8_K bytes, 64 (two sub-blocks) a tile; B = the weight
// tile's codes times their sub-block's scale, which a 64-byte group of the tiled layout (16
// weight rows × 4 codes: a row of B as it lies) shares. A 6-bit scale times a 4-bit code does not
// fit a byte, so each scale is split, sc = 8·hi + lo (3 bits each), into two B tiles of byte
// products (at most 7·15), and C_hi, C_lo (row t lane r) sum a whole super-block's products each:
// 16·S = 128·C_hi + 16·C_lo, the integer `tiled_superblock` sums with dot instructions, turned into
// floats the same way, so the products are the same floats, bit for bit (tested against each
// other). Per sub-block tiles of the scale-free codes, each scaled after, measured 1.2-1.3x the
// dot instructions (the tile loads and stores of 32 codes a row, not the products, were the
// cost); these 2x-2.5x (below). Q6_K's 8-bit scales times 6-bit codes would take three tiles.

// Linux gives a process AMX's tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); a tile instruction before then faults. Whether it was given; asked once.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
// Whether the tiled Q4_K products use AMX where they can (`kq_amx`: the tests compare both ways).
std::atomic<bool>& amx_flag() {
  static std::atomic<bool> on{amx_permitted()};
  return on;
}
constexpr int64_t AMX_ROWS = 16;  // activation rows a tile pass takes; products of fewer keep the dot instructions

// LDTILECFG's 64 bytes: palette 1, then each tile's bytes per row and rows: all eight 16 × 64.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) colsb[i] = 64, rows[i] = 16;
  }
};

// A tiled Q4_K super-block staged for the tiles: B tiles hi[c], lo[c] (c < 4: activation bytes
// 64c..64c+63, rows 0-7 sub-block 2c's code groups g, rows 8-15 sub-block 2c+1's), the byte
// products code·sc_hi and code·sc_lo by table (`vpermi2b` on (s << 4) | code), and the scales
// for the mins and the float step.
struct Q4Staged {
  alignas(64) uint8_t hi[4][16][64], lo[4][16][64];
  __m512i mins[4];
  __m512 d16, dmin;

  ALWAYS_INLINE void stage(const uint8_t* tb, __m512i table0, __m512i table1) {
    const __m512i low = _mm512_set1_epi8(15), bytes = _mm512_set1_epi32(0x01010101);
    for (int c = 0; c < 4; ++c) {
      __m512i sel[2][2];  // [sub-block 2c, 2c + 1][hi, lo]: (s << 4) in every byte of row r's lane
      for (int h = 0; h < 2; ++h) {
        const __m512i sc = tile_value(tb + 64 + 12 * (2 * c + h));
        sel[h][0] = _mm512_mullo_epi32(_mm512_slli_epi32(_mm512_srli_epi32(sc, 3), 4), bytes);
        sel[h][1] = _mm512_mullo_epi32(_mm512_slli_epi32(_mm512_and_si512(sc, _mm512_set1_epi32(7)), 4), bytes);
      }
      for (int g = 0; g < 8; ++g) {
        const __m512i codes = _mm512_loadu_si512(tb + 256 + 64 * (8 * c + g));
        const __m512i q[2] = {_mm512_and_si512(codes, low), _mm512_and_si512(_mm512_srli_epi16(codes, 4), low)};
        for (int h = 0; h < 2; ++h) {
          _mm512_store_si512(hi[c][8 * h + g], _mm512_permutex2var_epi8(table0, _mm512_or_si512(q[h], sel[h][0]), table1));
          _mm512_store_si512(lo[c][8 * h + g], _mm512_permutex2var_epi8(table0, _mm512_or_si512(q[h], sel[h][1]), table1));
        }
      }
    }
    const TileScales k(tb, AMX_ROWS);
    for (int j = 0; j < 4; ++j) mins[j] = k.mins[j];
    d16 = k.d16, dmin = k.dmin;
  }

  // Activation row t's C_hi, C_lo (16 i32 each) into its accumulator, as `tiled_superblock` does.
  ALWAYS_INLINE void finish(const int32_t* c_hi, const int32_t* c_lo, const int32_t* xpair, float dx, float* acc,
                            bool first) const {
    const __m512i S = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c_hi), 7),
                                       _mm512_slli_epi32(_mm512_load_si512(c_lo), 4));
    __m512i M = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) M = _mm512_dpwssd_epi32(M, mins[j], _mm512_set1_epi32(xpair[j]));
    const __m512 x = _mm512_set1_ps(dx);
    __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(d16, x), _mm512_cvtepi32_ps(S), first ? _mm512_setzero_ps() : _mm512_load_ps(acc));
    a = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, x), _mm512_cvtepi32_ps(M), a);
    _mm512_store_ps(acc, a);
  }
};

// 16 activation rows ga[0..n) (n <= 16) of super-block b as an A source: in place where there are
// 16 consecutive rows, else copied into `gathered` (rows past n zero).
ALWAYS_INLINE const int8_t* amx_rows(const Q8K& xq, const int64_t* ga, int64_t n, int64_t b, int8_t* gathered,
                                     int64_t& stride) {
  bool consecutive = n == 16;
  for (int64_t i = 1; i < n && consecutive; ++i) consecutive = ga[i] == ga[0] + i;
  stride = consecutive ? xq.K : QK_K;
  if (consecutive) return xq.q + ga[0] * xq.K + b * QK_K;
  for (int64_t i = 0; i < 16; ++i) {
    if (i < n) std::memcpy(gathered + i * QK_K, xq.q + ga[i] * xq.K + b * QK_K, QK_K);
    else std::memset(gathered + i * QK_K, 0, QK_K);
  }
  return gathered;
}

// `tile_product` for Q4_K on AMX (n_rows >= 16): each weight super-block staged once for all the
// rows, which meet it 32 at a time (two groups of 16: tiles 0-3 their C_hi, C_lo, 4-5 their A,
// 6-7 the B tiles, each B loaded once for both).
void tile_product_amx(const Q8K& xq, const int32_t* xpair, const uint8_t* tw, const int64_t* act, const int64_t* rows,
                      int64_t n_rows, float* y, int64_t ldy, const uint8_t* ahead) {
  const int64_t nb = xq.K / QK_K;
  alignas(64) uint8_t table[128];  // (s << 4) | code → s·code
  for (int i = 0; i < 128; ++i) table[i] = static_cast<uint8_t>((i >> 4) * (i & 15));
  const __m512i table0 = _mm512_load_si512(table), table1 = _mm512_load_si512(table + 64);
  Q4Staged st;
  alignas(64) int32_t C[4][256];
  alignas(64) int8_t gathered[2][16 * QK_K];
  alignas(64) float acc[TILE_T * 16];
  for (int64_t t0 = 0; t0 < n_rows; t0 += TILE_T) {
    const int64_t n = std::min(TILE_T, n_rows - t0);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tb = tw + b * kTileSB;
      if (t0 == 0 && ahead != nullptr)
        for (int64_t line = 0; line < kTileSB; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + b * kTileSB + line), _MM_HINT_T1);
      st.stage(tb, table0, table1);
      for (int64_t g = 0; g < n; g += 32) {
        const int64_t n0 = std::min<int64_t>(16, n - g), n1 = std::min<int64_t>(16, n - g - n0);
        int64_t s0 = 0, s1 = 0;
        const int8_t* a0 = amx_rows(xq, act + t0 + g, n0, b, gathered[0], s0);
        const int8_t* a1 = n1 > 0 ? amx_rows(xq, act + t0 + g + 16, n1, b, gathered[1], s1) : nullptr;
        _tile_zero(0);
        _tile_zero(1);
        if (a1 != nullptr) {
          _tile_zero(2);
          _tile_zero(3);
        }
        // Tiles are not renamed: each is loaded again for the next 64 bytes right after its last
        // use, so that the loads run while the other products do.
        _tile_loadd(6, st.hi[0], 64);
        _tile_loadd(4, a0, s0);
        _tile_loadd(7, st.lo[0], 64);
        if (a1 != nullptr) {
          _tile_loadd(5, a1, s1);
          for (int c = 0; c < 4; ++c) {
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(2, 5, 6);
            if (c < 3) _tile_loadd(6, st.hi[c + 1], 64);
            _tile_dpbssd(1, 4, 7);
            if (c < 3) _tile_loadd(4, a0 + 64 * (c + 1), s0);
            _tile_dpbssd(3, 5, 7);
            if (c < 3) {
              _tile_loadd(7, st.lo[c + 1], 64);
              _tile_loadd(5, a1 + 64 * (c + 1), s1);
            }
          }
        } else {
          for (int c = 0; c < 4; ++c) {
            _tile_dpbssd(0, 4, 6);
            if (c < 3) _tile_loadd(6, st.hi[c + 1], 64);
            _tile_dpbssd(1, 4, 7);
            if (c < 3) {
              _tile_loadd(4, a0 + 64 * (c + 1), s0);
              _tile_loadd(7, st.lo[c + 1], 64);
            }
          }
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        if (a1 != nullptr) {
          _tile_stored(2, C[2], 64);
          _tile_stored(3, C[3], 64);
        }
        for (int64_t i = 0; i < n0 + n1; ++i) {
          const int64_t row = act[t0 + g + i], at = i < 16 ? 0 : 2;
          st.finish(C[at] + 16 * (i % 16), C[at + 1] + 16 * (i % 16), &xpair[(row * nb + b) * Tile4::pairs],
                    xq.d[row * nb + b], acc + 16 * (g + i), b == 0);
        }
      }
    }
    for (int64_t t = 0; t < n; ++t) std::memcpy(y + rows[t0 + t] * ldy, acc + 16 * t, 64);
  }
}

// This thread's tiles configured for `tile_product_amx` while it lives, where `use`, and released
// after: per thread's share of a product (a configuration per 16-row tile was 8% of a 64-row
// product), and never across calls, since another library on the thread (oneDNN) may configure or
// release the tiles in between.
struct AmxTiles {
  const bool on;
  explicit AmxTiles(bool use) : on(use) {
    if (on) {
      const TileConfig config;
      _tile_loadconfig(&config);
    }
  }
  ~AmxTiles() {
    if (on) _tile_release();
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// Whether a TT product whose tiles meet up to `most_rows` activation rows at once runs on AMX.
template <class TT>
bool amx_for(int64_t most_rows) {
  return std::is_same_v<TT, Tile4> && most_rows >= AMX_ROWS && amx_flag().load(std::memory_order_relaxed);
}
#else
struct AmxTiles {
  explicit AmxTiles(bool) {}
};
template <class TT>
bool amx_for(int64_t) {
  return false;
}
#endif

// One tile of 16 rows (tw, its nb super-blocks) against activation rows act[0..n): y + rows[t]·ldy
// gets row act[t]'s 16 products. The rows' super-blocks are met TILE_T at a time, 4 in registers
// at once. With many rows, the super-blocks of `ahead` (the next tile, or nullptr) are fetched
// meanwhile; with few (decode), the bytes STREAM_AHEAD on (see there). `amx`: this thread's tiles
// are configured (`AmxTiles`) for Q4_K's 16+ rows.
template <class TT>
ALWAYS_INLINE void tile_product(const Q8K& xq, const int32_t* xpair, const uint8_t* tw, const int64_t* act,
                                const int64_t* rows, int64_t n_rows, float* y, int64_t ldy, const uint8_t* ahead,
                                [[maybe_unused]] bool amx) {
#ifdef HYBRIDKV_AMX
  if constexpr (std::is_same_v<TT, Tile4>)
    if (amx && n_rows >= AMX_ROWS) return tile_product_amx(xq, xpair, tw, act, rows, n_rows, y, ldy, ahead);
#endif
  const int64_t nb = xq.K / QK_K, P = TT::pairs;
  const bool fetch_ahead = hybridkv::stream_ahead_flag().load(std::memory_order_relaxed);
  __m512 acc[TILE_T];
  const int8_t* a[4];
  const int32_t* xp[4];
  float dx[4];
  for (int64_t t0 = 0; t0 < n_rows; t0 += TILE_T) {
    const int64_t n = std::min(TILE_T, n_rows - t0);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* tb = tw + b * TT::bytes;
      // Many rows hold a tile long: the next tile's super-block is fetched meanwhile.
      if (t0 == 0 && n > STREAM_ROWS && ahead != nullptr)
        for (int64_t line = 0; line < TT::bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + b * TT::bytes + line), _MM_HINT_T1);
      if (n <= STREAM_ROWS && fetch_ahead) stream_ahead(tb, TT::bytes);
      const typename TT::Scales k(tb, n);
      const bool first = b == 0;  // the accumulators' first write: no zeroing beforehand (GCC's memset)
      for (int64_t t = 0; t < n; t += 4) {
        const int take = static_cast<int>(std::min<int64_t>(4, n - t));
        for (int j = 0; j < take; ++j) {
          const int64_t row = act[t0 + t + j];
          a[j] = xq.q + row * xq.K + b * QK_K, xp[j] = &xpair[(row * nb + b) * P], dx[j] = xq.d[row * nb + b];
        }
        switch (take) {
          case 4: TT::template superblock<4>(tb, k, a, xp, dx, acc + t, first); break;
          case 3: TT::template superblock<3>(tb, k, a, xp, dx, acc + t, first); break;
          case 2: TT::template superblock<2>(tb, k, a, xp, dx, acc + t, first); break;
          default: TT::template superblock<1>(tb, k, a, xp, dx, acc + t, first); break;
        }
      }
    }
    for (int64_t t = 0; t < n; ++t) _mm512_storeu_ps(y + rows[t0 + t] * ldy, acc[t]);
  }
}

// y [T, ldy] (columns 0..N) = x @ W.T for tiled rows w of type TT: threads split the tiles.
template <class TT>
void tiled_matmul(const Q8K& xq, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  const int64_t T = xq.T, tile_bytes = xq.K / QK_K * TT::bytes;
  const std::vector<int32_t> xpair = tile_pairs<TT>(xq);
  std::vector<int64_t> rows(T);
  for (int64_t t = 0; t < T; ++t) rows[t] = t;
  const bool amx = amx_for<TT>(T);
  hybridkv::claimed_for(N / 16, hybridkv::claim_items(tile_bytes, 1), [&](int64_t i0, int64_t i1) {
    const AmxTiles tiles(amx);
    for (int64_t i = i0; i < i1; ++i)
      tile_product<TT>(xq, xpair.data(), w + i * tile_bytes, rows.data(), rows.data(), T, y + 16 * i, ldy,
                       i + 1 < N / 16 ? w + (i + 1) * tile_bytes : nullptr, amx);
  });
}

// y [P, N]: row p / per of x times expert ids[p]'s tiled rows, w [E, N, ·] (N a multiple of 16):
// threads split each expert's tiles, every tile met once by all the rows routed to its expert.
template <class TT>
void tiled_experts(const Q8K& xq, const uint8_t* w, const int64_t* ids, int64_t P, int64_t per, int64_t N, float* y) {
  const int64_t tile_bytes = xq.K / QK_K * TT::bytes, tiles = N / 16;
  const std::vector<int32_t> xpair = tile_pairs<TT>(xq);
  std::vector<int64_t> pairs, start;
  hybridkv::group_by_expert(ids, P, pairs, start);
  std::vector<int64_t> act(P);  // each pair's activation row, in the pairs' order
  for (int64_t i = 0; i < P; ++i) act[i] = pairs[i] / per;
  const int64_t G = static_cast<int64_t>(start.size()) - 1;
  auto tile_at = [&](int64_t g, int64_t i) { return w + (ids[pairs[start[g]]] * tiles + i) * tile_bytes; };
  int64_t most = 0;
  for (int64_t g = 0; g < G; ++g) most = std::max(most, start[g + 1] - start[g]);
  const bool amx = amx_for<TT>(most);
  hybridkv::claimed_for(G * tiles, hybridkv::claim_items(tile_bytes, 1), [&](int64_t u0, int64_t u1) {
    const AmxTiles amx_tiles(amx);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / tiles, i = u % tiles;
      const uint8_t* ahead = i + 1 < tiles ? tile_at(g, i + 1) : g + 1 < G ? tile_at(g + 1, 0) : nullptr;
      tile_product<TT>(xq, xpair.data(), tile_at(g, i), act.data() + start[g], pairs.data() + start[g],
                       start[g + 1] - start[g], y + 16 * i, N, ahead, amx);
    }
  });
}
#endif

// Tiled rows back to Q4_K (a copy) for the paths without the tiled kernel: the scalar code path,
// builds without AVX-512 VBMI and VNNI, and the sums the tests read.
at::Tensor untiled(const at::Tensor& w) { return tile_q4_k(w, true); }

// One super-block of Q4_K, Q4_K_R or Q5_K → 256 float32 weights: (d·sc_j)·q − dmin·m_j, as
// `blocks.q4_k` and gguf-py compute it. d·sc_j has at most 11 + 6 significant bits and q 5, so
// (d·sc_j)·q is exact in float32 and a fused multiply-add rounds the difference alike.
template <class KT>
void dequantize_k4(const uint8_t* w, float* out) {
  uint32_t u[4];
  k4_scales_mins(w + 4, u);
  const auto* sm = reinterpret_cast<const uint8_t*>(u);
  const float d = fp16(w), dmin = fp16(w + 2);
  for (int s = 0; s < 8; ++s) {
    const float scale = d * static_cast<float>(sm[s]), offset = dmin * static_cast<float>(sm[8 + s]);
    for (int p = 0; p < 32; ++p) {
      int q;
      if constexpr (std::is_same_v<KT, Q4KR>) {
        q = Q4KR::code(w, s, p);
      } else {
        q = (w[(std::is_same_v<KT, Q5K> ? 48 : 16) + 32 * (s / 2) + p] >> (4 * (s & 1))) & 15;
        if constexpr (std::is_same_v<KT, Q5K>) q |= ((w[16 + p] >> s) & 1) << 4;
      }
      out[32 * s + p] = static_cast<float>(q) * scale - offset;
    }
  }
}

// One Q6_K super-block → 256 float32 weights: (q − 32)·(d·sc_j) over 16 sub-blocks of 16.
void dequantize_q6k(const uint8_t* w, float* out) {
  const float d = fp16(w + 208);
  const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
  for (int h = 0; h < 2; ++h) {
    const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) {
        const int q = ((ql[l + 32 * (i & 1)] >> (4 * (i >> 1))) & 15) | (((qh[l] >> (2 * i)) & 3) << 4);
        out[128 * h + 32 * i + l] = static_cast<float>(q - 32) * (d * static_cast<float>(sc[8 * h + 2 * i + l / 16]));
      }
  }
}

// One Q2_K super-block → 256 float32 weights: (d·sc_j)·q − dmin·m_j over 16 sub-blocks of 16
// ((d·sc_j)·q is exact in float32, so a fused multiply-add rounds as the twin's two steps).
void dequantize_q2k(const uint8_t* w, float* out) {
  const float d = fp16(w + 80), dmin = fp16(w + 82);
  for (int i = 0; i < QK_K; ++i) {
    const float scale = d * static_cast<float>(w[i / 16] & 15), offset = dmin * static_cast<float>(w[i / 16] >> 4);
    out[i] = static_cast<float>(k2_code(w + 16, i)) * scale - offset;
  }
}

// One Q3_K super-block → 256 float32 weights: (q − 4)·(d·sc_j) over 16 sub-blocks of 16.
void dequantize_q3k(const uint8_t* w, float* out) {
  const float d = fp16(w + 108);
  int8_t sc[16];
  q3k_scales(w + 96, sc);
  for (int i = 0; i < QK_K; ++i)
    out[i] = static_cast<float>(Q3K::code(w, i) - 4) * (d * static_cast<float>(sc[i / 16]));
}

// Rows ids of K-quant rows w [V, K/256·bytes] as float32 [n, K]: an embedding lookup on a file's
// blocks, bit-identical to `QuantizedWeight.dequantize` of those rows (one call instead of the
// dozen PyTorch ops of the twin, ~0.3 ms a 0.8B decode step).
at::Tensor kq_dequantize_rows(const at::Tensor& w, const at::Tensor& ids_in, int64_t ggml_type) {
  const int bytes = block_bytes(ggml_type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) % bytes == 0,
              "kq_dequantize_rows: rows must be a contiguous uint8 [V, K/256*", bytes, "] tensor, got ",
              w.scalar_type(), " ", w.sizes());
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), V = w.size(0), nb = w.size(1) / bytes;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < V, "kq_dequantize_rows: row ", id[i], " out of range for ", V, " rows");
  at::Tensor out = at::empty({n, nb * QK_K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = wp + (id[b / nb] * nb + b % nb) * bytes;
      float* dst = op + b * QK_K;
      if (ggml_type == kQ4KT) {
        uint8_t q[144];
        untiled_block<144>(wp, nb, id[b / nb], b % nb, q, tile_block);
        dequantize_k4<Q4K>(q, dst);
        continue;
      }
      if (ggml_type == kQ6KT) {
        uint8_t q[Q6K::bytes];
        untiled_block<Q6K::bytes>(wp, nb, id[b / nb], b % nb, q, tile_block6);
        dequantize_q6k(q, dst);
        continue;
      }
      switch (ggml_type) {
        case 10: dequantize_q2k(blk, dst); break;
        case 11: dequantize_q3k(blk, dst); break;
        case 12: dequantize_k4<Q4K>(blk, dst); break;
        case 13: dequantize_k4<Q5K>(blk, dst); break;
        case 14: dequantize_q6k(blk, dst); break;
        case kQ4KR: dequantize_k4<Q4KR>(blk, dst); break;
      }
    }
  });
  return out;
}

// (S, M) of every super-block pair: q int8 [T, K], bsums int16 [T, K/16], rows [N, ·] → int32 [T, N, nb, 2].
at::Tensor kq_superblock_sums(const at::Tensor& q_in, const at::Tensor& bsums_in, const at::Tensor& w,
                              int64_t ggml_type, const std::string& isa) {
  TORCH_CHECK(q_in.scalar_type() == at::kChar && q_in.dim() == 2, "kq_superblock_sums: q must be int8 [T, K]");
  const at::Tensor q = q_in.contiguous(), bsums = bsums_in.to(at::kShort).contiguous();
  const int64_t T = q.size(0), K = q.size(1), N = check_rows(w, K, ggml_type, "kq_superblock_sums");
  if (ggml_type == kQ4KT) return kq_superblock_sums(q, bsums, untiled(w), 12, isa);
  if (ggml_type == kQ6KT) return kq_superblock_sums(q, bsums, tile_q6_k(w, true), 14, isa);
  TORCH_CHECK(bsums.numel() == T * K / 16, "kq_superblock_sums: bsums must be [T, K/16]");
  const Isa path = parse_isa(isa);
  at::Tensor out = at::empty({T, N, K / QK_K, 2}, q.options().dtype(at::kInt));
  const auto args = std::make_tuple(q.data_ptr<int8_t>(), bsums.data_ptr<int16_t>(), T, K, w.data_ptr<uint8_t>(), N,
                                    out.data_ptr<int32_t>());
  const bool avx2 = path == Isa::Avx2;
  switch (ggml_type) {
    case 10: std::apply(avx2 ? sums_impl<Q2K, Isa::Avx2> : sums_impl<Q2K, Isa::Scalar>, args); break;
    case 11: std::apply(avx2 ? sums_impl<Q3K, Isa::Avx2> : sums_impl<Q3K, Isa::Scalar>, args); break;
    case 12: std::apply(avx2 ? sums_impl<Q4K, Isa::Avx2> : sums_impl<Q4K, Isa::Scalar>, args); break;
    case 13: std::apply(avx2 ? sums_impl<Q5K, Isa::Avx2> : sums_impl<Q5K, Isa::Scalar>, args); break;
    case 14: std::apply(avx2 ? sums_impl<Q6K, Isa::Avx2> : sums_impl<Q6K, Isa::Scalar>, args); break;
    case kQ4KR: std::apply(avx2 ? sums_impl<Q4KR, Isa::Avx2> : sums_impl<Q4KR, Isa::Scalar>, args); break;
  }
  return out;
}

// y[:, 0:N) of a [T, ldy] output = x @ W.T for K-quant rows w [N, ·] of `ggml_type`, x already quantized.
void matmul_into(const Q8K& xq, const at::Tensor& w, int64_t N, int64_t ggml_type, Isa path, float* y, int64_t ldy) {
  if (ggml_type == kQ4KT) {
#ifdef HYBRIDKV_TILED
    if (path == Isa::Avx2) return tiled_matmul<Tile4>(xq, w.data_ptr<uint8_t>(), N, y, ldy);
#endif
    return matmul_into(xq, untiled(w), N, 12, path, y, ldy);
  }
  if (ggml_type == kQ6KT) {
#ifdef HYBRIDKV_TILED
    if (path == Isa::Avx2) return tiled_matmul<Tile6>(xq, w.data_ptr<uint8_t>(), N, y, ldy);
#endif
    return matmul_into(xq, tile_q6_k(w, true), N, 14, path, y, ldy);
  }
  const auto args = std::make_tuple(std::cref(xq), w.data_ptr<uint8_t>(), N, y, ldy);
  const bool avx2 = path == Isa::Avx2;
  switch (ggml_type) {
    case 10: std::apply(avx2 ? matmul_impl<Q2K, Isa::Avx2> : matmul_impl<Q2K, Isa::Scalar>, args); break;
    case 11: std::apply(avx2 ? matmul_impl<Q3K, Isa::Avx2> : matmul_impl<Q3K, Isa::Scalar>, args); break;
    case 12: std::apply(avx2 ? matmul_impl<Q4K, Isa::Avx2> : matmul_impl<Q4K, Isa::Scalar>, args); break;
    case 13: std::apply(avx2 ? matmul_impl<Q5K, Isa::Avx2> : matmul_impl<Q5K, Isa::Scalar>, args); break;
    case 14: std::apply(avx2 ? matmul_impl<Q6K, Isa::Avx2> : matmul_impl<Q6K, Isa::Scalar>, args); break;
    case kQ4KR: std::apply(avx2 ? matmul_impl<Q4KR, Isa::Avx2> : matmul_impl<Q4KR, Isa::Scalar>, args); break;
  }
}

at::Tensor kq_matmul(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2, "kq_matmul: x must be [T, K], got ", x.sizes());
  const int64_t N = check_rows(w, x.size(1), ggml_type, "kq_matmul");
  const Isa path = parse_isa(isa);
  const Q8K xq = quantize(x);
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  matmul_into(xq, w, N, ggml_type, path, y.data_ptr<float>(), N);
  return y;
}

// x @ [W_0 | W_1 | ...] → [T, ΣN_i]: a projection held as parts of K-quant types (a Q4_K_M file's
// fused q|k|v of Q6_K beside z of Q4_K) in one call, x quantized once and each part's products
// written into its columns (instead of a call per part and a concatenation).
at::Tensor kq_matmul_parts(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2, "kq_matmul_parts: x must be [T, K], got ", x.sizes());
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "kq_matmul_parts: ", ws.size(), " weights and ", types.size(),
              " types: one type per weight, at least one");
  std::vector<int64_t> rows(ws.size());
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) total += rows[i] = check_rows(ws[i], x.size(1), types[i], "kq_matmul_parts");
  const Isa path = parse_isa(isa);
  const Q8K xq = quantize(x);
  at::Tensor y = at::empty({x.size(0), total}, x.options().dtype(at::kFloat));
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    matmul_into(xq, ws[i], rows[i], types[i], path, y.data_ptr<float>() + col, total);
    col += rows[i];
  }
  return y;
}

// y [P, N]: row p of x times expert ids[p]'s weight rows, w [E, N, K/256*bytes] (MoE decode).
template <class KT, Isa I>
void experts_impl(const Q8K& xq, const uint8_t* w, const int64_t* ids, int64_t N, float* y) {
  const int64_t P = xq.T, K = xq.K, nb = K / QK_K, row_bytes = nb * KT::bytes;
  const int8_t* a = xq.q;
  const float* dx = xq.d;
  const std::vector<int16_t> xs = min_sums_of<KT>(xq.bsums, P * nb);
  std::vector<int8_t> buf;
  const int8_t* a1 = dot_order<KT, I>(a, P * nb, buf);
  // Threads split each expert's rows.
  std::vector<int64_t> pairs, start;
  hybridkv::group_by_expert(ids, P, pairs, start);
  const int64_t G = static_cast<int64_t>(start.size()) - 1;
  hybridkv::claimed_for(G * N, hybridkv::claim_items(row_bytes, 16), [&](int64_t u0, int64_t u1) {
#ifdef __AVX2__
    // On the stack: as vectors, each claim's allocation and zeroing (6 KiB) took the one-token
    // products of moe-mini's experts (18 KiB claims) from 0.94x to 0.73-0.77x the dense product's
    // rate on the same bytes.
    __m256 acc[TILE_T];
#endif
#ifdef HYBRIDKV_ZMM
    __m512 acc16[TILE_T];
#endif
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / N, n = u % N;
      const uint8_t* wr = w + (ids[pairs[start[g]]] * N + n) * row_bytes;
#ifdef __AVX2__
      if constexpr (I == Isa::Avx2) {
        // One token on this expert: eight of its rows at a time, as `matmul_impl`.
        if (start[g + 1] - start[g] == 1 && n + 8 <= N && u + 8 <= u1) {
          const int64_t p = pairs[start[g]];
          rows8_dot<KT>(wr, row_bytes, a1 + p * K, dx + p * nb, &xs[p * nb * 16], nb, y + p * N + n);
          u += 7;
          continue;
        }
#ifdef HYBRIDKV_ZMM
        // Several tokens on this expert (`rows16_from`): 16 of its rows at a time, as `matmul_impl`,
        // fetching the next 16 (or the next expert's first 16). On moe-mini Q4_K_M a 56-token chunk
        // (7 tokens an expert) has its Q4_K_R products 1.3-1.5x faster than decoded.
        if (start[g + 1] - start[g] >= rows16_from<KT>(true) && n % 16 == 0 && n + 16 <= N && u + 16 <= u1) {
          const uint8_t* ahead = n + 32 <= N ? wr + 16 * row_bytes
                                 : g + 1 < G ? w + ids[pairs[start[g + 1]]] * N * row_bytes : nullptr;
          for (int64_t i = start[g]; i < start[g + 1]; i += TILE_T)
            rows16_kdot<KT>(wr, row_bytes, nb, K, a, dx, xs.data(), pairs.data() + i, std::min(TILE_T, start[g + 1] - i),
                            y + n, N, acc16, i == start[g] ? ahead : nullptr);
          u += 15;
          continue;
        }
        // Fewer tokens on this expert (batched decode): each super-block decoded once for up to
        // four of them, as `matmul_impl` (moe-mini Q4_K_M: an 8-token step 1.06x the unpacked
        // form; the same bits).
        if constexpr (kDecoded<KT>)
          if (start[g + 1] - start[g] >= 2 && start[g + 1] - start[g] <= Decoded<KT>::MAX_T) {
            rows_dot_decoded<KT>(wr, a1, K, dx, xs.data(), nb, pairs.data() + start[g], start[g + 1] - start[g], y + n, N);
            continue;
          }
#endif
        // Many tokens on this expert: 8 of its rows at a time (without AVX-512, or the rows the
        // 16-row form leaves), as `matmul_impl`.
        if (start[g + 1] - start[g] >= rows8_from(true) && n % 8 == 0 && n + 8 <= N && u + 8 <= u1) {
          for (int64_t i = start[g]; i < start[g + 1]; i += TILE_T)
            rows8_kdot<KT>(wr, row_bytes, nb, K, a, dx, xs.data(), pairs.data() + i, std::min(TILE_T, start[g + 1] - i),
                           y + n, N, acc, i == start[g] && n + 16 <= N ? wr + 8 * row_bytes : nullptr);
          u += 7;
          continue;
        }
        // Several tokens on this expert (prefill, batched decode): each super-block unpacked once for all.
        if (start[g + 1] - start[g] >= 2) {
          for (int64_t i = start[g]; i < start[g + 1]; i += TILE_T)
            rows_dot_unpacked<KT>(wr, nb, K, a1, dx, xs.data(), pairs.data() + i, std::min(TILE_T, start[g + 1] - i),
                                  y + n, N, acc, true);
          continue;
        }
      }
#endif
      for (int64_t i = start[g]; i < start[g + 1]; ++i) {
        const int64_t p = pairs[i];
        y[p * N + n] = row_dot<KT, I>(wr, a1 + p * K, dx + p * nb, &xs[p * nb * 16], nb);
      }
    }
  });
}

at::Tensor kq_experts_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids_in, int64_t ggml_type,
                             const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "kq_experts_matmul: x must be [T, K] and w contiguous uint8 [E, N, row_bytes]");
  const int64_t T = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1), P = ids_in.numel();
  const bool tiled = ggml_type == kQ4KT || ggml_type == kQ6KT;
  TORCH_CHECK(!tiled || N % 16 == 0, "kq_experts_matmul: tiled experts (types ", kQ4KT, ", ", kQ6KT,
              ") hold a multiple of 16 rows each, got ", N);
  const int bytes = block_bytes(ggml_type);
  TORCH_CHECK(K % QK_K == 0 && w.size(2) == K / QK_K * bytes, "kq_experts_matmul: activations of ", K,
              " features need rows of ", K / QK_K * bytes, " bytes, got ", w.size(2));
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  TORCH_CHECK(T > 0 ? P % T == 0 : P == 0, "kq_experts_matmul: the ", P, " expert ids must be a multiple of x's ", T,
              " rows (row t serves ids t·P/T ..)");
  const int64_t per = T > 0 ? P / T : 1;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "kq_experts_matmul: expert ", idp[p], " out of range");
  const bool avx2 = parse_isa(isa) == Isa::Avx2;
#ifdef HYBRIDKV_TILED
  const bool tiled_kernel = avx2;
#else
  const bool tiled_kernel = false;
#endif
  if (tiled && !tiled_kernel) {  // the file's rows back (a copy), through their own kernels
    const at::Tensor flat = w.view({E * N, -1}), rows = ggml_type == kQ4KT ? untiled(flat) : tile_q6_k(flat, true);
    return kq_experts_matmul(x, rows.view({E, N, -1}), ids, ggml_type == kQ4KT ? 12 : 14, isa);
  }
  const Q8K xq = quantize(x);
  at::Tensor y = at::empty({P, N}, x.options().dtype(at::kFloat));
#ifdef HYBRIDKV_TILED
  if (tiled) {
    (ggml_type == kQ4KT ? tiled_experts<Tile4> : tiled_experts<Tile6>)(xq, w.data_ptr<uint8_t>(), idp, P, per, N,
                                                                         y.data_ptr<float>());
    return y;
  }
#endif
  const Q8K xp = repeat_rows(xq, per);  // the other kernels read a row per pair
  const auto args = std::make_tuple(std::cref(xp), w.data_ptr<uint8_t>(), idp, N, y.data_ptr<float>());
  switch (ggml_type) {
    case 10: std::apply(avx2 ? experts_impl<Q2K, Isa::Avx2> : experts_impl<Q2K, Isa::Scalar>, args); break;
    case 11: std::apply(avx2 ? experts_impl<Q3K, Isa::Avx2> : experts_impl<Q3K, Isa::Scalar>, args); break;
    case 12: std::apply(avx2 ? experts_impl<Q4K, Isa::Avx2> : experts_impl<Q4K, Isa::Scalar>, args); break;
    case 13: std::apply(avx2 ? experts_impl<Q5K, Isa::Avx2> : experts_impl<Q5K, Isa::Scalar>, args); break;
    case 14: std::apply(avx2 ? experts_impl<Q6K, Isa::Avx2> : experts_impl<Q6K, Isa::Scalar>, args); break;
    case kQ4KR: std::apply(avx2 ? experts_impl<Q4KR, Isa::Avx2> : experts_impl<Q4KR, Isa::Scalar>, args); break;
  }
  return y;
}

// Q4_K rows [..., nb·144] → `Q4KR`'s bytes (a copy), or back (`inverse`): blocks.repack_q4_k's twin.
at::Tensor kq_repack_q4_k(const at::Tensor& rows_in, bool inverse) {
  TORCH_CHECK(rows_in.scalar_type() == at::kByte && rows_in.dim() >= 1 && rows_in.size(-1) % Q4KR::bytes == 0,
              "kq_repack_q4_k: rows must be uint8 [..., nb * 144], got ", rows_in.scalar_type(), " ", rows_in.sizes());
  const at::Tensor rows = rows_in.contiguous();
  at::Tensor out = at::empty_like(rows);
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows.numel() / Q4KR::bytes, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* w = src + b * Q4KR::bytes;
      uint8_t* r = dst + b * Q4KR::bytes;
      std::memcpy(r, w, 16);
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 8; ++j) {
          const int at_r = 16 + 32 * c + 4 * j, at_q = 16 + 32 * (j % 4) + 4 * (2 * c + j / 4);
          std::memcpy(r + (inverse ? at_q : at_r), w + (inverse ? at_r : at_q), 4);
        }
    }
  });
  return out;
}

bool kq_tiled() {
#ifdef HYBRIDKV_TILED
  return true;
#else
  return false;
#endif
}

// Whether the tiled products of 16+ activation rows use AMX (set < 0 asks, 0 or 1 sets; setting 1
// where AMX cannot run leaves it off): the value before. False where it cannot run.
bool kq_amx(int64_t set) {
#ifdef HYBRIDKV_AMX
  std::atomic<bool>& on = amx_flag();
  return set < 0 ? on.load() : on.exchange(set != 0 && amx_permitted());
#else
  return false;
#endif
}

// Whether decode's products fetch their weights ahead (`hybridkv::stream_ahead_flag`): set < 0
// asks, 0 or 1 sets; the value before.
bool kq_stream_ahead(int64_t set) {
  std::atomic<bool>& on = hybridkv::stream_ahead_flag();
  return set < 0 ? on.load() : on.exchange(set != 0);
}

}  // namespace

namespace hybridkv::ops {  // for layer.cpp (ops.h)
at::Tensor kq_matmul_parts(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, const std::string& isa) {
  return ::kq_matmul_parts(x, ws, types, isa);
}
at::Tensor kq_experts_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, int64_t ggml_type,
                             const std::string& isa) {
  return ::kq_experts_matmul(x, w, ids, ggml_type, isa);
}
}  // namespace hybridkv::ops

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("kq_isas() -> str[]", kq_isas);  // no tensor to dispatch on: one kernel for every backend
  m.def("kq_experts_matmul(Tensor x, Tensor w, Tensor ids, int ggml_type, str isa) -> Tensor");
  m.def("quantize_rows_q8_k(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("kq_superblock_sums(Tensor q, Tensor bsums, Tensor w, int ggml_type, str isa) -> Tensor");
  m.def("kq_matmul(Tensor x, Tensor w, int ggml_type, str isa) -> Tensor");
  m.def("kq_matmul_parts(Tensor x, Tensor[] ws, int[] types, str isa) -> Tensor");
  m.def("kq_dequantize_rows(Tensor w, Tensor ids, int ggml_type) -> Tensor");
  m.def("kq_repack_q4_k(Tensor rows, bool inverse) -> Tensor");
  m.def("kq_tile_q4_k(Tensor rows, bool inverse) -> Tensor");
  m.def("kq_tile_q6_k(Tensor rows, bool inverse) -> Tensor");
  m.def("kq_tiled() -> bool", kq_tiled);  // whether this build has the tiled kernel
  m.def("kq_stream_ahead(int set) -> bool", kq_stream_ahead);
  m.def("kq_amx(int set) -> bool", kq_amx);
}

TORCH_LIBRARY_IMPL(hybridkv, CPU, m) {
  m.impl("quantize_rows_q8_k", quantize_rows_q8_k);
  m.impl("kq_superblock_sums", kq_superblock_sums);
  m.impl("kq_matmul", kq_matmul);
  m.impl("kq_matmul_parts", kq_matmul_parts);
  m.impl("kq_dequantize_rows", kq_dequantize_rows);
  m.impl("kq_experts_matmul", kq_experts_matmul);
  m.impl("kq_repack_q4_k", kq_repack_q4_k);
  m.impl("kq_tile_q4_k", tile_q4_k);
  m.impl("kq_tile_q6_k", tile_q6_k);
}
