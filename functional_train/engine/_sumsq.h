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
#if defined(__AVX2__) && defined(__FMA__) && (defined(__GNUC__) || defined(__clang__))
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
/* 256-bit vectors in the compilers' vector extensions, not <immintrin.h>'s intrinsics (the
   same instructions: vcvtps2pd, vfmadd231pd, vaddpd, vcmppd, vandpd; that header takes
   longer to parse than the rest of a generated stage) */
typedef double ft_sq_v4d __attribute__((vector_size(32)));
typedef float ft_sq_v4f __attribute__((vector_size(16)));
typedef long long ft_sq_v4l __attribute__((vector_size(32)));
#if defined(__has_builtin)
#if __has_builtin(__builtin_elementwise_fma)
#define FT_SQ_VFMA(a, b, c) __builtin_elementwise_fma(a, b, c)
#endif
#endif
#ifndef FT_SQ_VFMA
#define FT_SQ_VFMA(a, b, c) __builtin_ia32_vfmaddpd256(a, b, c)
#endif
typedef struct { ft_sq_v4d a0, a1, a2, a3; } ft_sq;

/* four elements from x, as doubles (exact) */
FT_SQ_ALWAYS ft_sq_v4d ft_sq_load_f32(const float *x) {
    ft_sq_v4f v;
    __builtin_memcpy(&v, x, sizeof v);
#if defined(__clang__)
    return __builtin_convertvector(v, ft_sq_v4d);
#else /* (GCC splits __builtin_convertvector into two 128-bit conversions) */
    return __builtin_ia32_cvtps2pd256(v);
#endif
}
FT_SQ_ALWAYS ft_sq_v4d ft_sq_load_f64(const double *x) {
    ft_sq_v4d v;
    __builtin_memcpy(&v, x, sizeof v);
    return v;
}

FT_SQ_ALWAYS void ft_sq_init(ft_sq *s) {
    const ft_sq_v4d zero = {0.0, 0.0, 0.0, 0.0};
    s->a0 = s->a1 = s->a2 = s->a3 = zero;
}

#define FT_SQ_CHUNKS(T, SUF)                                                                    \
FT_SQ_ALWAYS void ft_sq_chunks_##SUF(ft_sq *s, const T *x, int64_t n) {                         \
    ft_sq_v4d a0 = s->a0, a1 = s->a1, a2 = s->a2, a3 = s->a3;                                   \
    for (int64_t i = 0; i + 16 <= n; i += 16) {                                                 \
        const ft_sq_v4d u0 = ft_sq_load_##SUF(x + i), u1 = ft_sq_load_##SUF(x + i + 4),         \
                        w0 = ft_sq_load_##SUF(x + i + 8), w1 = ft_sq_load_##SUF(x + i + 12);    \
        a0 = FT_SQ_VFMA(u0, u0, a0); a1 = FT_SQ_VFMA(u1, u1, a1);                               \
        a2 = FT_SQ_VFMA(w0, w0, a2); a3 = FT_SQ_VFMA(w1, w1, a3);                               \
    }                                                                                           \
    s->a0 = a0; s->a1 = a1; s->a2 = a2; s->a3 = a3;                                             \
}
FT_SQ_CHUNKS(float, f32)
FT_SQ_CHUNKS(double, f64)

FT_SQ_ALWAYS double ft_sq_total(const ft_sq *s) {
    const ft_sq_v4d l = (s->a0 + s->a1) + (s->a2 + s->a3);
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
/* v with its NaNs made +0: the bits ANDed with the mask of v == v */
#define FT_SQ_NZ(v) ((ft_sq_v4d)((ft_sq_v4l)(v) & (ft_sq_v4l)((v) == (v))))

/* One chunk's four vectors of squares added to s's lanes and their NaN-zeroed ones to z's. */
FT_SQ_ALWAYS void ft_sq2_add(ft_sq *s, ft_sq *z, ft_sq_v4d u0, ft_sq_v4d u1, ft_sq_v4d w0,
                             ft_sq_v4d w1) {
    s->a0 = FT_SQ_VFMA(u0, u0, s->a0); s->a1 = FT_SQ_VFMA(u1, u1, s->a1);
    s->a2 = FT_SQ_VFMA(w0, w0, s->a2); s->a3 = FT_SQ_VFMA(w1, w1, s->a3);
    u0 = FT_SQ_NZ(u0); u1 = FT_SQ_NZ(u1); w0 = FT_SQ_NZ(w0); w1 = FT_SQ_NZ(w1);
    z->a0 = FT_SQ_VFMA(u0, u0, z->a0); z->a1 = FT_SQ_VFMA(u1, u1, z->a1);
    z->a2 = FT_SQ_VFMA(w0, w0, z->a2); z->a3 = FT_SQ_VFMA(w1, w1, z->a3);
}

#define FT_SQ2_CHUNKS(T, SUF)                                                                   \
FT_SQ_ALWAYS void ft_sq2_chunks_##SUF(ft_sq *s, ft_sq *z, const T *x, int64_t n) {              \
    ft_sq a = *s, b = *z; /* (locals: the accumulators stay in registers) */                   \
    for (int64_t i = 0; i + 16 <= n; i += 16)                                                   \
        ft_sq2_add(&a, &b, ft_sq_load_##SUF(x + i), ft_sq_load_##SUF(x + i + 4),                \
                   ft_sq_load_##SUF(x + i + 8), ft_sq_load_##SUF(x + i + 12));                  \
    *s = a; *z = b;                                                                             \
}
FT_SQ2_CHUNKS(float, f32)
FT_SQ2_CHUNKS(double, f64)
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
