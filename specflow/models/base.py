"""The model interface speculation needs: run any contiguous range of decoder layers.

A ``LayeredLM`` is a causal LM cut into its parts:

    ids --embed--> h_0 --layer 0--> h_1 --> ... --layer N-1--> h_N --head(N)--> logits

``h_l`` is the input of layer ``l`` (``h_N`` is the output of the last layer).  An *exit*
``L`` (1 <= L <= N) means "the logits computed from ``h_L``": ``head(h_L, L)``.  Exit ``N``
is the ordinary model; a smaller exit is early-exit/self-speculative drafting, using a
trained exit head when one is loaded for ``L`` and the shared final norm + LM head otherwise.

Each layer of each sequence owns a ``LayerKV``: the keys/values of the positions it has
computed so far, ``[0, length)``.  ``run_layer`` runs one layer for a *ragged batch* of
sequences (batch 1 is a batch of one) and appends each sequence's new positions to its
``LayerKV``; ``truncate(n)`` is rollback.  Where keys live (a contiguous buffer per sequence,
or blocks of a paged pool) is the ``LayerKV``'s business: the model meets it only through the
attention backend the ``LayerKV`` names.  The bookkeeping across layers (which positions each
layer has computed, the hidden states kept at layer boundaries) lives in
``specflow.models.session``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from specflow.errors import ConfigError

if TYPE_CHECKING:
    from specflow.paged.cache import PagedKVCache


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about a model that stages and configs check against.

    Attributes:
        name: a human-readable name (registry name, folder or hub id).
        num_layers: N, the number of decoder layers (exits are 1..N).
        vocab_size: V, the number of logits per position.
        hidden_size: H.
        max_positions: the context length the model supports.
        eos_token_ids: token ids that end generation.
        tokenizer_fingerprint: a hash of the tokenizer's vocabulary; two models can be
            drafter and target only if their fingerprints are equal.
        weights_fingerprint: a short hash identifying the weights (used to match exit heads).
    """

    name: str
    num_layers: int
    vocab_size: int
    hidden_size: int
    max_positions: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer_fingerprint: str = ""
    weights_fingerprint: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class LayerKV(Protocol):
    """The key/value cache of one decoder layer of one sequence: positions ``[0, length)``."""

    @property
    def length(self) -> int: ...

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (no-op when ``n >= length``)."""


# A ragged batch for one layer: (that sequence's LayerKV, its number of new positions t_i).
LayerBatch = list[tuple[LayerKV, int]]


@runtime_checkable
class LayeredLM(Protocol):
    """A causal LM whose decoder layers can be run one range at a time (see module doc)."""

    info: ModelInfo
    device: torch.device
    dtype: torch.dtype

    def new_layer_caches(self, max_len: int) -> list[LayerKV]:
        """One empty contiguous ``LayerKV`` per decoder layer for ``max_len`` positions."""

    def new_paged_cache(self, num_blocks: int, block_size: int, attention: str) -> PagedKVCache:
        """A paged KV pool for this model's layers (``ConfigError`` if it cannot page)."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [N] -> h_0 [N, H]``."""

    def run_layer(
        self, layer: int, hidden: torch.Tensor, batch: LayerBatch, memo: dict
    ) -> torch.Tensor:
        """``h_layer [N, H] -> h_{layer+1} [N, H]`` for a ragged batch.

        ``batch[i] = (kv_i, t_i)``: rows ``sum(t_<i) .. + t_i`` of ``hidden`` are positions
        ``[kv_i.length, kv_i.length + t_i)`` of sequence i.  Each sequence attends to its
        cached positions and causally within its block; the block's keys/values are
        appended to ``kv_i``.  ``memo`` caches addressing across the layers of one forward.
        """

    def head(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h_exit [N, H] -> logits [N, V]`` (float32) at exit ``exit_layer`` in 1..N."""

    def to(self, device: torch.device, dtype: torch.dtype) -> LayeredLM:
        """This model on ``device`` / ``dtype`` (itself when nothing changes)."""


def check_same_tokenizer(drafter: ModelInfo, target: ModelInfo) -> None:
    """Raise ``ConfigError`` unless the two models share a tokenizer (drafter / target)."""
    if drafter.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise ConfigError(
            f"drafter model {drafter.name!r} and target model {target.name!r} use different "
            f"tokenizers ({drafter.tokenizer_fingerprint[:12]} vs "
            f"{target.tokenizer_fingerprint[:12]}), so draft tokens would mean different text; "
            f"pick a drafter that shares the target's tokenizer (e.g. qwen2.5-coder-0.5b for "
            f"qwen2.5-coder-1.5b) or a model-free drafter (drafter=pld)"
        )
