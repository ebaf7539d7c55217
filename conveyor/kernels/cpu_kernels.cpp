// Skinny matrix products on CPU (a plain C ABI, loaded with ctypes: no torch headers, so it
// compiles in about a second): y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode
// step, streaming W once at memory speed (float32, AVX2 + FMA, OpenMP over output columns).
//
// MKL's sgemm packs W on every call and reaches a fraction of the memory bandwidth at
// M = 2..16 (BENCHMARKS.md). Here each W row is read from memory once, as one sequential
// stream, and dotted with the activation rows two at a time while it sits in L1.
//
// Two regimes, each with one sequence of operations per output element, so that within a
// regime a row's result does not depend on the batch:
// - up to SMALL_ROWS rows (memory-bound: batch-1 decode) each W row is one sequential stream,
//   dotted with the activation rows two at a time (four 8-wide FMA chains over K, then the
//   same horizontal sum). A single stream per thread is what reads fastest here.
// - above it (compute-bound) register tiles of TILE_M activation rows by TILE_N weight rows,
//   one 8-wide FMA chain per output: 12 accumulators, 7 loads per 12 FMAs instead of 1.5 loads
//   per FMA, 1.8-2.3x the arithmetic rate at 16-64 rows (BENCHMARKS.md).
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

// Dot products of one W row with R (1 or 2) activation rows.
template <int R>
inline void dots(const float* x, const float* wr, float* y, int64_t K, int64_t N) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
  const int64_t K32 = K & ~int64_t(31), K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K32; k += 32) {
    const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
    const __m256 w2 = _mm256_loadu_ps(wr + k + 16), w3 = _mm256_loadu_ps(wr + k + 24);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + k;
      a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, a[r][3]);
    }
  }
  for (int64_t k = K32; k < K8; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(wr + k);
    for (int r = 0; r < R; ++r) a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, a[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
    for (int64_t k = K8; k < K; ++k) s += x[r * K + k] * wr[k];
    y[r * N] = s;
  }
}

}  // namespace

constexpr int64_t SMALL_ROWS = 4, TILE_M = 3, TILE_N = 4;

// y[i * ldy + j] = x[i] . w[j] for i < MR, j < NR: one 8-wide FMA chain per output over K, the
// horizontal sum, then the scalar tail. With PF, the next tile's weight rows (the ones after
// these NR) are prefetched along the way: the first row tile of a block pulls its successor.
template <int MR, int NR, bool PF = false>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t ldy) {
  __m256 a[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) a[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    if (PF && (k & 15) == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + j) * K + k), _MM_HINT_T0);
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) a[i][j] = _mm256_fmadd_ps(xv, wv[j], a[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(a[i][j]);
      for (int64_t k = K8; k < K; ++k) s += x[i * K + k] * w[j * K + k];
      y[i * ldy + j] = s;
    }
}

// All M rows against the `nr` (<= TILE_N) weight rows at w: y[m * ldy + j]. The weight rows stay
// in L1 while the activation rows pass over them TILE_M at a time.
inline void tile_block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t ldy, int64_t nr) {
  if (nr < TILE_N) {  // the last few weight rows
    for (int64_t j = 0; j < nr; ++j)
      for (int64_t m = 0; m < M; ++m) tile<1, 1>(x + m * K, w + j * K, y + m * ldy + j, K, ldy);
    return;
  }
  int64_t m = 0;
  for (; m + TILE_M <= M; m += TILE_M) {
    if (m == 0) tile<TILE_M, TILE_N, true>(x, w, y, K, ldy);
    else tile<TILE_M, TILE_N>(x + m * K, w, y + m * ldy, K, ldy);
  }
  for (; m < M; ++m) tile<1, TILE_N>(x + m * K, w, y + m * ldy, K, ldy);
}

// The first rows of a pass over W, up to SMALL_ROWS of them: each W row read once, in order.
inline void stream_row(const float* x, const float* wr, float* y, int64_t M, int64_t K, int64_t ldy) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dots<2>(x + m * K, wr, y + m * ldy, K, ldy);
  if (m < M) dots<1>(x + m * K, wr, y + m * ldy, K, ldy);
}

extern "C" void skinny_linear(const float* xp, const float* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  if (M <= SMALL_ROWS) {  // guided: see team_linear
#pragma omp parallel for schedule(guided)
    for (int64_t n = 0; n < N; ++n) stream_row(xp, wp + n * K, yp + n, M, K, N);
    return;
  }
  const int64_t blocks = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    tile_block(xp, wp + b * TILE_N * K, yp + b * TILE_N, M, K, N, std::min(TILE_N, N - b * TILE_N));
}

extern "C" void skinny_set_threads(int n) { omp_set_num_threads(n); }


