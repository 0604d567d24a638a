"""cffi builders for the pmem backend, compiled at install time by setup.py.

- `ffibuilder`: ABI mode, out of line. It writes `embstore/_kernels/_libpmem_ffi.py`, which
  holds only the declarations below; `embstore._libpmem` dlopens Debian's `libpmem.so.1` at
  run time, so neither libpmem's headers nor the library are needed to build or install.
- `records_ffibuilder`: API mode, the record kernels of `pmem_records.c` (gather + CRC-32C
  verification in one pass, record writes, madvise). It is compiled together with `checksum.c` and
  `dram_index.c`, so the CRC and the id hash are the very code `embstore.checksum` and
  `IdIndex` use, without a second copy that could drift from them.
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).parent

# Declarations from libpmem.h (PMDK 1.x ABI, stable since libpmem.so.1). mode_t is an
# unsigned int on Linux, declared as such so the ABI module needs no system headers.
LIBPMEM_CDEF = """
void *pmem_map_file(const char *path, size_t len, int flags, unsigned int mode,
                    size_t *mapped_lenp, int *is_pmemp);
int pmem_unmap(void *addr, size_t len);
int pmem_is_pmem(const void *addr, size_t len);
void pmem_persist(const void *addr, size_t len);
int pmem_msync(const void *addr, size_t len);
void pmem_flush(const void *addr, size_t len);
void pmem_drain(void);
void *pmem_memcpy_persist(void *pmemdest, const void *src, size_t len);
const char *pmem_errormsg(void);
const char *pmem_check_version(unsigned major_required, unsigned minor_required);
"""

ffibuilder = FFI()
ffibuilder.cdef(LIBPMEM_CDEF)
ffibuilder.set_source("embstore._kernels._libpmem_ffi", None)

RECORDS_CDEF = """
int64_t rec_gather(const char *base, int64_t record_size, int64_t payload_offset,
                   int64_t row_bytes, const int64_t *keys, const int32_t *vals, uint64_t mask,
                   const int64_t *ids, int64_t n, char *out, uint8_t *found,
                   int64_t *first_bad, char *scratch);
int64_t rec_index_upsert(int64_t *keys, int32_t *vals, uint64_t mask, const int64_t *ids,
                         const int32_t *slots, int64_t n, int32_t *old_slots);
void rec_write(char *base, int64_t record_size, int64_t payload_offset, int64_t row_bytes,
               const int64_t *slots, const int64_t *ids, uint64_t first_counter,
               uint32_t kind, const char *rows, int64_t n);
void rec_seq_words(const uint64_t *counters, int64_t n, uint64_t *out);
void rec_zero_seq(char *base, int64_t record_size, int64_t seq_offset,
                  const int64_t *slots, int64_t n);
int rec_madvise(void *addr, size_t len, int advice);
int rec_sync_ranges(int fd, const int64_t *starts, const int64_t *lens, int64_t n);
"""

records_ffibuilder = FFI()
records_ffibuilder.cdef(RECORDS_CDEF)
records_ffibuilder.set_source(
    "embstore._kernels._pmem_records",
    "\n".join((HERE / name).read_text()
              for name in ("checksum.c", "dram_index.c", "pmem_records.c")),
    extra_compile_args=["-O3", "-std=gnu99"],
    define_macros=[("_GNU_SOURCE", None)],  # sync_file_range
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    records_ffibuilder.compile(verbose=True)
