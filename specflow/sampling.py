"""How tokens are chosen (``SamplingParams``), and turning logits into distributions and
tokens identically for every stage.

``SamplingParams`` is declared once: it is the config group ``sampling``'s schema
(``specflow.config``) and what the engine decodes with (``specflow.app`` turns the composed
group into one, which checks every value).  Drafters and acceptors must warp logits the same
way (temperature, then top-k, then top-p) so that the lossless rule compares the
distributions tokens are really drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: the config group ``sampling`` (its schema, and the one place
    these settings are declared).  ``temperature == 0`` is greedy (argmax).

    Attributes:
        temperature: softmax temperature; 0 = greedy.
        top_k: keep the k most likely tokens; 0 = no top-k filter.
        top_p: keep the smallest set of tokens whose mass reaches top_p; 1.0 = no nucleus
            filter.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (``temperature == 0``)."""
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [T, V] -> probs [T, V]`` (float32) after temperature, top-k and top-p.

    Greedy (``temperature == 0``) gives one-hot distributions on the argmax.
    """
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return probs
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [T, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row: ``probs [T, V] -> ids [T]``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """``logits [T, V] -> `` each row's argmax, the first index of its maximum (as
    ``logits.argmax(-1).tolist()``).

    On the host, float32 rows go through NumPy's argmax: vectorised, 7-15 times faster than
    torch's CPU argmax here (a 49,152-token row: 4 us against 44-64 us, on an AMD EPYC), which
    counts where every verified row's logits come to the host (14-17 % of a batch-8 round of
    SmolLM2 on a GPU).  Other dtypes and devices: torch's.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().contiguous().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[list[int], torch.Tensor | None]:
    """Pick one token per row of ``logits [T, V]``.

    Returns the token ids and, when sampling, the distributions ``[T, V]`` they were drawn
    from (``None`` when greedy: the choice is deterministic, q is one-hot).
    """
    if params.greedy:
        return greedy_tokens(logits), None
    probs = warp(logits, params)
    return sample(probs, generator).tolist(), probs