// ---- Paged decode attention: one query token per sequence, K/V read in place ----------------
// q, out: [D, H, d]; k_cache, v_cache: [slots, KVH, d] (slot = block * block_size + offset);
// tables: [D, max_blocks] block ids; ctx: [D] context lengths (the new token included).
// window > 0 keeps only the last `window` positions (sliding-window attention); softcap > 0 puts
// each score through cap * tanh(score / cap) (Gemma 2); sinks (or null): one logit a query head
// in its softmax's denominator (gpt-oss).
// K/V cache rows are float32 or float16 (kv_cache_dtype="float16": IEEE half, converted with
// F16C, round to nearest even, as torch's .to(float16)).
using half_t = uint16_t;
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline float load1(const float* p) { return *p; }
static inline float load1(const half_t* p) { return _cvtsh_ss(*p); }
static inline void store_row(float* dst, const float* src, int64_t d) { std::copy(src, src + d, dst); }
static inline void store_row(half_t* dst, const float* src, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < d; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

template <typename T>
static inline float dot(const float* a, const T* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * load1(b + i);
  return s;
}

// exp of 8 floats: 2^(x log2 e) = 2^i * 2^f, with 2^f on [-0.5, 0.5] by a degree-6 polynomial
// (relative error about 2e-7); inputs below -87 give 0, as softmax needs.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, i), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// ---- Element-wise passes of a layer, over any number of rows -----------------------------------
// Rows are split over threads once a pass is large enough to pay for the team. Each row's result
// is the same sequence of operations whatever the number of rows (the fused decode below uses the
// same functions), so a row's result does not depend on the batch.
static inline bool parallel_pays(int64_t elements) { return elements >= (int64_t(1) << 15); }

// RMSNorm of one row: out = x / sqrt(mean(x^2) + eps) * w, the sum of squares in double.
static inline void norm_row(const float* xr, const float* w, float* o, int64_t H, float eps) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    const __m256 v = _mm256_loadu_ps(xr + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
  double ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < H; ++i) ss += double(xr[i]) * xr[i];
  const float inv = 1.0f / std::sqrt(float(ss / double(H)) + eps);
  for (int64_t j = 0; j < H; ++j) o[j] = (xr[j] * inv) * w[j];
}

// Rope on one head, in place: the two halves rotated (the HF / NeoX layout).
static inline void rope_head(float* v, const float* c, const float* s, int64_t half) {
  for (int64_t e = 0; e < half; ++e) {
    const float a = v[e], b = v[e + half];
    v[e] = a * c[e] - b * s[e];
    v[e + half] = b * c[e] + a * s[e];
  }
}

// SiLU(gate) * up over n values: gate / (1 + exp(-gate)) * up, exp by exp8 (the argument clamped
// to [-87, 88], where the result is exactly 0 or gate to float precision).
static inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps(88.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(zero, gv), top));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    alignas(32) float lane[8] = {0};
    lane[0] = std::min(-g[i], 88.0f);
    alignas(32) float e[8];
    _mm256_store_ps(e, exp8(_mm256_load_ps(lane)));
    o[i] = g[i] / (1.0f + e[0]) * u[i];
  }
}

extern "C" void rms_norm_rows(const float* x, const float* w, float* out, int64_t M, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (parallel_pays(M * H))
  for (int64_t m = 0; m < M; ++m) norm_row(x + m * H, w, out + m * H, H, eps);
}

// Rope in place on the first `heads` heads of each row of x (row stride `stride` floats, heads of
// hd floats); cos / sin are [M, hd / 2].
extern "C" void rope_rows(float* x, const float* cos, const float* sin, int64_t M, int64_t heads, int64_t hd,
                          int64_t stride) {
  const int64_t half = hd / 2;
#pragma omp parallel for schedule(static) if (parallel_pays(M * heads * hd))
  for (int64_t task = 0; task < M * heads; ++task) {
    const int64_t m = task / heads, h = task % heads;
    rope_head(x + m * stride + h * hd, cos + m * half, sin + m * half, half);
  }
}

// out[m] = SiLU(gu[m, :I]) * gu[m, I:] for the M rows of the gate/up projection [M, 2I].
extern "C" void silu_mul_rows(const float* gu, float* out, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (parallel_pays(M * I))
  for (int64_t m = 0; m < M; ++m) silu_mul_row(gu + m * 2 * I, gu + m * 2 * I + I, out + m * I, I);
}

// The index of each row's largest value (the first one on ties; the first NaN if there is one,
// as torch.argmax): the greedy sampler's step over [M, N] logits.
extern "C" void argmax_rows(const float* x, int64_t M, int64_t N, int64_t* out) {
#pragma omp parallel for schedule(static) if (parallel_pays(M * N))
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * N;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) {
      const __m256 v = _mm256_loadu_ps(r + i);
      mx = _mm256_max_ps(mx, v);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float best = lanes[0];
    for (int j = 1; j < 8; ++j) best = std::max(best, lanes[j]);
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < N; ++i) {
      if (std::isnan(r[i])) has_nan = true;
      else best = std::max(best, r[i]);
    }
    int64_t k = 0;
    if (has_nan) {
      while (!std::isnan(r[k])) ++k;
    } else {
      const __m256 b8 = _mm256_set1_ps(best);
      for (; k + 8 <= N; k += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + k), b8, _CMP_EQ_OQ));
        if (mask != 0) { k += __builtin_ctz(mask); break; }
      }
      while (k < N && r[k] != best) ++k;
    }
    out[m] = k;
  }
}

