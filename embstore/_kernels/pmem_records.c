/* Record kernels of the pmem backend: fixed-size slot records in a mapped file.
 *
 * Record layout (offsets from the record's start; see backends/_pmem_format.py for the full table):
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
 * crc_fn/pick() come from checksum.c and mix64/find_one from dram_index.c, compiled into the
 * same module, so the CRC and the hash are exactly those of embstore.checksum and IdIndex.
 */
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>

#define REC_SEQ_OFFSET 16
#define REC_CRC_OFFSET 8
#define REC_KIND_OFFSET 12

static inline void prefetch_record(const char *rec, int64_t record_size) {
    for (int64_t off = 0; off < record_size; off += 64) __builtin_prefetch(rec + off, 0, 0);
    __builtin_prefetch(rec + record_size - 1, 0, 0);
}

/* CRC-32C of (id ++ run) for GROUP records at once. One CRC is a chain of dependent crc32
 * instructions (3 cycles each); interleaving independent records keeps the unit busy every
 * cycle, which is what makes verification cheaper than the memory traffic it rides on. */
#define GROUP 4
#if defined(__x86_64__)
__attribute__((target("sse4.2")))
static void crc_group_hw(const unsigned char *const *rec, int64_t run_offset, int64_t run,
                         uint32_t *out) {
    uint64_t c[GROUP];
    for (int g = 0; g < GROUP; g++) {
        uint64_t w; memcpy(&w, rec[g], 8);
        c[g] = __builtin_ia32_crc32di(0xFFFFFFFFu, w);
    }
    int64_t i = 0;
    for (; i + 8 <= run; i += 8) {
        for (int g = 0; g < GROUP; g++) {
            uint64_t w; memcpy(&w, rec[g] + run_offset + i, 8);
            c[g] = __builtin_ia32_crc32di(c[g], w);
        }
    }
    for (int g = 0; g < GROUP; g++) {
        uint32_t c32 = (uint32_t)c[g];
        for (int64_t k = i; k < run; k++) c32 = __builtin_ia32_crc32qi(c32, rec[g][run_offset + k]);
        out[g] = c32 ^ 0xFFFFFFFFu;
    }
}
#endif

static void crc_group(crc_fn f, const unsigned char *const *rec, int64_t count,
                      int64_t run_offset, int64_t run, uint32_t *out) {
#if defined(__x86_64__)
    if (count == GROUP && f == crc_hw) { crc_group_hw(rec, run_offset, run, out); return; }
#endif
    for (int64_t g = 0; g < count; g++) {
        uint32_t c = f(0xFFFFFFFFu, rec[g], 8);
        out[g] = f(c, rec[g] + run_offset, run) ^ 0xFFFFFFFFu;
    }
}

/* Check the records of a group (id and CRC) and copy out the good payloads. */
static int64_t finish_group(crc_fn f, const unsigned char *const *rec, const int64_t *pos,
                            int64_t count, int64_t payload_offset, int64_t row_bytes,
                            const int64_t *ids, char *out, uint8_t *found, int64_t *first_bad) {
    uint32_t crc[GROUP];
    int64_t bad = 0;
    crc_group(f, rec, count, REC_KIND_OFFSET, payload_offset + row_bytes - REC_KIND_OFFSET, crc);
    for (int64_t g = 0; g < count; g++) {
        int64_t j = pos[g];
        char *dst = out + j * row_bytes;
        int64_t stored_id;
        uint32_t stored_crc;
        memcpy(&stored_id, rec[g], 8);
        memcpy(&stored_crc, rec[g] + REC_CRC_OFFSET, 4);
        if (stored_id != ids[j] || crc[g] != stored_crc) {
            if (*first_bad < 0 || j < *first_bad) *first_bad = j;
            bad++;
            memset(dst, 0, (size_t)row_bytes);
            found[j] = 0;
        } else {
            memcpy(dst, rec[g] + payload_offset, (size_t)row_bytes);
            found[j] = 1;
        }
    }
    return bad;
}

