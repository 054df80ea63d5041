"""One pass per prompt: greedy self-generated continuations *and* the hidden states to cache.

For each prompt of ``P`` tokens, the model's ``run_layer`` prefills positions ``[0, P)`` (a
batch of one), keeping ``h_L`` at every requested exit and ``h_N``; then up to ``G`` greedy
tokens are decoded for a batch of prompts at once: every decode step is one ``run_layer``
per layer over a ragged batch of one token per sequence (the MLP and projections batched over
sequences: the weights are read once per step instead of once per sequence, which is what
makes CPU decoding cheap; attention per sequence over its own contiguous cache).  Only the
model's public ``LayeredLM`` API is used.  The new token's hidden states are the next
position's cached states, so nothing is computed twice.

Positions with cached states are ``[0, P+G-1)`` (the last generated token is never fed
back).  Row ``p``'s final logits predict token ``p+1``; on the generated part their argmax
*is* token ``p+1`` (greedy).  With ``temperature > 0`` each new token is drawn instead from
``softmax(logits / temperature)`` with a seeded generator (the same seed and prompts give the
same tokens): more answers of the target's own distribution for one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.kv.base import LayeredLM, LayerKV
from specflow.kv.contiguous import layer_caches


@dataclass
class Generated:
    """One prompt's result: tokens (prompt + continuation) and hidden states per layer.

    ``hidden[L]`` is ``[len(tokens) - 1 or P, H]`` float32 for every requested layer ``L``
    (and ``N``): ``h_L`` of positions ``[0, rows)``.
    """

    tokens: list[int]
    prompt_len: int
    hidden: dict[int, torch.Tensor]


def pick_tokens(logits: torch.Tensor, temperature: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """``logits [B, V]`` -> ``[B]`` token ids: argmax when ``temperature`` is 0, else one draw
    from ``softmax(logits / temperature)`` per row (``generator``: the seeded source)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.inference_mode()
def prefill(
    lm: LayeredLM, prompt: list[int], layers: list[int], max_len: int,
    temperature: float = 0.0, generator: torch.Generator | None = None,
) -> tuple[dict[int, torch.Tensor], list[LayerKV], int]:
    """Run the prompt through every layer; return (``{L: h_L [P, H]}`` for ``layers`` and
    ``N``, the filled caches, the next token: greedy, or drawn at ``temperature``)."""
    n = lm.info.num_layers
    caches = layer_caches(lm, max_len)
    h = lm.embed(torch.tensor(prompt, dtype=torch.long))
    kept = {}
    memo: dict = {}
    for layer in range(n):
        h = lm.run_layer(layer, h, [(caches[layer], len(prompt))], memo)
        if layer + 1 in layers or layer + 1 == n:
            kept[layer + 1] = h.float().clone()
    first = int(pick_tokens(lm.head(h[-1:], n), temperature, generator)[0])
    return kept, caches, first


@torch.inference_mode()
def generate_with_hidden(
    lm: LayeredLM,
    prompts: list[list[int]],
    layers: list[int],
    max_new_tokens: int,
    batch_size: int = 16,
    eos_ids: tuple[int, ...] = (),
    progress: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[Generated]:
    """Greedy continuations of ``prompts`` (sampled ones at ``temperature > 0``, drawn with a
    generator seeded by ``seed``) and the hidden states of every position (see module doc).
    A sequence stops after ``max_new_tokens`` or an EOS token."""
    from tqdm.auto import tqdm

    n = lm.info.num_layers
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    results: list[Generated | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    bar = tqdm(total=len(prompts), desc="prefill+generate", disable=not progress)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        states = []  # per sequence: [tokens, hidden lists, caches, done]
        for i in idx:
            kept, caches, first = prefill(
                lm, prompts[i], layers, len(prompts[i]) + max_new_tokens, temperature, generator
            )
            states.append(([*prompts[i], first], {k: [v] for k, v in kept.items()}, caches))
        active = [j for j, s in enumerate(states) if s[0][-1] not in eos_ids]
        for _ in range(max_new_tokens - 1):
            if not active:
                break
            h = lm.embed(torch.tensor([states[j][0][-1] for j in active]))  # [B, H]
            memo: dict = {}
            for layer in range(n):
                batch = [(states[j][2][layer], 1) for j in active]  # one token per sequence
                h = lm.run_layer(layer, h, batch, memo)  # [B, H]
                if layer + 1 in states[active[0]][1]:
                    for row, j in enumerate(active):
                        states[j][1][layer + 1].append(h[row : row + 1].float().clone())
            nxt = pick_tokens(lm.head(h, n), temperature, generator).tolist()
            for j, tok in zip(active, nxt, strict=True):
                states[j][0].append(int(tok))
            active = [j for j in active if states[j][0][-1] not in eos_ids]
        for i, (tokens, hidden, _caches) in zip(idx, states, strict=True):
            results[i] = Generated(
                tokens=tokens,
                prompt_len=len(prompts[i]),
                hidden={k: torch.cat(v) for k, v in hidden.items()},
            )
        bar.update(len(idx))
    bar.close()
    return results  # type: ignore[return-value]