// The eight sums of eight vectors, as one vector: lane i holds the sum of a[i]'s lanes.
static inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Prefetch bytes [offset, offset + bytes) of eight rows (the next eight tokens' K or V of one head):
// the loops below visit eight rows a head at a time, a pattern the hardware prefetchers do not
// follow as they follow one sequential stream.
static inline void prefetch_rows(const char* const* rows, int64_t offset, int64_t bytes) {
  for (int i = 0; i < 8; ++i)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(rows[i] + offset + b, _MM_HINT_T1);
}

// Attention of one sequence's query heads of KV heads [g0, g1) (G query heads per KV head) over
// its context through its block table: scores, an exact softmax (max-subtracted, exp8), then the
// weighted sum of V. q, out: this sequence's [H, d] rows; caches [slots, KVH, d].
//
// Tokens are taken eight at a time. A token's K (then V) rows of these heads are one contiguous
// run and a block's tokens follow each other, so the reads stream; the eight tokens' rows then sit
// in L1 while every head uses them. A head's eight scores come from eight accumulators (one per
// token) over the dims, reduced by one transposing sum instead of a horizontal sum per token; its
// output takes the eight tokens' V rows in registers, 64 dims at a time. Each score and output is
// the same sequence of operations whatever the batch or the split of heads over threads: a row's
// result does not depend on the batch.
// A token tree's row (`path_n` > 0) reads its last `path_n` context positions from `path` (positions
// in its table's order: the guesses its branch follows, its own last) instead of those before it.
template <typename T>
static void attend_heads(const float* qi, const T* k_cache, const T* v_cache, const int64_t* table,
                         int64_t len, int64_t g0, int64_t g1, int64_t G, int64_t KVH, int64_t d,
                         int64_t block_size, float scale, int64_t window, float* oi, float softcap = 0.f,
                         const float* sinks = nullptr, const int64_t* path = nullptr, int64_t path_n = 0) {
  const int64_t start = (window > 0 && len > window) ? len - window : 0;
  const int64_t n = len - start, row = KVH * d, h0 = g0 * G, nh = (g1 - g0) * G;
  const int64_t n8 = n & ~int64_t(7), d8 = d & ~int64_t(7), d64 = d & ~int64_t(63);
  thread_local std::vector<int64_t> offsets;
  thread_local std::vector<float> s, acc, inv_sum;
  offsets.resize(n);
  s.resize(nh * n);
  acc.assign(nh * d, 0.f);
  inv_sum.resize(nh);
  for (int64_t t = 0; t < n; ++t) {
    int64_t pos = start + t;
    if (pos >= len - path_n) pos = path[pos - (len - path_n)];
    offsets[t] = (table[pos / block_size] * block_size + pos % block_size) * row;
  }
  // Scores.
  for (int64_t t = 0; t < n8; t += 8) {
    const T* kr[8];
    const char* next[8];
    for (int i = 0; i < 8; ++i) {
      kr[i] = k_cache + offsets[t + i];
      next[i] = reinterpret_cast<const char*>(k_cache + offsets[std::min(n - 1, t + 8 + i)]);
    }
    for (int64_t j = 0; j < nh; ++j) {
      const float* qh = qi + (h0 + j) * d;
      const int64_t kofs = ((h0 + j) / G) * d;
      if (j % G == 0) prefetch_rows(next, kofs * sizeof(T), d * sizeof(T));
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t e = 0; e < d8; e += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + e);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(kr[i] + kofs + e), a[i]);
      }
      alignas(32) float sc[8];
      _mm256_store_ps(sc, hsum8(a));
      for (int i = 0; i < 8; ++i) {
        for (int64_t e = d8; e < d; ++e) sc[i] += qh[e] * load1(kr[i] + kofs + e);
        s[j * n + t + i] = sc[i] * scale;
      }
    }
  }
  for (int64_t t = n8; t < n; ++t)
    for (int64_t j = 0; j < nh; ++j)
      s[j * n + t] = dot(qi + (h0 + j) * d, k_cache + offsets[t] + ((h0 + j) / G) * d, d) * scale;
  if (softcap > 0.f)
    for (int64_t i = 0; i < nh * n; ++i) s[i] = softcap * std::tanh(s[i] / softcap);
  // Softmax per head.
  for (int64_t j = 0; j < nh; ++j) {
    float* sh = s.data() + j * n;
    float mx = sinks != nullptr ? sinks[h0 + j] : -INFINITY;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 s8 = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), m8));
      _mm256_storeu_ps(sh + t, e);
      s8 = _mm256_add_ps(s8, e);
    }
    float sum = hsum(s8);
    for (; t < n; ++t) { sh[t] = std::exp(sh[t] - mx); sum += sh[t]; }
    if (sinks != nullptr) sum += std::exp(sinks[h0 + j] - mx);
    inv_sum[j] = 1.0f / sum;
  }
  // The weighted sum of V: per head, 64 output dims in registers over up to eight tokens.
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t t1 = std::min(n, t0 + 8);
    const char* next[8];
    for (int i = 0; i < 8; ++i)
      next[i] = reinterpret_cast<const char*>(v_cache + offsets[std::min(n - 1, t0 + 8 + i)]);
    for (int64_t j = 0; j < nh; ++j) {
      const float* sh = s.data() + j * n;
      const int64_t vofs = ((h0 + j) / G) * d;
      if (j % G == 0) prefetch_rows(next, vofs * sizeof(T), d * sizeof(T));
      float* a = acc.data() + j * d;
      for (int64_t e0 = 0; e0 < d64; e0 += 64) {
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_ps(a + e0 + 8 * c);
        for (int64_t t = t0; t < t1; ++t) {
          const __m256 p = _mm256_set1_ps(sh[t]);
          const T* vr = v_cache + offsets[t] + vofs + e0;
          for (int c = 0; c < 8; ++c) r[c] = _mm256_fmadd_ps(p, load8(vr + 8 * c), r[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + e0 + 8 * c, r[c]);
      }
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t e = d64; e < d; ++e) a[e] += sh[t] * load1(v_cache + offsets[t] + vofs + e);
    }
  }
  for (int64_t j = 0; j < nh; ++j)
    for (int64_t e = 0; e < d; ++e) oi[(h0 + j) * d + e] = acc[j * d + e] * inv_sum[j];
}

