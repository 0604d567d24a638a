/* Per-slot kernels of the eviction policies (policies/_tracked.py): sweeps of their lazy
 * FIFO logs (`SlotLog`) and access counters.
 *
 * A log is an array of (slot, stamp) entries read from `head`; an entry is live while
 * alive[slot] holds and stamp[slot] equals the entry's stamp, so re-appending a slot with a
 * fresh stamp makes its older entries stale. Why C: these run on every hit or eviction of a
 * cache tier, one branch per entry; the numpy versions made several passes, temporaries and
 * a hashed dedupe per call, and cost more than the tier's own hash probes.
 */
#include <stdint.h>

/* CLOCK's hand: from pos[0] (head) to pos[1] (tail), a live entry whose ref is clear becomes
 * a victim (alive cleared, slot written to out); one whose ref is set has it cleared and is
 * appended at the tail with stamp pos[2]++ (second chance), so a sweep can reach it again.
 * Stops after `need` victims or at the tail. The caller leaves room for one append per live
 * entry. Updates pos[0..2]; returns the number of victims. */
int64_t clock_sweep(int32_t *log_slots, int64_t *log_stamps, int64_t *pos,
                    int64_t *stamp, uint8_t *alive, uint8_t *ref, int64_t need, int32_t *out) {
    int64_t head = pos[0], tail = pos[1], next = pos[2], k = 0;
    while (k < need && head < tail) {
        int32_t s = log_slots[head];
        int64_t st = log_stamps[head];
        head++;
        if (!alive[s] || stamp[s] != st) continue;
        if (ref[s]) {
            ref[s] = 0;
            log_slots[tail] = s;
            log_stamps[tail] = next;
            stamp[s] = next;
            next++;
            tail++;
        } else {
            alive[s] = 0;
            out[k++] = s;
        }
    }
    pos[0] = head;
    pos[1] = tail;
    pos[2] = next;
    return k;
}

/* The slots of distinct ids in ascending order of id, for a log that must not depend on the
 * order of ids within a batch. An LSD radix sort on 11-bit digits of the id (sign bit
 * flipped, so negative ids sort first) that skips every digit all ids share: ids below 2^33
 * take three passes. numpy's argsort of the ids plus a take cost 5x more.
 * ka/kb and sa/sb are scratch of n entries each; returns 0 if the result is in sa, 1 if in sb. */
#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)
#define DIGITS 6
int slots_by_id(const int64_t *ids, const int32_t *slots, int64_t n,
                uint64_t *ka, int32_t *sa, uint64_t *kb, int32_t *sb) {
    uint32_t hist[DIGITS][RADIX] = {{0}};
    for (int64_t j = 0; j < n; j++) {
        uint64_t k = (uint64_t)ids[j] ^ (1ULL << 63);
        ka[j] = k;
        sa[j] = slots[j];
        for (int d = 0; d < DIGITS; d++) hist[d][(k >> (d * RADIX_BITS)) & (RADIX - 1)]++;
    }
    uint64_t *src_k = ka, *dst_k = kb;
    int32_t *src_s = sa, *dst_s = sb;
    int in_b = 0;
    for (int d = 0; d < DIGITS && n > 0; d++) {
        uint32_t *h = hist[d];
        int shift = d * RADIX_BITS;
        if (h[(src_k[0] >> shift) & (RADIX - 1)] == (uint32_t)n) continue;
        uint32_t sum = 0;
        for (int b = 0; b < RADIX; b++) {
            uint32_t c = h[b];
            h[b] = sum;
            sum += c;
        }
        for (int64_t j = 0; j < n; j++) {
            uint64_t k = src_k[j];
            uint32_t p = h[(k >> shift) & (RADIX - 1)]++;
            dst_k[p] = k;
            dst_s[p] = src_s[j];
        }
        uint64_t *tk = src_k; src_k = dst_k; dst_k = tk;
        int32_t *ts = src_s; src_s = dst_s; dst_s = ts;
        in_b = !in_b;
    }
    return in_b;
}

/* LRU's touch: append each slot at the tail with a fresh stamp, once per call, in order of
 * first occurrence; a slot whose stamp is already from this call (>= the call's first
 * stamp, pos[2] on entry) is a repeat and skipped, so no hash dedupe is needed. Writes
 * time[slot] = now when time is not NULL. The caller leaves room for n appends. Updates
 * pos[1..2]; returns the number appended. */
