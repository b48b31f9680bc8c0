// Decode-time CPU kernels (see hybridkv/ops/native.py for their Python signatures and twins).
//
// At decode a projection has T <= a few dozen rows, so x @ W is bound by reading W once. The
// products here hold a tile of R rows x 64 or 128 columns of the result in registers while W's
// rows stream by, and split the columns over ATen's threads. Weights are [D, N] (transposed
// storage), float32 or bfloat16; activations and results are float32. Around them: the whole MoE
// block, one Gated DeltaNet step and one gated-attention step (both updating the cache pools in
// place), and rms_norm. GCC vector extensions give AVX-512 or AVX2 code from the same source
// (-march=native).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "parallel.h"

namespace {

// One vector is one machine register: 16 floats with AVX-512, 8 with AVX2. (GCC lowers a generic
// vector wider than the registers into stack round trips, several times slower than scalar code.)
#if defined(__AVX512F__)
#define HYBRIDKV_LANES 16
#else
#define HYBRIDKV_LANES 8
#endif
constexpr int LANES = HYBRIDKV_LANES;
// How a few rows of x meet a weight w [D, N] (`matmul_into`):
//   AVX-512 (32 registers): register tiles of up to R rows x V vectors of the result, held while
//     w's rows stream by down a column strip (`columns`); wide tiles (up to MAX_R rows) read long
//     runs of each row (128-byte runs stream at half the bandwidth of 256-byte ones, measured).
//     float32 6 x 4 (64 columns); bfloat16 3 x 8 (128 columns), 6 x 4 narrow.
//   AVX2 (16 registers): w's rows streamed whole into a block of y kept in L1 (`stream_rows`):
//     the strip walk's short runs, 4 KiB apart when N is a power of two, stream at half the rate
//     there, and a 6 x 4 tile does not fit. 1.2-2.2x MKL at 2-8 rows, about even at 16 (measured,
//     one thread, Zen 3).
//   Up to SPLIT_ROWS rows (decode, a verify forward, a short chunk): each thread streams its own
//     contiguous block of w's rows into partial sums of all T rows, then the partials are added
//     (`matmul_rows_split_depth`). Out of cache, on AVX-512, this reads the weight 1.3-2.3x faster
//     than the column strips at 1-5 rows and about even at 8 (2 threads, Zen 4, measured by
//     streaming 1.5 GB of weights; a first form without column blocks likewise on Sapphire
//     Rapids); on AVX2 one row always (1.0-1.3x MKL).
#if HYBRIDKV_LANES == 16
constexpr bool STREAM_ROWS = false;
constexpr int64_t SPLIT_ROWS = 8;
// The split form takes 2..SPLIT_ROWS rows only for weights above this size (one row always): a
// small weight stays in the caches between steps (a model whose weights fit in L3), where the
// split form's column blocks, their rows 4 KiB apart in the cache sets, ran 1.4-3x slower than
// the register tiles at 2-8 rows (a [192, 4096] float32 weight at 5 rows: 171 against 57 us);
// read from memory the two were even up to 4 MiB, the split form 10-35% faster at 8 MiB (Zen 4,
// 2 threads).
constexpr int64_t SPLIT_FROM_BYTES = 4 << 20;
#else
constexpr bool STREAM_ROWS = true;
constexpr int64_t SPLIT_ROWS = 1;  // the 4 x 4 tile of `depth_block_rows` does not fit 16 registers
constexpr int64_t SPLIT_FROM_BYTES = 0;
#endif
template <typename W>
struct Tiling {
  static constexpr int V = sizeof(W) == 2 ? 8 : 4;
  static constexpr int MAX_R = sizeof(W) == 2 ? 3 : 6;
  static constexpr int COLS = V * LANES;  // also the unit of parallel work
};
constexpr int NARROW_V = 4, NARROW_R = 6;
constexpr int64_t Y_BLOCK = 4096;  // floats of y that `stream_rows` keeps in L1 (16 KiB)
constexpr int64_t FEW_ROWS = 32;  // up to here a product streams its weight; beyond, MKL (float32)
#if defined(__AVX512BF16__)
constexpr bool BF16_DOT = true;
#else
constexpr bool BF16_DOT = false;
#endif

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the top half of a float32: widen each lane to 32 bits and shift it up.
inline vf load(const at::BFloat16* p) {
#ifdef __AVX512F__  // one zero-extension and one shift (GCC splits the generic form into 256-bit halves)
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  return (vf)_mm512_castsi512_ps(wide);
#elif defined(__AVX2__)  // likewise (the generic form widens each 128-bit half apart)
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

// float16 (a KV pool's): one conversion instruction per vector where the CPU has F16C.
inline vf load(const at::Half* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  vf v;
  for (int i = 0; i < LANES; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline float scalar(float v) { return v; }
inline float scalar(at::BFloat16 v) { return static_cast<float>(v); }
inline float scalar(at::Half v) { return static_cast<float>(v); }

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The sum of a vector's lanes as a tree (a lane-by-lane loop is a 16-add dependency chain).
inline float hsum(vf v) {
#if HYBRIDKV_LANES == 16
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const v8 a = v;
#endif
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef int32_t vi __attribute__((vector_size(4 * LANES)));

// exp(x) for x <= 0 (softmax), a vector at a time: x = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-7
// Taylor polynomial (relative error < 1e-8 before rounding), 2^n through the exponent bits.
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;  // exp(-87) ~ 1.6e-38: below every softmax term that matters
  const vf magic = vf{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  vf p = vf{} + (1.f / 5040.f);
  p = p * r + (1.f / 720.f);
  p = p * r + (1.f / 120.f);
  p = p * r + (1.f / 24.f);
  p = p * r + (1.f / 6.f);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)scale;
}

// exp(x) for any x (above 88, where 2^n would leave the exponent range: +inf).
inline vf vexp_any(vf x) {
  const vf hi = vf{} + 88.0f;
  const vf big = x > hi ? vf{} + __builtin_inff() : vf{};
  const vf e = vexp(x < hi ? x : hi);
  return x > hi ? big : e;
}

// Sum of x[i] * y[i] for i < n, a vector at a time.
inline float dot(const float* x, const float* y, int64_t n) {
  vf acc = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc += load(x + i) * load(y + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}


// y[r, n0:n0+V*LANES] = sum_d x[r, d] * w[d, n0:...] for r < R. With several rows, the next tile's
// columns of each row are prefetched as this one is read, so the strided walk down W's rows does
// not wait on memory.
template <int R, int V, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t D) {
  vf acc[R][V] = {};
  for (int64_t d = 0; d < D; ++d) {
    const W* wr = w + d * ldw;
    vf wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(wr + v * LANES);
    if constexpr (R > 1)  // (one row: the hardware prefetcher alone streams faster, measured)
      for (int v = 0; v < V; ++v) __builtin_prefetch(wr + V * LANES + v * LANES, 0, 3);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * ldx + d];
      for (int v = 0; v < V; ++v) acc[r][v] += xr * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(y + r * ldy + v * LANES, acc[r][v]);
}

template <int V, typename W>
inline void tile_rows(int R, const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy, int64_t D) {
  switch (R) {
    case 1: return tile<1, V>(x, ldx, w, ldw, y, ldy, D);
    case 2: return tile<2, V>(x, ldx, w, ldw, y, ldy, D);
    case 3: return tile<3, V>(x, ldx, w, ldw, y, ldy, D);
    case 4: return tile<4, V>(x, ldx, w, ldw, y, ldy, D);
    case 5: return tile<5, V>(x, ldx, w, ldw, y, ldy, D);
    default: return tile<6, V>(x, ldx, w, ldw, y, ldy, D);
  }
}

// Columns [n0, n1) of y[T, N] = x[T, D] @ w[D, N], every row of x.
template <typename W>
void columns(const float* x, int64_t T, int64_t D, const W* w, int64_t N, float* y, int64_t n0, int64_t n1) {
  const bool wide = T <= Tiling<W>::MAX_R;
  const int64_t cols = wide ? Tiling<W>::COLS : NARROW_V * LANES, max_r = wide ? Tiling<W>::MAX_R : NARROW_R;
  int64_t n = n0;
  for (; n + cols <= n1; n += cols)
    for (int64_t r = 0; r < T; r += max_r) {
      const int rows = static_cast<int>(std::min<int64_t>(max_r, T - r));
      if (wide)
        tile_rows<Tiling<W>::V>(rows, x + r * D, D, w + n, N, y + r * N + n, N, D);
      else
        tile_rows<NARROW_V>(rows, x + r * D, D, w + n, N, y + r * N + n, N, D);
    }
  for (; n + LANES <= n1; n += LANES)
    for (int64_t r = 0; r < T; r += NARROW_R)
      tile_rows<1>(std::min<int64_t>(NARROW_R, T - r), x + r * D, D, w + n, N, y + r * N + n, N, D);
  for (; n < n1; ++n)  // fewer than LANES columns left
    for (int64_t r = 0; r < T; ++r) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += x[r * D + d] * scalar(w[d * N + n]);
      y[r * N + n] = s;
    }
}

// Split [0, N) into chunks of `chunk` columns, one parallel_for over them (and over `groups` products).
template <typename F>
void parallel_columns(int64_t groups, int64_t N, int64_t chunk, F&& body) {
  const int64_t chunks = (N + chunk - 1) / chunk;
  hybridkv::claimed_for(groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t g = i / chunks, c = i % chunks;
      const int64_t c_end = std::min(end - g * chunks, chunks);  // contiguous run within group g
      body(g, c * chunk, std::min(N, c_end * chunk));
      i = g * chunks + c_end;
    }
  });
}

void check_weight(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), name, " must be contiguous");
}

template <typename F>
void with_weight_type(const at::Tensor& w, F&& f) {
  if (w.scalar_type() == at::kFloat)
    f(w.data_ptr<float>());
  else
    f(reinterpret_cast<const at::BFloat16*>(w.data_ptr<at::BFloat16>()));
}

// y[N] += sum_{d0 <= d < d1} x[d] * w[d, :] for R rows of w at a time (d1 - d0 a multiple of R),
// each row's vector meeting the same vector of y, which is loaded and stored once per R rows.
// Out of line: inlined into its callers this loop ran at 2/3 the rate in some builds and not in
// others (the same instructions; Zen 4), and a call per block of rows costs nothing against it.
template <int R, typename W>
__attribute__((noinline)) void depth_rows(const float* x, const W* w, int64_t N, float* y, int64_t d0, int64_t d1) {
  for (int64_t d = d0; d < d1; d += R) {
    const W* wd = w + d * N;
    float a[R];
    for (int j = 0; j < R; ++j) a[j] = x[d + j];
    int64_t n = 0;
    for (; n + LANES <= N; n += LANES) {
      vf s = load(y + n);
      for (int j = 0; j < R; ++j) s += a[j] * load(wd + j * N + n);
      store(y + n, s);
    }
    for (; n < N; ++n)
      for (int j = 0; j < R; ++j) y[n] += a[j] * scalar(wd[j * N + n]);
  }
}

// y[N] += sum_{d0 <= d < d1} x[d] * w[d, :]: w's rows streamed whole, sixteen at a time (one at a
// time when short). Sixteen rows side by side (more streams in flight) read float32 weights of
// 4 KiB rows 1.35x as fast as four and of 8 KiB rows 1.2x, 28 KiB rows about even (one thread,
// Zen 4); the 0.8B shape's projections 1.13-1.15x (two threads, quiet host).
template <typename W>
void depth_block(const float* x, const W* w, int64_t N, float* y, int64_t d0, int64_t d1) {
  // Rows shorter than a page (1024 bfloat16 outputs) one at a time: the block's rows are contiguous,
  // so that reads one stream; four side by side ran 20% slower (Zen 4, a [3584, 1024] down_proj).
  const bool one_row = N * static_cast<int64_t>(sizeof(W)) < 4096;
  if (one_row) return depth_rows<1>(x, w, N, y, d0, d1);
  const int64_t by16 = d0 + (d1 - d0) / 16 * 16;
  depth_rows<16>(x, w, N, y, d0, by16);
  const int64_t by4 = by16 + (d1 - by16) / 4 * 4;
  depth_rows<4>(x, w, N, y, by16, by4);
  depth_rows<1>(x, w, N, y, by4, d1);
}