// This step's K and V rows into their cache slots: k, v are [T, row] with row strides k_stride and
// v_stride (views of the QKV projection), the caches [slots, row] in float32 or float16 (rounded
// to nearest even, as torch's .to(float16)).
template <typename T>
static void write_kv_impl(const float* k, const float* v, int64_t k_stride, int64_t v_stride, T* k_cache, T* v_cache,
                          const int64_t* slots, int64_t n, int64_t row) {
#pragma omp parallel for schedule(static) if (parallel_pays(n * row))
  for (int64_t t = 0; t < n; ++t) {
    store_row(k_cache + slots[t] * row, k + t * k_stride, row);
    store_row(v_cache + slots[t] * row, v + t * v_stride, row);
  }
}

extern "C" void write_kv_rows(const float* k, const float* v, int64_t k_stride, int64_t v_stride, void* k_cache,
                              void* v_cache, const int64_t* slots, int64_t n, int64_t row, int64_t kv_half) {
  if (kv_half)
    write_kv_impl(k, v, k_stride, v_stride, static_cast<half_t*>(k_cache), static_cast<half_t*>(v_cache), slots, n, row);
  else
    write_kv_impl(k, v, k_stride, v_stride, static_cast<float*>(k_cache), static_cast<float*>(v_cache), slots, n, row);
}

// Tasks for D sequences on T threads: one per sequence (all heads, the contiguous reads above)
// when there are at least T sequences; otherwise each sequence's KV heads split in `parts` ranges
// so that a single decode still uses every thread.
static inline int64_t head_parts(int64_t D, int64_t KVH, int64_t T) {
  return D >= T ? 1 : std::min<int64_t>(KVH, (T + D - 1) / D);
}

template <typename T>
static inline void attend_task(int64_t task, int64_t parts, const float* q, const T* k_cache,
                               const T* v_cache, const int64_t* tables, int64_t max_blocks, const int64_t* ctx,
                               int64_t H, int64_t KVH, int64_t d, int64_t block_size, float scale, int64_t window,
                               int64_t q_stride, float* out, float softcap = 0.f, const float* sinks = nullptr,
                               const int64_t* paths = nullptr, int64_t path_width = 0,
                               const int64_t* path_lens = nullptr) {
  const int64_t i = task / parts, part = task % parts;
  const int64_t g0 = KVH * part / parts, g1 = KVH * (part + 1) / parts;
  attend_heads(q + i * q_stride, k_cache, v_cache, tables + i * max_blocks, ctx[i], g0, g1, H / KVH, KVH, d,
               block_size, scale, window, out + i * H * d, softcap, sinks,
               paths == nullptr ? nullptr : paths + i * path_width, path_lens == nullptr ? 0 : path_lens[i]);
}

extern "C" void paged_decode_attention(const float* q, const void* k_cache, const void* v_cache,
                                       const int64_t* tables, int64_t max_blocks, const int64_t* ctx,
                                       int64_t D, int64_t H, int64_t KVH, int64_t d, int64_t block_size,
                                       float scale, int64_t window, float* out, int64_t kv_half,
                                       float softcap, const float* sinks, const int64_t* paths, int64_t path_width,
                                       const int64_t* path_lens) {
  const int64_t parts = head_parts(D, KVH, omp_get_max_threads());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < D * parts; ++task) {
    if (kv_half)
      attend_task(task, parts, q, static_cast<const half_t*>(k_cache), static_cast<const half_t*>(v_cache), tables,
                  max_blocks, ctx, H, KVH, d, block_size, scale, window, H * d, out, softcap, sinks, paths,
                  path_width, path_lens);
    else
      attend_task(task, parts, q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), tables,
                  max_blocks, ctx, H, KVH, d, block_size, scale, window, H * d, out, softcap, sinks, paths,
                  path_width, path_lens);
  }
}