/* For each j, the row of ids[j]: the slot index (a hash table laid out and probed exactly as
 * IdIndex's, by dram_index.c's find_one compiled into this module) maps the id to its record
 * slot. Copies the payload to out[j], or zeros where the id is absent, verifying that the
 * record holds ids[j] and that its CRC matches. Returns the number of bad records, the index
 * of the first one in *first_bad (-1 if none); bad records are never copied out.
 *
 * scratch (GROUP * (payload_offset + row_bytes) bytes, or NULL): copy each record there first
 * and check the copy, for a reader whose mapping a writer in another process may change
 * meanwhile; a record changed while it was copied fails its check, never comes out torn.
 *
 * Each id costs two dependent cache misses (hash bucket, then record). The loop is a software
 * pipeline: at step t it prefetches the bucket of id t, probes id t-STAGE (its bucket is in
 * cache by now) and prefetches that record, and verifies and copies id t-2*STAGE, so the
 * misses of many ids are in flight together. */
#define STAGE 10
#define RING 32
/* Slots verified in this call, direct-mapped: the hot ids of a skewed batch repeat many
 * times, and each distinct record needs checking once per call, not once per occurrence. */
#define VERIFIED 1024

static void remember(int64_t *verified, const unsigned char *const *rec, const int64_t *pos,
                     int64_t count, const uint8_t *found, const char *base,
                     int64_t record_size) {
    for (int64_t g = 0; g < count; g++)
        if (found[pos[g]]) {
            int64_t s = ((const char *)rec[g] - base) / record_size;
            verified[s & (VERIFIED - 1)] = s;
        }
}

int64_t rec_gather(const char *base, int64_t record_size, int64_t payload_offset,
                   int64_t row_bytes, const int64_t *keys, const int32_t *vals, uint64_t mask,
                   const int64_t *ids, int64_t n, char *out, uint8_t *found,
                   int64_t *first_bad, char *scratch) {
    crc_fn f = pick();
    int64_t bad = 0;
    int64_t slot[RING];
    int64_t verified[VERIFIED];
    memset(verified, 0xFF, sizeof verified);  /* -1: no slot */
    const unsigned char *rec[GROUP];
    int64_t pos[GROUP];
    int64_t count = 0;
    *first_bad = -1;
    for (int64_t t = 0; t < n + 2 * STAGE; t++) {
        if (t < n) {
            uint64_t h = mix64((uint64_t)ids[t]) & mask;
            __builtin_prefetch(&vals[h], 0, 0);
            __builtin_prefetch(&keys[h], 0, 0);
        }
        int64_t b = t - STAGE;
        if (b >= 0 && b < n) {
            int64_t s = find_one(keys, vals, mask, ids[b]);
            slot[b % RING] = s;
            if (s >= 0) prefetch_record(base + s * record_size, record_size);
        }
        int64_t j = t - 2 * STAGE;
        if (j < 0) continue;
        int64_t s = slot[j % RING];
        if (s < 0) {
            memset(out + j * row_bytes, 0, (size_t)row_bytes);
            found[j] = 0;
            continue;
        }
        if (!scratch && verified[s & (VERIFIED - 1)] == s &&
            memcmp(base + s * record_size, &ids[j], 8) == 0) {
            /* this record passed its check earlier in this call and nothing can have
             * changed it since (the caller holds the table); copy it again */
            memcpy(out + j * row_bytes, base + s * record_size + payload_offset,
                   (size_t)row_bytes);
            found[j] = 1;
            continue;
        }
        if (scratch) {
            /* one copy of the record, then every check and the payload from the copy: a
             * writer in another process may change the mapping between two reads of it */
            char *copy = scratch + count * (payload_offset + row_bytes);
            memcpy(copy, base + s * record_size, (size_t)(payload_offset + row_bytes));
            rec[count] = (const unsigned char *)copy;
        } else {
            rec[count] = (const unsigned char *)(base + s * record_size);
        }
        pos[count++] = j;
        if (count == GROUP) {
            bad += finish_group(f, rec, pos, count, payload_offset, row_bytes, ids, out, found,
                                first_bad);
            if (!scratch) remember(verified, rec, pos, count, found, base, record_size);
            count = 0;
        }
    }
    if (count)
        bad += finish_group(f, rec, pos, count, payload_offset, row_bytes, ids, out, found,
                            first_bad);
    return bad;
}