// y[T, N] += x[T, d0:d1] @ w[d0:d1, :] for T rows: four rows of w at a time, in blocks of columns
// small enough that the T rows of y stay in L1; each load of w (4 rows x 4 vectors, in registers)
// is applied to every row of x.
template <typename W>
void depth_block_rows(const float* x, int64_t T, int64_t D, const W* w, int64_t N, float* y, int64_t d0,
                      int64_t d1) {
  if (T == 1) return depth_block(x, w, N, y, d0, d1);
  constexpr int64_t TILE = 4 * LANES;
  const int64_t cb = std::max<int64_t>(TILE, Y_BLOCK / T / TILE * TILE);
  for (int64_t c0 = 0; c0 < N; c0 += cb) {
    const int64_t c1 = std::min(N, c0 + cb);
    int64_t d = d0;
    for (; d + 4 <= d1; d += 4) {
      const W *w0 = w + d * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
      int64_t n = c0;
      // The next 4 rows' tile, needed one column block later: the hardware prefetcher restarts on
      // every short run of a column block (10-20% at 5-8 rows, measured on Zen 4).
      const bool prefetch = d + 8 <= d1;
      for (; n + TILE <= c1; n += TILE) {
        if (prefetch)
          for (int r = 4; r < 8; ++r)
            for (int64_t b = 0; b < TILE * (int64_t)sizeof(W); b += 64)
              __builtin_prefetch(reinterpret_cast<const char*>(w0 + r * N + n) + b);
        vf a[4][4];
        for (int j = 0; j < 4; ++j) {
          a[0][j] = load(w0 + n + j * LANES);
          a[1][j] = load(w1 + n + j * LANES);
          a[2][j] = load(w2 + n + j * LANES);
          a[3][j] = load(w3 + n + j * LANES);
        }
        for (int64_t t = 0; t < T; ++t) {
          const float* xt = x + t * D + d;
          const float x0 = xt[0], x1 = xt[1], x2 = xt[2], x3 = xt[3];
          float* yt = y + t * N + n;
          for (int j = 0; j < 4; ++j)
            store(yt + j * LANES,
                  load(yt + j * LANES) + x0 * a[0][j] + x1 * a[1][j] + x2 * a[2][j] + x3 * a[3][j]);
        }
      }
      for (; n + LANES <= c1; n += LANES) {
        const vf v0 = load(w0 + n), v1 = load(w1 + n), v2 = load(w2 + n), v3 = load(w3 + n);
        for (int64_t t = 0; t < T; ++t) {
          const float* xt = x + t * D + d;
          float* yt = y + t * N + n;
          store(yt, load(yt) + xt[0] * v0 + xt[1] * v1 + xt[2] * v2 + xt[3] * v3);
        }
      }
      for (; n < c1; ++n)
        for (int64_t t = 0; t < T; ++t) {
          const float* xt = x + t * D + d;
          y[t * N + n] += xt[0] * scalar(w0[n]) + xt[1] * scalar(w1[n]) + xt[2] * scalar(w2[n]) + xt[3] * scalar(w3[n]);
        }
    }
    for (; d < d1; ++d)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = c0; n < c1; ++n) y[t * N + n] += x[t * D + d] * scalar(w[d * N + n]);
  }
}

// Few rows: each thread streams a contiguous block of w's rows into its own partial sums, then the
// partials are added.
void matmul_rows_split_depth(const float* x, int64_t T, int64_t D, const at::Tensor& w, float* y) {
  const int64_t N = w.size(1), parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), D / 4));
  const int64_t step = (D / parts + 3) / 4 * 4;
  std::vector<float> partial(parts * T * N, 0.f);
  with_weight_type(w, [&](auto* wp) {
    at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p)
        depth_block_rows(x, T, D, wp, N, partial.data() + p * T * N, std::min(D, p * step),
                         std::min(D, (p + 1) * step));
    });
  });
  for (int64_t i = 0; i < T * N; ++i) {
    float s = 0.f;
    for (int64_t p = 0; p < parts; ++p) s += partial[p * T * N + i];
    y[i] = s;
  }
}

// Columns of y one `stream_rows` block holds for T rows.
inline int64_t stream_block(int64_t T) {
  return std::max<int64_t>(LANES, Y_BLOCK / std::max<int64_t>(T, 1) / LANES * LANES);
}

// Columns [n0, n1) of y[T, N] = x[T, D] @ w[D, N], streaming w's rows: per block of columns whose
// rows of y stay in L1, four rows of w at a time, each read as one contiguous run and applied to
// every row of x.
template <typename W>
void stream_rows(const float* x, int64_t T, int64_t D, const W* w, int64_t N, float* y, int64_t n0, int64_t n1) {
  const int64_t block = stream_block(T);
  for (int64_t c0 = n0; c0 < n1; c0 += block) {
    const int64_t c1 = std::min(n1, c0 + block);
    for (int64_t t = 0; t < T; ++t) std::fill(y + t * N + c0, y + t * N + c1, 0.f);
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
      const W *w0 = w + d * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
      int64_t t = 0;
      for (; t + 2 <= T; t += 2) {  // two rows of x share each load of w: 8 FMAs per 4 loads of w
        const float *xa = x + t * D + d, *xb = xa + D;
        const float a0 = xa[0], a1 = xa[1], a2 = xa[2], a3 = xa[3], b0 = xb[0], b1 = xb[1], b2 = xb[2], b3 = xb[3];
        float *ya = y + t * N, *yb = ya + N;
        int64_t n = c0;
        for (; n + LANES <= c1; n += LANES) {
          const vf v0 = load(w0 + n), v1 = load(w1 + n), v2 = load(w2 + n), v3 = load(w3 + n);
          store(ya + n, load(ya + n) + a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3);
          store(yb + n, load(yb + n) + b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3);
        }
        for (; n < c1; ++n) {
          const float v0 = scalar(w0[n]), v1 = scalar(w1[n]), v2 = scalar(w2[n]), v3 = scalar(w3[n]);
          ya[n] += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3;
          yb[n] += b0 * v0 + b1 * v1 + b2 * v2 + b3 * v3;
        }
      }
      for (; t < T; ++t) {
        const float *xt = x + t * D + d, a0 = xt[0], a1 = xt[1], a2 = xt[2], a3 = xt[3];
        float* yt = y + t * N;
        int64_t n = c0;
        for (; n + LANES <= c1; n += LANES)
          store(yt + n, load(yt + n) + a0 * load(w0 + n) + a1 * load(w1 + n) + a2 * load(w2 + n) + a3 * load(w3 + n));
        for (; n < c1; ++n) yt[n] += a0 * scalar(w0[n]) + a1 * scalar(w1[n]) + a2 * scalar(w2[n]) + a3 * scalar(w3[n]);
      }
    }
    for (; d < D; ++d)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = c0; n < c1; ++n) y[t * N + n] += x[t * D + d] * scalar(w[d * N + n]);
  }
}

// Columns [n0, n1) of y[T, N] = x[T, D] @ w[D, N] the way this machine does them best (see the top).
template <typename W>
void product_columns(const float* x, int64_t T, int64_t D, const W* w, int64_t N, float* y, int64_t n0, int64_t n1) {
  if constexpr (STREAM_ROWS)
    stream_rows(x, T, D, w, N, y, n0, n1);
  else
    columns(x, T, D, w, N, y, n0, n1);
}

// The unit of parallel work of `product_columns` for T rows.
template <typename W>
int64_t chunk_columns(int64_t T) {
  return STREAM_ROWS ? stream_block(T) : Tiling<W>::COLS;
}

// y[T, N] = x[T, D] @ w[D, N], columns split over threads.
void matmul_into(const float* x, int64_t T, int64_t D, const at::Tensor& w, float* y) {
  const int64_t N = w.size(1);
  if (T > FEW_ROWS && w.scalar_type() == at::kFloat) {  // compute-bound: MKL's GEMM
    at::Tensor yt = at::from_blob(y, {T, N}, at::kFloat);
    at::mm_out(yt, at::from_blob(const_cast<float*>(x), {T, D}, at::kFloat), w);
    return;
  }
  if (T == 0) return;
  if (T <= SPLIT_ROWS && (T == 1 || w.nbytes() > SPLIT_FROM_BYTES)) return matmul_rows_split_depth(x, T, D, w, y);
  with_weight_type(w, [&](auto* wp) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(wp)>>;
    parallel_columns(1, N, chunk_columns<W>(T), [&](int64_t, int64_t n0, int64_t n1) {
      product_columns(x, T, D, wp, N, y, n0, n1);
    });
  });
}

at::Tensor rows_matmul(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(0), "rows_matmul: x [T, D] @ w [D, N], got ",
              x_in.sizes(), " and ", w.sizes());
  check_weight(w, "rows_matmul weight");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(1)}, x.options());
  matmul_into(x.data_ptr<float>(), x.size(0), x.size(1), w, y.data_ptr<float>());
  return y;
}

// y[t, n0 + j] = x[t] . w[n0 + j] for RX rows of x and RW rows of w [N, D] (each row contiguous):
// RW x RX sums in registers while the rows stream by a vector at a time (AVX2: 4 x 3 sums and the
// 4 weight vectors fill the 16 registers; x comes from L1/L2 as a memory operand). With both x and
// w in bfloat16 where the CPU has AVX512-BF16, `vdpbf16ps` takes 32 of each a vector: the same
// exact products (a bfloat16 product fits a float32), two added into each float32 lane, with no
// widening of the weights.
template <int RW, int RX, typename X, typename W>
inline void dot_tile(const X* x, int64_t D, const W* w, float* y, int64_t N) {
  int64_t d = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, at::BFloat16> && std::is_same_v<W, at::BFloat16>) {
    __m512 acc[RX][RW];
    for (int r = 0; r < RX; ++r)
      for (int j = 0; j < RW; ++j) acc[r][j] = _mm512_setzero_ps();
    for (; d + 32 <= D; d += 32) {
      __m512bh wv[RW];
      for (int j = 0; j < RW; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * D + d);
      for (int r = 0; r < RX; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * D + d);
        for (int j = 0; j < RW; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
      }
    }
    for (int r = 0; r < RX; ++r)
      for (int j = 0; j < RW; ++j) {
        float sum = _mm512_reduce_add_ps(acc[r][j]);
        for (int64_t i = d; i < D; ++i) sum += scalar(x[r * D + i]) * scalar(w[j * D + i]);
        y[r * N + j] = sum;
      }
  } else
#endif
  {
    static_assert(std::is_same_v<X, float>, "x is float32 unless both are bfloat16 with AVX512-BF16");
    vf acc[RX][RW] = {};
    for (; d + LANES <= D; d += LANES) {
      vf wv[RW];
      for (int j = 0; j < RW; ++j) wv[j] = load(w + j * D + d);
      for (int r = 0; r < RX; ++r) {
        const vf xv = load(x + r * D + d);
        for (int j = 0; j < RW; ++j) acc[r][j] += xv * wv[j];
      }
    }
    for (int r = 0; r < RX; ++r)
      for (int j = 0; j < RW; ++j) {
        float sum = hsum(acc[r][j]);
        for (int64_t i = d; i < D; ++i) sum += x[r * D + i] * scalar(w[j * D + i]);
        y[r * N + j] = sum;
      }
  }
}

// y[r] = x . w[r] for `rows` float32 rows of w [rows, D] and one row of x: `dot_tile`'s one-row
// form, out of line, its results kept and stored 16 at a time. Inlined into `rows_matmul_t`, the
// same loop read a 248k-row head at 37 GB/s in one build and 52-58 in others; this read 52 where
// that build's read 37 (a sum over the same tensor: 56; 2 threads, Zen 4, quiet host), and as
// fast as the best inlined one elsewhere.
__attribute__((noinline)) void dot_one_row(const float* x, int64_t D, const float* w, float* y, int64_t rows) {
  float kept[16];
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, rows - r0);
    for (int64_t r = 0; r < n; ++r) dot_tile<1, 1>(x, D, w + (r0 + r) * D, kept + r, 0);
    std::memcpy(y + r0, kept, n * sizeof(float));
  }
}

template <int RW, typename X, typename W>
inline void dot_rows(int RX, const X* x, int64_t D, const W* w, float* y, int64_t N) {
  switch (RX) {
    case 1: return dot_tile<RW, 1>(x, D, w, y, N);
    case 2: return dot_tile<RW, 2>(x, D, w, y, N);
    default: return dot_tile<RW, 3>(x, D, w, y, N);
  }
}

