/* CRC-32C (Castagnoli) of each row's id and payload, for the whole batch in one call.
 *
 * A CRC detects every error burst of up to 32 bits, so any single-byte change of a stored row
 * (or of its id) is detected, which a multiply-mix hash would only make likely. SSE4.2 has a
 * CRC-32C instruction; where the CPU lacks it a slice-by-8 table does the same computation.
 */
#include <stdint.h>
#include <string.h>

static uint32_t table[8][256];
static int table_ready = 0;

static void init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
    table_ready = 1;
}

static uint32_t crc_soft(uint32_t crc, const unsigned char *p, int64_t len) {
    while (len >= 8) {
        uint64_t w; memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xFF] ^ table[6][(w >> 8) & 0xFF] ^ table[5][(w >> 16) & 0xFF] ^
              table[4][(w >> 24) & 0xFF] ^ table[3][(w >> 32) & 0xFF] ^
              table[2][(w >> 40) & 0xFF] ^ table[1][(w >> 48) & 0xFF] ^ table[0][w >> 56];
        p += 8; len -= 8;
    }
    while (len--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2")))
static uint32_t crc_hw(uint32_t crc, const unsigned char *p, int64_t len) {
    uint64_t c = crc;
    while (len >= 8) { uint64_t w; memcpy(&w, p, 8); c = __builtin_ia32_crc32di(c, w); p += 8; len -= 8; }
    uint32_t c32 = (uint32_t)c;
    while (len--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

typedef uint32_t (*crc_fn)(uint32_t, const unsigned char *, int64_t);

static crc_fn pick(void) {
    if (!table_ready) init_table();
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) return crc_hw;
#endif
    return crc_soft;
}

/* out[j] = crc32c(id_j as 8 little-endian bytes ++ row_j), rows `stride` bytes apart. */
void crc32c_rows(const int64_t *ids, const char *rows, int64_t n, int64_t row_bytes,
                 int64_t stride, uint32_t *out) {
    crc_fn f = pick();
    for (int64_t j = 0; j < n; j++) {
        uint32_t c = f(0xFFFFFFFFu, (const unsigned char *)&ids[j], 8);
        c = f(c, (const unsigned char *)(rows + j * stride), row_bytes);
        out[j] = c ^ 0xFFFFFFFFu;
    }
}

/* Plain CRC-32C of a buffer (for headers and tests against known vectors). */
uint32_t crc32c_buffer(const char *data, int64_t len) {
    crc_fn f = pick();
    return f(0xFFFFFFFFu, (const unsigned char *)data, len) ^ 0xFFFFFFFFu;
}

int crc32c_uses_hardware(void) {
    return pick() != crc_soft;
}