// ---- A whole decode step's decoder layers in one call ----------------------------------------
// The M rows are single-token decodes (M <= 64 in float32, 16 with int8 weights: the model's
// FusedDecode.max_rows). Per layer: RMSNorm, QKV projection (+ bias), optional per-head q/k
// RMSNorm, rope (two halves, HF layout), K/V written to their slots, paged attention, output
// projection added to the residual, RMSNorm, gate/up projection, SiLU(gate) * up, down
// projection added to the residual. One OpenMP team runs it all: each stage is an `omp for`
// whose implicit barrier is the only synchronisation, so no Python and no thread start-up sits
// between the weight streams. The projections use the same `stream_row` / `tile_block` as
// skinny_linear, so each output element is computed as in the layer-by-layer path.
namespace {

struct LayerWeights {  // one row of the pointer table (0 where absent)
  int64_t in_norm, wqkv, bqkv, q_norm, k_norm, wo, post_norm, wgu, wd, k_cache, v_cache;
  // int8 projections (quantization="int8"): each weight above is then int8 [N, K], with a float
  // scale per output row and the smoothing divisor per input channel (1 / s, or 0 for none).
  int64_t sqkv, zqkv, so, zo, sgu, zgu, sd, zd;
};

// Dot products of one int8 weight row with R (1 or 2) float activation rows, times the row's
// scale: weight-only int8 (the activations stay float32).
template <int R>
inline void dots_q8(const float* x, const int8_t* wr, float* y, int64_t K, int64_t N, float scale) {
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  auto widen = [](const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  const int64_t K16 = K & ~int64_t(15), K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K16; k += 16) {
    const __m256 w0 = widen(wr + k), w1 = widen(wr + k + 8);
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, a[r][1]);
    }
  }
  for (int64_t k = K16; k < K8; k += 8) {
    const __m256 w0 = widen(wr + k);
    for (int r = 0; r < R; ++r) a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, a[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(a[r][0], a[r][1]));
    for (int64_t k = K8; k < K; ++k) s += x[r * K + k] * float(wr[k]);
    y[r * N] = s * scale;
  }
}


// y[m, n] (= or +=) x[m] . W[n] for all m < M, rows of W split over the team (called inside a
// parallel region). `accumulate` adds to y (the residual) instead of storing.
// With `scale` (int8 weights), x is first divided by the smoothing (into xs, [M, K] scratch).
inline void team_linear(const float* x, const void* w, float* y, int64_t M, int64_t K, int64_t N,
                        const float* bias, bool accumulate, float* tmp /* [max(M, 8), N] */,
                        const float* scale = nullptr, const float* inv_smooth = nullptr, float* xs = nullptr) {
  if (scale != nullptr && inv_smooth != nullptr) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * K; ++i) xs[i] = x[i] * inv_smooth[i % K];
    x = xs;
  }
  // Row m's result for column n, from tmp row r: plus the bias, stored or added to y.
  auto finish = [&](int64_t r, int64_t m, int64_t n) {
    float v = tmp[r * N + n];
    if (bias != nullptr) v += bias[n];
    float* out = y + m * N + n;
    *out = accumulate ? *out + v : v;
  };
  if (scale == nullptr && M > SMALL_ROWS) {  // float32 register tiles, as in skinny_linear
    const float* wf = static_cast<const float*>(w);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < (N + TILE_N - 1) / TILE_N; ++b) {
      const int64_t n0 = b * TILE_N, nr = std::min(TILE_N, N - n0);
      tile_block(x, wf + n0 * K, tmp + n0, M, K, N, nr);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n0 + nr; ++n) finish(m, m, n);
    }
    return;
  }
  // Memory-bound passes: the two threads' halves of a weight stream rarely finish together on
  // this shared machine, and a static split makes the first wait at the barrier. Guided chunks
  // (large first, then smaller) even out the end for a few more chunk starts: 0.88 -> 0.90 of a
  // plain read's speed over SmolLM2's weights at 50 GB/s, 0.97 -> 1.0 at 30 (benchmarks/batch1_ab.py).
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t m1 = std::min<int64_t>(M, m0 + 8), rows = m1 - m0;
#pragma omp for schedule(guided)
    for (int64_t n = 0; n < N; ++n) {
      if (scale != nullptr) {
        const int8_t* wr = static_cast<const int8_t*>(w) + n * K;
        int64_t m = m0;
        for (; m + 2 <= m1; m += 2) dots_q8<2>(x + m * K, wr, tmp + (m - m0) * N + n, K, N, scale[n]);
        if (m < m1) dots_q8<1>(x + m * K, wr, tmp + (m - m0) * N + n, K, N, scale[n]);
      } else {
        stream_row(x + m0 * K, static_cast<const float*>(w) + n * K, tmp + n, rows, K, N);
      }
      for (int64_t r = 0; r < rows; ++r) finish(r, m0 + r, n);
    }
  }
}

}  // namespace

