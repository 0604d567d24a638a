"""cffi builders for the C kernels (API mode, compiled at install time by setup.py)."""

from pathlib import Path

from cffi import FFI

CDEF = """
int64_t idx_find(const int64_t *keys, const int32_t *vals, uint64_t mask,
                 const int64_t *ids, int64_t n, int32_t *out_slots);
void idx_insert(int64_t *keys, int32_t *vals, uint64_t mask,
                const int64_t *ids, const int32_t *slots, int64_t n);
int64_t idx_remove(int64_t *keys, int32_t *vals, uint64_t mask,
                   const int64_t *ids, int64_t n, int32_t *out_slots);
void idx_rehash(const int64_t *old_keys, const int32_t *old_vals, uint64_t old_cap,
                int64_t *keys, int32_t *vals, uint64_t mask);
int64_t idx_items(const int64_t *keys, const int32_t *vals, uint64_t cap,
                  int64_t *out_ids, int32_t *out_slots);
int64_t idx_gather(const int64_t *keys, const int32_t *vals, uint64_t mask,
                   char *const *slabs, int shift, int64_t row_bytes,
                   const int64_t *ids, int64_t n, char *out, uint8_t *found,
                   int32_t *out_slots);
void slab_gather(char *const *slabs, int shift, int64_t row_bytes,
                 const int32_t *slots, int64_t n, char *out);
void slab_scatter(char *const *slabs, int shift, int64_t row_bytes,
                  const int32_t *slots, int64_t n, const char *src);
typedef struct { int64_t key; int32_t group; uint32_t epoch; } group_slot_t;
int64_t group_ids(const int64_t *ids, int64_t n, group_slot_t *table, uint64_t mask,
                  uint32_t epoch, int64_t *out_unique, int64_t *out_inverse, int64_t *out_last);
void copy_rows(char *dst, const int64_t *dst_idx, const char *src, const int64_t *src_idx,
               int64_t n, int64_t row_bytes);
void scatter_add_f32(const int64_t *inverse, int64_t n, int64_t dim, const float *src, float *out);
void scatter_add_f64(const int64_t *inverse, int64_t n, int64_t dim, const double *src,
                     double *out);
typedef struct { int64_t key[5]; int32_t val[5]; int32_t pad; } bucket_t;
int64_t bk_find(const bucket_t *t, uint64_t nb, const int64_t *ids, int64_t n,
                int32_t *out_slots);
void bk_insert(bucket_t *t, uint64_t nb, const int64_t *ids, const int32_t *slots, int64_t n);
int64_t bk_remove(bucket_t *t, uint64_t nb, const int64_t *ids, int64_t n, int32_t *out_slots);
void bk_rehash(const bucket_t *old, uint64_t old_nb, bucket_t *t, uint64_t nb);
int64_t bk_items(const bucket_t *t, uint64_t nb, int64_t *out_ids, int32_t *out_slots);
int64_t bk_gather(const bucket_t *t, uint64_t nb, char *const *slabs, int shift,
                  int64_t row_bytes, int64_t out_bytes, const int64_t *ids, int64_t n,
                  char *out, uint8_t *found, int32_t *out_slots);
int64_t bitmap_set(uint8_t *bits, int64_t nbits, const int64_t *ids, int64_t n, int clear,
                   int64_t *outside, int64_t *held);
"""


def _builder(module: str, cdef: str, source: str | tuple[str, ...], std: str,
             extra: tuple[str, ...] = ()) -> FFI:
    """An API-mode builder of `module` from C files beside this one, in order."""
    builder = FFI()
    builder.cdef(cdef)
    sources = (source,) if isinstance(source, str) else source
    builder.set_source(module, "\n".join((Path(__file__).parent / name).read_text()
                                          for name in sources),
                       extra_compile_args=["-O3", f"-std={std}", *extra])
    return builder


ffibuilder = _builder("embstore._kernels._dram_index", CDEF, ("dram_index.c", "bucket_index.c"),
                      "c99")

CHECKSUM_CDEF = """
void crc32c_rows(const int64_t *ids, const char *rows, int64_t n, int64_t row_bytes,
                 int64_t stride, uint32_t *out);
uint32_t crc32c_buffer(const char *data, int64_t len);
int crc32c_uses_hardware(void);
"""

