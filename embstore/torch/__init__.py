"""PyTorch adapter: store tables as torch.nn modules, and a pipeline that prefetches rows.

Imported on demand (``import embstore.torch``); ``import embstore`` does not load torch.

- `EmbeddingBag`, `Embedding`: torch.nn.EmbeddingBag's and torch.nn.Embedding's calling
  conventions over one store table.
- `EmbeddingBagCollection`: several features (TorchRec's KeyedJaggedTensor or
  {feature: (values, lengths)}) pooled side by side, like TorchRec's module of that name.
- `TrainPipeline`: looks up the next batches' rows on a background thread while the current
  batch computes; exact (bit-identical results) by default.

Their backward passes apply each table's fused optimizer inside the store: there is no dense
gradient and nothing for a torch optimizer to step; train the dense part as usual.

Caveats:
    - Tables live on the CPU side (numpy); on a GPU the looked-up rows are copied to the
      device and the gradients back.
    - Time-based expiry (a "ttl" policy on a bottom tier) counts store calls, and the pipeline
      adds lookups, so expiry may differ with and without it.
"""

from .modules import Embedding, EmbeddingBag, EmbeddingBagCollection, KeyedEmbeddings
from .pipeline import TrainPipeline

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "KeyedEmbeddings",
           "TrainPipeline"]
