/* Per-tensor sums of squares in float64 for the global norm of a gradient clip (ft_sumsq).
 *
 * Part of functional_train (engine/native.py compiles this file on first use and calls it
 * through ctypes). With AVX2 and FMA the body runs on 256-bit vectors; the remainder, and
 * everything elsewhere, runs a scalar loop of correctly rounded fused multiply-adds. Compile
 * without floating-point contraction (-ffp-contract=off): the fused multiply-adds are the
 * explicit ones.
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#else
#define VECTOR 0
#endif

#define ALWAYS static inline __attribute__((always_inline))

#if defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
#define FMA_f64(a, b, c) __builtin_fma(a, b, c)
#else  /* no fused multiply-add instruction: a product and a sum, each rounded */
#define FMA_f64(a, b, c) ((a) * (b) + (c))
#endif

/* Sums of squares, one per leaf, accumulated in float64 (for the global norm of a gradient
 * clip): out[k] = sum over i of ptr[k][i]^2. The square of a float32 is exact in float64. The
 * order of the additions depends only on the leaf's length (four interleaved vector
 * accumulators, then the remainder), so a leaf's sum is the same wherever it lies in memory. */
#if VECTOR
#define SUMSQ_BODY_f32                                                                          \
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;                                \
    for (; i + 16 <= n; i += 16) {                                                              \
        const __m256 u = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);               \
        const __m256d u0 = _mm256_cvtps_pd(_mm256_castps256_ps128(u)),                          \
            u1 = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1)),                                  \
            w0 = _mm256_cvtps_pd(_mm256_castps256_ps128(w)),                                    \
            w1 = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));                                  \
        a0 = _mm256_fmadd_pd(u0, u0, a0); a1 = _mm256_fmadd_pd(u1, u1, a1);                    \
        a2 = _mm256_fmadd_pd(w0, w0, a2); a3 = _mm256_fmadd_pd(w1, w1, a3);                     \
    }                                                                                           \
    total = hsum4(a0, a1, a2, a3);
#define SUMSQ_BODY_f64                                                                          \
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;                                \
    for (; i + 16 <= n; i += 16) {                                                              \
        const __m256d u0 = _mm256_loadu_pd(x + i), u1 = _mm256_loadu_pd(x + i + 4),             \
            w0 = _mm256_loadu_pd(x + i + 8), w1 = _mm256_loadu_pd(x + i + 12);                  \
        a0 = _mm256_fmadd_pd(u0, u0, a0); a1 = _mm256_fmadd_pd(u1, u1, a1);                    \
        a2 = _mm256_fmadd_pd(w0, w0, a2); a3 = _mm256_fmadd_pd(w1, w1, a3);                     \
    }                                                                                           \
    total = hsum4(a0, a1, a2, a3);

/* ((a0 + a1) + (a2 + a3)), then its four lanes as ((l0 + l1) + (l2 + l3)) */
ALWAYS double hsum4(__m256d a0, __m256d a1, __m256d a2, __m256d a3) {
    double l[4];
    _mm256_storeu_pd(l, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    return (l[0] + l[1]) + (l[2] + l[3]);
}
#else
#define SUMSQ_BODY_f32
#define SUMSQ_BODY_f64
#endif

#define DEFINE_SUMSQ(T, SUF)                                                                    \
void ft_sumsq_##SUF(int64_t leaves, const T *const *ptr, const int64_t *numel, double *out) {  \
    for (int64_t k = 0; k < leaves; k++) {                                                      \
        const T *x = ptr[k];                                                                    \
        const int64_t n = numel[k];                                                             \
        int64_t i = 0;                                                                          \
        double total = 0.0;                                                                     \
        SUMSQ_BODY_##SUF                                                                        \
        for (; i < n; i++) total = FMA_f64((double)x[i], (double)x[i], total);                  \
        out[k] = total;                                                                         \
    }                                                                                           \
}
DEFINE_SUMSQ(float, f32)
DEFINE_SUMSQ(double, f64)

/* The ABI version engine/native.py checks. */
int ft_version(void) { return 6; }