checksum_ffibuilder = _builder("embstore._kernels._checksum", CHECKSUM_CDEF, "checksum.c",
                               "gnu99")

POLICY_CDEF = """
int64_t clock_sweep(int32_t *log_slots, int64_t *log_stamps, int64_t *pos,
                    int64_t *stamp, uint8_t *alive, uint8_t *ref, int64_t need, int32_t *out);
int64_t log_touch(int32_t *log_slots, int64_t *log_stamps, int64_t *pos, int64_t *stamp,
                  const int32_t *slots, int64_t n, double *time, double now);
int slots_by_id(const int64_t *ids, const int32_t *slots, int64_t n,
                uint64_t *ka, int32_t *sa, uint64_t *kb, int32_t *sb);
void count_accesses(double *count, int64_t *seen, int64_t call, const int32_t *slots,
                    int64_t n);
void count_accesses_saturating(uint8_t *freq, uint8_t max, const int32_t *slots, int64_t n);
void sketch_count(uint8_t *sketch, int bits, int depth, const int64_t *ids, int64_t n,
                  uint64_t key1, uint64_t key2, uint8_t top);
void sketch_estimate(const uint8_t *sketch, int bits, int depth, const int64_t *ids,
                     int64_t n, uint64_t key1, uint64_t key2, uint8_t *out);
int64_t shards_keep(const int64_t *ids, int64_t n, uint64_t key, int bits, uint64_t threshold,
                    int64_t *out, uint8_t *keep);
"""

policy_ffibuilder = _builder("embstore._kernels._policy_kernels", POLICY_CDEF,
                             "policy_kernels.c", "c99")

BAG_CDEF = """
void bag_group(const int64_t *offsets, int64_t nbags, const int64_t *inverse, int64_t nrows,
               int64_t *start, int64_t *order, int32_t *bag_of);
int bag_grad_rows(const float *grad, int64_t dim, const int64_t *start, const int64_t *order,
                  const int32_t *bag_of, const float *weights, const float *bag_size,
                  int64_t skip, int accumulate, int64_t lo, int64_t hi, float *acc,
                  float *out);
void bag_pool_slots_f32(char *const *slabs, int shift, int64_t row_bytes, const int32_t *slots,
                        const int64_t *offsets, const int64_t *inverse, int64_t dim,
                        int64_t lo, int64_t hi, float *out);
"""

bag_ffibuilder = _builder("embstore._kernels._bag_kernels", BAG_CDEF, "bag_kernels.c", "c99",
                          ("-ffp-contract=off", "-fno-fast-math"))

OPTIM_CDEF = """
int64_t optim_step_f32(int rule, int decay, float lr, float eps, float wd, float *rows,
                       int64_t width, const float *grads, int64_t n, int64_t dim,
                       float *scratch);
int64_t optim_step_slots_f32(int rule, int decay, float lr, float eps, float wd,
                             char *const *slabs, int shift, const int32_t *slots,
                             int64_t width, const float *grads, int64_t n, int64_t dim,
                             float *preimage, int64_t *order, float *scratch);
int slots_distinct(const int32_t *slots, int64_t n, uint64_t *bits);
int values_finite_f32(const float *x, int64_t n);
"""

# The optimizer rules must round every operation once, on every machine: no fused
# multiply-add (contraction) and no fast-math reassociation.
optim_ffibuilder = _builder("embstore._kernels._optim_kernels", OPTIM_CDEF, "optim_kernels.c",
                            "c99", ("-ffp-contract=off", "-fno-fast-math"))

HALF_CDEF = """
void half_decode(const uint16_t *in, int64_t n, int bf16, const float *table, float *out);
void half_encode(const float *in, int64_t n, int64_t dim, int64_t stride, int bf16,
                 const int64_t *ids, uint64_t seed_key, uint16_t *out);
"""

half_ffibuilder = _builder("embstore._kernels._half_kernels", HALF_CDEF, "half_kernels.c", "c99",
                           ("-ffp-contract=off", "-fno-fast-math"))

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    checksum_ffibuilder.compile(verbose=True)
    policy_ffibuilder.compile(verbose=True)
    bag_ffibuilder.compile(verbose=True)
    optim_ffibuilder.compile(verbose=True)
    half_ffibuilder.compile(verbose=True)
