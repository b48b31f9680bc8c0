// GGUF weight-block kernels (PyTorch twins and Python signatures: hybridkv/ops/quant/int8_dot.py).
//
// llama.cpp's decode scheme for Q8_0 weights: each activation row is quantized once into 8-bit
// blocks of 32 (d = max|x|/127 kept in float32); a weight block (f16 d; i8 q[32], 34 bytes, read in
// place from the file's rows) and an activation block meet as one exact integer dot product, then
// one float multiply by d_w·d_x. Three code paths give the same integer sums: AVX-512 VNNI or
// AVX-VNNI (`dpbusd`), AVX2 (`maddubs` + `madd`), and a plain loop; `isa` picks one, so the tests
// run each that this CPU has. Built with -march=native, so the VNNI path exists only where the CPU
// has it.
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

#if defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define HYBRIDKV_VNNI 1
#endif

namespace {

constexpr int QK8 = 32;
constexpr int Q8_0_BYTES = 34;  // f16 d, then 32 int8

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
  const std::vector<std::string> have = q8_isas();
  const std::string pick = name == "auto" ? have.front() : name;
  std::string listed;
  for (const auto& h : have) listed += (listed.empty() ? "" : ", ") + h;
  TORCH_CHECK(std::find(have.begin(), have.end(), pick) != have.end(), "isa '", name,
              "' is not available in this build (this CPU: ", listed, ", or auto)");
  return pick == "vnni" ? Isa::Vnni : pick == "avx2" ? Isa::Avx2 : Isa::Scalar;
}

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

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
__attribute__((optimize("no-tree-vectorize"))) inline int32_t block_sum_scalar(const uint8_t* wq, const int8_t* a) {
  int32_t s = 0;
  for (int j = 0; j < QK8; ++j) s += static_cast<int32_t>(static_cast<int8_t>(wq[j])) * a[j];
  return s;
}

#ifdef __AVX2__
// One block pair's dot product as 8 int32 lanes (lane i: weights 4i..4i+3). Both instructions take
// unsigned × signed bytes, so the weight's sign moves onto the activation: |w| read as unsigned is
// exact even for −128, and a·sign(w) cannot overflow since |a| <= 127 — exact for any block bytes.
template <Isa I>
inline __m256i block_dot(const uint8_t* wq, const int8_t* a) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i w_abs = _mm256_sign_epi8(w, w);
  const __m256i x_signed = _mm256_sign_epi8(x, w);
#ifdef HYBRIDKV_VNNI
  if constexpr (I == Isa::Vnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, x_signed);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w_abs, x_signed);
#endif
  }
#endif
  // Byte pairs into int16 (|pair| <= 2·128·127 < 2^15: no saturation), then int16 pairs into int32.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x_signed), _mm256_set1_epi16(1));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The sums of 8 consecutive block pairs, one per lane: three rounds of pairwise adds transpose the
// 8 x 8 lanes (hadd works within 128-bit halves, the last step adds the halves).
template <Isa I>
inline __m256i block_sums8(const uint8_t* w, const int8_t* a) {
  __m256i s[8];
  for (int i = 0; i < 8; ++i) s[i] = block_dot<I>(w + i * Q8_0_BYTES + 2, a + i * QK8);
  const __m256i h01 = _mm256_hadd_epi32(s[0], s[1]), h23 = _mm256_hadd_epi32(s[2], s[3]);
  const __m256i h45 = _mm256_hadd_epi32(s[4], s[5]), h67 = _mm256_hadd_epi32(s[6], s[7]);
  const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

inline float hsum_f32(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Block sums of one weight row (nb blocks at w) with one activation row (q at a) into out[nb].
template <Isa I>
void row_block_sums(const uint8_t* w, const int8_t* a, int64_t nb, int32_t* out) {
  int64_t b = 0;
#ifdef __AVX2__
  if constexpr (I != Isa::Scalar) {
    for (; b + 8 <= nb; b += 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b), block_sums8<I>(w + b * Q8_0_BYTES, a + b * QK8));
    for (; b < nb; ++b) out[b] = hsum_i32(block_dot<I>(w + b * Q8_0_BYTES + 2, a + b * QK8));
  }
#endif
  for (; b < nb; ++b) out[b] = block_sum_scalar(w + b * Q8_0_BYTES + 2, a + b * QK8);
}

// Σ_b block_sum_b · (dw[b]·dx[b]) for one weight row and one activation row.
template <Isa I>
float row_dot(const uint8_t* w, const float* dw, const int8_t* a, const float* dx, int64_t nb) {
  int64_t b = 0;
  float s = 0.f;
#ifdef __AVX2__
  if constexpr (I != Isa::Scalar) {
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
      const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(dw + b), _mm256_loadu_ps(dx + b));
      const __m256 sums = _mm256_cvtepi32_ps(block_sums8<I>(w + b * Q8_0_BYTES, a + b * QK8));
      acc = _mm256_fmadd_ps(sums, scale, acc);
    }
    s = hsum_f32(acc);
    for (; b < nb; ++b)
      s += static_cast<float>(hsum_i32(block_dot<I>(w + b * Q8_0_BYTES + 2, a + b * QK8))) * (dw[b] * dx[b]);
  }
