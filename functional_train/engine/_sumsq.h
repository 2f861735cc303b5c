/* Sums of squares in float64, one per tensor, for the global norm of a gradient clip.
 *
 * Part of functional_train: the one definition of the clip's sums, used by ``_kernels.c``
 * (``ft_sumsq``, on tensors in memory) and by the stages ``fuse.py`` generates (a stage that
 * writes the updates a clip then reads sums them block by block as it writes them), so that
 * both give the same bits. The order of the additions depends only on the tensor's length,
 * and is the same on every machine: 16 interleaved lanes (lane j takes the elements whose index
 * is j modulo 16) over every whole chunk of 16 elements; the lanes added as
 * ((a[j] + a[4 + j]) + (a[8 + j] + a[12 + j])) for j < 4 and those four as
 * ((l0 + l1) + (l2 + l3)); then the remaining elements one by one. With AVX2 and FMA the
 * lanes are four 256-bit accumulators (a0 holding lanes 0 to 3, ...); elsewhere 16 doubles in
 * plain C, which the compiler vectorises as it can (on x86 without AVX2: 2.1x the speed of
 * the serial loop session 54 replaced for float32, 1.5x for float64; its order differed).
 * The square of a float32 is exact in float64; every step is a correctly rounded fused
 * multiply-add where the machine has one (where it has none, a product and a sum: other
 * bits). Compile without floating-point contraction (-ffp-contract=off): the fused
 * multiply-adds are the explicit ones.
 *
 * Use: ft_sq_init(&s); ft_sq_chunks_f32(&s, x, m) over consecutive pieces of the tensor, each
 * a whole number of chunks of 16 but the last (whose own remainder it leaves); then
 * ft_sq_end_f32(&s, the last n % 16 elements, n % 16).
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FT_SQ_VECTOR 1
#else
#define FT_SQ_VECTOR 0
#endif

#define FT_SQ_ALWAYS static inline __attribute__((always_inline))

#if defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
#define FT_SQ_FMA(a, b, c) __builtin_fma(a, b, c)
#else /* no fused multiply-add instruction: a product and a sum, each rounded */
#define FT_SQ_FMA(a, b, c) ((a) * (b) + (c))
#endif

#if FT_SQ_VECTOR
typedef struct { __m256d a0, a1, a2, a3; } ft_sq;

FT_SQ_ALWAYS void ft_sq_init(ft_sq *s) {
    s->a0 = s->a1 = s->a2 = s->a3 = _mm256_setzero_pd();
}

FT_SQ_ALWAYS void ft_sq_chunks_f32(ft_sq *s, const float *x, int64_t n) {
    __m256d a0 = s->a0, a1 = s->a1, a2 = s->a2, a3 = s->a3;
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m256 u = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        const __m256d u0 = _mm256_cvtps_pd(_mm256_castps256_ps128(u)),
                      u1 = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1)),
                      w0 = _mm256_cvtps_pd(_mm256_castps256_ps128(w)),
                      w1 = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
        a0 = _mm256_fmadd_pd(u0, u0, a0); a1 = _mm256_fmadd_pd(u1, u1, a1);
        a2 = _mm256_fmadd_pd(w0, w0, a2); a3 = _mm256_fmadd_pd(w1, w1, a3);
    }
    s->a0 = a0; s->a1 = a1; s->a2 = a2; s->a3 = a3;
}

FT_SQ_ALWAYS void ft_sq_chunks_f64(ft_sq *s, const double *x, int64_t n) {
    __m256d a0 = s->a0, a1 = s->a1, a2 = s->a2, a3 = s->a3;
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m256d u0 = _mm256_loadu_pd(x + i), u1 = _mm256_loadu_pd(x + i + 4),
                      w0 = _mm256_loadu_pd(x + i + 8), w1 = _mm256_loadu_pd(x + i + 12);
        a0 = _mm256_fmadd_pd(u0, u0, a0); a1 = _mm256_fmadd_pd(u1, u1, a1);
        a2 = _mm256_fmadd_pd(w0, w0, a2); a3 = _mm256_fmadd_pd(w1, w1, a3);
    }
    s->a0 = a0; s->a1 = a1; s->a2 = a2; s->a3 = a3;
}

FT_SQ_ALWAYS double ft_sq_total(const ft_sq *s) {
    double l[4];
    _mm256_storeu_pd(l, _mm256_add_pd(_mm256_add_pd(s->a0, s->a1), _mm256_add_pd(s->a2, s->a3)));
    return (l[0] + l[1]) + (l[2] + l[3]);
}
#else
#define FT_SQ_LANES 16
typedef struct { double a[FT_SQ_LANES]; } ft_sq;

FT_SQ_ALWAYS void ft_sq_init(ft_sq *s) {
    for (int j = 0; j < FT_SQ_LANES; j++) s->a[j] = 0.0;
}

#define FT_SQ_CHUNKS(T, SUF)                                                                    \
FT_SQ_ALWAYS void ft_sq_chunks_##SUF(ft_sq *s, const T *x, int64_t n) {                         \
    ft_sq a = *s; /* (a local: the accumulators stay in registers) */                          \
    for (int64_t i = 0; i + FT_SQ_LANES <= n; i += FT_SQ_LANES)                                 \
        for (int j = 0; j < FT_SQ_LANES; j++)                                                   \
            a.a[j] = FT_SQ_FMA((double)x[i + j], (double)x[i + j], a.a[j]);                     \
    *s = a;                                                                                     \
}
FT_SQ_CHUNKS(float, f32)
FT_SQ_CHUNKS(double, f64)

