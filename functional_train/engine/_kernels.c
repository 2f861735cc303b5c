/* Out-of-place Adam / AdamW and SGD steps for float32 and float64 CPU tensors, with
 * non-temporal ("streaming") stores for the results; and per-tensor sums of squares in
 * float64 for the global norm of a gradient clip (ft_sumsq, at the end).
 *
 * Part of functional_train (engine/native.py compiles this file on first use and calls it
 * through ctypes). A pure optimizer step writes its new parameters and moments into fresh
 * buffers; ordinary stores first read each destination cache line from memory (write
 * allocate), which costs a pure step about as much memory traffic as the update itself. The
 * x86 streaming stores (_mm256_stream_ps / _pd) write whole lines without reading them.
 *
 * The arithmetic is the primitives' (functional_train's scale_by_adam, add_decayed_weights,
 * trace and the learning rate) in the leaves' dtype, with float32 scalars for float32 leaves,
 * each product-and-sum rounded once where the CPU has fused multiply-add: the lerp of the
 * first moment, the second moment's update, the denominator, the decay and the parameter's
 * update; the bias corrections are reciprocals applied by multiplication. That costs one
 * division and one square root per element (the primitives' order costs three divisions),
 * about what torch's own fused kernel costs.
 *
 * With AVX2 and FMA the body runs on 256-bit vectors (on CPUs with AVX-512 too: memory-bound
 * loops run no faster on 512-bit ones, and some CPUs lower their clock for them), its results
 * streamed when asked and every result of the leaf starts on a 32-byte boundary, stored
 * otherwise; the remainder, and everything elsewhere, runs a scalar loop of the same correctly
 * rounded operations (fma, sqrt, division), so every element gets the same bits wherever it
 * falls and a slice of a leaf computes what the whole leaf computes. Compile without
 * floating-point contraction (-ffp-contract=off): the fused multiply-adds are the explicit
 * ones.
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#else
#define VECTOR 0
#endif

#define ALWAYS static inline __attribute__((always_inline))
/* leaf k's pointer of role j (NULL where the role's array is) */
#define Q(j) (ptr[j] ? ptr[j][k] : 0)

#if defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
#define FMA_f32(a, b, c) __builtin_fmaf(a, b, c)
#define FMA_f64(a, b, c) __builtin_fma(a, b, c)
#else  /* no fused multiply-add instruction: a product and a sum, each rounded */
#define FMA_f32(a, b, c) ((a) * (b) + (c))
#define FMA_f64(a, b, c) ((a) * (b) + (c))
#endif
#define SQRT_f32 __builtin_sqrtf
#define SQRT_f64 __builtin_sqrt

/* torch.maximum: NaN if either is NaN (a if both). */
#define MAXIMUM(a, b) ((a) != (a) ? (a) : ((b) != (b) ? (b) : ((a) > (b) ? (a) : (b))))

ALWAYS int aligned32(const void *x) { return x == 0 || ((uintptr_t)x & 31) == 0; }

/* The 256-bit vector operations, by element type. */
#if VECTOR
#define W_f32 8
#define W_f64 4
#define V_f32 __m256
#define V_f64 __m256d
#define SET1_f32 _mm256_set1_ps
#define SET1_f64 _mm256_set1_pd
#define LOAD_f32 _mm256_loadu_ps
#define LOAD_f64 _mm256_loadu_pd
#define STORE_f32 _mm256_storeu_ps
#define STORE_f64 _mm256_storeu_pd
#define STREAM_f32 _mm256_stream_ps
#define STREAM_f64 _mm256_stream_pd
#define ADD_f32 _mm256_add_ps
#define ADD_f64 _mm256_add_pd
#define SUB_f32 _mm256_sub_ps
#define SUB_f64 _mm256_sub_pd
#define MUL_f32 _mm256_mul_ps
#define MUL_f64 _mm256_mul_pd
#define DIV_f32 _mm256_div_ps
#define DIV_f64 _mm256_div_pd
#define VSQRT_f32 _mm256_sqrt_ps
#define VSQRT_f64 _mm256_sqrt_pd
#define VFMA_f32 _mm256_fmadd_ps
#define VFMA_f64 _mm256_fmadd_pd
/* maximum(a, b) as MAXIMUM: max returns b where either is NaN (or both are zeros), then a
 * where a is NaN */
#define VMAX_f32(a, b) _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q))
#define VMAX_f64(a, b) _mm256_blendv_pd(_mm256_max_pd(a, b), a, _mm256_cmp_pd(a, a, _CMP_UNORD_Q))
#define PUT(SUF, dst, x) do { if (stream) STREAM_##SUF(dst, x); else STORE_##SUF(dst, x); } while (0)
#endif