// y[T, N] = x[T, D] @ w[N, D]^T for few rows: a weight stored [out, in], as a tied lm_head uses
// the embedding [V, D]. Each thread streams a contiguous block of w's rows once; every row of x
// meets each weight row (or group of 8 rows, AVX2 with more than one row: 4) while it is in L1.
// Eight rows at a time, up to 3 rows of x each pass, read a 248k-row float32 head 12-15% faster
// at 2-5 rows than four (Zen 4, measured). A bfloat16 x meets a bfloat16 w in pairs (`dot_tile`)
// where it can.
at::Tensor rows_matmul_t(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1),
              "rows_matmul_t: x [T, D] @ w [N, D]^T, got ", x_in.sizes(), " and ", w.sizes());
  check_weight(w, "rows_matmul_t weight");
  const bool pairs = BF16_DOT && x_in.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
  const at::Tensor x = pairs ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t T = x.size(0), D = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({T, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  constexpr int64_t GROUP = 8;  // rows of w per unit of work (one tile; AVX2 with more than one row: two)
  // One weight row after another, each whole: one stream, which the hardware prefetcher follows
  // best. 8 rows side by side (the tiles) win only where several rows of x share each weight
  // vector and the rows are at least a page long (float32 at D >= 1024). Measured on Zen 4 over
  // a 248k-row head: one row of x 1.3x faster (float32) and 1.8x (bfloat16, 2 KiB rows); 2-3 rows
  // of x on 2 KiB rows 1.7x; float32 rows at 2+ rows of x 1.1-1.8x slower.
  const bool one_stream = T == 1 || D * static_cast<int64_t>(w.element_size()) < 4096;
  auto stream = [&](const auto* xp, const auto* wp) {
    const int64_t groups = (N + GROUP - 1) / GROUP;
    const int64_t claim = hybridkv::claim_items(GROUP * D * static_cast<int64_t>(sizeof(*wp)), 1);
    hybridkv::claimed_for(groups, claim, [&](int64_t begin, int64_t end) {
      const int64_t stop = std::min(N, end * GROUP);
      if constexpr (std::is_same_v<decltype(xp), const float*> && std::is_same_v<decltype(wp), const float*>) {
        if (T == 1) return dot_one_row(xp, D, wp + begin * GROUP * D, yp + begin * GROUP, stop - begin * GROUP);
      }
      for (int64_t n = begin * GROUP; n < stop;) {
        const int64_t left = one_stream ? 0 : stop - n;  // one stream: always the one-row form below
        if (LANES == 16 && left >= 8) {  // 8 x 3 sums + 8 weight vectors: 32 registers
          for (int64_t t = 0; t < T; t += 3)
            dot_rows<8>(static_cast<int>(std::min<int64_t>(3, T - t)), xp + t * D, D, wp + n * D, yp + t * N + n, N);
          n += 8;
        } else if (left >= 4) {
          for (int64_t t = 0; t < T; t += 3)
            dot_rows<4>(static_cast<int>(std::min<int64_t>(3, T - t)), xp + t * D, D, wp + n * D, yp + t * N + n, N);
          n += 4;
        } else {
          for (int64_t t = 0; t < T; t += 3)
            dot_rows<1>(static_cast<int>(std::min<int64_t>(3, T - t)), xp + t * D, D, wp + n * D, yp + t * N + n, N);
          n += 1;
        }
      }
    }, 64);
  };
  with_weight_type(w, [&](auto* wp) {
    if constexpr (BF16_DOT && std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(wp)>>, at::BFloat16>) {
      if (pairs) return stream(reinterpret_cast<const at::BFloat16*>(x.data_ptr<at::BFloat16>()), wp);
    }
    stream(x.data_ptr<float>(), wp);
  });
  return y;
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }
inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }
inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

void check_experts(int64_t D, const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3, "moe: gate_up [E, D, 2I] and down [E, I, D]");
  const int64_t E = gate_up.size(0), I = gate_up.size(2) / 2;
  TORCH_CHECK(gate_up.size(1) == D && down.size(0) == E && down.size(1) == I && down.size(2) == D,
              "moe: shapes do not match: D ", D, ", gate_up ", gate_up.sizes(), ", down ", down.sizes());
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type(), "moe: gate_up and down differ in dtype");
  check_weight(gate_up, "moe gate_up");
  check_weight(down, "moe down");
}

// Routed SwiGLU experts for a few tokens: out[t] += sum_j wts[t, j] * expert_{ids[t, j]}(x[t]).
// Reads each chosen expert's weights once, in place (no gather), both products split over threads.
// rows [0, P) of act [P, I] = silu(h[:, :I]) * h[:, I:], h [P, 2I].
void silu_mul_rows(const float* h, int64_t P, int64_t I, float* act) {
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const float *gate = h + s * 2 * I, *up = gate + I;
      float* a = act + s * I;
      int64_t i = 0;
      for (; i + LANES <= I; i += LANES) {
        const vf g = load(gate + i);
        store(a + i, g / (1.f + vexp_any(-g)) * load(up + i));
      }
      for (; i < I; ++i) a[i] = silu(gate[i]) * up[i];
    }
  });
}

// Routed SwiGLU experts: out[t] += sum_j wts[t, j] * expert_{ids[t, j]}(x[t]). Experts with few
// rows read their weights once, in place (no gather), grouped in one pass over the threads;
// experts with many rows (prefill) go to MKL one by one.
void routed_into(const float* xp, int64_t T, int64_t D, const int64_t* idp, const float* wp, int64_t k,
                 const at::Tensor& gate_up, const at::Tensor& down, float* op) {
  const int64_t E = gate_up.size(0), I2 = gate_up.size(2), I = I2 / 2, P = T * k;
  // Counting sort of the T*k (token, expert) pairs by expert: expert e owns rows start[e]:start[e+1].
  std::vector<int64_t> start(E + 1, 0), token(P), row_of(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "moe: expert id ", idp[p], " out of range [0, ", E, ")");
    ++start[idp[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t s = fill[idp[p]]++;
    token[s] = p / k;
    row_of[p] = s;
  }
  // Experts with many rows go to MKL: float32 as they are; bfloat16 widened to float32 one expert
  // at a time where the CPU has no bfloat16 dot instructions (this kernel's tiles are not a GEMM).
  const bool mkl = gate_up.scalar_type() == at::kFloat || !BF16_DOT;
  std::vector<int64_t> few, many;  // experts with rows, by how many
  int64_t max_rows = 1;  // of the few
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows > 0) (mkl && rows > FEW_ROWS ? many : few).push_back(e);
    if (rows > 0 && !(mkl && rows > FEW_ROWS)) max_rows = std::max(max_rows, rows);
  }

  // Scratch from ATen's allocator: uninitialised (a zeroed std::vector costs a memset of ~18 MB at 512 tokens).
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor xs = at::empty({P, D}, f32), h = at::empty({P, I2}, f32), act = at::empty({P, I}, f32);
  at::Tensor ys = at::empty({P, D}, f32);
  float *xsp = xs.data_ptr<float>(), *hp = h.data_ptr<float>(), *ap = act.data_ptr<float>(), *yp = ys.data_ptr<float>();
  at::parallel_for(0, P, 64, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) std::memcpy(xsp + s * D, xp + token[s] * D, D * sizeof(float));
  });
  // Each expert's rows of out [P, N] = its rows of in [P, K] @ weight[e] [K, N].
  auto expert_products = [&](const float* in, int64_t K, const at::Tensor& weight, int64_t N, float* out) {
    for (int64_t e : many) {
      const int64_t s0 = start[e], rows = start[e + 1] - s0;
      at::Tensor out_e = at::from_blob(out + s0 * N, {rows, N}, at::kFloat);
      at::mm_out(out_e, at::from_blob(const_cast<float*>(in) + s0 * K, {rows, K}, at::kFloat),
                 weight.select(0, e).to(at::kFloat));
    }
    if (few.empty()) return;
    with_weight_type(weight, [&](auto* wp) {
      using W = std::remove_cv_t<std::remove_pointer_t<decltype(wp)>>;
      if (max_rows > SPLIT_ROWS) {
        parallel_columns(static_cast<int64_t>(few.size()), N, chunk_columns<W>(max_rows),
                         [&](int64_t g, int64_t n0, int64_t n1) {
                           const int64_t e = few[g], s0 = start[e], rows = start[e + 1] - s0;
                           product_columns(in + s0 * K, rows, K, wp + e * K * N, N, out + s0 * N, n0, n1);
                         });
        return;
      }
      // Decode and verify: each thread streams whole experts (or, with fewer experts than threads,
      // contiguous depth blocks of one) into partial sums, as `matmul_rows_split_depth` does.
      const int64_t G = static_cast<int64_t>(few.size());
      const int64_t parts = std::max<int64_t>(1, std::min<int64_t>((at::get_num_threads() + G - 1) / G, K / 4));
      const int64_t step = (K / parts + 3) / 4 * 4;
      std::vector<float> partial(parts > 1 ? parts * P * N : 0, 0.f);
      at::parallel_for(0, G * parts, 1, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
          const int64_t e = few[u / parts], part = u % parts, s0 = start[e], rows = start[e + 1] - s0;
          float* dst = parts == 1 ? out + s0 * N : partial.data() + (part * P + s0) * N;
          if (parts == 1) std::fill(dst, dst + rows * N, 0.f);
          depth_block_rows(in + s0 * K, rows, K, wp + e * K * N, N, dst, std::min(K, part * step),
                           std::min(K, (part + 1) * step));
        }
      });
      if (parts == 1) return;
      for (int64_t e : few)
        for (int64_t i = start[e] * N; i < start[e + 1] * N; ++i) {
          float sum = 0.f;
          for (int64_t part = 0; part < parts; ++part) sum += partial[part * P * N + i];
          out[i] = sum;
        }
    });
  };
  expert_products(xsp, D, gate_up, I2, hp);
  silu_mul_rows(hp, P, I, ap);
  expert_products(ap, I, down, D, yp);
  // Back to the tokens: each output row is written by one thread only.
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * D;
      for (int64_t j = 0; j < k; ++j) {
        const float wgt = wp[t * k + j];
        const float* y = yp + row_of[t * k + j] * D;
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) store(o + d, load(o + d) + wgt * load(y + d));
        for (; d < D; ++d) o[d] += wgt * y[d];
      }
    }
  });
}

// A whole sparse-MoE feed-forward:
//   [router E | shared gate 1 | shared gate_up 2Is] = x @ gate_in;  probs = softmax(router);
//   top_k experts (weights renormalised if norm_topk); out = routed + sigmoid(shared gate) *
//   (silu(shared gate) * shared up) @ shared_down.
// x [T, D]; gate_in [D, E + 1 + 2Is]; gate_up [E, D, 2I]; down [E, I, D]; shared_down [Is, D].
at::Tensor moe_block(const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& gate_up,
                     const at::Tensor& down, const at::Tensor& shared_down, int64_t top_k, bool norm_topk) {
  TORCH_CHECK(x_in.dim() == 2, "moe_block: x must be [T, D]");
  const int64_t T = x_in.size(0), D = x_in.size(1), E = gate_up.size(0);
  check_experts(D, gate_up, down);
  check_weight(gate_in, "moe_block gate_in");
  check_weight(shared_down, "moe_block shared_down");
  const int64_t Is = shared_down.size(0), G = E + 1 + 2 * Is;
  TORCH_CHECK(gate_in.dim() == 2 && gate_in.size(0) == D && gate_in.size(1) == G && shared_down.size(1) == D,
              "moe_block: gate_in ", gate_in.sizes(), " / shared_down ", shared_down.sizes(), " do not match");
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_block: top_k ", top_k, " must be in 1..", E);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const float* xp = x.data_ptr<float>();
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor r_t = at::empty({T, G}, f32), act_t = at::empty({T, Is}, f32), shared_t = at::empty({T, D}, f32);
  float *r = r_t.data_ptr<float>(), *act = act_t.data_ptr<float>(), *shared = shared_t.data_ptr<float>();
  std::vector<float> wts(T * top_k);
  std::vector<int64_t> ids(T * top_k);
  matmul_into(xp, T, D, gate_in, r);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(E);
    std::vector<int64_t> order(E);
    for (int64_t t = begin; t < end; ++t) {
      const float* logits = r + t * G;
      float mx = logits[0];
      for (int64_t e = 1; e < E; ++e) mx = std::max(mx, logits[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(logits[e] - mx));
      for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
      for (int64_t e = 0; e < E; ++e) order[e] = e;
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
        return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
      });
      float chosen = 0.f;
      for (int64_t j = 0; j < top_k; ++j) chosen += probs[order[j]];
      for (int64_t j = 0; j < top_k; ++j) {
        ids[t * top_k + j] = order[j];
        wts[t * top_k + j] = norm_topk ? probs[order[j]] / chosen : probs[order[j]];
      }
    }
  });
  // Shared expert: its gate_up columns sit in r after the router and the shared gate.
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* sg = r + t * G + E + 1;
      for (int64_t i = 0; i < Is; ++i) act[t * Is + i] = silu(sg[i]) * sg[Is + i];
    }
  });
  matmul_into(act, T, Is, shared_down, shared);
  at::Tensor out = at::empty({T, D}, x.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float gate = sigmoid(r[t * G + E]);
      for (int64_t d = 0; d < D; ++d) op[t * D + d] = gate * shared[t * D + d];
    }
  });
  routed_into(xp, T, D, ids.data(), wts.data(), top_k, gate_up, down, op);
  return out;
}