#endif
  for (; b < nb; ++b) s += static_cast<float>(block_sum_scalar(w + b * Q8_0_BYTES + 2, a + b * QK8)) * (dw[b] * dx[b]);
  return s;
}

int64_t check_q8_0_rows(const at::Tensor& w, int64_t K, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": Q8_0 rows must be a contiguous uint8 [N, K/32*34] tensor, got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(K % QK8 == 0 && w.size(1) == K / QK8 * Q8_0_BYTES, op, ": activations of ", K,
              " features need Q8_0 rows of ", K / QK8 * Q8_0_BYTES, " bytes (K a multiple of 32), got ", w.size(1));
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

template <Isa I>
void block_sums_impl(const int8_t* a, int64_t T, const uint8_t* w, int64_t N, int64_t nb, int32_t* out) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t t = 0; t < T; ++t)
        row_block_sums<I>(w + n * nb * Q8_0_BYTES, a + t * nb * QK8, nb, out + (t * N + n) * nb);
  });
}

// The integer block sums of activation blocks q [T, K] with Q8_0 rows w [N, K/32*34] → int32 [T, N, K/32].
at::Tensor q8_0_block_sums(const at::Tensor& q_in, const at::Tensor& w, const std::string& isa) {
  TORCH_CHECK(q_in.scalar_type() == at::kChar && q_in.dim() == 2, "q8_0_block_sums: q must be int8 [T, K]");
  const at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), K = q.size(1), N = check_q8_0_rows(w, K, "q8_0_block_sums"), nb = K / QK8;
  at::Tensor out = at::empty({T, N, nb}, q.options().dtype(at::kInt));
  const int8_t* a = q.data_ptr<int8_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  switch (parse_isa(isa)) {
    case Isa::Vnni: block_sums_impl<Isa::Vnni>(a, T, wp, N, nb, op); break;
    case Isa::Avx2: block_sums_impl<Isa::Avx2>(a, T, wp, N, nb, op); break;
    case Isa::Scalar: block_sums_impl<Isa::Scalar>(a, T, wp, N, nb, op); break;
  }
  return out;
}

// y [T, N] = x @ W.T: threads split W's rows; each weight row is read once from memory and its
// f16 scales widened once, then dotted with every activation row while it sits in L1.
template <Isa I>
void matmul_impl(const int8_t* a, const float* dx, int64_t T, const uint8_t* w, int64_t N, int64_t nb, float* y) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> dw(nb);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * nb * Q8_0_BYTES;
      for (int64_t b = 0; b < nb; ++b) dw[b] = fp16(wr + b * Q8_0_BYTES);
#ifdef __AVX2__
      // One stream of weights keeps too few cache misses in flight: fetch the row 4 KiB ahead.
      for (int64_t at = 0; at < nb * Q8_0_BYTES; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wr + 4096 + at), _MM_HINT_T0);
#endif
      for (int64_t t = 0; t < T; ++t) y[t * N + n] = row_dot<I>(wr, dw.data(), a + t * nb * QK8, dx + t * nb, nb);
    }
  });
}

