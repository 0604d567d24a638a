/* Gradients of pooled embedding bags, summed per distinct row, for the torch adapter.
 *
 * For every position k of bag b (offsets[b] <= k < offsets[b + 1]) whose distinct row is
 * r = inverse[k], the position's gradient is
 *
 *     p = grad[b]            (one row of the pooled gradient, dim floats)
 *     p = p * weights[k]     (per-sample weights, "sum" pooling)
 *     p = p / bag_size[b]    ("mean" pooling)
 *
 * and out[r] is the float32 sum of its positions' gradients in position order, starting from
 * +0.0 (or, to add a table's next feature, from out[r] as it stands). That is the same sum,
 * in the same order, as materialising every position's gradient and summing the rows of each
 * id in position order (IdGroups.sum_rows), without the [N, dim] intermediate. Positions whose
 * row is `skip` (the padding id's) contribute nothing. Compiled in ISO C mode: no contraction
 * of a*b+c into an FMA, so results do not depend on the CPU.
 *
 * Two steps: `bag_group` lists each row's positions (a counting sort: `start` [nrows + 1],
 * `order` [n]) and each position's bag; `bag_grad_rows` then sums rows [lo, hi) each in a
 * scratch row and writes it once. Ranges of rows are independent, so they run on threads,
 * and no row of `out` is read before it is written (no zeroed [nrows, dim] buffer, no
 * scattered read-modify-write of it).
 */
#include <stdint.h>
#include <string.h>

void bag_group(const int64_t *offsets, int64_t nbags, const int64_t *inverse, int64_t nrows,
               int64_t *start, int64_t *order, int32_t *bag_of) {
    int64_t n = offsets[nbags];
    memset(start, 0, (size_t)(nrows + 1) * sizeof(int64_t));
    for (int64_t k = 0; k < n; k++) start[inverse[k] + 1]++;
    for (int64_t r = 0; r < nrows; r++) start[r + 1] += start[r];
    for (int64_t b = 0; b < nbags; b++)
        for (int64_t k = offsets[b]; k < offsets[b + 1]; k++) {
            bag_of[k] = (int32_t)b;
            order[start[inverse[k]]++] = k;  /* ascending k within each row */
        }
    /* each start[r] now holds the end of row r: shift back */
    for (int64_t r = nrows; r > 0; r--) start[r] = start[r - 1];
    start[0] = 0;
}

/* Returns 1 where every element written is finite. `acc`: dim floats of scratch. */
__attribute__((target_clones("avx2", "default")))  /* the same sums, wider vectors */
int bag_grad_rows(const float *grad, int64_t dim, const int64_t *start, const int64_t *order,
                  const int32_t *bag_of, const float *weights, const float *bag_size,
                  int64_t skip, int accumulate, int64_t lo, int64_t hi, float *acc,
                  float *out) {
    uint32_t bad = 0;
    for (int64_t r = lo; r < hi; r++) {
        float *dst = out + r * dim;
        if (accumulate) memcpy(acc, dst, (size_t)dim * sizeof(float));
        else for (int64_t c = 0; c < dim; c++) acc[c] = 0.0f;
        if (r != skip) {
            for (int64_t j = start[r]; j < start[r + 1]; j++) {
                int64_t k = order[j];
                int32_t b = bag_of[k];
                const float *g = grad + (int64_t)b * dim;
                if (weights) {
                    float w = weights[k];
                    for (int64_t c = 0; c < dim; c++) acc[c] += g[c] * w;
                } else if (bag_size) {
                    float s = bag_size[b];
                    for (int64_t c = 0; c < dim; c++) acc[c] += g[c] / s;
                } else {
                    for (int64_t c = 0; c < dim; c++) acc[c] += g[c];
                }
            }
        }
        for (int64_t c = 0; c < dim; c++) {
            uint32_t bits;
            memcpy(&bits, &acc[c], 4);
            bad |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u);
        }
        memcpy(dst, acc, (size_t)dim * sizeof(float));
    }
    return !bad;
}

/* Rows are prefetched POOL_AHEAD positions on, so that their cache misses overlap. */
#define POOL_AHEAD 8
/* Columns summed at a time in a local accumulator (four AVX2 registers). */
#define POOL_COLUMNS 32

/* Sum pooling straight from a DRAM tier's slabs: out[b] (b in [lo, hi)) is the float32 sum,
 * in position order from +0.0, of the rows at slots[inverse[k]] for the positions k of bag b;
 * rows are `row_bytes` apart in chunks of 2**shift (the optimizer state after the first `dim`
 * floats is not read). The same additions in the same order as torch.embedding_bag's "sum"
 * over a gathered copy of the rows, without the copy. */
__attribute__((target_clones("avx2", "default")))
void bag_pool_slots_f32(char *const *slabs, int shift, int64_t row_bytes, const int32_t *slots,
                        const int64_t *offsets, const int64_t *inverse, int64_t dim,
                        int64_t lo, int64_t hi, float *out) {
    const uint64_t chunk_mask = ((uint64_t)1 << shift) - 1;
    const int64_t end = offsets[hi];
    const int64_t bytes = dim * (int64_t)sizeof(float);
    float acc[POOL_COLUMNS];
    for (int64_t b = lo; b < hi; b++) {
        for (int64_t c0 = 0; c0 < dim; c0 += POOL_COLUMNS) {
            const int64_t w = dim - c0 < POOL_COLUMNS ? dim - c0 : POOL_COLUMNS;
            for (int64_t c = 0; c < POOL_COLUMNS; c++) acc[c] = 0.0f;
            for (int64_t k = offsets[b]; k < offsets[b + 1]; k++) {
                if (c0 == 0 && k + POOL_AHEAD < end) {
                    uint64_t a = (uint64_t)slots[inverse[k + POOL_AHEAD]];
                    const char *p = slabs[a >> shift] + (a & chunk_mask) * row_bytes;
                    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
                    __builtin_prefetch(p + bytes - 1);
                }
                uint64_t v = (uint64_t)slots[inverse[k]];
                const float *row = (const float *)(slabs[v >> shift] + (v & chunk_mask) * row_bytes)
                                   + c0;
                if (w == POOL_COLUMNS) {  /* a constant count: the sums stay in registers */
                    for (int64_t c = 0; c < POOL_COLUMNS; c++) acc[c] += row[c];
                } else {
                    for (int64_t c = 0; c < w; c++) acc[c] += row[c];
                }
            }
            memcpy(out + b * dim + c0, acc, (size_t)w * sizeof(float));
        }
    }
}