FT_SQ_ALWAYS double ft_sq_total(const ft_sq *s) {
    double l[4];
    for (int j = 0; j < 4; j++) l[j] = (s->a[j] + s->a[4 + j]) + (s->a[8 + j] + s->a[12 + j]);
    return (l[0] + l[1]) + (l[2] + l[3]);
}
#endif

#define FT_SQ_END(T, SUF)                                                                       \
FT_SQ_ALWAYS double ft_sq_end_##SUF(const ft_sq *s, const T *rest, int64_t r) {                 \
    double total = ft_sq_total(s);                                                              \
    for (int64_t i = 0; i < r; i++) total = FT_SQ_FMA((double)rest[i], (double)rest[i], total); \
    return total;                                                                               \
}
FT_SQ_END(float, f32)
FT_SQ_END(double, f64)

/* The same sums with every NaN taken as zero, beside the plain ones, in one read of the
 * tensor: the sums of squares of ``zero_nans``' results, bit for bit (a NaN's lane adds the
 * square of +0, which leaves a sum of squares as it was, in the same order), and the plain
 * sums that say which tensors hold a NaN. Use: ft_sq_init both; ft_sq2_chunks_f32(&s, &z, x,
 * m) as ft_sq_chunks_f32; then ft_sq_end_f32(&s, ...) and ft_sq_end_nz_f32(&z, ...). */
#if FT_SQ_VECTOR
#define FT_SQ_NZ(v) _mm256_and_pd((v), _mm256_cmp_pd((v), (v), _CMP_ORD_Q))

/* One chunk's four vectors of squares added to s's lanes and their NaN-zeroed ones to z's. */
FT_SQ_ALWAYS void ft_sq2_add(ft_sq *s, ft_sq *z, __m256d u0, __m256d u1, __m256d w0, __m256d w1) {
    s->a0 = _mm256_fmadd_pd(u0, u0, s->a0); s->a1 = _mm256_fmadd_pd(u1, u1, s->a1);
    s->a2 = _mm256_fmadd_pd(w0, w0, s->a2); s->a3 = _mm256_fmadd_pd(w1, w1, s->a3);
    u0 = FT_SQ_NZ(u0); u1 = FT_SQ_NZ(u1); w0 = FT_SQ_NZ(w0); w1 = FT_SQ_NZ(w1);
    z->a0 = _mm256_fmadd_pd(u0, u0, z->a0); z->a1 = _mm256_fmadd_pd(u1, u1, z->a1);
    z->a2 = _mm256_fmadd_pd(w0, w0, z->a2); z->a3 = _mm256_fmadd_pd(w1, w1, z->a3);
}

FT_SQ_ALWAYS void ft_sq2_chunks_f32(ft_sq *s, ft_sq *z, const float *x, int64_t n) {
    ft_sq a = *s, b = *z; /* (locals: the accumulators stay in registers) */
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m256 u = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        ft_sq2_add(&a, &b, _mm256_cvtps_pd(_mm256_castps256_ps128(u)),
                   _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1)),
                   _mm256_cvtps_pd(_mm256_castps256_ps128(w)),
                   _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
    }
    *s = a; *z = b;
}

FT_SQ_ALWAYS void ft_sq2_chunks_f64(ft_sq *s, ft_sq *z, const double *x, int64_t n) {
    ft_sq a = *s, b = *z;
    for (int64_t i = 0; i + 16 <= n; i += 16)
        ft_sq2_add(&a, &b, _mm256_loadu_pd(x + i), _mm256_loadu_pd(x + i + 4),
                   _mm256_loadu_pd(x + i + 8), _mm256_loadu_pd(x + i + 12));
    *s = a; *z = b;
}
#else
#define FT_SQ2_CHUNKS(T, SUF)                                                                   \
FT_SQ_ALWAYS void ft_sq2_chunks_##SUF(ft_sq *s, ft_sq *z, const T *x, int64_t n) {              \
    ft_sq a = *s, b = *z;                                                                       \
    for (int64_t i = 0; i + FT_SQ_LANES <= n; i += FT_SQ_LANES)                                 \
        for (int j = 0; j < FT_SQ_LANES; j++) {                                                 \
            const double v = (double)x[i + j], y = v == v ? v : 0.0;                            \
            a.a[j] = FT_SQ_FMA(v, v, a.a[j]);                                                   \
            b.a[j] = FT_SQ_FMA(y, y, b.a[j]);                                                   \
        }                                                                                       \
    *s = a;                                                                                     \
    *z = b;                                                                                     \
}
FT_SQ2_CHUNKS(float, f32)
FT_SQ2_CHUNKS(double, f64)
#endif

#define FT_SQ_END_NZ(T, SUF)                                                                    \
FT_SQ_ALWAYS double ft_sq_end_nz_##SUF(const ft_sq *s, const T *rest, int64_t r) {              \
    double total = ft_sq_total(s);                                                              \
    for (int64_t i = 0; i < r; i++) {                                                           \
        const double v = (double)rest[i], y = v == v ? v : 0.0;                                 \
        total = FT_SQ_FMA(y, y, total);                                                         \
    }                                                                                           \
    return total;                                                                               \
}
FT_SQ_END_NZ(float, f32)
FT_SQ_END_NZ(double, f64)