// One token of the gated delta rule on a head's state S [dk, dv], in place:
//   S *= decay;  u = beta * (v - S^T k);  S += k u^T;  o = S^T q.
void delta_step(float* S, const float* q, const float* k, const float* v, float beta, float decay, int64_t dk,
                int64_t dv, float* u, float* o) {
  std::fill(u, u + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      u[j] += k[i] * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) u[j] = beta * (v[j] - u[j]);
  std::fill(o, o + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += k[i] * u[j];
      o[j] += q[i] * row[j];
    }
  }
}

// What `delta_run` needs of one token of one value head.
struct DeltaToken {
  const float *q, *k, *v;
  float beta, decay, qk;  // qk = q . k
};

// Below this, a run's state multiple g (see `delta_run`) is folded into the state.
constexpr float DELTA_FOLD_BELOW = 1e-6f;

// One pass over a slice's dk rows (S at its first column, rows dv apart). UPDATE: each row becomes
// row·g + k[i]·w (FOLD) or row + k[i]·w, and is stored. NEXT: a = Σ kn[i]·row, b = Σ qn[i]·row
// over the rows as they leave the pass (even and odd rows in two chains, then added).
template <int NV, bool UPDATE, bool FOLD, bool NEXT>
inline void delta_pass(float* S, int64_t dk, int64_t dv, const float* k, const vf* w, float g, const float* kn,
                       const float* qn, vf* a, vf* b) {
  vf a2[NV] = {}, b2[NV] = {};
  for (int v = 0; v < NV; ++v) a[v] = b[v] = vf{};
  auto row = [&](int64_t i, vf* ra, vf* rb) {
    for (int v = 0; v < NV; ++v) {
      float* p = S + i * dv + v * LANES;
      vf r = load(p);
      if constexpr (UPDATE) {
        r = FOLD ? r * g + k[i] * w[v] : r + k[i] * w[v];
        store(p, r);
      }
      if constexpr (NEXT) ra[v] += kn[i] * r, rb[v] += qn[i] * r;
    }
  };
  int64_t i = 0;
  for (; i + 2 <= dk; i += 2) row(i, a, b), row(i + 1, a2, b2);
  for (; i < dk; ++i) row(i, a, b);
  for (int v = 0; v < NV; ++v) a[v] += a2[v], b[v] += b2[v];
}

// The gated delta rule of `delta_step` over a run of n tokens, on columns [c, c + NV*LANES) of a
// head's state S [dk, dv] and of its tokens' v and o. Each column of the state meets only its own
// u and o, so the slice (2 vectors of columns: 16 KiB at dk = 128 with AVX-512, 8 KiB with AVX2)
// stays in L1 for the whole run; token by token, the whole head (64 KiB) streamed through L2
// twice a token.
// The slice is held as S = g P: a token's decay multiplies g, not the state, and one pass per
// token updates P and reads the next token's P^T k and P^T q (three multiply-adds an element,
// where decay, write and read-out took five):
//   a = P^T k, b = P^T q,  g' = g decay,  u = beta (v - g' a),  o = S'^T q = g' b + (q . k) u,
//   P += k (u / g')   (S' = g' P),  or, folding g into the state,  P = g' P + k u and g' = 1.
// The run folds after its last token (S itself again) and when g' falls below DELTA_FOLD_BELOW
// (so P stays within a few powers of ten of S). Writes o's columns to o (a token's row o_stride
// apart).
template <int NV>
void delta_run(float* S, int64_t c, int64_t dk, int64_t dv, const DeltaToken* tok, int64_t n, float* o,
               int64_t o_stride) {
  S += c, o += c;
  vf a[NV], b[NV];
  delta_pass<NV, false, false, true>(S, dk, dv, nullptr, nullptr, 0.f, tok[0].k, tok[0].q, a, b);  // first reads
  float g = 1.f;
  for (int64_t t = 0; t < n; ++t) {
    const DeltaToken& x = tok[t];
    const float g2 = g * x.decay;
    vf w[NV];
    for (int v = 0; v < NV; ++v) {
      w[v] = x.beta * (load(x.v + c + v * LANES) - g2 * a[v]);
      store(o + t * o_stride + v * LANES, g2 * b[v] + x.qk * w[v]);
    }
    // One pass: P updated (folded: times g2), and the next token's reads from the new P.
    if (t + 1 == n) {
      delta_pass<NV, true, true, false>(S, dk, dv, x.k, w, g2, nullptr, nullptr, a, b);
    } else if (!(g2 >= DELTA_FOLD_BELOW)) {
      delta_pass<NV, true, true, true>(S, dk, dv, x.k, w, g2, tok[t + 1].k, tok[t + 1].q, a, b);
      g = 1.f;
    } else {
      for (int v = 0; v < NV; ++v) w[v] *= 1.f / g2;
      delta_pass<NV, true, false, true>(S, dk, dv, x.k, w, g2, tok[t + 1].k, tok[t + 1].q, a, b);
      g = g2;
    }
  }
}

// out = RMSNorm(o) * weight * silu(z) over dv.
void gated_rms_norm(const float* o, const float* z, const float* weight, float eps, int64_t dv, float* out) {
  const float inv = 1.f / std::sqrt(dot(o, o, dv) / static_cast<float>(dv) + eps);
  int64_t j = 0;
  for (; j + LANES <= dv; j += LANES) {
    const vf zj = load(z + j);
    store(out + j, load(o + j) * inv * load(weight + j) * (zj / (1.f + vexp_any(-zj))));
  }
  for (; j < dv; ++j) out[j] = o[j] * inv * weight[j] * (z[j] / (1.f + std::exp(-z[j])));
}


#if HYBRIDKV_LANES == 16
// The permute tables for n vectors (1..MAX), built once per process (not at every decode call).
struct Permutes {
  static constexpr int MAX = 8;
  int n;
  // Step s of output o: acc = permute(acc, x[s]) (step 1: permute(x[0], x[1]); n = 1: one permute
  // of x[0]); lanes whose source is x[s] take it, the others keep theirs.
  __m512i split_idx[MAX][MAX], join_idx[MAX][MAX];

  explicit Permutes(int count) : n(count) {
    alignas(64) int32_t m[2][MAX][MAX][LANES];
    for (int o = 0; o < n; ++o)
      for (int l = 0; l < LANES; ++l) {
        const int f = l * n + o, g = o * LANES + l;  // split: raw f; join: element g % n of lane g / n
        place(m[0][o], l, f / LANES, f % LANES);
        place(m[1][o], l, g % n, g / n);
      }
    for (int o = 0; o < n; ++o)
      for (int s = 0; s < n; ++s) {
        split_idx[o][s] = _mm512_load_si512(m[0][o][s]);
        join_idx[o][s] = _mm512_load_si512(m[1][o][s]);
      }
  }

  void place(int32_t (*steps)[LANES], int l, int src, int lane) const {
    steps[0][l] = lane;  // the only step when n = 1 (set always, so every table loaded is defined)
    if (n == 1) return;
    steps[1][l] = src == 0 ? lane : src == 1 ? LANES + lane : l;
    for (int s = 2; s < n; ++s) steps[s][l] = src == s ? LANES + lane : l;
  }

  template <int N>
  static vf combine(const __m512* x, const __m512i* idx) {
    if constexpr (N == 1) return (vf)_mm512_permutexvar_ps(idx[0], x[0]);
    __m512 acc = _mm512_permutex2var_ps(x[0], idx[1], x[1]);
    for (int s = 2; s < N; ++s) acc = _mm512_permutex2var_ps(acc, idx[s], x[s]);
    return (vf)acc;
  }

  // The count a compile-time constant, so the vectors stay in registers: with n read at run time
  // the copy into x compiled to a memcpy call (a tenth of a decode step's gdn_forward).
  template <int N>
  void split_n(const float* raw, vf* out) const {
    __m512 x[N];
    for (int s = 0; s < N; ++s) x[s] = _mm512_loadu_ps(raw + s * LANES);
    for (int o = 0; o < N; ++o) out[o] = combine<N>(x, split_idx[o]);
  }

  template <int N>
  void join_n(const vf* in, float* raw) const {
    __m512 x[N];
    for (int s = 0; s < N; ++s) x[s] = (__m512)in[s];
    for (int o = 0; o < N; ++o) _mm512_storeu_ps(raw + o * LANES, (__m512)combine<N>(x, join_idx[o]));
  }

  template <class F>
  void with_count(F&& f) const {
    switch (n) {
      case 1: return f(std::integral_constant<int, 1>{});
      case 2: return f(std::integral_constant<int, 2>{});
      case 3: return f(std::integral_constant<int, 3>{});
      case 4: return f(std::integral_constant<int, 4>{});
      case 5: return f(std::integral_constant<int, 5>{});
      case 6: return f(std::integral_constant<int, 6>{});
      case 7: return f(std::integral_constant<int, 7>{});
      default: return f(std::integral_constant<int, 8>{});
    }
  }

  void split(const float* raw, vf* out) const {
    with_count([&](auto c) { split_n<decltype(c)::value>(raw, out); });
  }

  void join(const vf* in, float* raw) const {
    with_count([&](auto c) { join_n<decltype(c)::value>(in, raw); });
  }

  // Tables for 1..MAX vectors, or null.
  static const Permutes* of(int64_t count) {
    static const std::vector<Permutes> all = [] {
      std::vector<Permutes> tables;
      for (int i = 1; i <= MAX; ++i) tables.emplace_back(i);
      return tables;
    }();
    return count >= 1 && count <= MAX ? &all[count - 1] : nullptr;
  }
};
#endif

// n vectors stored interleaved, element j of lane l at l*n + j (the conv weight [C, K] and state
// [C, K-1] of LANES channels), split into n vectors (lane l of vector j = element j of lane l) and
// joined back. A whole block of LANES lanes goes through `Permutes`' two-source lane permutes in
// registers, where lane-by-lane moves went through memory (perf put a third of the conv phase on
// three of those scalar stores); with the loop order below the 0.8B shape's 18 linear-attention
// layers took 5-8% less time at batch 8, 3-5% at batch 1 (Zen 4). A partial block, AVX2, or n
// above `Permutes::MAX` moves lane by lane; lanes past `width` split as 0.
struct Interleaved {
  int64_t n;
#if HYBRIDKV_LANES == 16
  const Permutes* permutes;
  explicit Interleaved(int64_t count) : n(count), permutes(Permutes::of(count)) {}
#else
  explicit Interleaved(int64_t count) : n(count) {}
#endif

  void split(const float* raw, vf* out, int64_t width) const {
#if HYBRIDKV_LANES == 16
    if (permutes && width == LANES) return permutes->split(raw, out);
#endif
    for (int64_t j = 0; j < n; ++j)
      for (int l = 0; l < LANES; ++l) out[j][l] = l < width ? raw[l * n + j] : 0.f;
  }

  void join(const vf* in, float* raw, int64_t width) const {
#if HYBRIDKV_LANES == 16
    if (permutes && width == LANES) return permutes->join(in, raw);
#endif
    for (int64_t j = 0; j < n; ++j)
      for (int l = 0; l < width; ++l) raw[l * n + j] = in[j][l];
  }
};

