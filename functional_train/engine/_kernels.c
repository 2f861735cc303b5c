/* Per-tensor sums of squares in float64 for the global norm of a gradient clip (ft_sumsq):
 * out[k] = sum over i of ptr[k][i]^2, in the order ``_sumsq.h`` defines (which depends only
 * on the tensor's length, so a leaf's sum is the same wherever it lies in memory).
 *
 * Part of functional_train (engine/native.py compiles this file, with ``_sumsq.h``, on first
 * use and calls it through ctypes).
 */
#include "_sumsq.h" /* (native.py puts the header's text here) */

#define FT_DEFINE_SUMSQ(T, SUF)                                                                 \
void ft_sumsq_##SUF(int64_t leaves, const T *const *ptr, const int64_t *numel, double *out) {  \
    for (int64_t k = 0; k < leaves; k++) {                                                      \
        const int64_t n = numel[k];                                                             \
        ft_sq s;                                                                                \
        ft_sq_init(&s);                                                                         \
        ft_sq_chunks_##SUF(&s, ptr[k], n);                                                      \
        out[k] = ft_sq_end_##SUF(&s, ptr[k] + (n & ~(int64_t)15), n & 15);                      \
    }                                                                                           \
}
FT_DEFINE_SUMSQ(float, f32)
FT_DEFINE_SUMSQ(double, f64)

/* ft_sumsq's sums (out) and, in the same read, those with every NaN taken as zero (zeroed):
 * the sums of squares of zero_nans' results, bit for bit those of the results themselves. */
#define FT_DEFINE_SUMSQ2(T, SUF)                                                                \
void ft_sumsq2_##SUF(int64_t leaves, const T *const *ptr, const int64_t *numel, double *out,   \
                     double *zeroed) {                                                          \
    for (int64_t k = 0; k < leaves; k++) {                                                      \
        const int64_t n = numel[k];                                                             \
        const T *rest = ptr[k] + (n & ~(int64_t)15);                                            \
        ft_sq s, z;                                                                             \
        ft_sq_init(&s);                                                                         \
        ft_sq_init(&z);                                                                         \
        ft_sq2_chunks_##SUF(&s, &z, ptr[k], n);                                                 \
        out[k] = ft_sq_end_##SUF(&s, rest, n & 15);                                             \
        zeroed[k] = ft_sq_end_nz_##SUF(&z, rest, n & 15);                                       \
    }                                                                                           \
}
FT_DEFINE_SUMSQ2(float, f32)
FT_DEFINE_SUMSQ2(double, f64)

/* The ABI version engine/native.py checks. */
int ft_version(void) { return 7; }
