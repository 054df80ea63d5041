"""Any HF causal LM as a one-unit ``LayeredLM``: the generic fallback for ``NativeLM``.

The whole decoder runs as one unit, "layer 0": ``info.num_layers == 1`` (``run_layer`` runs
units, and this backend cannot stop inside HF's decoder) and the only exit is 1; the
decoder's real layer count is ``info.decoder_layers``.  No early exit, but speculation with
a separate drafter works for every architecture HF supports.

``embed`` is HF's input embedding (``h_0``) and ``run_layer(0, h_0)`` feeds it to the decoder
as ``inputs_embeds``; ``run_layer`` returns the decoder's last hidden state (after HF's final
norm) and ``head`` applies the output embedding, so logits == HF's ``logits`` for models
computing them as ``lm_head(last_hidden_state)`` (plus Gemma-style
``final_logit_softcapping``).  HF keeps its own cache (a ``DynamicCache`` per sequence,
``HFLayerKV``): contiguous layout only (``kv`` is a ``SelfManagedKV``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import DynamicCache

from specflow.errors import ConfigError, PromptTooLongError
from specflow.kv.base import LayerKV, ModelInfo, SelfManagedKV


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
        self.input_embeddings = hf_model.get_input_embeddings()
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        self.info = dataclasses.replace(info, num_layers=1, decoder_layers=info.num_layers)

    @property
    def kv(self) -> SelfManagedKV:
        """HF keeps its own cache: one ``HFLayerKV`` (the single unit) per sequence."""
        return SelfManagedKV(
            new_caches=self._new_caches,
            why_not_paged=(
                f"{self.info.name} runs on the generic transformers backend, which keeps its "
                f"own contiguous cache: set runner.kv_layout=contiguous (paged KV needs "
                f"model.backend=native, Llama/Qwen2 models)"
            ),
        )

    def _new_caches(self, max_len: int) -> list[LayerKV]:
        return [HFLayerKV(self.hf_model.config, max_len)]

    def to(self, device: torch.device, dtype: torch.dtype) -> HFBackendLM:
        param = next(self.hf_model.parameters())
        if torch.device(device).type == param.device.type and dtype == param.dtype:
            return self
        raise ConfigError(
            f"{self.info.name} runs on the generic transformers backend, which is not moved: "
            f"load it with the device/dtype you run it on (model.dtype), or use the native "
            f"backend"
        )

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [T] -> h_0 [T, H]``: HF's input embedding."""
        return self.input_embeddings(token_ids.to(device=self.device, dtype=torch.long))

    @torch.inference_mode()
    def run_layer(
        self, layer: int, hidden: torch.Tensor, batch: list[tuple[HFLayerKV, int]], memo: dict
    ) -> torch.Tensor:
        """``h_0 [N, H] -> last hidden states [N, H]``: the batch's sequences one by one."""
        outs, row = [], 0
        for cache, t in batch:
            outs.append(self._run_one(layer, hidden[row : row + t], cache))
            row += t
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _run_one(self, layer: int, hidden: torch.Tensor, cache: HFLayerKV) -> torch.Tensor:
        """``h_0 [T, H] -> last hidden state [T, H]`` for positions ``[cache.length, +T)``."""
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
            inputs_embeds=hidden[None],
            position_ids=positions[None],
            cache=cache.cache,
            use_cache=True,
        )
        return out.last_hidden_state[0]  # [T, H]

    def exit_adapter(self, exit_layer: int) -> None:
        """No adapters: the one exit is the model's last layer."""
        return None

    def fused_layers(self) -> None:
        """None: HF's decoder runs the forward (``LayeredLM`` doc)."""
        return None

    @torch.no_grad()
    def head(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """``h [T, H] -> logits [T, V]`` float32; only exit 1 exists."""
        if exit_layer != 1:
            raise ValueError(f"HFBackendLM has one exit (1), got {exit_layer}")
        logits = self.lm_head(hidden).float()  # [T, V]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