// A Gated DeltaNet mixer after in_proj, over a packed batch of sequences (decode is every length
// 1): causal conv + SiLU, joint q|k L2 norm, gates, the delta rule token by token, RMSNorm(o) *
// silu(z). On a CPU the recurrent form beats the chunked one: a head's state [dk, dv] stays in L1
// and a token costs four passes over it. The states are updated in place in the pools at `slots`;
// the states after each token in `snap_tokens` are copied to the snapshot pools at `snap_ids`.
//   mixed [T, C + Hv*dv + 2*Hv] = q|k|v (C) | z | b | a;  conv_weight [C, K];  A_log, dt_bias [Hv];
//   norm_weight [dv];  conv_pool [slots, C, K-1];  delta_pool [slots, Hv, dk, dv] (float32);
//   cu_seqlens [N+1];  slots [N];  snap_tokens [S] ascending;  snap_ids [S].
// Returns [T, Hv*dv] float32.
at::Tensor gdn_forward(const at::Tensor& mixed_in, const at::Tensor& conv_weight_in, const at::Tensor& A_log,
                       const at::Tensor& dt_bias, const at::Tensor& norm_weight, double eps, int64_t Hk, int64_t dk,
                       at::Tensor conv_pool, at::Tensor delta_pool, const at::Tensor& slots_in,
                       const at::Tensor& cu_seqlens_in, at::Tensor snap_conv, at::Tensor snap_delta,
                       const at::Tensor& snap_tokens_in, const at::Tensor& snap_ids_in, bool tiled) {
  const int64_t T = mixed_in.size(0), Hv = A_log.size(0), dv = norm_weight.size(0);
  const int64_t C = conv_weight_in.size(0), K = conv_weight_in.size(1), r = Hv / Hk;
  TORCH_CHECK(Hk >= 1 && Hv % Hk == 0 && K >= 1, "gdn_forward: Hv (", Hv, ") must be a multiple of Hk (", Hk, ")");
  TORCH_CHECK(mixed_in.dim() == 2 && mixed_in.size(1) == C + Hv * dv + 2 * Hv && C == 2 * Hk * dk + Hv * dv,
              "gdn_forward: mixed ", mixed_in.sizes(), " does not match C=", C, " Hv=", Hv, " dv=", dv);
  for (const at::Tensor* pool : {&conv_pool, &delta_pool, &snap_conv, &snap_delta})
    TORCH_CHECK(pool->scalar_type() == at::kFloat && pool->is_contiguous(),
                "gdn_forward: state pools must be contiguous float32");
  TORCH_CHECK(conv_pool.size(1) == C && conv_pool.size(2) == K - 1 && delta_pool.size(1) == Hv &&
                  delta_pool.size(2) == dk && delta_pool.size(3) == dv && snap_conv.sizes().slice(1) ==
                  conv_pool.sizes().slice(1) && snap_delta.sizes().slice(1) == delta_pool.sizes().slice(1),
              "gdn_forward: pool shapes ", conv_pool.sizes(), " ", delta_pool.sizes(), " do not match the layer");
  const at::Tensor mixed = mixed_in.to(at::kFloat).contiguous();
  const at::Tensor conv_weight = conv_weight_in.to(at::kFloat).contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous(), cu = cu_seqlens_in.to(at::kLong).contiguous();
  const at::Tensor snap_tokens = snap_tokens_in.to(at::kLong).contiguous();
  const at::Tensor snap_ids = snap_ids_in.to(at::kLong).contiguous();
  const at::Tensor a_log = A_log.to(at::kFloat).contiguous(), bias = dt_bias.to(at::kFloat).contiguous();
  const at::Tensor nw = norm_weight.to(at::kFloat).contiguous();
  const int64_t N = slots.numel(), S = snap_tokens.numel();
  TORCH_CHECK(cu.numel() == N + 1, "gdn_forward: cu_seqlens needs one entry more than slots");
  TORCH_CHECK(snap_ids.numel() == S, "gdn_forward: snap_tokens and snap_ids differ in length");

  const int64_t W = C + Hv * dv + 2 * Hv, Km1 = K - 1;
  const float* mp = mixed.data_ptr<float>();
  const float* cw = conv_weight.data_ptr<float>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *cup = cu.data_ptr<int64_t>();
  const int64_t *stok = snap_tokens.data_ptr<int64_t>(), *sid = snap_ids.data_ptr<int64_t>();
  float *cp = conv_pool.data_ptr<float>(), *dp = delta_pool.data_ptr<float>();
  float *scp = snap_conv.data_ptr<float>(), *sdp = snap_delta.data_ptr<float>();
  TORCH_CHECK(cup[0] == 0 && cup[N] == T, "gdn_forward: cu_seqlens must run from 0 to T=", T);
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(cup[n + 1] > cup[n], "gdn_forward: sequence ", n, " has no tokens");
    TORCH_CHECK(slot[n] >= 0 && slot[n] < conv_pool.size(0), "gdn_forward: slot ", slot[n], " out of range");
  }
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(stok[i] >= 0 && stok[i] < T && (i == 0 || stok[i] >= stok[i - 1]),
                "gdn_forward: snap_tokens must be ascending token indices in [0, T)");
    TORCH_CHECK(sid[i] >= 0 && sid[i] < snap_conv.size(0), "gdn_forward: snapshot id ", sid[i], " out of range");
  }
  // The first snapshot at or after token `t`.
  auto first_snapshot = [&](int64_t t) { return std::lower_bound(stok, stok + S, t) - stok; };

  // Phase 1, per block of LANES channels: the causal conv of every sequence, token by token, its
  // window (the conv state) kept in registers; SiLU. A block's weights [LANES, K] and state
  // [LANES, K-1] are split into vectors (and the state joined back) by `Interleaved`.
  at::Tensor y = at::empty({T, C}, mixed.options());
  float* yp = y.data_ptr<float>();
  const Interleaved taps(K), window(Km1);
  // One sequence's tokens through a block: `win` (oldest first) is this block's window. M > 0 is
  // K-1 known at compile time, so the window lives in registers and shifts by renaming (a run-time
  // shift loop compiles to a memmove call a token); M = 0 takes Km1 at run time.
  auto conv_tokens = [&](auto m_const, vf* win, const vf* wt, int64_t n, int64_t c0, int64_t width) {
    constexpr int M = decltype(m_const)::value;
    const bool whole = width == LANES;
    vf reg[M > 0 ? M : 1];
    vf* w = M > 0 ? reg : win;
    const int64_t m = M > 0 ? M : Km1;
    for (int64_t j = 0; j < M; ++j) reg[j] = win[j];
    int64_t p = first_snapshot(cup[n]);
    for (int64_t t = cup[n]; t < cup[n + 1]; ++t) {
      vf xin = {};
      if (whole)
        xin = load(mp + t * W + c0);
      else
        std::memcpy(&xin, mp + t * W + c0, width * sizeof(float));
      vf acc = xin * wt[m];
      for (int64_t j = 0; j < m; ++j) acc += w[j] * wt[j];
      for (int64_t j = 0; j + 1 < m; ++j) w[j] = w[j + 1];
      if (m > 0) w[m - 1] = xin;
      const vf act = acc / (1.f + vexp_any(-acc));
      if (whole)
        store(yp + t * C + c0, act);
      else
        std::memcpy(yp + t * C + c0, &act, width * sizeof(float));
      for (; p < S && stok[p] == t; ++p) window.join(w, scp + (sid[p] * C + c0) * Km1, width);
    }
    for (int64_t j = 0; j < M; ++j) win[j] = reg[j];
  };
  at::parallel_for(0, (C + LANES - 1) / LANES, 1, [&](int64_t begin, int64_t end) {
    // The thread's weights split once, then sequence by sequence: each walks its state, inputs
    // and outputs in order (the 0.8B shape's states are 72 KiB apart, its output rows 24 KiB, so
    // going across the sequences block by block puts all of them on the same L1 sets).
    std::vector<vf> wts((end - begin) * K), win(std::max<int64_t>(Km1, 1));
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * LANES, width = std::min<int64_t>(LANES, C - c0);
      taps.split(cw + c0 * K, wts.data() + (blk - begin) * K, width);
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t c0 = blk * LANES, width = std::min<int64_t>(LANES, C - c0);
        const vf* wt = wts.data() + (blk - begin) * K;
        float* state = cp + slot[n] * C * Km1;
        window.split(state + c0 * Km1, win.data(), width);
        if (Km1 == 3)  // Qwen3-Next and Qwen3.5: conv kernel 4
          conv_tokens(std::integral_constant<int, 3>{}, win.data(), wt, n, c0, width);
        else if (Km1 == 2)
          conv_tokens(std::integral_constant<int, 2>{}, win.data(), wt, n, c0, width);
        else
          conv_tokens(std::integral_constant<int, 0>{}, win.data(), wt, n, c0, width);
        window.join(win.data(), state + c0 * Km1, width);
      }
  });
  // L2 norm of each q and k head (q also scaled by dk^-0.5), per token.
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t head = 0; head < 2 * Hk; ++head) {
        float* h = yp + t * C + head * dk;
        const float ss = dot(h, h, dk);
        const float scale = (1.f / std::sqrt(ss + 1e-6f)) * (head < Hk ? q_scale : 1.f);
        for (int64_t i = 0; i < dk; ++i) h[i] *= scale;
      }
  });

  // Phase 2, per (sequence, value head): gates, the delta rule over the sequence's tokens (a
  // column slice at a time, `delta_run`; runs end at the tokens that keep a snapshot, which is
  // the head's state copied whole), then gated RMSNorm of each token's o in place.
  at::Tensor out = at::empty({T, Hv * dv}, mixed.options());
  float* op = out.data_ptr<float>();
  const float *alp = a_log.data_ptr<float>(), *bp = bias.data_ptr<float>(), *nwp = nw.data_ptr<float>();
  constexpr int64_t SLICE = 2 * LANES;
  const bool vectors = dv % LANES == 0;
  hybridkv::claimed_for(N * Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(dv);
    std::vector<DeltaToken> toks;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / Hv, h = item % Hv, key_head = tiled ? h % Hk : h / r;
      float* Sh = dp + ((slot[n] * Hv) + h) * dk * dv;  // [dk, dv]
      const float a_scale = -std::exp(alp[h]);
      const int64_t t0 = cup[n], len = cup[n + 1] - t0;
      toks.resize(len);
      for (int64_t t = t0; t < t0 + len; ++t) {
        const float* x = mp + t * W;
        const float *q = yp + t * C + key_head * dk, *k = yp + t * C + (Hk + key_head) * dk;
        const float beta = sigmoid(x[C + Hv * dv + h]);
        const float decay = std::exp(a_scale * softplus(x[C + Hv * dv + Hv + h] + bp[h]));
        toks[t - t0] = {q, k, yp + t * C + 2 * Hk * dk + h * dv, beta, decay, dot(q, k, dk)};
      }
      float* o = op + t0 * Hv * dv + h * dv;
      int64_t p = first_snapshot(t0);
      for (int64_t start = 0; start < len;) {
        const int64_t stop = p < S && stok[p] < t0 + len ? stok[p] - t0 + 1 : len;  // tokens [start, stop)
        if (vectors) {
          for (int64_t c = 0; c < dv;) {
            if (c + SLICE <= dv) {
              delta_run<2>(Sh, c, dk, dv, toks.data() + start, stop - start, o + start * Hv * dv, Hv * dv);
              c += SLICE;
            } else {
              delta_run<1>(Sh, c, dk, dv, toks.data() + start, stop - start, o + start * Hv * dv, Hv * dv);
              c += LANES;
            }
          }
        } else {
          for (int64_t t = start; t < stop; ++t) {
            const DeltaToken& x = toks[t];
            delta_step(Sh, x.q, x.k, x.v, x.beta, x.decay, dk, dv, u.data(), o + t * Hv * dv);
          }
        }
        for (; p < S && stok[p] == t0 + stop - 1; ++p)
          std::memcpy(sdp + ((sid[p] * Hv) + h) * dk * dv, Sh, dk * dv * sizeof(float));
        start = stop;
      }
      for (int64_t t = t0; t < t0 + len; ++t) {
        float* ot = op + t * Hv * dv + h * dv;
        gated_rms_norm(ot, mp + t * W + C + h * dv, nwp, static_cast<float>(eps), dv, ot);
      }
    }
  });
  return out;
}


inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void from_float(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}
inline void from_float(const float* src, at::Half* dst, int64_t n) {  // round to nearest even, as PyTorch's .half()
  for (int64_t i = 0; i < n; ++i) dst[i] = at::Half(src[i]);
}

// In place on one head x[hd]: RMSNorm with weight w, then rotate-half RoPE on the first rd dims.
inline void norm_rope(float* x, const float* w, float eps, const float* cos, const float* sin, int64_t hd,
                      int64_t rd) {
  float ss = 0.f;
  for (int64_t i = 0; i < hd; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(hd) + eps);
  for (int64_t i = 0; i < hd; ++i) x[i] = x[i] * inv * w[i];
  const int64_t half = rd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// Attention's inner products as small register tiles. Query rows (a query head of a token) and
// positions meet RT x PT at a time: each key vector loaded once serves RT rows, each query vector
// PT positions, and the sums stay in registers (one dot product at a time was bound by its loads
// and its horizontal sum). Values likewise: RT rows' sums of VD vectors held in registers over
// a run of positions, each value vector loaded once for the RT rows (the sums kept in memory were
// bound by the stores).
#if HYBRIDKV_LANES == 16
constexpr int ATT_RT = 4, ATT_PT = 4, ATT_VD = 4;
#else
constexpr int ATT_RT = 2, ATT_PT = 4, ATT_VD = 2;
#endif
constexpr int64_t ATT_RUN = 64;  // positions per run of the values: its rows stay in L2 across the tiles

// res[a][b] = q[a] . k[b] over hd, for a < RT (ATT_RT, or 2 for the last rows).
template <int RT, typename KV>
__attribute__((noinline)) void dots_tile(const float* const* q, const KV* const* k, int64_t hd, float (*res)[ATT_PT]) {
  vf acc[RT][ATT_PT];
  for (int a = 0; a < RT; ++a)
    for (int b = 0; b < ATT_PT; ++b) acc[a][b] = vf{};
  int64_t d = 0;
  for (; d + LANES <= hd; d += LANES) {
    vf kv[ATT_PT];
    for (int b = 0; b < ATT_PT; ++b) {
      kv[b] = load(k[b] + d);
      __asm__("" : "+v"(kv[b]));  // loaded once into a register (GCC would fold a load into each use)
    }
    for (int a = 0; a < RT; ++a) {
      vf qv = load(q[a] + d);
      __asm__("" : "+v"(qv));
      for (int b = 0; b < ATT_PT; ++b) acc[a][b] += qv * kv[b];
    }
  }
  for (int a = 0; a < RT; ++a)
    for (int b = 0; b < ATT_PT; ++b) res[a][b] = hsum(acc[a][b]);
  if (d < hd)  // apart, so the sums above stay in registers
    for (int a = 0; a < RT; ++a)
      for (int b = 0; b < ATT_PT; ++b)
        for (int64_t i = d; i < hd; ++i) res[a][b] += q[a][i] * scalar(k[b][i]);
}

// Many tokens' scores as a small matrix product, the positions in the vector lanes: the keys of
// ATT_KB blocks of LANES positions are transposed once (kt [ATT_KB][hd][LANES]) for all the query
// rows, then ATT_QR rows at a time meet them, each query element broadcast (no horizontal sums:
// the 4 x 4 dot tiles above spend as many instructions on those as on their multiply-adds). The
// transposes pay where many rows meet the keys: ATT_QROWS and more a KV head, over float32 K/V
// (a 56-token chunk onto 1,248 positions of the 0.8B shape: 5.2 -> 3.4-4.2 ms a layer, 2 threads;
// even at 8 tokens, 32 rows).
constexpr int ATT_KB = 2;
constexpr int64_t ATT_QROWS = 32;
#if HYBRIDKV_LANES == 16
constexpr int ATT_QR = 8;
#else
constexpr int ATT_QR = 4;
#endif

#if HYBRIDKV_LANES == 16
// The 16 x 16 floats r[0..16) (row i: 16 consecutive floats) transposed in registers into out[i * 16].
inline void transpose16(__m512* r, float* out) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + 2 + j])));
      r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + 2 + j])));
    }
  // r[4q + x] holds, in each 128-bit lane l, rows 4q..4q+3's column 4l + x
  for (int x = 0; x < 4; ++x) {
    const __m512 a = _mm512_shuffle_f32x4(r[x], r[4 + x], 0x88), b = _mm512_shuffle_f32x4(r[x], r[4 + x], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0x88), d = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0xDD);
    _mm512_storeu_ps(out + 16 * x, _mm512_shuffle_f32x4(a, c, 0x88));
    _mm512_storeu_ps(out + 16 * (4 + x), _mm512_shuffle_f32x4(b, d, 0x88));
    _mm512_storeu_ps(out + 16 * (8 + x), _mm512_shuffle_f32x4(a, c, 0xDD));
    _mm512_storeu_ps(out + 16 * (12 + x), _mm512_shuffle_f32x4(b, d, 0xDD));
  }
}
#endif

// kt[(c * hd + d) * LANES + b] = k[c * LANES + b][d]; positions from np on are 0.
template <typename KV>
void transpose_keys(const KV* const* k, int64_t np, int64_t hd, float* kt) {
#if HYBRIDKV_LANES == 16
  if constexpr (std::is_same_v<KV, float>) {
    if (hd % 16 == 0) {
      for (int c = 0; c < ATT_KB; ++c)
        for (int64_t d = 0; d < hd; d += 16) {
          __m512 r[16];
          for (int b = 0; b < 16; ++b) r[b] = c * 16 + b < np ? _mm512_loadu_ps(k[c * 16 + b] + d) : _mm512_setzero_ps();
          transpose16(r, kt + (c * hd + d) * 16);
        }
      return;
    }
  }
#endif
  for (int c = 0; c < ATT_KB; ++c)
    for (int b = 0; b < LANES; ++b) {
      const int64_t p = c * LANES + b;
      float* col = kt + c * hd * LANES + b;
      if (p < np)
        for (int64_t d = 0; d < hd; ++d) col[d * LANES] = scalar(k[p][d]);
      else
        for (int64_t d = 0; d < hd; ++d) col[d * LANES] = 0.f;
    }
}

// out[a][at : at + ATT_KB * LANES) = sc * (q[a] . the transposed keys' positions), for a < RT.
template <int RT>
__attribute__((noinline)) void scores_tile(const float* const* q, const float* kt, int64_t hd, float sc,
                                           float* const* out, int64_t at) {
  vf acc[RT][ATT_KB];
  for (int a = 0; a < RT; ++a)
    for (int c = 0; c < ATT_KB; ++c) acc[a][c] = vf{};
  for (int64_t d = 0; d < hd; ++d) {
    vf kv[ATT_KB];
    for (int c = 0; c < ATT_KB; ++c) kv[c] = load(kt + (c * hd + d) * LANES);
    for (int a = 0; a < RT; ++a) {
      const vf qa = vf{} + q[a][d];
      for (int c = 0; c < ATT_KB; ++c) acc[a][c] += qa * kv[c];
    }
  }
  for (int a = 0; a < RT; ++a)
    for (int c = 0; c < ATT_KB; ++c) store(out[a] + at + c * LANES, sc * acc[a][c]);
}

// acc[a][d : d + V * LANES] += sum over p < np of w[a][p] * rows[p][d : ...].
template <int RT, int V, typename KV>
__attribute__((noinline)) void weigh_tile(const float* const* w, const KV* const* rows, int64_t np, int64_t d, float* const* acc) {
  vf sums[RT][V];
  for (int a = 0; a < RT; ++a)
    for (int v = 0; v < V; ++v) sums[a][v] = load(acc[a] + d + v * LANES);
  for (int64_t p = 0; p < np; ++p) {
    vf x[V];
    for (int v = 0; v < V; ++v) x[v] = load(rows[p] + d + v * LANES);
    for (int a = 0; a < RT; ++a) {
      const float wt = w[a][p];
      for (int v = 0; v < V; ++v) sums[a][v] += wt * x[v];
    }
  }
  for (int a = 0; a < RT; ++a)
    for (int v = 0; v < V; ++v) store(acc[a] + d + v * LANES, sums[a][v]);
}

constexpr int64_t KV_AHEAD = 8;  // positions a decode step's key and value rows are fetched ahead
constexpr int64_t SPLIT_MIN = 64;  // fewest positions a decode step's attention splits off for a thread

