/* Record kernels of the pmem backend: fixed-size slot records in a mapped file.
 *
 * Record layout (offsets from the record's start; see backends/pmem.py for the full table):
 *   0  int64  id
 *   8  uint32 crc   CRC-32C of the id followed by bytes [12, payload_offset + row_bytes)
 *   12 uint32 kind
 *   16 uint64 seq   0 marks a free slot
 *   payload_offset  row_bytes of payload
 *
 * Why C: a batched read must find the record, check its id and CRC and copy its payload.
 * In numpy that is a gather of whole records into a temporary, a CRC pass and a second copy
 * of the payloads; one pass here touches each record once and prefetches records a few ids
 * ahead, which is what lets a verified read keep up with an unverified numpy gather.
 * crc_fn/pick() come from checksum.c, compiled into the same module.
 */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define REC_SEQ_OFFSET 16
#define REC_CRC_OFFSET 8
#define REC_KIND_OFFSET 12
#define PREFETCH_AHEAD 12

static inline void prefetch_record(const char *rec, int64_t record_size) {
    for (int64_t off = 0; off < record_size; off += 64) __builtin_prefetch(rec + off, 0, 0);
    __builtin_prefetch(rec + record_size - 1, 0, 0);
}

/* Copy the payload of slots[j] (or zeros where slots[j] < 0) to out[j], verifying that the
 * record holds ids[j] and that its CRC matches. Returns the number of bad records; the index
 * of the first one goes to *first_bad (-1 if none). Bad records are never copied out. */
int64_t rec_gather(const char *base, int64_t record_size, int64_t payload_offset,
                   int64_t row_bytes, const int64_t *ids, const int64_t *slots, int64_t n,
                   char *out, uint8_t *found, int64_t *first_bad) {
    crc_fn f = pick();
    int64_t bad = 0;
    *first_bad = -1;
    int64_t run = payload_offset + row_bytes - REC_KIND_OFFSET;
    for (int64_t j = 0; j < n && j < PREFETCH_AHEAD; j++)
        if (slots[j] >= 0) prefetch_record(base + slots[j] * record_size, record_size);
    for (int64_t j = 0; j < n; j++) {
        if (j + PREFETCH_AHEAD < n && slots[j + PREFETCH_AHEAD] >= 0)
            prefetch_record(base + slots[j + PREFETCH_AHEAD] * record_size, record_size);
        char *dst = out + j * row_bytes;
        int64_t s = slots[j];
        if (s < 0) {
            memset(dst, 0, (size_t)row_bytes);
            found[j] = 0;
            continue;
        }
        const char *rec = base + s * record_size;
        int64_t stored_id;
        uint32_t stored_crc;
        memcpy(&stored_id, rec, 8);
        memcpy(&stored_crc, rec + REC_CRC_OFFSET, 4);
        uint32_t c = f(0xFFFFFFFFu, (const unsigned char *)rec, 8);
        c = f(c, (const unsigned char *)(rec + REC_KIND_OFFSET), run) ^ 0xFFFFFFFFu;
        if (stored_id != ids[j] || c != stored_crc) {
            if (bad == 0) *first_bad = j;
            bad++;
            memset(dst, 0, (size_t)row_bytes);
            found[j] = 0;
            continue;
        }
        memcpy(dst, rec + payload_offset, (size_t)row_bytes);
        found[j] = 1;
    }
    return bad;
}

/* Write complete records (n x record_size, contiguous) to their slots. The seq word is
 * stored last: a process killed mid-record leaves seq 0 (a free slot) or a CRC mismatch in
 * a slot with a seq above the durable watermark, both of which reopening ignores. */
void rec_scatter(char *base, int64_t record_size, const int64_t *slots, int64_t n,
                 const char *records) {
    for (int64_t j = 0; j < n; j++) {
        char *dst = base + slots[j] * record_size;
        const char *src = records + j * record_size;
        memcpy(dst, src, REC_SEQ_OFFSET);
        memcpy(dst + REC_SEQ_OFFSET + 8, src + REC_SEQ_OFFSET + 8,
               (size_t)(record_size - REC_SEQ_OFFSET - 8));
        uint64_t seq;
        memcpy(&seq, src + REC_SEQ_OFFSET, 8);
        __atomic_store_n((uint64_t *)(dst + REC_SEQ_OFFSET), seq, __ATOMIC_RELEASE);
    }
}

/* Mark slots free: one aligned 8-byte store each, atomic on x86 and failure-atomic on
 * persistent memory, so a retired record is either still whole or free, never torn. */
void rec_zero_seq(char *base, int64_t record_size, int64_t seq_offset,
                  const int64_t *slots, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        __atomic_store_n((uint64_t *)(base + slots[j] * record_size + seq_offset), 0,
                         __ATOMIC_RELEASE);
}

int rec_madvise(void *addr, size_t len, int advice) {
    return madvise(addr, len, advice);
}