template <typename T>
static void decode_layers_impl(float* x, int64_t M, const int64_t* layers, int64_t L, int64_t H, int64_t nh,
                               int64_t nkv, int64_t hd, int64_t I, float eps, const float* cos, const float* sin,
                               const int64_t* positions, const int64_t* slots, const int64_t* tables,
                               int64_t max_blocks, const int64_t* ctx, int64_t block_size, float scale,
                               int64_t window, const int64_t* ids, const float* embed, const float* final_norm,
                               bool chained, const int64_t* aux_layers, int64_t n_aux, float* aux,
                               const int64_t* paths, int64_t path_width, const int64_t* path_lens) {
  const int64_t qkv_n = (nh + 2 * nkv) * hd, half = hd / 2, row = nkv * hd;
  const int64_t threads = omp_get_max_threads(), parts = head_parts(M, nkv, threads), G = nh / nkv;
  // Up to SMALL_ROWS rows each thread computes the norms and SiLU(gate) * up of every row itself,
  // into its own buffers: a few microseconds of redundant arithmetic instead of a barrier, whose
  // cost (a thread waiting for the other to finish its half of the weights) is several times more
  // at batch 1 (benchmarks/batch1_ab.py). Larger steps share one buffer, each row computed once.
  const bool redundant = M <= SMALL_ROWS;
  const int64_t copies = redundant ? threads : 1;  // of the norm and SiLU buffers
  std::vector<float> xn(copies * M * H), qkv(M * qkv_n), attn(M * nh * hd), gu(M * 2 * I), act(copies * M * I);
  std::vector<float> tmp(std::max<int64_t>(M, 8) * std::max<int64_t>(std::max(qkv_n, 2 * I), H));
  std::vector<float> xs(M * std::max<int64_t>(std::max(H, nh * hd), I));  // smoothed int8 inputs
#pragma omp parallel
  {
  const int64_t tid = omp_get_thread_num();
  float* my_xn = xn.data() + (redundant ? tid : 0) * M * H;
  float* my_act = act.data() + (redundant ? tid : 0) * M * I;
  auto norm_rows = [&](const float* w) {
    if (redundant) {
      for (int64_t m = 0; m < M; ++m) norm_row(x + m * H, w, my_xn + m * H, H, eps);
    } else {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) norm_row(x + m * H, w, my_xn + m * H, H, eps);
    }
  };
  if (ids != nullptr) {  // the embedding rows, as torch.embedding copies them
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) std::copy(embed + ids[m] * H, embed + (ids[m] + 1) * H, x + m * H);
  }
  for (int64_t l = 0; l < L; ++l) {
    const LayerWeights& lw = reinterpret_cast<const LayerWeights*>(layers)[l];
    auto ptr = [](int64_t p) { return reinterpret_cast<float*>(p); };
    T *k_cache = reinterpret_cast<T*>(lw.k_cache), *v_cache = reinterpret_cast<T*>(lw.v_cache);
    for (int64_t a = 0; a < n_aux; ++a) {  // the residual stream entering this layer, kept
      if (aux_layers[a] != l) continue;
      // (no barrier: x is next written by the output projection, after the QKV stage's)
#pragma omp for schedule(static) nowait
      for (int64_t m = 0; m < M; ++m) std::copy(x + m * H, x + (m + 1) * H, aux + (m * n_aux + a) * H);
    }
    norm_rows(ptr(lw.in_norm));
    team_linear(my_xn, ptr(lw.wqkv), qkv.data(), M, H, qkv_n, ptr(lw.bqkv), false, tmp.data(), ptr(lw.sqkv),
                ptr(lw.zqkv), xs.data());
    // Each attention task first prepares the heads it owns (the query heads of its KV heads, and
    // those KV heads): optional per-head RMSNorm, rope, and K/V into the cache slot. No other
    // task reads them, so this needs no stage (and no barrier) of its own; but `chained` rows
    // (several rows of one sequence, a row reading the K/V of the rows before it) are all
    // written before any attends, one barrier a layer.
    auto prepare_task = [&](int64_t task) {
      const int64_t m = task / parts, part = task % parts;
      float* q = qkv.data() + m * qkv_n;
      auto prepare = [&](float* v, const float* nw) {
        if (nw != nullptr) norm_row(v, nw, v, hd, eps);
        rope_head(v, cos + positions[m] * half, sin + positions[m] * half, half);
      };
      for (int64_t g = nkv * part / parts; g < nkv * (part + 1) / parts; ++g) {
        for (int64_t h = g * G; h < (g + 1) * G; ++h) prepare(q + h * hd, ptr(lw.q_norm));
        prepare(q + (nh + g) * hd, ptr(lw.k_norm));
        store_row(k_cache + slots[m] * row + g * hd, q + (nh + g) * hd, hd);
        store_row(v_cache + slots[m] * row + g * hd, q + (nh + nkv + g) * hd, hd);
      }
    };
    auto attend = [&](int64_t task) {
      attend_task(task, parts, qkv.data(), k_cache, v_cache, tables, max_blocks, ctx, nh, nkv, hd, block_size, scale,
                  window, qkv_n, attn.data(), 0.f, nullptr, paths, path_width, path_lens);
    };
    if (chained) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < M * parts; ++task) prepare_task(task);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < M * parts; ++task) attend(task);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < M * parts; ++task) {
        prepare_task(task);
        attend(task);
      }
    }
    team_linear(attn.data(), ptr(lw.wo), x, M, nh * hd, H, nullptr, true, tmp.data(), ptr(lw.so), ptr(lw.zo),
                xs.data());
    norm_rows(ptr(lw.post_norm));
    team_linear(my_xn, ptr(lw.wgu), gu.data(), M, H, 2 * I, nullptr, false, tmp.data(), ptr(lw.sgu), ptr(lw.zgu),
                xs.data());
    if (redundant) {
      for (int64_t m = 0; m < M; ++m) silu_mul_row(gu.data() + m * 2 * I, gu.data() + m * 2 * I + I, my_act + m * I, I);
    } else {
      // Each row in eight slices for the threads, cut at multiples of 8 so that every element
      // takes the same vector or tail path as in silu_mul_rows.
      auto cut = [I](int64_t slice) { return slice == 8 ? I : (I * slice / 8) & ~int64_t(7); };
#pragma omp for schedule(static)
      for (int64_t task = 0; task < M * 8; ++task) {
        const int64_t m = task / 8, i0 = cut(task % 8), i1 = cut(task % 8 + 1);
        silu_mul_row(gu.data() + m * 2 * I + i0, gu.data() + m * 2 * I + I + i0, my_act + m * I + i0, i1 - i0);
      }
    }
    team_linear(my_act, ptr(lw.wd), x, M, I, H, nullptr, true, tmp.data(), ptr(lw.sd), ptr(lw.zd), xs.data());
  }
  if (final_norm != nullptr) {  // the model's final RMSNorm, in place
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) norm_row(x + m * H, final_norm, x + m * H, H, eps);
  }
  }
}