// One decode step of gated attention after qkv_proj for each token n: q/k RMSNorm + RoPE, its K/V
// written into the paged pools at slot_mapping[n], attention of its H query heads over the
// kv_lens[n] positions of its block table row, read in place (no gather), output gated by
// sigmoid(gate). Every token's K/V is written before any attends, so the tokens of a verify or a
// short chunk (kv lengths one apart over one table) see each other causally; they are read as one.
//   qkv [T, (2H + 2Hkv) * hd] = q | gate | k | v;  cos, sin [T, rd];  pools [blocks, bs, Hkv, hd].
// Returns [T, H * hd] float32.
template <typename KV>
at::Tensor attention_decode_impl(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, double eps,
                                 const at::Tensor& cos_t, const at::Tensor& sin_t, KV* kp, KV* vp, int64_t pool_rows,
                                 int64_t bs, int64_t Hkv, int64_t hd, const at::Tensor& slot_mapping,
                                 const at::Tensor& block_tables, const at::Tensor& kv_lens, double scale, int64_t H) {
  const int64_t T = qkv.size(0), rd = cos_t.size(1), group = H / Hkv, width = qkv.size(1);
  const int64_t max_blocks = block_tables.size(1);
  const float* in = qkv.data_ptr<float>();
  const float *qw = q_norm.data_ptr<float>(), *kw = k_norm.data_ptr<float>();
  const float *cp = cos_t.data_ptr<float>(), *sp = sin_t.data_ptr<float>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t n = 0; n < T; ++n) {
    TORCH_CHECK(slot[n] >= 0 && slot[n] < pool_rows, "attention_decode: slot ", slot[n], " out of range");
    TORCH_CHECK(lens[n] >= 1 && lens[n] <= max_blocks * bs, "attention_decode: kv_len ", lens[n],
                " does not fit the block table");
    for (int64_t b = 0; b < (lens[n] + bs - 1) / bs; ++b)
      TORCH_CHECK(table[n * max_blocks + b] >= 0 && table[n * max_blocks + b] * bs < pool_rows,
                  "attention_decode: block id out of range");
  }
  at::Tensor q = at::empty({T, H, hd}, qkv.options());
  float* qp = q.data_ptr<float>();
  // Phase 1, per token: normalised, rotated queries; this token's key and value into the pools.
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k(hd);
    for (int64_t n = begin; n < end; ++n) {
      const float* row = in + n * width;
      for (int64_t h = 0; h < H; ++h) {
        float* qh = qp + (n * H + h) * hd;
        std::memcpy(qh, row + h * hd, hd * sizeof(float));
        norm_rope(qh, qw, static_cast<float>(eps), cp + n * rd, sp + n * rd, hd, rd);
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(k.data(), row + 2 * H * hd + h * hd, hd * sizeof(float));
        norm_rope(k.data(), kw, static_cast<float>(eps), cp + n * rd, sp + n * rd, hd, rd);
        from_float(k.data(), kp + (slot[n] * Hkv + h) * hd, hd);
        from_float(row + (2 * H + Hkv) * hd + h * hd, vp + (slot[n] * Hkv + h) * hd, hd);
      }
    }
  });
  // Tokens that continue one another in one sequence (a verify, a short chunk: kv lengths one
  // apart, read through the same blocks as the group's first token) form a group, whose
  // positions are read once for all its tokens.
  std::vector<int64_t> gstart{0}, group_of(T, 0);
  for (int64_t n = 1; n < T; ++n) {
    const int64_t* a = table + gstart.back() * max_blocks;
    const bool next = lens[n] == lens[n - 1] + 1 &&
                      std::equal(a, a + (lens[n] + bs - 1) / bs, table + n * max_blocks);
    if (!next) gstart.push_back(n);
    group_of[n] = static_cast<int64_t>(gstart.size()) - 1;
  }
  gstart.push_back(T);
  const int64_t G = static_cast<int64_t>(gstart.size()) - 1;
  // Phase 2, split over positions (flash decoding): item (group, split s) reads its positions of
  // every KV head front to back (a position's Hkv rows lie together, so a thread streams whole
  // blocks), keeping per token and query head the scores' max, the sum of their exps and the
  // unnormalised weighted values; the splits are merged after. Token j of a group sees the
  // group's positions below its own kv length. Each split's rows are fetched KV_AHEAD positions
  // on: they were evicted by the layers' weights since the last step.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> first(G + 1, 0), chunk(G), base{0};  // base: an item's first partial (token, head)
  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t len = lens[gstart[gi + 1] - 1], m = gstart[gi + 1] - gstart[gi];
    const int64_t wanted = std::max<int64_t>(1, (2 * threads + G - 1) / G);  // items enough for the threads
    const int64_t splits = std::min(wanted, (len + SPLIT_MIN - 1) / SPLIT_MIN);
    chunk[gi] = (len + splits - 1) / splits;
    first[gi + 1] = first[gi] + (len + chunk[gi] - 1) / chunk[gi];
    for (int64_t item = first[gi]; item < first[gi + 1]; ++item) base.push_back(base.back() + m * H);
  }
  const int64_t items = first[G];
  std::vector<float> part_max(base[items]), part_sum(base[items]), part_acc(base[items] * hd);
  const float sc = static_cast<float>(scale);
  hybridkv::claimed_for(items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, spare(hd);  // spare: where padding rows of a tile sum to
    std::vector<float> kt(ATT_KB * LANES * hd);  // keys transposed (`transpose_keys`)
    std::vector<float*> out_of;
    std::vector<const float*> q_of, w_of;
    std::vector<float*> acc_of;
    std::vector<const KV*> rows(ATT_RUN);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t gi = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const int64_t n0 = gstart[gi], m = gstart[gi + 1] - n0, len0 = lens[n0];
      const int64_t p0 = (item - first[gi]) * chunk[gi], p1 = std::min(lens[n0 + m - 1], p0 + chunk[gi]);
      const int64_t S = p1 - p0, R = m * group;  // R: query rows per KV head
      const int64_t R_pad = R + ATT_RT;  // room for a last tile's padding rows
      // Rows go ATT_RT at a time, the last one or two as a tile of 2 (no work on padding rows
      // when a KV head has 2 query heads, as in the default model).
      auto tile_rows = [&](int64_t r) { return R - r >= ATT_RT ? ATT_RT : 2; };
      const int64_t* blocks = table + n0 * max_blocks;
      auto at_row = [&](const KV* pool, int64_t p, int64_t g) {
        return pool + ((blocks[p / bs] * bs + p % bs) * Hkv + g) * hd;
      };
      // Position p's rows of every KV head (they lie together), into L1 (hint 3) or L2 (hint 2).
      auto fetch = [&](const KV* pool, int64_t p, auto hint) {
        if (p >= p1) return;
        const char* at = reinterpret_cast<const char*>(at_row(pool, p, 0));
        for (int64_t b = 0; b < Hkv * hd * static_cast<int64_t>(sizeof(KV)); b += 64)
          __builtin_prefetch(at + b, 0, decltype(hint)::value);
      };
      // Row r of KV head g is token j = r / group's query head h = g * group + r % group: its
      // scores are scores[(j * H + h) * Sp + p - p0], its sums acc[(j * H + h) * hd ...]. Padding
      // rows repeat the last row.
      auto head_of = [&](int64_t r, int64_t g) {
        r = std::min(r, R - 1);
        return r / group * H + g * group + r % group;
      };
      // A row of scores per (token, query head), Sp apart: whole blocks of ATT_KB * LANES
      // positions where `scores_tile` writes them.
      const bool transposed = std::is_same_v<KV, float> && R >= ATT_QROWS;
      const int64_t Sp = transposed ? (S + ATT_KB * LANES - 1) / (ATT_KB * LANES) * (ATT_KB * LANES) : S;
      scores.resize(m * H * Sp);
      // One token (a decode step) over float32 K/V: position by position, one dot product per
      // query head, keys fetched KV_AHEAD positions on (the tiles below measured no faster here:
      // a decode step's keys and values come from memory, evicted by the layers' weights since
      // the last step). Over 16-bit K/V the tiles, which widen each vector in registers, measured
      // 1.1-1.4x faster than rows widened into memory first and met position by position.
      bool by_position = false;
      if constexpr (std::is_same_v<KV, float>) {
        by_position = m == 1;
        const float* qn = qp + n0 * H * hd;
        for (int64_t p = p0; by_position && p < p1; ++p) {
          fetch(kp, p + KV_AHEAD, std::integral_constant<int, 3>{});
          for (int64_t g = 0; g < Hkv; ++g) {
            const float* k = at_row(kp, p, g);
            for (int64_t h = g * group; h < (g + 1) * group; ++h) scores[h * S + p - p0] = sc * dot(qn + h * hd, k, hd);
          }
        }
      }
      const int64_t R_q = R + ATT_QR;  // rows of q_of and out_of per KV head: a last tile's padding
      if (!by_position) {
        q_of.resize(Hkv * R_q);
        out_of.resize(Hkv * R_q);
        for (int64_t g = 0; g < Hkv; ++g)
          for (int64_t r = 0; r < R_q; ++r) {
            q_of[g * R_q + r] = qp + (n0 * H + head_of(r, g)) * hd;
            out_of[g * R_q + r] = scores.data() + head_of(r, g) * Sp;
          }
      }
      // Many rows: ATT_KB * LANES positions at a time in order, each KV head's keys of them
      // transposed and met by its query rows ATT_QR at a time (`scores_tile`; padding rows repeat
      // the last row, so they write its scores again). Values are fetched into L2 for the pass
      // below.
      constexpr int64_t KB = ATT_KB * LANES;
      for (int64_t p = p0; !by_position && transposed && p < p1; p += KB) {
        const int64_t np = std::min(KB, p1 - p);
        for (int64_t b = 0; b < np; ++b) fetch(vp, p + b + KB, std::integral_constant<int, 2>{});
        for (int64_t g = 0; g < Hkv; ++g) {
          const KV* k[KB];
          for (int64_t b = 0; b < KB; ++b) k[b] = at_row(kp, std::min(p + b, p1 - 1), g);
          transpose_keys(k, np, hd, kt.data());
          for (int64_t r = 0; r < R; r += ATT_QR)
            scores_tile<ATT_QR>(q_of.data() + g * R_q + r, kt.data(), hd, sc, out_of.data() + g * R_q + r, p - p0);
        }
      }
      // Fewer: ATT_PT positions at a time in order, each KV head's rows of them against its query
      // rows. Keys are fetched KV_AHEAD positions on into L1, values into L2 for the pass below.
      for (int64_t p = p0; !by_position && !transposed && p < p1; p += ATT_PT) {
        for (int b = 0; b < ATT_PT; ++b) {
          fetch(kp, p + b + KV_AHEAD, std::integral_constant<int, 3>{});
          fetch(vp, p + b + KV_AHEAD, std::integral_constant<int, 2>{});
        }
        for (int64_t g = 0; g < Hkv; ++g) {
          const KV* k[ATT_PT];
          for (int b = 0; b < ATT_PT; ++b) k[b] = at_row(kp, std::min(p + b, p1 - 1), g);
          for (int64_t r = 0, rt; r < R; r += rt) {
            float res[ATT_RT][ATT_PT];
            rt = tile_rows(r);
            if (rt == ATT_RT)
              dots_tile<ATT_RT>(q_of.data() + g * R_q + r, k, hd, res);
            else
              dots_tile<2>(q_of.data() + g * R_q + r, k, hd, res);
            for (int a = 0; a < rt && r + a < R; ++a)
              for (int b = 0; b < ATT_PT && p + b < p1; ++b) scores[head_of(r + a, g) * Sp + p + b - p0] = sc * res[a][b];
          }
        }
      }
      // Softmax parts per token and query head over the positions the token sees (the rest
      // weigh 0 below).
      for (int64_t j = 0; j < m; ++j) {
        const int64_t Sj = std::clamp<int64_t>(len0 + j - p0, 0, S);  // positions token j sees here
        for (int64_t h = 0; h < H; ++h) {
          const int64_t u = base[item] + j * H + h;
          float* s = scores.data() + (j * H + h) * Sp;
          std::fill(s + Sj, s + S, 0.f);
          if (Sj == 0) {
            part_max[u] = -std::numeric_limits<float>::infinity();
            part_sum[u] = 0.f;
            continue;
          }
          // the largest score, LANES at a time (a max is exact in any order)
          vf vmax = vf{} + s[0];
          int64_t p = 0;
          for (; p + LANES <= Sj; p += LANES) {
            const vf x = load(s + p);
            vmax = vmax < x ? x : vmax;
          }
          float mx = s[0];
          for (int l = 0; l < LANES; ++l) mx = std::max(mx, vmax[l]);
          for (; p < Sj; ++p) mx = std::max(mx, s[p]);
          p = 0;
          vf sums = {};
          for (; p + LANES <= Sj; p += LANES) {
            const vf e = vexp(load(s + p) - mx);
            store(s + p, e);
            sums += e;
          }
          float sum = hsum(sums);
          for (; p < Sj; ++p) sum += (s[p] = std::exp(s[p] - mx));
          part_max[u] = mx;
          part_sum[u] = sum;
        }
      }
      // Weighted values. One token over float32: position by position as they stream in, the
      // sums in L1. Otherwise: per run, KV head and tile of rows, the rows' sums in registers.
      float* acc = part_acc.data() + base[item] * hd;
      std::fill(acc, acc + m * H * hd, 0.f);
      if constexpr (std::is_same_v<KV, float>) {
        if (by_position) {
          for (int64_t p = p0; p < p1; ++p) {
            fetch(vp, p + KV_AHEAD, std::integral_constant<int, 3>{});
            for (int64_t g = 0; g < Hkv; ++g) {
              const float* v = at_row(vp, p, g);
              for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                const float w = scores[h * S + p - p0];
                float* a = acc + h * hd;
                for (int64_t i = 0; i < hd; ++i) a[i] += w * v[i];
              }
            }
          }
          continue;
        }
      }
      w_of.resize(R_pad);
      acc_of.resize(R_pad);
      // Many rows (`transposed`) take 2 * ATT_RT rows a tile over half as many vectors of
      // values: each value vector loaded once for twice the rows.
      const int64_t wide = transposed ? 2 * ATT_RT : ATT_RT;
      const int64_t tiles = (R + wide - 1) / wide, calls = Hkv * tiles;  // weigh calls a run
      for (int64_t pr = p0; pr < p1; pr += ATT_RUN) {
        const int64_t pe = std::min(p1, pr + ATT_RUN), np = pe - pr;
        // The next run's values into L2, a slice before each (head, rows) call of this one.
        int64_t ahead = pe, call = 0;
        auto fetch_next = [&] {
          const int64_t until = pe + (++call * ATT_RUN + calls - 1) / calls;
          for (; ahead < until; ++ahead) fetch(vp, ahead, std::integral_constant<int, 2>{});
        };
        for (int64_t g = 0; g < Hkv; ++g) {
          for (int64_t p = pr; p < pe; ++p) rows[p - pr] = at_row(vp, p, g);
          for (int64_t r = 0; r < R_pad; ++r) {
            w_of[r] = scores.data() + head_of(r, g) * Sp + pr - p0;
            acc_of[r] = r < R ? acc + head_of(r, g) * hd : spare.data();
          }
          for (int64_t r = 0, rt; r < R; r += rt) {
            rt = transposed && R - r >= wide ? wide : tile_rows(r);
            fetch_next();
            auto weigh = [&](auto tile, auto vectors) {
              constexpr int V = decltype(vectors)::value;
              int64_t d = 0;
              for (; d + V * LANES <= hd; d += V * LANES)
                weigh_tile<decltype(tile)::value, V>(w_of.data() + r, rows.data(), np, d, acc_of.data() + r);
              for (; d + LANES <= hd; d += LANES)
                weigh_tile<decltype(tile)::value, 1>(w_of.data() + r, rows.data(), np, d, acc_of.data() + r);
              return d;
            };
            using VD = std::integral_constant<int, ATT_VD>;
            const int64_t d = rt == 2 * ATT_RT ? weigh(std::integral_constant<int, 2 * ATT_RT>{}, std::integral_constant<int, std::max(1, ATT_VD / 2)>{})
                              : rt == ATT_RT   ? weigh(std::integral_constant<int, ATT_RT>{}, VD{})
                                               : weigh(std::integral_constant<int, 2>{}, VD{});
            for (int a = 0; a < rt && r + a < R; ++a)
              for (int64_t p = 0; p < np; ++p)
                for (int64_t i = d; i < hd; ++i) acc_of[r + a][i] += w_of[r + a][p] * scalar(rows[p][i]);
          }
        }
      }
    }
  });
  // Merge each head's splits (rescaled to the largest max), normalise, gate by sigmoid(gate); a
  // few tokens' worth in this thread (waking the others cost more than the merge).
  at::Tensor out = at::empty({T, H * hd}, qkv.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * H, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> o(hd);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n = u / H, h = u % H, gi = group_of[n], at = (n - gstart[gi]) * H + h;
      float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t item = first[gi]; item < first[gi + 1]; ++item) mx = std::max(mx, part_max[base[item] + at]);
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t item = first[gi]; item < first[gi + 1]; ++item) {
        const float f = std::exp(part_max[base[item] + at] - mx);
        sum += f * part_sum[base[item] + at];
        const float* a = part_acc.data() + (base[item] + at) * hd;
        for (int64_t i = 0; i < hd; ++i) o[i] += f * a[i];
      }
      const float* gate = in + n * width + H * hd + h * hd;
      float* dst = op + n * H * hd + h * hd;
      for (int64_t i = 0; i < hd; ++i) dst[i] = o[i] / sum / (1.f + std::exp(-gate[i]));
    }
  });
  return out;
}

