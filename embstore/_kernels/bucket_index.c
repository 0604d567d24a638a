/* The DRAM tier's id -> slot index: linear probing over cache-line buckets.
 *
 * Compiled after dram_index.c in the same module (it uses mix64). Layout: `nb` buckets of 64
 * bytes, each 5 int64 keys, 5 int32 values (slots) and 4 bytes of padding; the array is
 * 64-byte aligned, so a bucket is one cache line and a probe usually costs one miss (the
 * split keys[]/vals[] arrays of dram_index.c cost two). An entry is empty when its value is
 * -1. Entry position p = bucket * 5 + k; every id's probe starts at entry 0 of its home
 * bucket, home = (mix64(id) * nb) >> 64 (any nb, not only powers of two, so the load can be
 * held between 0.87 and 0.93: 12.8 bytes per entry, 13.8-14.7 bytes per id). Probing walks
 * positions cyclically until the id or an empty entry; deletion shifts later entries of the
 * cluster back (no tombstones), exactly as in dram_index.c but with bucket homes.
 */

#define BK 5

typedef struct {
    int64_t key[BK];
    int32_t val[BK];
    int32_t pad;
} bucket_t;

static inline uint64_t bk_home(int64_t id, uint64_t nb) {
    return (uint64_t)(((unsigned __int128)mix64((uint64_t)id) * nb) >> 64);
}

/* Slot of id, or -1, probing from its home bucket. */
static inline int32_t bk_find_one(const bucket_t *t, uint64_t nb, uint64_t home, int64_t id) {
    uint64_t b = home;
    for (;;) {
        const bucket_t *bk = &t[b];
        for (int k = 0; k < BK; k++) {
            int32_t v = bk->val[k];
            if (v < 0) return -1;
            if (bk->key[k] == id) return v;
        }
        b = b + 1 == nb ? 0 : b + 1;
    }
}

/* Probes ids in order, each id's home bucket prefetched BK_AHEAD ids before its probe. A
 * rolling distance keeps that many loads in flight all the time: blocks of 32 prefetched just
 * before they were probed left the block's first probes waiting for their buckets (on 10M
 * ids, 65K probes: 13-19 ns a probe, against 15-32 in blocks; in the training step of
 * `embstore bench torch`, 3.5-3.7 ms a step against 4.1-4.6, one thread). Comparing a
 * bucket's keys in one AVX2 instruction made the probe alone 2x faster but neither the step
 * nor a lookup measurably: the rows' misses dominate both. */
#define BK_AHEAD 16

int64_t bk_find(const bucket_t *t, uint64_t nb, const int64_t *ids, int64_t n,
                int32_t *out_slots) {
    int64_t found = 0;
    uint64_t home[BK_AHEAD];
    for (int64_t j = 0; j < n && j < BK_AHEAD; j++) {
        home[j] = bk_home(ids[j], nb);
        __builtin_prefetch(&t[home[j]]);
    }
    for (int64_t j = 0; j < n; j++) {
        uint64_t h = home[j % BK_AHEAD];
        if (j + BK_AHEAD < n) {
            uint64_t next = bk_home(ids[j + BK_AHEAD], nb);
            home[j % BK_AHEAD] = next;
            __builtin_prefetch(&t[next]);
        }
        int32_t v = bk_find_one(t, nb, h, ids[j]);
        out_slots[j] = v;
        found += v >= 0;
    }
    return found;
}

#define BK_BLOCK 32  /* ids per block of bk_insert's prefetches */

static inline void bk_put_one(bucket_t *t, uint64_t nb, int64_t id, int32_t slot) {
    uint64_t b = bk_home(id, nb);
    for (;;) {
        bucket_t *bk = &t[b];
        for (int k = 0; k < BK; k++) {
            if (bk->val[k] < 0) {
                bk->key[k] = id;
                bk->val[k] = slot;
                return;
            }
        }
        b = b + 1 == nb ? 0 : b + 1;
    }
}

/* Insert ids known to be absent and distinct. */
void bk_insert(bucket_t *t, uint64_t nb, const int64_t *ids, const int32_t *slots, int64_t n) {
    for (int64_t base = 0; base < n; base += BK_BLOCK) {
        int64_t m = n - base < BK_BLOCK ? n - base : BK_BLOCK;
        for (int64_t k = 0; k < m; k++) __builtin_prefetch(&t[bk_home(ids[base + k], nb)], 1);
        for (int64_t k = 0; k < m; k++) bk_put_one(t, nb, ids[base + k], slots[base + k]);
    }
}