int64_t log_touch(int32_t *log_slots, int64_t *log_stamps, int64_t *pos, int64_t *stamp,
                  const int32_t *slots, int64_t n, double *time, double now) {
    int64_t tail = pos[1], first = pos[2], next = pos[2];
    for (int64_t j = 0; j < n; j++) {
        int32_t s = slots[j];
        if (stamp[s] >= first) continue;
        stamp[s] = next;
        log_slots[tail] = s;
        log_stamps[tail] = next;
        tail++;
        next++;
        if (time) time[s] = now;
    }
    int64_t appended = tail - pos[1];
    pos[1] = tail;
    pos[2] = next;
    return appended;
}

/* LFU's access: count[slot] += 1 and seen[slot] = call for every slot, repeats included
 * (each counts), in one pass where numpy needed a hashed dedupe and a bincount. */
void count_accesses(double *count, int64_t *seen, int64_t call, const int32_t *slots,
                    int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        count[slots[j]] += 1.0;
        seen[slots[j]] = call;
    }
}

/* S3-FIFO's access: a small saturating counter per slot, one step per occurrence. */
void count_accesses_saturating(uint8_t *freq, uint8_t max, const int32_t *slots, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        uint8_t *f = &freq[slots[j]];
        if (*f < max) (*f)++;
    }
}

/* policies/_hashing.py's splitmix64 of one id with its seed-derived xor key. */
static inline uint64_t keyed_splitmix64(int64_t id, uint64_t key) {
    uint64_t x = ((uint64_t)id ^ key) + 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* A count-min sketch of `depth` rows of 2**bits 4-bit counters (W-TinyLFU's), two to a byte:
 * counter i of the flattened rows (row r starts at r << bits) is the low nibble of byte i / 2
 * when i is even, the high one when odd. An id's counter in row r is at (h1 + r * h2) mod
 * 2**bits, h1 and h2 (forced odd) its hashes under key1 and key2: policies/_hashing.py's
 * positions(), so either side may read what the other wrote. sketch_count adds 1 to each of
 * an id's counters, saturating at `top` (<= 15), per occurrence; sketch_estimate writes the
 * least of them. One pass where numpy made a dozen over [depth, n] temporaries and np.add.at
 * went through the ufunc machinery per element (55 ns an element on a sketch of 8M cells). */
static inline uint64_t sketch_cell(int bits, int r, uint64_t h1, uint64_t h2, uint64_t mask) {
    return ((uint64_t)r << bits) + ((h1 + (uint64_t)r * h2) & mask);
}

void sketch_count(uint8_t *sketch, int bits, int depth, const int64_t *ids, int64_t n,
                  uint64_t key1, uint64_t key2, uint8_t top) {
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    for (int64_t j = 0; j < n; j++) {
        uint64_t h1 = keyed_splitmix64(ids[j], key1);
        uint64_t h2 = keyed_splitmix64(ids[j], key2) | 1;
        for (int r = 0; r < depth; r++) {
            uint64_t i = sketch_cell(bits, r, h1, h2, mask);
            int shift = (int)(i & 1) << 2;
            if (((sketch[i >> 1] >> shift) & 15) < top) sketch[i >> 1] += (uint8_t)(1 << shift);
        }
    }
}

void sketch_estimate(const uint8_t *sketch, int bits, int depth, const int64_t *ids,
                     int64_t n, uint64_t key1, uint64_t key2, uint8_t *out) {
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    for (int64_t j = 0; j < n; j++) {
        uint64_t h1 = keyed_splitmix64(ids[j], key1);
        uint64_t h2 = keyed_splitmix64(ids[j], key2) | 1;
        uint8_t least = 15;
        for (int r = 0; r < depth; r++) {
            uint64_t i = sketch_cell(bits, r, h1, h2, mask);
            uint8_t c = (sketch[i >> 1] >> ((int)(i & 1) << 2)) & 15;
            if (c < least) least = c;
        }
        out[j] = least;
    }
}

/* SHARDS spatial sampling (embstore/_access_log.py): copy to out, in order, the ids whose
 * splitmix64 hash (policies/_hashing.py's, key = its seed-derived xor) has its top `bits`
 * bits below `threshold`, and where keep is not NULL set keep[j] to whether id j is kept.
 * Returns how many were kept. One pass where numpy made a dozen over temporaries: recording
 * a training step's lookups must cost little against the step. */
int64_t shards_keep(const int64_t *ids, int64_t n, uint64_t key, int bits, uint64_t threshold,
                    int64_t *out, uint8_t *keep) {
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++) {
        uint64_t x = keyed_splitmix64(ids[j], key);
        int in = (x >> (64 - bits)) < threshold;
        out[kept] = ids[j];
        kept += in;
        if (keep) keep[j] = (uint8_t)in;
    }
    return kept;
}
