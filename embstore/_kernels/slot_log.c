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
