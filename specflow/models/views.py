"""Views of a model that share its weights: the model with some layers skipped."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from specflow.errors import ConfigError
from specflow.models.base import LayerBatch, LayeredLM, LayerKV

if TYPE_CHECKING:
    from specflow.paged.cache import PagedKVCache


class LayerSkipView:
    """``model`` with the decoder layers in ``skip`` left out (self-speculative drafting).

    Layer ``i`` of the view is layer ``kept[i]`` of the model; the view's hidden states
    differ from the model's, so it keeps its own KV caches (its own session).
    """

    def __init__(self, model: LayeredLM, skip: list[int]) -> None:
        depth = model.info.num_layers
        bad = [i for i in skip if not 0 <= i < depth]
        if bad:
            raise ConfigError(f"skip_layers {bad} outside 0..{depth - 1} ({model.info.name})")
        self.kept = [i for i in range(depth) if i not in set(skip)]
        if not self.kept:
            raise ConfigError("skip_layers skips every layer; keep at least one")
        self.skip = sorted(set(skip))
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        name = f"{model.info.name}[skip {self.skip}]"
        self.info = replace(model.info, name=name, num_layers=len(self.kept))

    def new_layer_caches(self, max_len: int) -> list[LayerKV]:
        caches = self.model.new_layer_caches(max_len)
        return [caches[i] for i in self.kept]

    def new_paged_cache(
        self, num_blocks: int, block_size: int, attention: str, num_layers: int | None = None
    ) -> PagedKVCache:
        """A pool with one layer per *kept* layer (the view's own depth)."""
        return self.model.new_paged_cache(
            num_blocks, block_size, attention, num_layers or len(self.kept)
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> LayerSkipView:
        moved = self.model.to(device, dtype)
        return self if moved is self.model else LayerSkipView(moved, self.skip)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(token_ids)

    def run_layer(
        self, layer: int, hidden: torch.Tensor, batch: LayerBatch, memo: dict
    ) -> torch.Tensor:
        # The weights of model layer kept[layer]; the keys/values of the view's own layer.
        return self.model.run_layer(self.kept[layer], hidden, batch, memo)

    def head(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        # The view's last layer feeds the model's final norm + LM head.
        return self.model.head(hidden, self.model.info.num_layers)
