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
#include <cstdint>

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

extern "C" void skinny_linear(const float* xp, const float* wp, float* yp, int64_t M, int64_t K, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* wr = wp + n * K;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) dots<2>(xp + m * K, wr, yp + m * N + n, K, N);
    if (m < M) dots<1>(xp + m * K, wr, yp + m * N + n, K, N);
  }
}

extern "C" void skinny_set_threads(int n) { omp_set_num_threads(n); }