/* One Adam leaf. s: coef, weight_decay, 1 - b1, b2, 1 - b2, eps, 1 / (1 - b1^t),
 * 1 / sqrt(1 - b2^t), lr, where coef is the clip factor (1 without a clip), negated for
 * maximize. Flags: scaled (coef is not 1), l2 (weight decay into the gradient), dec (decoupled
 * weight decay into the update), ams (amsgrad: nm, onm the running maximum). */
#define ADAM_SCALAR(T, SUF)                                                                     \
    for (; i < n; i++) {                                                                        \
        T gi = scaled ? g[i] * coef : g[i];                                                     \
        if (l2) gi = FMA_##SUF(wd, p[i], gi);                                                   \
        const T m2 = FMA_##SUF(omb1, gi - m[i], m[i]);                                          \
        const T v2 = FMA_##SUF(omb2, gi * gi, v[i] * b2);                                       \
        T d = v2;                                                                               \
        if (ams) { d = MAXIMUM(nm[i], v2); }                                                    \
        T o = m2 / FMA_##SUF(SQRT_##SUF(d), ibc2, eps) * ibc1;                                  \
        if (dec) o = FMA_##SUF(wd, p[i], o);                                                    \
        const T p2 = FMA_##SUF(nlr, o, p[i]);                                                   \
        op[i] = p2;                                                                             \
        om[i] = m2;                                                                             \
        ov[i] = v2;                                                                             \
        if (ams) onm[i] = d;                                                                    \
    }

#if VECTOR
#define ADAM_VECTOR(T, SUF)                                                                     \
    {                                                                                           \
        const V_##SUF vcoef = SET1_##SUF(coef), vwd = SET1_##SUF(wd), vomb1 = SET1_##SUF(omb1), \
            vb2 = SET1_##SUF(b2), vomb2 = SET1_##SUF(omb2), veps = SET1_##SUF(eps),             \
            vibc1 = SET1_##SUF(ibc1), vibc2 = SET1_##SUF(ibc2), vnlr = SET1_##SUF(nlr);         \
        stream = stream && aligned32(op) && aligned32(om) && aligned32(ov) && aligned32(onm);   \
        for (; i + W_##SUF <= n; i += W_##SUF) {                                                \
            const V_##SUF pi = LOAD_##SUF(p + i), mi = LOAD_##SUF(m + i);                       \
            V_##SUF gi = LOAD_##SUF(g + i);                                                     \
            if (scaled) gi = MUL_##SUF(gi, vcoef);                                              \
            if (l2) gi = VFMA_##SUF(vwd, pi, gi);                                               \
            const V_##SUF m2 = VFMA_##SUF(vomb1, SUB_##SUF(gi, mi), mi);                        \
            const V_##SUF v2 = VFMA_##SUF(vomb2, MUL_##SUF(gi, gi),                             \
                                          MUL_##SUF(LOAD_##SUF(v + i), vb2));                   \
            V_##SUF d = v2;                                                                     \
            if (ams) d = VMAX_##SUF(LOAD_##SUF(nm + i), v2);                                    \
            V_##SUF o = MUL_##SUF(DIV_##SUF(m2, VFMA_##SUF(VSQRT_##SUF(d), vibc2, veps)),       \
                                  vibc1);                                                       \
            if (dec) o = VFMA_##SUF(vwd, pi, o);                                                \
            PUT(SUF, op + i, VFMA_##SUF(vnlr, o, pi));                                          \
            PUT(SUF, om + i, m2);                                                               \
            PUT(SUF, ov + i, v2);                                                               \
            if (ams) PUT(SUF, onm + i, d);                                                      \
        }                                                                                       \
    }
#else
#define ADAM_VECTOR(T, SUF) (void)stream;
#endif

#define DEFINE_ADAM(T, SUF)                                                                     \
ALWAYS void adam_leaf_##SUF(int64_t n, const T *p, const T *g, const T *m, const T *v,          \
                            const T *nm, T *op, T *om, T *ov, T *onm, const T *s, int stream,  \
                            const int scaled, const int l2, const int dec, const int ams) {     \
    const T coef = s[0], wd = s[1], omb1 = s[2], b2 = s[3], omb2 = s[4], eps = s[5],           \
            ibc1 = s[6], ibc2 = s[7], nlr = -s[8];                                              \
    int64_t i = 0;                                                                              \
    ADAM_VECTOR(T, SUF)                                                                         \
    ADAM_SCALAR(T, SUF)                                                                         \
}                                                                                               \
/* ptr: 9 arrays of a pointer per leaf, p, g, m, v, nm, new p, new m, new v, new nm (NULL for  \
 * nm's without amsgrad). */                                                                    \
DEFINE_ENTRY(adam, T, SUF, ADAM_CALL)

#define ADAM_CALL(SUF, F)                                                                       \
    case F: adam_leaf_##SUF(numel[k], Q(0), Q(1), Q(2), Q(3), Q(4), Q(5), Q(6), Q(7), Q(8), s, \
                            stream, (F) & 1, (F) >> 1 & 1, (F) >> 2 & 1, (F) >> 3 & 1); break;
