/* The fused optimizer rules for float32 rows: one implementation, used by every tier layout.
 *
 * A stored row is [weights (dim) | state]; `rows` holds n such rows of `width` floats each,
 * C-contiguous. Each rule updates a row in place from its (already summed) gradient, with
 * exactly the float32 operations of the numpy rules in embstore/_optim_rules.py, in the same
 * order, each rounded once: built with -ffp-contract=off and without -ffast-math, so no
 * multiply-add is fused and nothing is reassociated, and the results are the same bits on
 * every machine (and the same as the numpy rules, which the tests check).
 *
 * Row mean of row-wise Adagrad: sum(g*g) over the row is added in numpy's pairwise order
 * (what np.add.reduce does along a contiguous row): rows shorter than 8 left to right from
 * -0.0; up to 128 elements in 8 interleaved partial sums r[k] += a[i+k], combined as
 * ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the tail left to right; longer rows split in two
 * halves (the first a multiple of 8 long) summed recursively and added. Then sum / dim.
 *
 * The row loops are built twice, for AVX2 and for the baseline instruction set, and chosen at
 * load time (target_clones): wider vectors of the same element-wise operations and the same
 * pairwise order give the same bits (the tests compare them with the numpy rules), and the
 * step of 10M x 64 rows runs 5-8% faster.
 *
 * Every entry point returns the index of the first row whose result holds a NaN or an
 * infinity (weights or state), or -1; the caller decides whether that is an error (it writes
 * nothing back then).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

enum { RULE_SGD = 0, RULE_ADAGRAD = 1, RULE_ROWWISE_ADAGRAD = 2 };
enum { DECAY_NONE = 0, DECAY_L2 = 1, DECAY_DECOUPLED = 2 };

/* The row sum is built into each clone of its callers: the block (the whole row up to 128
 * elements) inlined, longer rows through a recursion cloned for AVX2 too. Called as a function
 * built for the baseline instruction set, from the AVX2 clones and without a vzeroupper, it
 * paid an SSE/AVX transition on every row (a dim-64 row-wise Adagrad step took 160 ns in
 * cache); through the clones' dispatch it paid a call (40 ns at dim 16); inlined, 13-24 ns at
 * dims 16-64. */
static inline __attribute__((always_inline)) float pairwise_block(const float *a, int64_t n) {
    if (n < 8) {
        float res = -0.0f;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    float r[8];
    int64_t i;
    for (int k = 0; k < 8; k++) r[k] = a[k];
    for (i = 8; i < n - (n % 8); i += 8)
        for (int k = 0; k < 8; k++) r[k] += a[i + k];
    float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) res += a[i];
    return res;
}

__attribute__((target_clones("avx2", "default")))
static float pairwise_long(const float *a, int64_t n) {
    if (n <= 128) return pairwise_block(a, n);
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_long(a, n2) + pairwise_long(a + n2, n - n2);
}

static inline __attribute__((always_inline)) float pairwise_sum(const float *a, int64_t n) {
    return n <= 128 ? pairwise_block(a, n) : pairwise_long(a, n);
}

static inline int all_finite(const float *x, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        bad |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u);
    }
    return !bad;
}

/* 1 when none of the n floats is a NaN or an infinity: the input check of every write,
 * without numpy's temporary bool array */
int values_finite_f32(const float *x, int64_t n) {
    return all_finite(x, n);
}