// cos / sin are the rope tables [positions, head_dim / 2], read at each row's position. With
// `ids`, the rows of x are first the embedding rows of those tokens; with `final_norm`, they end
// normalised by it: the whole decode step of the model up to the LM head, with no Python
// between (the host work after a step's weight stream runs with cold caches, so each torch op
// left out saves tens of microseconds there).
// `chained`: rows may follow one another in one sequence (a speculative step's guesses, each
// row a one-token decode of the same block table): every row's K/V are written before any row
// attends. With `n_aux` layer indices, aux [M, n_aux, H] gets the residual stream entering each
// of those layers (an EAGLE-3 head's input). `paths` [M, path_width] and `path_lens` [M] (or
// null): chained rows of a token tree, as attend_heads reads them.
extern "C" void decode_layers(float* x, int64_t M, const int64_t* layers, int64_t L, int64_t H, int64_t nh,
                              int64_t nkv, int64_t hd, int64_t I, float eps, const float* cos, const float* sin,
                              const int64_t* positions, const int64_t* slots, const int64_t* tables,
                              int64_t max_blocks, const int64_t* ctx, int64_t block_size, float scale, int64_t window,
                              int64_t kv_half, const int64_t* ids, const float* embed, const float* final_norm,
                              int64_t chained, const int64_t* aux_layers, int64_t n_aux, float* aux,
                              const int64_t* paths, int64_t path_width, const int64_t* path_lens) {
  if (kv_half)
    decode_layers_impl<half_t>(x, M, layers, L, H, nh, nkv, hd, I, eps, cos, sin, positions, slots, tables,
                               max_blocks, ctx, block_size, scale, window, ids, embed, final_norm, chained != 0,
                               aux_layers, n_aux, aux, paths, path_width, path_lens);
  else
    decode_layers_impl<float>(x, M, layers, L, H, nh, nkv, hd, I, eps, cos, sin, positions, slots, tables,
                              max_blocks, ctx, block_size, scale, window, ids, embed, final_norm, chained != 0,
                              aux_layers, n_aux, aux, paths, path_width, path_lens);
}