/* Point each id at slots[j], inserting absent ids (the table has room: the caller reserved
 * it). old_slots[j] gets the id's previous slot, or -1 where it was inserted. Returns the
 * number inserted. One probe per id does the lookup and the update together. */
int64_t rec_index_upsert(int64_t *keys, int32_t *vals, uint64_t mask, const int64_t *ids,
                         const int32_t *slots, int64_t n, int32_t *old_slots) {
    int64_t inserted = 0;
    for (int64_t j = 0; j < n; j++) {
        uint64_t i = mix64((uint64_t)ids[j]) & mask;
        for (;;) {
            if (vals[i] < 0) {
                keys[i] = ids[j];
                vals[i] = slots[j];
                old_slots[j] = -1;
                inserted++;
                break;
            }
            if (keys[i] == ids[j]) {
                old_slots[j] = vals[i];
                vals[i] = slots[j];
                break;
            }
            i = (i + 1) & mask;
        }
    }
    return inserted;
}

/* The seq word of a counter: counter << 8 | CRC-8 (poly 0x07, MSB first, init 0) of the
 * counter's 7 low bytes, low byte first; the same as _pmem_format.seq_words. */
static uint64_t seq_word(uint64_t counter) {
    uint8_t crc = 0;
    for (int k = 0; k < 7; k++) {
        crc ^= (uint8_t)(counter >> (8 * k));
        for (int b = 0; b < 8; b++) 
            crc = (crc & 0x80) ? (uint8_t)((crc << 1) ^ 0x07) : (uint8_t)(crc << 1);
    }
    return counter << 8 | crc;
}

void rec_seq_words(const uint64_t *counters, int64_t n, uint64_t *out) {
    for (int64_t j = 0; j < n; j++) out[j] = seq_word(counters[j]);
}

/* Build and write the record of each row: id, kind, payload, padding, CRC, and the seq word
 * (counter first_counter + j for row j) last. A process killed mid-record so leaves seq 0
 * (a free slot) or, mid-way through a reused or rewritten slot's bytes, a CRC mismatch
 * under a seq above the durable watermark, both of which reopening ignores. The CRC is
 * computed from the caller's values, so the mapping is only written, never read back. */
void rec_write(char *base, int64_t record_size, int64_t payload_offset, int64_t row_bytes,
               const int64_t *slots, const int64_t *ids, uint64_t first_counter,
               uint32_t kind, const char *rows, int64_t n) {
    crc_fn f = pick();
    int64_t pad = record_size - payload_offset - row_bytes;
    for (int64_t j = 0; j < n; j++) {
        char *dst = base + slots[j] * record_size;
        const char *row = rows + j * row_bytes;
        uint64_t word = seq_word(first_counter + (uint64_t)j);
        uint32_t c = f(0xFFFFFFFFu, (const unsigned char *)&ids[j], 8);
        c = f(c, (const unsigned char *)&kind, 4);
        c = f(c, (const unsigned char *)&word, 8);
        c = f(c, (const unsigned char *)row, row_bytes) ^ 0xFFFFFFFFu;
        memcpy(dst, &ids[j], 8);
        memcpy(dst + REC_CRC_OFFSET, &c, 4);
        memcpy(dst + REC_KIND_OFFSET, &kind, 4);
        memcpy(dst + payload_offset, row, (size_t)row_bytes);
        if (pad) memset(dst + payload_offset + row_bytes, 0, (size_t)pad);
        __atomic_store_n((uint64_t *)(dst + REC_SEQ_OFFSET), word, __ATOMIC_RELEASE);
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

/* Start write-back of each byte range [starts[j], starts[j] + lens[j]) of the file without
 * waiting and without a device cache flush; the caller then waits for all of it with one
 * fdatasync. msync(MS_SYNC) of a range is fsync of that range, device flush included, so one
 * msync per dirty range cost one flush per range. Returns 0, or an errno value. */
int rec_sync_ranges(int fd, const int64_t *starts, const int64_t *lens, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (sync_file_range(fd, starts[j], lens[j], SYNC_FILE_RANGE_WRITE) != 0) return errno;
    return 0;
}

int rec_madvise(void *addr, size_t len, int advice) {
    return madvise(addr, len, advice);
}
