// Helpers shared by the block kernels (quant.cpp, kquant.cpp): vector forms, fp16 scales, and
// which code path a call asks for.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// VNNI's byte and word dot products, in AVX-512 VL or AVX-VNNI form.
#if defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define HYBRIDKV_VNNI 1
#endif

// The 512-bit forms of the block kernels (AVX-512 BW and VNNI; F16C for the scales).
#if defined(HYBRIDKV_VNNI) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define HYBRIDKV_ZMM 1
#endif

namespace hybridkv {

// `name` ("auto": the first, the fastest) if this build has it among `have`, else an error listing
// what it has.
inline std::string pick_isa(const std::vector<std::string>& have, const std::string& name) {
  const std::string pick = name == "auto" ? have.front() : name;
  std::string listed;
  for (const auto& h : have) listed += (listed.empty() ? "" : ", ") + h;
  TORCH_CHECK(std::find(have.begin(), have.end(), pick) != have.end(), "isa '", name,
              "' is not available in this build (this CPU: ", listed, ", or auto)");
  return pick;
}

// A block's fp16 scale at p (unaligned) as float.
inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

#ifdef HYBRIDKV_VNNI
// acc + Σ over each 4 bytes of u (unsigned) · s (signed), per int32 lane.
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}

// acc + Σ over each 2 int16 of a · b, per int32 lane.
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#endif
}
#endif

#ifdef __AVX2__
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_f32(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Transposes 8 vectors of 8 dwords in place: v[j] lane i = old v[i] lane j (the 8-weight-row
// kernels: 8 rows' 4-byte code groups become one vector per group, a lane per row).
inline void transpose8(__m256i* v) {
  const __m256i a0 = _mm256_unpacklo_epi32(v[0], v[1]), a1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i a2 = _mm256_unpacklo_epi32(v[2], v[3]), a3 = _mm256_unpackhi_epi32(v[2], v[3]);
  const __m256i a4 = _mm256_unpacklo_epi32(v[4], v[5]), a5 = _mm256_unpackhi_epi32(v[4], v[5]);
  const __m256i a6 = _mm256_unpacklo_epi32(v[6], v[7]), a7 = _mm256_unpackhi_epi32(v[6], v[7]);
  const __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
  const __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
  const __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
  const __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
  v[0] = _mm256_permute2x128_si256(b0, b4, 0x20);
  v[1] = _mm256_permute2x128_si256(b1, b5, 0x20);
  v[2] = _mm256_permute2x128_si256(b2, b6, 0x20);
  v[3] = _mm256_permute2x128_si256(b3, b7, 0x20);
  v[4] = _mm256_permute2x128_si256(b0, b4, 0x31);
  v[5] = _mm256_permute2x128_si256(b1, b5, 0x31);
  v[6] = _mm256_permute2x128_si256(b2, b6, 0x31);
  v[7] = _mm256_permute2x128_si256(b3, b7, 0x31);
}

// Prefetches `bytes` bytes at `at` of each of `rows` rows row_bytes apart, into L1 or (`ToL2`) L2.
// The kernels that read 8 or 16 weight rows at once fetch the next group this way: that many short
// strided streams defeat the hardware prefetcher. The K-quants' 8- and 16-row products fetch into
// L2: on weights streaming from memory they ran 1.06-1.43x faster than fetching into L1 (Zen 4,
// 2 threads, 16 to 56 rows), the expert-indexed ones at 7 tokens an expert 1.3x. The 32-weight
// types' products measured even within this host's noise and keep L1.
template <bool ToL2 = false>
inline void prefetch_rows(const uint8_t* at, int rows, int64_t row_bytes, int bytes) {
  for (int i = 0; i < rows; ++i)
    for (int line = 0; line < bytes; line += 64) {
      const char* p = reinterpret_cast<const char*>(at + i * row_bytes + line);
      if constexpr (ToL2) {
        _mm_prefetch(p, _MM_HINT_T1);
      } else {
        _mm_prefetch(p, _MM_HINT_T0);
      }
    }
}
#endif

#ifdef HYBRIDKV_ZMM
// transpose8 of lo (rows 0-7) and hi (rows 8-15), joined: out[j] lane i = row i's dword j, i < 16.
inline void transpose8x16(__m256i* lo, __m256i* hi, __m512i* out) {
  transpose8(lo);
  transpose8(hi);
  for (int j = 0; j < 8; ++j) out[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[j]), hi[j], 1);
}
#endif

}  // namespace hybridkv