/* The exported ft_<NAME>_<SUF>(leaves, ptr, numel, s, flags, stream): each leaf through the
 * kernel's specialisation for its flags (CALL), then the fence. */
#define DEFINE_ENTRY(NAME, T, SUF, CALL)                                                        \
void ft_##NAME##_##SUF(int64_t leaves, void *const *const *ptr, const int64_t *numel,          \
                       const T *s, int flags, int stream) {                                     \
    for (int64_t k = 0; k < leaves; k++) {                                                      \
        switch (flags & 15) {                                                                   \
            CASES16(CALL, SUF)                                                                  \
        }                                                                                       \
    }                                                                                           \
    fence();                                                                                    \
}
#define CASES16(CALL, SUF) CALL(SUF, 0) CALL(SUF, 1) CALL(SUF, 2) CALL(SUF, 3) CALL(SUF, 4)     \
    CALL(SUF, 5) CALL(SUF, 6) CALL(SUF, 7) CALL(SUF, 8) CALL(SUF, 9) CALL(SUF, 10)             \
    CALL(SUF, 11) CALL(SUF, 12) CALL(SUF, 13) CALL(SUF, 14) CALL(SUF, 15)

/* One SGD leaf. s: coef (as Adam's), weight_decay, momentum, lr. Flags: scaled, l2 (weight
 * decay), mom (a momentum buffer: buf, obuf), nesterov. */
#define SGD_SCALAR(T, SUF)                                                                      \
    for (; i < n; i++) {                                                                        \
        T gi = scaled ? g[i] * coef : g[i];                                                     \
        if (l2) gi = FMA_##SUF(wd, p[i], gi);                                                   \
        if (mom) {                                                                              \
            const T b2 = FMA_##SUF(mu, buf[i], gi);                                             \
            obuf[i] = b2;                                                                       \
            gi = nesterov ? FMA_##SUF(mu, b2, gi) : b2;                                         \
        }                                                                                       \
        op[i] = FMA_##SUF(nlr, gi, p[i]);                                                       \
    }

#if VECTOR
#define SGD_VECTOR(T, SUF)                                                                      \
    {                                                                                           \
        const V_##SUF vcoef = SET1_##SUF(coef), vwd = SET1_##SUF(wd), vmu = SET1_##SUF(mu),     \
            vnlr = SET1_##SUF(nlr);                                                             \
        stream = stream && aligned32(op) && aligned32(obuf);                                    \
        for (; i + W_##SUF <= n; i += W_##SUF) {                                                \
            const V_##SUF pi = LOAD_##SUF(p + i);                                               \
            V_##SUF gi = LOAD_##SUF(g + i);                                                     \
            if (scaled) gi = MUL_##SUF(gi, vcoef);                                              \
            if (l2) gi = VFMA_##SUF(vwd, pi, gi);                                               \
            if (mom) {                                                                          \
                const V_##SUF b2 = VFMA_##SUF(vmu, LOAD_##SUF(buf + i), gi);                    \
                PUT(SUF, obuf + i, b2);                                                         \
                gi = nesterov ? VFMA_##SUF(vmu, b2, gi) : b2;                                   \
            }                                                                                   \
            PUT(SUF, op + i, VFMA_##SUF(vnlr, gi, pi));                                         \
        }                                                                                       \
    }
#else
#define SGD_VECTOR(T, SUF) (void)stream;
#endif

#define DEFINE_SGD(T, SUF)                                                                      \
ALWAYS void sgd_leaf_##SUF(int64_t n, const T *p, const T *g, const T *buf, T *op, T *obuf,     \
                           const T *s, int stream, const int scaled, const int l2,              \
                           const int mom, const int nesterov) {                                 \
    const T coef = s[0], wd = s[1], mu = s[2], nlr = -s[3];                                     \
    int64_t i = 0;                                                                              \
    SGD_VECTOR(T, SUF)                                                                          \
    SGD_SCALAR(T, SUF)                                                                          \
}                                                                                               \
/* ptr: 5 arrays of a pointer per leaf, p, g, buf, new p, new buf (NULL for buf's without      \
 * momentum). */                                                                                \
DEFINE_ENTRY(sgd, T, SUF, SGD_CALL)

#define SGD_CALL(SUF, F)                                                                        \
    case F: sgd_leaf_##SUF(numel[k], Q(0), Q(1), Q(2), Q(3), Q(4), s, stream, (F) & 1,          \
                           (F) >> 1 & 1, (F) >> 2 & 1, (F) >> 3 & 1); break;

/* Orders the streamed stores before whatever the caller does next (they are weakly ordered). */
static void fence(void) {
#if VECTOR
    _mm_sfence();
#endif
}

DEFINE_ADAM(float, f32)
DEFINE_ADAM(double, f64)
DEFINE_SGD(float, f32)
DEFINE_SGD(double, f64)

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
int ft_version(void) { return 5; }
