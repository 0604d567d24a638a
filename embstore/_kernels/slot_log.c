/* Sweeps of the eviction policies' lazy FIFO logs (policies/_tracked.py, `SlotLog`).
 *
 * A log is an array of (slot, stamp) entries read from `head`; an entry is live while
 * alive[slot] holds and stamp[slot] equals the entry's stamp, so re-appending a slot with a
 * fresh stamp makes its older entries stale. Why C: the hand of CLOCK takes one branch per
 * entry, and the numpy version (peek a chunk of live entries, cut at the n-th victim, re-push
 * the passed ones) made several passes and temporaries per chunk; on a cache tier it cost
 * more than the tier's hash probes.
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
