// Skinny matrix products on CPU (a plain C ABI, loaded with ctypes: no torch headers, so it
// compiles in about a second): y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode
// step, streaming W once at memory speed (float32, AVX2 + FMA, OpenMP over output columns).
//
// MKL's sgemm packs W on every call and reaches a fraction of the memory bandwidth at
// M = 2..16 (BENCHMARKS.md). Here each W row is read from memory once, as one sequential
// stream, and dotted with the activation rows two at a time while it sits in L1.
//
// Every output element is the same sequence of operations (four 8-wide FMA chains over K,
// then the same horizontal sum), whatever M is: a row's result does not depend on the batch.
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

// Rows are taken 8 at a time, one pass over W each: 8 activation rows (18 KB at K = 576) stay
// in L1 while W streams; more rows per pass would spill them and make the pass compute-bound.
extern "C" void skinny_linear(const float* xp, const float* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t m1 = std::min<int64_t>(M, m0 + 8);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* wr = wp + n * K;
      int64_t m = m0;
      for (; m + 2 <= m1; m += 2) dots<2>(xp + m * K, wr, yp + m * N + n, K, N);
      if (m < m1) dots<1>(xp + m * K, wr, yp + m * N + n, K, N);
    }
  }
}

extern "C" void skinny_set_threads(int n) { omp_set_num_threads(n); }

// ---- RMSNorm of a few rows: out = x / sqrt(mean(x^2) + eps) * w ----------------------------
extern "C" void rms_norm_rows(const float* x, const float* w, float* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float* o = out + m * H;
    double ss = 0.0;
    for (int64_t i = 0; i < H; ++i) ss += double(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(float(ss / double(H)) + eps);
    for (int64_t i = 0; i < H; ++i) o[i] = (xr[i] * inv) * w[i];
  }
}

// ---- Paged decode attention: one query token per sequence, K/V read in place ----------------
// q, out: [D, H, d]; k_cache, v_cache: [slots, KVH, d] (slot = block * block_size + offset);
// tables: [D, max_blocks] block ids; ctx: [D] context lengths (the new token included).
// window > 0 keeps only the last `window` positions (sliding-window attention).
static inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
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

extern "C" void paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                                       const int64_t* tables, int64_t max_blocks, const int64_t* ctx,
                                       int64_t D, int64_t H, int64_t KVH, int64_t d, int64_t block_size,
                                       float scale, int64_t window, float* out) {
  const int64_t G = H / KVH, row = KVH * d;
  // One task per sequence: a token's K (then V) row of all KV heads is one contiguous run, and a
  // block's tokens follow each other, so the reads stream instead of hopping between heads.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < D; ++i) {
    const int64_t len = ctx[i];
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int64_t n = len - start;
    const int64_t* table = tables + i * max_blocks;
    const float* qi = q + i * H * d;
    std::vector<float> s(H * n);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const float* kr = k_cache + (table[pos / block_size] * block_size + pos % block_size) * row;
      for (int64_t h = 0; h < H; ++h) s[h * n + t] = dot(qi + h * d, kr + (h / G) * d, d) * scale;
    }
    std::vector<float> inv_sum(H);
    for (int64_t h = 0; h < H; ++h) {
      float* sh = s.data() + h * n;
      float mx = -INFINITY;
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
      inv_sum[h] = 1.0f / sum;
    }
    std::vector<float> acc(H * d, 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const float* vr = v_cache + (table[pos / block_size] * block_size + pos % block_size) * row;
      for (int64_t h = 0; h < H; ++h) {
        const float* vh = vr + (h / G) * d;
        const float p = s[h * n + t];
        const __m256 p8 = _mm256_set1_ps(p);
        float* a = acc.data() + h * d;
        int64_t e = 0;
        for (; e + 8 <= d; e += 8) _mm256_storeu_ps(a + e, _mm256_fmadd_ps(p8, _mm256_loadu_ps(vh + e), _mm256_loadu_ps(a + e)));
        for (; e < d; ++e) a[e] += p * vh[e];
      }
    }
    float* oi = out + i * H * d;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < d; ++e) oi[h * d + e] = acc[h * d + e] * inv_sum[h];
  }
}
