"""Any HF causal LM as a one-layer ``LayeredLM``: the generic fallback for ``NativeLM``.

The whole decoder is "layer 0", so ``info.num_layers == 1`` and the only exit is 1 (the
real layer count stays in ``info.extra["real_num_layers"]`` for reporting).  No early exit,
but speculation with a separate drafter works for every architecture HF supports.

Hack: ``embed`` returns the token ids themselves (``[T]`` long), not ``h_0``; layer 0 embeds
them inside HF.  This only holds because ``ModelSession`` passes ``embed``'s output straight
to ``run_layer(0, ...)`` and never keeps or concatenates ``h_0``.

``run_layer`` returns the decoder's last hidden state (after HF's final norm) and ``head``
applies the output embedding, so logits == HF's ``logits`` for models computing them as
``lm_head(last_hidden_state)`` (plus Gemma-style ``final_logit_softcapping``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import DynamicCache

from specflow.errors import ConfigError, PromptTooLongError
from specflow.models.base import ModelInfo


class HFLayerKV:
    """A ``DynamicCache`` of the whole HF model; ``length`` = its sequence length.

    Past recording is activated so that sliding-window layers can be rolled back too.
    """

    def __init__(self, config, max_len: int) -> None:
        self.cache = DynamicCache(config=config)
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self.max_len = max_len

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def truncate(self, n: int) -> None:
        """Forget positions ``>= n`` (no-op when ``n >= length``)."""
        length = self.length
        if n < length:
            self.cache.crop(n - length)  # transformers 5: a negative count of tokens to drop


class HFBackendLM:
    """Wraps an HF causal LM as one "layer" (see module doc)."""

    def __init__(self, hf_model: nn.Module, info: ModelInfo) -> None:
        self.hf_model = hf_model.eval()
        self.decoder = hf_model.get_decoder()
        self.lm_head = hf_model.get_output_embeddings()
        self.softcap = getattr(hf_model.config, "final_logit_softcapping", None)
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        extra = {**info.extra, "real_num_layers": info.num_layers}
        self.info = dataclasses.replace(info, num_layers=1, extra=extra)

    def new_layer_caches(self, max_len: int) -> list[HFLayerKV]:
        """One ``HFLayerKV`` (the single "layer") for up to ``max_len`` positions."""
        return [HFLayerKV(self.hf_model.config, max_len)]

    def new_paged_cache(
        self, num_blocks: int, block_size: int, attention: str, num_layers: int | None = None
    ):  # noqa: ANN201 - never returns
        raise ConfigError(
            f"{self.info.name} runs on the generic transformers backend, which keeps its own "
            f"contiguous cache: set runner.kv_layout=contiguous (paged KV needs "
            f"model.backend=native, Llama/Qwen2 models)"
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> HFBackendLM:
        param = next(self.hf_model.parameters())
        if torch.device(device).type == param.device.type and dtype == param.dtype:
            return self
        raise ConfigError(
            f"{self.info.name} runs on the generic transformers backend, which is not moved: "
            f"load it with the device/dtype you run it on (model.dtype), or use the native "
            f"backend"
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [T] -> token_ids [T]`` (long): embedding happens inside layer 0."""
        return token_ids.to(device=self.device, dtype=torch.long)

    @torch.inference_mode()
    def run_layer(
        self, layer: int, hidden: torch.Tensor, batch: list[tuple[HFLayerKV, int]], memo: dict
    ) -> torch.Tensor:
        """``token_ids [N] -> last hidden states [N, H]``: the batch's sequences one by one."""
        outs, row = [], 0
        for cache, t in batch:
            outs.append(self._run_one(layer, hidden[row : row + t], cache))
            row += t
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _run_one(self, layer: int, hidden: torch.Tensor, cache: HFLayerKV) -> torch.Tensor:
        """``token_ids [T] -> last hidden state [T, H]`` for positions ``[cache.length, +T)``."""
        if layer != 0:
            raise ValueError(f"HFBackendLM has one layer (0), got layer {layer}")
        start = cache.length
        t = hidden.shape[0]
        if start + t > cache.max_len:
            raise PromptTooLongError(
                f"position {start + t} is beyond this cache's {cache.max_len} positions"
            )
        positions = torch.arange(start, start + t, device=self.device)  # [T]
        out = self.decoder(
            input_ids=hidden[None],
            position_ids=positions[None],
            cache=cache.cache,
            use_cache=True,
        )
        return out.last_hidden_state[0]  # [T, H]

    @torch.no_grad()
    def head(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h [T, H] -> logits [T, V]`` float32; only exit 1 exists."""
        if exit_layer != 1:
            raise ValueError(f"HFBackendLM has one exit (1), got {exit_layer}")
        logits = self.lm_head(hidden).float()  # [T, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