at::Tensor attention_decode(const at::Tensor& qkv_in, const at::Tensor& q_norm, const at::Tensor& k_norm, double eps,
                            const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor k_pool, at::Tensor v_pool,
                            const at::Tensor& slot_mapping_in, const at::Tensor& block_tables_in,
                            const at::Tensor& kv_lens_in, double scale, int64_t H) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "attention_decode: k_pool and v_pool must be contiguous [blocks, block_size, Hkv, hd]");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() &&
                  (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16 ||
                   k_pool.scalar_type() == at::kHalf),
              "attention_decode: pools must both be float32, both bfloat16 or both float16");
  const int64_t bs = k_pool.size(1), Hkv = k_pool.size(2), hd = k_pool.size(3), T = qkv_in.size(0);
  TORCH_CHECK(H % Hkv == 0 && qkv_in.dim() == 2 && qkv_in.size(1) == (2 * H + 2 * Hkv) * hd,
              "attention_decode: qkv ", qkv_in.sizes(), " does not match H=", H, " Hkv=", Hkv, " hd=", hd);
  TORCH_CHECK(q_norm.numel() == hd && k_norm.numel() == hd, "attention_decode: norm weights must be [hd]");
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(0) == T && cos_in.sizes() == sin_in.sizes() && cos_in.size(1) <= hd,
              "attention_decode: cos and sin must be [T, rd] with rd <= hd");
  TORCH_CHECK(slot_mapping_in.numel() == T && kv_lens_in.numel() == T && block_tables_in.dim() == 2 &&
                  block_tables_in.size(0) == T,
              "attention_decode: slot_mapping, kv_lens and block_tables need one entry per token");
  const at::Tensor qkv = qkv_in.to(at::kFloat).contiguous();
  const at::Tensor qn = q_norm.to(at::kFloat).contiguous(), kn = k_norm.to(at::kFloat).contiguous();
  const at::Tensor cos_t = cos_in.to(at::kFloat).contiguous(), sin_t = sin_in.to(at::kFloat).contiguous();
  const at::Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables_in.to(at::kLong).contiguous(), lens = kv_lens_in.to(at::kLong).contiguous();
  const int64_t rows = k_pool.size(0) * bs;
  if (k_pool.scalar_type() == at::kFloat)
    return attention_decode_impl(qkv, qn, kn, eps, cos_t, sin_t, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                                 rows, bs, Hkv, hd, slots, tables, lens, scale, H);
  if (k_pool.scalar_type() == at::kHalf)
    return attention_decode_impl(qkv, qn, kn, eps, cos_t, sin_t, k_pool.data_ptr<at::Half>(),
                                 v_pool.data_ptr<at::Half>(), rows, bs, Hkv, hd, slots, tables, lens, scale, H);
  return attention_decode_impl(qkv, qn, kn, eps, cos_t, sin_t, k_pool.data_ptr<at::BFloat16>(),
                               v_pool.data_ptr<at::BFloat16>(), rows, bs, Hkv, hd, slots, tables, lens, scale, H);
}


// silu(gate) * up for gate_up [T, 2I] (gate columns first) → [T, I] float32: `silu_mul_rows`.
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0, "silu_mul: gate_up must be [T, 2I], got ",
              gate_up_in.sizes());
  const at::Tensor gate_up = gate_up_in.to(at::kFloat).contiguous();
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  silu_mul_rows(gate_up.data_ptr<float>(), T, I, out.data_ptr<float>());
  return out;
}

// A MoE layer's output from its parts: out[t] = Σ_j weights[t, j] · y[t·k + j] (j in order) +
// sigmoid(gate[t]) · shared[t]; y [T·k, D] the (token, expert) pairs' products, weights [T, k],
// shared [T, D] the shared expert's, gate [T, 1] its gate logit; all float32 → [T, D]. One pass
// over rows split across threads, where ATen's four ops ran the weighting on one thread.
at::Tensor moe_combine(const at::Tensor& y_in, const at::Tensor& weights_in, const at::Tensor& shared_in,
                       const at::Tensor& gate_in) {
  TORCH_CHECK(y_in.dim() == 2 && weights_in.dim() == 2 && shared_in.dim() == 2 &&
                  y_in.size(0) == weights_in.numel() && shared_in.size(0) == weights_in.size(0) &&
                  shared_in.size(1) == y_in.size(1) && gate_in.numel() == weights_in.size(0),
              "moe_combine: y must be [T*k, D], weights [T, k], shared [T, D] and gate [T, 1], got ", y_in.sizes(),
              ", ", weights_in.sizes(), ", ", shared_in.sizes(), ", ", gate_in.sizes());
  for (const at::Tensor* t : {&y_in, &weights_in, &shared_in, &gate_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "moe_combine: float32 inputs only, got ", t->scalar_type());
  const at::Tensor y = y_in.contiguous(), w = weights_in.contiguous(), sh = shared_in.contiguous();
  const at::Tensor g = gate_in.contiguous();
  const int64_t T = w.size(0), k = w.size(1), D = y.size(1);
  at::Tensor out = at::empty({T, D}, y.options());
  const float *yp = y.data_ptr<float>(), *wp = w.data_ptr<float>(), *sp = sh.data_ptr<float>(), *gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k * D)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float gate = sigmoid(gp[t]);
      float* o = op + t * D;
      int64_t d = 0;
      for (; d + LANES <= D; d += LANES) {
        vf acc = load(yp + t * k * D + d) * wp[t * k];
        for (int64_t j = 1; j < k; ++j) acc += load(yp + (t * k + j) * D + d) * wp[t * k + j];
        store(o + d, acc + load(sp + t * D + d) * gate);
      }
      for (; d < D; ++d) {
        float acc = yp[t * k * D + d] * wp[t * k];
        for (int64_t j = 1; j < k; ++j) acc += yp[(t * k + j) * D + d] * wp[t * k + j];
        o[d] = acc + sp[t * D + d] * gate;
      }
    }
  });
  return out;
}

constexpr int64_t NORM_ROWS = 32;  // rows a norm takes on one thread

// x / rms(x) * weight over the last dim, in float32; the result in x's dtype (float32 or bfloat16).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const int64_t D = weight_in.numel();
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == D, "rms_norm: x ", x_in.sizes(), " does not end in ", D);
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), w = weight_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t rows = x.numel() / std::max<int64_t>(D, 1);
  // Rows split over threads from 32 on (a prefill chunk; a decode step's few stay on this thread):
  // each row's numbers do not depend on the split.
  at::parallel_for(0, rows, NORM_ROWS, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * D;
      const float inv = 1.f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) yp[r * D + i] = xr[i] * inv * wp[i];
    }
  });
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// (x + delta, rms_norm(x + delta)): a decoder layer's residual add and the norm after it in one
// call (two ops and their Python around each of the 2 per layer of a decode step). The sum is
// `x + delta` as PyTorch computes it (float32 sums added here, other dtypes by at::add).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == delta.sizes(), "add_rms_norm: x ", x.sizes(), " and delta ", delta.sizes(), " differ");
  at::Tensor sum;
  if (x.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat) {
    const at::Tensor a = x.contiguous(), b = delta.contiguous();
    sum = at::empty_like(a);
    const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
    float* sp = sum.data_ptr<float>();
    at::parallel_for(0, a.numel(), NORM_ROWS * weight.numel(), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) sp[i] = ap[i] + bp[i];
    });
  } else {
    sum = at::add(x, delta);
  }
  return {sum, rms_norm(sum, weight, eps)};
}

}  // namespace

// For layer.cpp (ops.h): the anonymous namespace's ops under names another file can call.
namespace hybridkv::ops {
at::Tensor rows_matmul(const at::Tensor& x, const at::Tensor& w) { return ::rows_matmul(x, w); }
at::Tensor moe_block(const at::Tensor& x, const at::Tensor& gate_in, const at::Tensor& gate_up, const at::Tensor& down,
                     const at::Tensor& shared_down, int64_t top_k, bool norm_topk) {
  return ::moe_block(x, gate_in, gate_up, down, shared_down, top_k, norm_topk);
}
at::Tensor gdn_forward(const at::Tensor& mixed, const at::Tensor& conv_weight, const at::Tensor& A_log,
                       const at::Tensor& dt_bias, const at::Tensor& norm_weight, double eps, int64_t Hk, int64_t dk,
                       at::Tensor conv_pool, at::Tensor delta_pool, const at::Tensor& slots,
                       const at::Tensor& cu_seqlens, at::Tensor snap_conv, at::Tensor snap_delta,
                       const at::Tensor& snap_tokens, const at::Tensor& snap_ids, bool tiled) {
  return ::gdn_forward(mixed, conv_weight, A_log, dt_bias, norm_weight, eps, Hk, dk, conv_pool, delta_pool, slots,
                       cu_seqlens, snap_conv, snap_delta, snap_tokens, snap_ids, tiled);
}
at::Tensor attention_decode(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, double eps,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& kv_lens,
                            double scale, int64_t H) {
  return ::attention_decode(qkv, q_norm, k_norm, eps, cos, sin, k_pool, v_pool, slot_mapping, block_tables, kv_lens,
                            scale, H);
}
at::Tensor silu_mul(const at::Tensor& gate_up) { return ::silu_mul(gate_up); }
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& shared, const at::Tensor& gate) {
  return ::moe_combine(y, weights, shared, gate);
}
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  return ::add_rms_norm(x, delta, weight, eps);
}
}  // namespace hybridkv::ops

TORCH_LIBRARY(hybridkv, m) {
  m.def("rows_matmul(Tensor x, Tensor w) -> Tensor");
  m.def("rows_matmul_t(Tensor x, Tensor w) -> Tensor");
  m.def(
      "moe_block(Tensor x, Tensor gate_in, Tensor gate_up, Tensor down, Tensor shared_down, int top_k, "
      "bool norm_topk) -> Tensor");
  m.def(
      "gdn_forward(Tensor mixed, Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor norm_weight, float eps, "
      "int Hk, int dk, Tensor(a!) conv_pool, Tensor(b!) delta_pool, Tensor slots, Tensor cu_seqlens, "
      "Tensor(c!) snap_conv, Tensor(d!) snap_delta, Tensor snap_tokens, Tensor snap_ids, bool tiled) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("moe_combine(Tensor y, Tensor weights, Tensor shared, Tensor gate) -> Tensor");
  m.def(
      "attention_decode(Tensor qkv, Tensor q_norm, Tensor k_norm, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slot_mapping, Tensor block_tables, Tensor kv_lens, "
      "float scale, int H) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridkv, CPU, m) {
  m.impl("rows_matmul", rows_matmul);
  m.impl("rows_matmul_t", rows_matmul_t);
  m.impl("moe_block", moe_block);
  m.impl("gdn_forward", gdn_forward);
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("moe_combine", moe_combine);
  m.impl("attention_decode", attention_decode);
}