/* scratch: at least dim floats */
static inline void step_row(int rule, int decay, float lr, float eps, float wd, float *w,
                            const float *g, int64_t dim, float *scratch) {
    switch (rule) {
    case RULE_SGD:
        if (decay) {
            for (int64_t c = 0; c < dim; c++) {
                float d = g[c] + wd * w[c];
                w[c] = w[c] - lr * d;
            }
        } else {
            for (int64_t c = 0; c < dim; c++) w[c] = w[c] - lr * g[c];
        }
        break;
    case RULE_ADAGRAD: {
        float *acc = w + dim;
        for (int64_t c = 0; c < dim; c++) {
            float d = decay ? g[c] + wd * w[c] : g[c];
            float a = acc[c] + d * d;
            acc[c] = a;
            float std = sqrtf(a) + eps;
            float u = (d * lr) / std;
            w[c] = w[c] - u;
        }
        break;
    }
    case RULE_ROWWISE_ADAGRAD: {
        float *acc = w + dim;
        if (decay == DECAY_L2) {
            for (int64_t c = 0; c < dim; c++) {
                float d = g[c] + wd * w[c];
                scratch[c] = d * d;
            }
        } else {
            for (int64_t c = 0; c < dim; c++) scratch[c] = g[c] * g[c];
        }
        float mean = pairwise_sum(scratch, dim) / (float)dim;
        float a = acc[0] + mean;
        acc[0] = a;
        float m = lr / (sqrtf(a) + eps);
        if (decay == DECAY_L2) {
            float corr = 1.0f - m * wd;
            for (int64_t c = 0; c < dim; c++) w[c] = w[c] * corr - g[c] * m;
        } else if (decay == DECAY_DECOUPLED) {
            float corr = 1.0f - lr * wd;
            for (int64_t c = 0; c < dim; c++) w[c] = w[c] * corr - g[c] * m;
        } else {
            for (int64_t c = 0; c < dim; c++) w[c] = w[c] - g[c] * m;
        }
        break;
    }
    }
}

/* Rows in place: rows[n, width] (weights then state), grads[n, dim]. */
__attribute__((target_clones("avx2", "default")))
int64_t optim_step_f32(int rule, int decay, float lr, float eps, float wd, float *rows,
                       int64_t width, const float *grads, int64_t n, int64_t dim,
                       float *scratch) {
    int64_t first_bad = -1;
    for (int64_t j = 0; j < n; j++) {
        float *w = rows + j * width;
        step_row(rule, decay, lr, eps, wd, w, grads + j * dim, dim, scratch);
        if (first_bad < 0 && !all_finite(w, width)) first_bad = j;
    }
    return first_bad;
}

/* Rows are prefetched ROW_AHEAD rows on, so that their cache misses overlap. */
#define ROW_AHEAD 8

/* Ranges at least this long are stepped in ascending slot order (see below); shorter ones
 * in the order given, where the rows are few enough to stay in cache anyway. */
#define SORT_MIN_ROWS 2048
#define DIGIT_BITS 12

static inline float *slot_row(char *const *slabs, int shift, uint64_t chunk_mask,
                              int64_t row_bytes, int32_t slot) {
    uint64_t v = (uint64_t)slot;
    return (float *)(slabs[v >> shift] + (v & chunk_mask) * row_bytes);
}

static inline void prefetch_for_write(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 1);
    __builtin_prefetch(p + bytes - 1, 1);
}

/* order[k] = position of the k-th smallest of n slots (each >= 0): LSD radix sort, 12 bits
 * a pass (two passes below 2**24 slots), passes over digits every slot shares skipped;
 * `scratch`: n int64. */
static void order_by_slot(const int32_t *slots, int64_t n, int64_t *order, int64_t *scratch) {
    int64_t *src = order, *dst = scratch;
    uint32_t all_or = 0;
    for (int64_t j = 0; j < n; j++) {
        src[j] = j;
        all_or |= (uint32_t)slots[j];
    }
    const uint32_t digit_mask = (1u << DIGIT_BITS) - 1;
    for (int shift = 0; shift < 32 && (all_or >> shift); shift += DIGIT_BITS) {
        int64_t count[(1 << DIGIT_BITS) + 1];
        memset(count, 0, sizeof(count));
        for (int64_t j = 0; j < n; j++) count[(((uint32_t)slots[j] >> shift) & digit_mask) + 1]++;
        if (count[(((uint32_t)slots[0] >> shift) & digit_mask) + 1] == n) continue;
        for (int d = 0; d < (1 << DIGIT_BITS); d++) count[d + 1] += count[d];
        for (int64_t j = 0; j < n; j++) {
            int64_t k = src[j];
            dst[count[((uint32_t)slots[k] >> shift) & digit_mask]++] = k;
        }
        int64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != order) memcpy(order, src, (size_t)n * sizeof(int64_t));
}