// ---- int8 activation preparation (conveyor/models/quantize.py, Int8Linear) --------------------
// For each row of x [M, K]: s = x * inv_smooth (if given), row_max = max(max|s|, 1e-12),
// out[m, :K] = s / row_max, out[m, K] = 1, out[m, K + 1] = -1 (out is [M, K + 2]). The same
// IEEE operations as the torch code it replaces, so the results are bit-equal; one call instead
// of six tensor ops, whose dispatch cost was most of a batch-1 int8 projection.
extern "C" void int8_prepare_rows(const float* x, const float* inv_smooth, float* out, float* row_max,
                                  int64_t M, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (parallel_pays(M * K))
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* o = out + m * (K + 2);
    __m256 mx8 = _mm256_setzero_ps();
    float mx = 0.f;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 v = _mm256_loadu_ps(xr + k);
      if (inv_smooth != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(inv_smooth + k));
      _mm256_storeu_ps(o + k, v);
      mx8 = _mm256_max_ps(mx8, _mm256_andnot_ps(sign, v));
    }
    for (; k < K; ++k) {
      const float v = inv_smooth != nullptr ? xr[k] * inv_smooth[k] : xr[k];
      o[k] = v;
      mx = std::max(mx, std::fabs(v));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx8);
    for (int j = 0; j < 8; ++j) mx = std::max(mx, lanes[j]);
    mx = std::max(mx, 1e-12f);
    const __m256 d8 = _mm256_set1_ps(mx);
    k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, _mm256_div_ps(_mm256_loadu_ps(o + k), d8));
    for (; k < K; ++k) o[k] = o[k] / mx;
    o[K] = 1.f;
    o[K + 1] = -1.f;
    row_max[m] = mx;
  }
}

// y[M, N] = (x / smooth) @ (q * scale)^T for the few rows of a decode step with int8 weights
// (the int8 LM head), weight-only: the activations stay float32.
extern "C" void skinny_linear_q8(const float* x, const int8_t* w, const float* scale, const float* inv_smooth,
                                 float* y, int64_t M, int64_t K, int64_t N) {
  std::vector<float> tmp(8 * N), xs(inv_smooth != nullptr ? M * K : 0);
#pragma omp parallel
  team_linear(x, w, y, M, K, N, nullptr, false, tmp.data(), scale, inv_smooth, xs.data());
}

// ---------------------------------------------------------------------------------------------
// Tensor parallelism's all-reduce among the processes of one machine (conveyor/runner/
// tensor_parallel.py), through a shared mapping: a header of one 64-byte line per rank (its
// generation counter) and one abort word, then two sets (by generation parity) of one slot
// per rank. A call copies its chunk into its slot, publishes its generation (release), waits
// for every rank's (acquire), and sums the slots in rank order: every rank gets the same bits.
// A slot of a parity is written again two generations later, after every rank has published
// the generation in between, which it does only after its reads: no second barrier is needed.
// Waiting spins with pause, then yields the core (more ranks than cores); it gives up on the
// abort word (a watchdog saw a rank die) or after `timeout_s`.
#include <atomic>
#include <chrono>
#include <cstring>
#include <sched.h>

namespace {
constexpr int64_t SHM_LINE = 64;

template <typename T>
int shm_all_reduce_impl(char* base, int64_t rank, int64_t size, int64_t slot_bytes, T* x, int64_t n, int64_t* gen,
                        double timeout_s) {
    auto flag = [&](int64_t r) { return reinterpret_cast<std::atomic<int64_t>*>(base + r * SHM_LINE); };
    auto* abort_word = reinterpret_cast<std::atomic<int64_t>*>(base + size * SHM_LINE);
    char* slots = base + (size + 1) * SHM_LINE;
    const int64_t per = slot_bytes / int64_t(sizeof(T));
    const auto start = std::chrono::steady_clock::now();
    for (int64_t at = 0; at < n; at += per) {
        const int64_t len = std::min(per, n - at);
        const int64_t g = ++*gen;
        T* set = reinterpret_cast<T*>(slots + (g & 1) * size * slot_bytes);
        std::memcpy(set + rank * per, x + at, len * sizeof(T));
        flag(rank)->store(g, std::memory_order_release);
        for (int64_t q = 0; q < size; ++q) {
            int64_t spins = 0;
            while (flag(q)->load(std::memory_order_acquire) < g) {
                if (++spins < 4096) {
                    _mm_pause();
                    continue;
                }
                sched_yield();
                if ((spins & 1023) == 0) {
                    if (abort_word->load(std::memory_order_relaxed)) return -2;
                    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
                    if (waited.count() > timeout_s) return -1;
                }
            }
        }
        T* out = x + at;
        std::memcpy(out, set, len * sizeof(T));
        for (int64_t q = 1; q < size; ++q) {
            const T* s = set + q * per;
            for (int64_t i = 0; i < len; ++i) out[i] += s[i];
        }
    }
    return 0;
}
}  // namespace

extern "C" int shm_all_reduce(void* base, int64_t rank, int64_t size, int64_t slot_bytes, void* x, int64_t n,
                              int64_t elem_bytes, int64_t* gen, double timeout_s) {
    char* b = static_cast<char*>(base);
    if (elem_bytes == 4)
        return shm_all_reduce_impl(b, rank, size, slot_bytes, static_cast<float*>(x), n, gen, timeout_s);
    if (elem_bytes == 8)
        return shm_all_reduce_impl(b, rank, size, slot_bytes, static_cast<double*>(x), n, gen, timeout_s);
    return -3;
}
