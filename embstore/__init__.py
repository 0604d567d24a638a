"""embstore: a tiered storage engine for the embedding tables of recommendation models.

Tables map int64 ids to float rows plus the optimizer state that travels with them, held in a
chain of tiers (DRAM, persistent memory, RocksDB, LMDB) with admission and eviction policies.
See `embstore.open`.

Caveats:
    - A store has one writer at a time (a lock file enforces it: StoreLockedError); within
      the process one writing handle per store, shared by threads. Read-only handles
      (`open(path, read_only=True)`) take no lock and may open beside the writer.
    - Cache tiers start empty on every open; only the bottom tier is the store of record.
    - Only `flush()` (or `close()`) makes writes durable. After a flush fails, the handle
      refuses every later flush (SyncFailedError): close it and reopen the store.
    - A table whose store of record persists keeps a written-id record beside it, so a row the
      medium lost raises CorruptStoreError instead of reading as new; if those records are
      lost while the rows are intact, `rebuild_written_records(path)` rebuilds them.
    - Large batches on DRAM tiers run their memory-bound kernels on several threads
      (`set_num_threads`, or `EMBSTORE_NUM_THREADS`); results are the same for every count.
"""

from . import errors, fsck, init, optim
from ._open import open
from ._parallel import get_num_threads, set_num_threads
from ._written_rebuild import rebuild_written_records
from .checkpoint import restore
from .spec import TableSpec, TierSpec
from .store import EmbeddingStore

__all__ = ["EmbeddingStore", "TableSpec", "TierSpec", "errors", "fsck", "get_num_threads", "init",
           "open", "optim", "rebuild_written_records", "restore", "set_num_threads"]
__version__ = "0.1.0"