at::Tensor q8_0_matmul(const at::Tensor& x, const at::Tensor& w, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2, "q8_0_matmul: x must be [T, K], got ", x.sizes());
  const int64_t T = x.size(0), K = x.size(1), N = check_q8_0_rows(w, K, "q8_0_matmul"), nb = K / QK8;
  const Isa path = parse_isa(isa);
  const auto [q, d] = quantize_rows_q8(x);
  at::Tensor y = at::empty({T, N}, x.options().dtype(at::kFloat));
  const int8_t* a = q.data_ptr<int8_t>();
  const float* dx = d.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (path) {
    case Isa::Vnni: matmul_impl<Isa::Vnni>(a, dx, T, wp, N, nb, yp); break;
    case Isa::Avx2: matmul_impl<Isa::Avx2>(a, dx, T, wp, N, nb, yp); break;
    case Isa::Scalar: matmul_impl<Isa::Scalar>(a, dx, T, wp, N, nb, yp); break;
  }
  return y;
}

// y [P, N]: row p of x times expert ids[p]'s weight, w [E, N, K/32*34] (MoE decode: one call per
// projection for every (token, expert) pair). Threads split the pairs' rows.
template <Isa I>
void experts_impl(const int8_t* a, const float* dx, int64_t P, const uint8_t* w, const int64_t* ids, int64_t N,
                  int64_t nb, float* y) {
  const int64_t row_bytes = nb * Q8_0_BYTES;
  at::parallel_for(0, P * N, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> dw(nb);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / N, n = i % N;
      const uint8_t* wr = w + (ids[p] * N + n) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) dw[b] = fp16(wr + b * Q8_0_BYTES);
      y[i] = row_dot<I>(wr, dw.data(), a + p * nb * QK8, dx + p * nb, nb);
    }
  });
}

at::Tensor q8_0_experts_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids_in,
                               const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "q8_0_experts_matmul: x must be [P, K] and w contiguous uint8 [E, N, K/32*34]");
  const int64_t P = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1), nb = K / QK8;
  TORCH_CHECK(K % QK8 == 0 && w.size(2) == nb * Q8_0_BYTES, "q8_0_experts_matmul: activations of ", K,
              " features need rows of ", nb * Q8_0_BYTES, " bytes, got ", w.size(2));
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  TORCH_CHECK(ids.numel() == P, "q8_0_experts_matmul: one expert id per row of x");
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "q8_0_experts_matmul: expert ", idp[p], " out of range");
  const Isa path = parse_isa(isa);
  const auto [q, d] = quantize_rows_q8(x);
  at::Tensor y = at::empty({P, N}, x.options().dtype(at::kFloat));
  const auto args = std::make_tuple(q.data_ptr<int8_t>(), d.data_ptr<float>(), P, w.data_ptr<uint8_t>(), idp, N, nb,
                                    y.data_ptr<float>());
  switch (path) {
    case Isa::Vnni: std::apply(experts_impl<Isa::Vnni>, args); break;
    case Isa::Avx2: std::apply(experts_impl<Isa::Avx2>, args); break;
    case Isa::Scalar: std::apply(experts_impl<Isa::Scalar>, args); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridkv, m) {
  m.def("q8_isas() -> str[]", q8_isas);  // no tensor to dispatch on: one kernel for every backend
  m.def("q8_0_experts_matmul(Tensor x, Tensor w, Tensor ids, str isa) -> Tensor");
  m.def("quantize_rows_q8(Tensor x) -> (Tensor, Tensor)");
  m.def("q8_0_block_sums(Tensor q, Tensor w, str isa) -> Tensor");
  m.def("q8_0_matmul(Tensor x, Tensor w, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridkv, CPU, m) {
  m.impl("quantize_rows_q8", quantize_rows_q8);
  m.impl("q8_0_block_sums", q8_0_block_sums);
  m.impl("q8_0_matmul", q8_0_matmul);
  m.impl("q8_0_experts_matmul", q8_0_experts_matmul);
}
