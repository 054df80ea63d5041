"""The contract between a model and its keys/values: what ``models/`` and ``kv/`` share.

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
or blocks of a paged pool) is the ``LayerKV``'s business: a decoder layer meets it only
through the ``AttentionBackend`` the ``LayerKV`` names (``AttendedKV``).  A model describes
its keys/values by a ``KVSpec`` (layers, KV heads, head dim, dtype, device) and the stores of
``specflow.kv`` build the buffers from it; a model that keeps its own cache (the generic
transformers backend) says so with ``SelfManagedKV``.

This module imports nothing else of ``specflow.kv`` but the leaf ``specflow.kv.tree``, and
nothing of ``specflow.models``:
``models/`` implements these protocols, ``kv/`` builds on them, neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from specflow.errors import ConfigError
from specflow.kv.tree import TreeLayout


@dataclass(frozen=True)
class ModelInfo:
    """Static facts about a model that stages and configs check against.

    Attributes:
        name: a human-readable name (registry name, folder or hub id).
        num_layers: N, the number of layer units ``run_layer`` runs one at a time (exits
            are 1..N).  The decoder's own layer count when layers run one by one (the native
            backend); 1 for a model that runs its whole decoder as one unit (the generic
            transformers backend: ``decoder_layers`` then says how many it has).
        vocab_size: V, the number of logits per position.
        hidden_size: H.
        max_positions: the context length the model supports.
        eos_token_ids: token ids that end generation.
        tokenizer_fingerprint: a hash of the tokenizer's vocabulary; two models can be
            drafter and target only if their fingerprints are equal.
        weights_fingerprint: a short hash identifying the weights (used to match exit heads).
        decoder_layers: the architecture's decoder layer count where it differs from
            ``num_layers`` (0: they are the same).
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
    decoder_layers: int = 0


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


