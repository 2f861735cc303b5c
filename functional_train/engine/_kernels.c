/* Per-tensor sums of squares in float64 for the global norm of a gradient clip (ft_sumsq):
 * out[k] = sum over i of ptr[k][i]^2, in the order ``_sumsq.h`` defines (which depends only
 * on the tensor's length, so a leaf's sum is the same wherever it lies in memory).
 *
 * Part of functional_train (engine/native.py compiles this file, with ``_sumsq.h``, on first
 * use and calls it through ctypes).
 */
#include "_sumsq.h" /* (native.py puts the header's text here) */

void ft_sumsq_f32(int64_t leaves, const float *const *ptr, const int64_t *numel, double *out) {
    for (int64_t k = 0; k < leaves; k++) {
        const int64_t n = numel[k];
        ft_sq s;
        ft_sq_init(&s);
        ft_sq_chunks_f32(&s, ptr[k], n);
        out[k] = ft_sq_end_f32(&s, ptr[k] + (n & ~(int64_t)15), n & 15);
    }
}

void ft_sumsq_f64(int64_t leaves, const double *const *ptr, const int64_t *numel, double *out) {
    for (int64_t k = 0; k < leaves; k++) {
        const int64_t n = numel[k];
        ft_sq s;
        ft_sq_init(&s);
        ft_sq_chunks_f64(&s, ptr[k], n);
        out[k] = ft_sq_end_f64(&s, ptr[k] + (n & ~(int64_t)15), n & 15);
    }
}

/* The ABI version engine/native.py checks. */
int ft_version(void) { return 6; }
