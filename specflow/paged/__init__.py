"""Batched decoding over a paged KV cache (continuous batching, SDPA / FlashAttention).

- ``cache``: ``BlockAllocator`` (fixed-size blocks, free list, reservations) and
  ``PagedKVCache`` (one K/V pool per model, per-sequence block tables, per-layer lengths).
- ``attention``: ``sdpa_paged`` / ``flash_paged`` and ``select_backend``.
- ``batched_lm``: ``BatchedLM`` (NativeLM weights, ragged batched layers writing into the
  paged cache), ``PagedSession`` (``ModelSession`` bookkeeping over paged caches) and
  ``batched_logits``.
- ``batch_engine``: ``BatchedPipeline``, the round loop of a ``SpeculativePipeline`` over up to
  ``batch_size`` sequences at once.
- ``batch_runner``: ``BatchRunner``, the batched counterpart of ``specflow.runner.Runner``.

The batch-1 path (``NativeLM`` + ``ModelSession`` + ``SpeculativePipeline.generate``) does not
use any of this.
"""