# ---------------------------------------------------------------------------- keys/values
@runtime_checkable
class LayerKV(Protocol):
    """The key/value cache of one decoder layer of one sequence: positions ``[0, length)``.

    What a session and a store need of any layer cache.
    """

    @property
    def length(self) -> int: ...

    @property
    def max_len(self) -> int:
        """The most positions this cache may hold."""

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (no-op when ``n >= length``)."""


@runtime_checkable
class AttendedKV(LayerKV, Protocol):
    """A ``LayerKV`` whose keys/values specflow's attention backends read and write: what a
    decoder layer (``NativeLM.run_layer``) needs of its batch.

    Attributes:
        layer: the layer index this cache belongs to (its pool's layer, for paged).
        seq_id: the sequence it belongs to (its block table, for paged).
        attention: the backend that writes and reads these keys/values.
    """

    @property
    def layer(self) -> int: ...

    @property
    def seq_id(self) -> int: ...

    @property
    def attention(self) -> AttentionBackend[Any]: ...

    # The token tree the positions from ``tree.start`` on form (``specflow.kv.tree``), or
    # None: the backends lay out and mask a forward's rows by it.
    tree: TreeLayout | None

    def keep_rows(self, start: int, rows: list[int]) -> None:
        """Of the positions from ``start`` on keep ``rows`` (increasing offsets): position
        ``start + rows[j]`` moves to ``start + j`` and the length becomes
        ``start + len(rows)`` (a verified tree's accepted path)."""


# A ragged batch for one layer: (that sequence's LayerKV, its number of new positions t_i).
LayerBatch = list[tuple[LayerKV, int]]

KV = TypeVar("KV", bound=AttendedKV, contravariant=True)


class AttentionBackend(Protocol[KV]):
    """How one layer's ragged batch writes and reads its keys/values.

    Each backend takes batches of its own ``LayerKV`` type ``KV`` (the per-backend batch
    type ``list[tuple[KV, int]]``).  For a batch ``[(kv_i, t_i)]`` of one layer:

    ``positions(batch, memo)``: the absolute positions of the packed rows (``[N]`` or a
    slice); ``attend(q [N, NH, D], k [N, KH, D], v [N, KH, D], batch, scale, memo)``: write
    the new keys/values (RoPE already applied), advance every ``kv_i.length`` by ``t_i``, and
    return ``[N, NH, D]`` with *lower-right aligned* causal attention: query ``s_i + j`` sees
    keys ``<= s_i + j`` of its own sequence.  ``memo`` caches addressing across the layers
    of one forward.
    """

    name: str

    def positions(self, batch: list[tuple[KV, int]], memo: dict) -> slice | torch.Tensor: ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: list[tuple[KV, int]],
        scale: float,
        memo: dict,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class KVSpec:
    """What a model's keys/values look like: all a store needs to build buffers for them.

    Per layer and position: ``kv_heads x head_dim`` keys and as many values, in ``dtype`` on
    ``device``; ``num_layers`` layers.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    # The model needs each query row attended exactly as a one-row step attends it (the
    # same keys, the same ops, so the same bits) whatever rows are verified beside it: a
    # GGUF-quantized model, whose 8-bit activations can turn a last-bit difference into
    # another token.  The contiguous layout does it (``specflow.kv.contiguous``); the paged
    # layout's padded batches cannot and refuse such a model.
    row_exact: bool = False


@dataclass(frozen=True)
class SelfManagedKV:
    """A model that keeps its own cache (the generic transformers backend): contiguous only.

    Attributes:
        new_caches: ``max_len -> one LayerKV per layer`` (the model's own cache objects).
        why_not_paged: the message a paged layout gets (names the fix).
    """

    new_caches: Callable[[int], list[LayerKV]]
    why_not_paged: str


class ExitAdapter(Protocol):
    """An exit head with a KV cache (an attention adapter): one decoder layer that reads
    ``h_L`` of every position of a sequence, in order, before the model's layer ``L`` consumes
    it (``specflow.kv.session`` feeds it); ``LayeredLM.head`` at exit ``L`` then maps the
    adapter's outputs ``a`` to logits.  ``specflow.models.adapter_head`` has the math."""

    @property
    def kv(self) -> KVSpec:
        """The keys/values of the adapter's one layer (one cache per sequence)."""

    def run(self, hidden: torch.Tensor, batch: LayerBatch, memo: dict) -> torch.Tensor:
        """``h_L [N, H] -> a [N, H]`` for a ragged batch of the adapter's caches (the batch
        convention of ``LayeredLM.run_layer``)."""


@runtime_checkable
class LayeredLM(Protocol):
    """A causal LM whose decoder layers can be run one range at a time (see module doc)."""

    info: ModelInfo
    device: torch.device
    dtype: torch.dtype

    @property
    def kv(self) -> KVSpec | SelfManagedKV:
        """The shape of this model's keys/values (or: it keeps its own cache)."""

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
        """``h_exit [N, H] -> logits [N, V]`` (float32) at exit ``exit_layer`` in 1..N (at an
        exit with an adapter, ``hidden`` is the adapter's output)."""

    def exit_adapter(self, exit_layer: int) -> ExitAdapter | None:
        """The attention adapter at early exit ``exit_layer``, or ``None`` (position-wise)."""

    def to(self, device: torch.device, dtype: torch.dtype) -> LayeredLM:
        """This model on ``device`` / ``dtype`` (itself when nothing changes)."""

    def fused_layers(self) -> FusedLayers | None:
        """Its layers as one kernel call runs them for a full forward of a few rows without
        the layer loop -- the same bits (``specflow.kv.fused``) -- or ``None`` (the layer
        loop runs every forward).  The GGUF-quantized native model's."""


class RowPaddedLM(LayeredLM, Protocol):
    """A ``LayeredLM`` that runs a pass of few rows on at least ``min_rows`` rows (its row
    padding, ``model.min_rows``) and keeps what its row probe measured (``row_probe``:
    ``specflow.cpu.row_padding.RowProbe`` once probed, else ``None``): the native model.  A
    feature head placed beside its target reads both to price a tree against chains."""

    min_rows: int
    row_probe: object | None


@dataclass(frozen=True, eq=False)
class FusedLayers:
    """A model whose full forward of a few rows runs in one kernel call
    (``LayeredLM.fused_layers``; ``specflow.kv.fused`` runs it over a session's caches).

    Attributes:
        layers: the address of each layer's kernel description, in order (``specflow.quant.
            layer.QuantLayer.address``), valid while ``keep`` lives.
        embed: ``token_ids [T] -> h_0 [T, H]``.
        cos, sin_signed: the RoPE tables ``[P, D]`` (float32, contiguous).
        scale: the attention's ``1 / sqrt(D)``.
        keep: what keeps the addresses valid (the layer kernels).
    """

    layers: tuple[int, ...]
    embed: Callable[[torch.Tensor], torch.Tensor]
    cos: torch.Tensor
    sin_signed: torch.Tensor
    scale: float
    keep: object


# ---------------------------------------------------------------------------- static path
# One sequence of a static step: (its sequence id, its tokens of the step, first position).
StaticRow = tuple[int, list[int], int]


class StaticPath(Protocol):
    """Fixed-shape full forwards of one model over its paged pool (``specflow.kv.static``):
    what a session asks of it."""

    def run(self, rows: list[StaticRow]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """``(h_N [t_i, H], logits [t_i, V])`` per row after one full forward of layers
        ``0..N-1`` (the pool's lengths updated), or ``None`` when the step does not fit a
        static shape (then nothing ran: the caller runs it eagerly)."""

    def note_eager(self) -> None:
        """Count a step the sessions could not hand to the static path (partial layers)."""
