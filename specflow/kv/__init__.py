"""The basement: where a request's keys/values live and how a decoder layer attends to them.

- ``base``: the contract with the models (``LayeredLM``, ``ModelInfo``), the layer caches
  (``LayerKV``, ``AttendedKV``), ``AttentionBackend``, ``KVSpec`` and ``StaticPath``.  It
  imports nothing else of ``kv`` but the leaf ``tree``; ``specflow.models`` imports only it.
- ``tree``: ``TreeLayout``, cache rows that form a token tree (masks, positions, the path).
- ``session``: ``ModelSession``, one model's view of one request (a layered KV cache that
  computes only what is missing), and the batched forwards over many sessions.
- ``stores``: ``KVStores`` (a run's stores: contiguous or paged, placement, admission).
- ``contiguous``: ``KVCache`` and ``ContiguousAttention`` (a buffer per sequence and layer).
- ``paged``: ``PagedKVCache`` (blocks, block tables, promises) and ``PagedAttention``.
- ``kernels``: ``paged_sdpa`` (the one paged SDPA kernel), ``flash_paged``, causal prefill.
- ``static``: fixed-shape decode/verify steps over a pool, replayed as CUDA graphs.

Imports point down: stores -> session -> contiguous -> base; stores -> paged, static -> kernels.
"""