/* Remove ids; out_slots[j] gets the freed slot or -1 if absent. Returns the number removed. */
int64_t bk_remove(bucket_t *t, uint64_t nb, const int64_t *ids, int64_t n, int32_t *out_slots) {
    const uint64_t cap = nb * BK;
    int64_t removed = 0;
    uint64_t home[BK_AHEAD];  /* home buckets prefetched ahead, as in bk_find */
    for (int64_t j = 0; j < n && j < BK_AHEAD; j++) {
        home[j] = bk_home(ids[j], nb);
        __builtin_prefetch(&t[home[j]], 1);
    }
    for (int64_t j = 0; j < n; j++) {
        uint64_t p = home[j % BK_AHEAD] * BK;
        if (j + BK_AHEAD < n) {
            home[j % BK_AHEAD] = bk_home(ids[j + BK_AHEAD], nb);
            __builtin_prefetch(&t[home[j % BK_AHEAD]], 1);
        }
        for (;;) {
            bucket_t *bk = &t[p / BK];
            int k = (int)(p % BK);
            if (bk->val[k] < 0) { p = cap; break; }
            if (bk->key[k] == ids[j]) break;
            p = p + 1 == cap ? 0 : p + 1;
        }
        if (p == cap) { out_slots[j] = -1; continue; }
        out_slots[j] = t[p / BK].val[p % BK];
        removed++;
        /* backward shift: an entry at q whose home entry h lies cyclically at or before the
         * hole moves into it (its probe from h passes the hole) */
        uint64_t hole = p, q = p;
        for (;;) {
            q = q + 1 == cap ? 0 : q + 1;
            bucket_t *bq = &t[q / BK];
            int kq = (int)(q % BK);
            if (bq->val[kq] < 0) break;
            uint64_t h = bk_home(bq->key[kq], nb) * BK;
            /* cyclic distances back from q, without a division */
            uint64_t dist_h = q >= h ? q - h : q + cap - h;
            uint64_t dist_hole = q >= hole ? q - hole : q + cap - hole;
            if (dist_h < dist_hole) continue;
            bucket_t *bh = &t[hole / BK];
            bh->key[hole % BK] = bq->key[kq];
            bh->val[hole % BK] = bq->val[kq];
            hole = q;
        }
        t[hole / BK].val[hole % BK] = -1;
    }
    return removed;
}

/* Move every live entry of an old table into an empty new one. */
void bk_rehash(const bucket_t *old, uint64_t old_nb, bucket_t *t, uint64_t nb) {
    for (uint64_t b = 0; b < old_nb; b++)
        for (int k = 0; k < BK; k++)
            if (old[b].val[k] >= 0) bk_put_one(t, nb, old[b].key[k], old[b].val[k]);
}

/* Live ids and their slots, in table order; returns the count written. */
int64_t bk_items(const bucket_t *t, uint64_t nb, int64_t *out_ids, int32_t *out_slots) {
    int64_t m = 0;
    for (uint64_t b = 0; b < nb; b++)
        for (int k = 0; k < BK; k++)
            if (t[b].val[k] >= 0) {
                out_ids[m] = t[b].key[k];
                out_slots[m] = t[b].val[k];
                m++;
            }
    return m;
}

/* idx_gather of dram_index.c over buckets, software-pipelined in blocks of ids: probe a block
 * (its buckets were prefetched one block earlier) and prefetch each found row; prefetch the
 * next block's buckets; then copy this block's rows (zeros where absent). The buckets' misses
 * so overlap the rows' (1.15-1.27x faster on Zipf batches, 1.06x uniform, than hashing and
 * prefetching a block's buckets only just before probing it). Each output row holds the first
 * `out_bytes` bytes of the stored row (all `row_bytes` of it, or the weights without the
 * optimizer state that follows them), so a reader of weights alone moves no state. */
int64_t bk_gather(const bucket_t *t, uint64_t nb, char *const *slabs, int shift,
                  int64_t row_bytes, int64_t out_bytes, const int64_t *ids, int64_t n,
                  char *out, uint8_t *found, int32_t *out_slots) {
    const uint64_t chunk_mask = ((uint64_t)1 << shift) - 1;
    int64_t hits = 0;
    uint64_t home[2][GATHER_BLOCK];
    const char *src[GATHER_BLOCK];
    int cur = 0;
    {
        int64_t m = n < GATHER_BLOCK ? n : GATHER_BLOCK;
        for (int64_t k = 0; k < m; k++) {
            home[0][k] = bk_home(ids[k], nb);
            __builtin_prefetch(&t[home[0][k]]);
        }
    }
    for (int64_t base = 0; base < n; base += GATHER_BLOCK) {
        int64_t m = n - base < GATHER_BLOCK ? n - base : GATHER_BLOCK;
        for (int64_t k = 0; k < m; k++) {
            int32_t v = bk_find_one(t, nb, home[cur][k], ids[base + k]);
            if (out_slots) out_slots[base + k] = v;
            if (v >= 0) {
                const char *p = slabs[(uint64_t)v >> shift] + ((uint64_t)v & chunk_mask) * row_bytes;
                src[k] = p;
                for (int64_t off = 0; off < out_bytes; off += 64) __builtin_prefetch(p + off);
                __builtin_prefetch(p + out_bytes - 1);
            } else {
                src[k] = 0;
            }
        }
        /* the next block's buckets load while this block's rows are copied */
        int64_t nbase = base + GATHER_BLOCK;
        int64_t nm = n - nbase < GATHER_BLOCK ? n - nbase : GATHER_BLOCK;
        for (int64_t k = 0; k < nm; k++) {
            home[cur ^ 1][k] = bk_home(ids[nbase + k], nb);
            __builtin_prefetch(&t[home[cur ^ 1][k]]);
        }
        for (int64_t k = 0; k < m; k++) {
            char *dst = out + (base + k) * out_bytes;
            if (src[k]) {
                memcpy(dst, src[k], out_bytes);
                found[base + k] = 1;
                hits++;
            } else {
                memset(dst, 0, out_bytes);
                found[base + k] = 0;
            }
        }
        cur ^= 1;
    }
    return hits;
}
