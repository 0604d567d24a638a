/* Half-precision weights: float32 <-> binary16 (fp16) and bfloat16, rounded to nearest or
 * stochastically, for the rows of half-precision tables (embstore/_precision.py).
 *
 * Stochastic rounding takes one of the two neighbours of x in the 16-bit format, the far one
 * with probability |x - near| / |far - near|, so E[rounded] = x. The random bits of element
 * (i, c) are splitmix64(splitmix64(id_i ^ seed_key) + (c + 1) * golden): a pure function of
 * (table, id, column, step), the same as embstore.init.hash_bits computes in numpy.
 *
 * Built in ISO C mode without contraction: every operation is rounded once, on every machine.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL

static inline uint64_t mix64(uint64_t z) {
    z ^= z >> 30; z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27; z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  /* zero or subnormal: m * 2^-24, exact */
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (e == 31) return from_bits(sign | 0x7f800000u | (m << 13));
    return from_bits(sign | ((e - 15u + 127u) << 23) | (m << 13));
}

static inline uint16_t f32_to_f16(float f) {  /* round to nearest, ties to even */
    uint32_t x = to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* >= 65520: infinity */
    if (a < 0x38800000u) {  /* below 2^-14: a multiple of 2^-24 (a subnormal) or zero */
        float scaled = from_bits(a) * 16777216.0f;  /* exact: a power of two */
        return (uint16_t)(sign | (uint32_t)nearbyintf(scaled));
    }
    uint32_t h = (((a >> 23) - 127u + 15u) << 10) | ((a & 0x7fffffu) >> 13);
    uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  /* may carry into e */
    return (uint16_t)(sign | h);
}

static inline uint16_t f16_step(uint16_t h, int up) {  /* the neighbour towards +-infinity */
    if ((h & 0x7fffu) == 0) return up ? 0x0001u : 0x8001u;
    if (!(h & 0x8000u)) return (uint16_t)(up ? h + 1 : h - 1);
    return (uint16_t)(up ? h - 1 : h + 1);
}

static inline uint16_t bf16_nearest(float f) {
    uint32_t u = to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  /* NaN */
    uint64_t w = (uint64_t)u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(w >> 16);
}

/* `table` (fp16 only): the float32 value of each of the 65,536 fp16 bit patterns, which the
 * caller builds once; a lookup in it (256 KiB, cache-resident) beats decoding each field. */
void half_decode(const uint16_t *in, int64_t n, int bf16, const float *table, float *out) {
    if (bf16) {
        for (int64_t i = 0; i < n; i++) out[i] = from_bits((uint32_t)in[i] << 16);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = table[in[i]];
    }
}

/* Round rows [n, dim] of float32 (row stride `stride` floats) into out [n, dim]: to nearest
 * where ids is NULL, else stochastically with the bits of (ids[i], column, seed_key). */
void half_encode(const float *in, int64_t n, int64_t dim, int64_t stride, int bf16,
                 const int64_t *ids, uint64_t seed_key, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *x = in + i * stride;
        uint16_t *o = out + i * dim;
        if (!ids) {
            for (int64_t c = 0; c < dim; c++) o[c] = bf16 ? bf16_nearest(x[c]) : f32_to_f16(x[c]);
            continue;
        }
        uint64_t row_key = mix64((uint64_t)ids[i] ^ seed_key);
        for (int64_t c = 0; c < dim; c++) {
            uint64_t bits = mix64(row_key + (uint64_t)(c + 1) * GOLDEN);
            float v = x[c];
            uint32_t u = to_bits(v);
            if (bf16) {
                if ((u & 0x7fffffffu) > 0x7f800000u) { o[c] = 0x7fc0u; continue; }
                o[c] = (uint16_t)(((uint64_t)u + (bits >> 48)) >> 16);
                continue;
            }
            uint16_t near = f32_to_f16(v);
            float nf = f16_to_f32(near);
            if (nf == v || !isfinite(nf) || isnan(v)) { o[c] = near; continue; }
            uint16_t other = f16_step(near, nf < v);
            double gap = (double)f16_to_f32(other) - (double)nf;
            double p = ((double)v - (double)nf) / gap;
            double draw = (double)(bits >> 11) * (1.0 / 9007199254740992.0);
            o[c] = (draw < p) ? other : near;
        }
    }
}
