"""Views of a model that share its weights: the model with some layers skipped."""

from __future__ import annotations

from dataclasses import replace

import torch

from specflow.errors import ConfigError
from specflow.kv.base import KVSpec, LayerBatch, LayeredLM, SelfManagedKV


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

    @property
    def kv(self) -> KVSpec:
        """The model's keys/values for the *kept* layers only (the view's own depth)."""
        spec = self.model.kv
        if isinstance(spec, SelfManagedKV):
            raise ConfigError(
                f"drafter.skip_layers needs the native backend; {self.model.info.name} keeps "
                f"its own cache (model.backend=hf)"
            )
        return replace(spec, num_layers=len(self.kept))

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

    def exit_adapter(self, exit_layer: int) -> None:
        """No adapters: the view drafts from its last layer only."""
        return None

    def fused_layers(self) -> None:
        """None: the view's layers run one by one (``LayeredLM`` doc)."""
        return None

    def head(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        # The view's last layer feeds the model's final norm + LM head.
        return self.model.head(hidden, self.model.info.num_layers)
