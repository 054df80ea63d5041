"""The paged KV store (the GPU path; also on CPU): blocks, block tables, paged attention.

- ``cache``: ``BlockAllocator`` (fixed-size blocks, free list, promises for admission
  control) and ``PagedKVCache`` (one K/V pool per model, per-sequence block tables,
  per-layer lengths; ``PagedLayerKV`` is one (sequence, layer)'s ``LayerKV``).
- ``attention``: the kernels (``sdpa_paged``, ``flash_paged``), ``select_backend`` and
  ``PagedAttention``, the model's attention backend over a pool.

Sessions over a pool are ordinary ``specflow.kv.session.ModelSession``s (opened by
``specflow.kv.stores.KVStores``); the engine and the decoder layer are the same for
every KV layout and batch size.
"""