/* Step the rows at `slots` (distinct) of chunked slabs in place, in one pass, rows
 * prefetched ROW_AHEAD on. Where `preimage` is not NULL each row is first copied there
 * ([n, width]), and at the first row whose result is not finite every row stepped so far is
 * restored from it and the pass stops: the slabs are then as before the call. Returns the
 * first row (lowest index) whose result is not finite, or -1.
 *
 * Where `order` is not NULL (2n int64 of scratch) and the range is long, the rows are stepped
 * in ascending slot order, and preimage row k is then the row at slots[order[k]] (order[k] =
 * k otherwise). Rows spread at random over a table larger than the caches each cost a cache
 * miss and a TLB miss; in address order the page-table walks share their cache lines: the
 * step of 82k rows of a 10M x 64 table took 180 ns a row at random and 135-145 in slot
 * order, the sort included, on one or two threads. Distinct rows are independent, so the
 * order changes no result. A pass that meets a result that is not finite puts its rows
 * back and steps them again in the given order, to stop at the lowest such row. */
__attribute__((target_clones("avx2", "default")))
int64_t optim_step_slots_f32(int rule, int decay, float lr, float eps, float wd,
                             char *const *slabs, int shift, const int32_t *slots,
                             int64_t width, const float *grads, int64_t n, int64_t dim,
                             float *preimage, int64_t *order, float *scratch) {
    const uint64_t chunk_mask = ((uint64_t)1 << shift) - 1;
    const int64_t row_bytes = width * (int64_t)sizeof(float);
    int64_t first_bad = -1;
    if (order && n >= SORT_MIN_ROWS) {
        order_by_slot(slots, n, order, order + n);
        int64_t k = 0;
        for (; k < n; k++) {
            if (k + ROW_AHEAD < n) {
                int64_t ahead = order[k + ROW_AHEAD];
                prefetch_for_write((const char *)slot_row(slabs, shift, chunk_mask, row_bytes,
                                                          slots[ahead]), row_bytes);
                const char *g = (const char *)(grads + ahead * dim);
                for (int64_t off = 0; off < dim * (int64_t)sizeof(float); off += 64)
                    __builtin_prefetch(g + off);
            }
            int64_t j = order[k];
            float *w = slot_row(slabs, shift, chunk_mask, row_bytes, slots[j]);
            if (preimage) memcpy(preimage + k * width, w, row_bytes);
            step_row(rule, decay, lr, eps, wd, w, grads + j * dim, dim, scratch);
            if (!all_finite(w, width)) {
                if (!preimage) {
                    if (first_bad < 0 || j < first_bad) first_bad = j;
                    continue;
                }
                for (int64_t i = 0; i <= k; i++)
                    memcpy(slot_row(slabs, shift, chunk_mask, row_bytes, slots[order[i]]),
                           preimage + i * width, row_bytes);
                break;
            }
        }
        if (k == n) return first_bad;
    }
    if (order)
        for (int64_t j = 0; j < n; j++) order[j] = j;
    for (int64_t j = 0; j < n; j++) {
        if (j + ROW_AHEAD < n)
            prefetch_for_write((const char *)slot_row(slabs, shift, chunk_mask, row_bytes,
                                                      slots[j + ROW_AHEAD]), row_bytes);
        float *w = slot_row(slabs, shift, chunk_mask, row_bytes, slots[j]);
        if (preimage) memcpy(preimage + j * width, w, row_bytes);
        step_row(rule, decay, lr, eps, wd, w, grads + j * dim, dim, scratch);
        if (first_bad < 0 && !all_finite(w, width)) {
            first_bad = j;
            if (preimage) {
                for (int64_t k = 0; k <= j; k++)
                    memcpy(slot_row(slabs, shift, chunk_mask, row_bytes, slots[k]),
                           preimage + k * width, row_bytes);
                return first_bad;
            }
        }
    }
    return first_bad;
}

/* Whether `slots` (n of them, each < 64 * words) are distinct: a bit per slot in `bits`
 * (all zero on entry and again on return). Cheaper than grouping the ids by hash when, as
 * usual, the caller passes each id once: the bitmap of a 10M-row table is 1.25 MB. */
int slots_distinct(const int32_t *slots, int64_t n, uint64_t *bits) {
    int64_t j = 0;
    int distinct = 1;
    for (; j < n; j++) {
        uint32_t s = (uint32_t)slots[j];
        uint64_t mask = (uint64_t)1 << (s & 63);
        if (bits[s >> 6] & mask) { distinct = 0; break; }
        bits[s >> 6] |= mask;
    }
    for (int64_t k = 0; k < j; k++) bits[(uint32_t)slots[k] >> 6] = 0;
    return distinct;
}
