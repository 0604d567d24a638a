/* Gradients of pooled embedding bags, summed per distinct row, for the torch adapter.
 *
 * For every position k of bag b (offsets[b] <= k < offsets[b + 1]) whose distinct row is
 * r = inverse[k], add the position's gradient to out[r]:
 *
 *     p = grad[b]            (one row of the pooled gradient, dim floats)
 *     p = p * weights[k]     (per-sample weights, "sum" pooling)
 *     p = p / bag_size[b]    ("mean" pooling)
 *     out[r] += p
 *
 * Positions are visited in order and `out` starts at zero, so each element is the same
 * float32 sum, in the same order, as materialising every position's gradient and summing the
 * rows of each id in position order (IdGroups.sum_rows), without the [N, dim] intermediate.
 * Positions whose row is `skip` (the padding id's) contribute nothing. Compiled in ISO C mode:
 * no contraction of a*b+c into an FMA, so results do not depend on the CPU.
 */
#include <stdint.h>

__attribute__((target_clones("avx2", "default")))  /* the same sums, wider vectors */
void bag_grad_f32(const float *grad, int64_t dim, const int64_t *offsets, int64_t nbags,
                  const int64_t *inverse, const float *weights, const float *bag_size,
                  int64_t skip, float *out) {
    for (int64_t b = 0; b < nbags; b++) {
        const float *g = grad + b * dim;
        for (int64_t k = offsets[b]; k < offsets[b + 1]; k++) {
            int64_t r = inverse[k];
            if (r == skip) continue;
            float *dst = out + r * dim;
            if (weights) {
                float w = weights[k];
                for (int64_t c = 0; c < dim; c++) dst[c] += g[c] * w;
            } else if (bag_size) {
                float s = bag_size[b];
                for (int64_t c = 0; c < dim; c++) dst[c] += g[c] / s;
            } else {
                for (int64_t c = 0; c < dim; c++) dst[c] += g[c];
            }
        }
    }
}
