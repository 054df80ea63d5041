"""Prompts to distil on: the project's own Spec-Bench dev questions (or random ids in tests).

Each Spec-Bench question's first turn is cut to ``max_prompt_tokens`` content tokens (long
summarization/RAG articles would otherwise dominate the cost) and wrapped in the chat
template, as the runner does.  The split is stratified by position in the file: question
``i`` is held out for evaluation iff ``i % eval_every == eval_offset`` (the file lists the
categories in blocks, so every category is represented in both splits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specflow.workload import DATA_DIR


@dataclass(frozen=True)
class Prompt:
    """One prompt: its source id, category, token ids and split (0 train, 1 eval)."""

    prompt_id: str
    category: str
    ids: list[int]
    split: int


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    """One user turn in the tokenizer's chat template, generation prompt added, as ids."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _split(i: int, eval_every: int, eval_offset: int) -> int:
    return int(eval_every > 0 and i % eval_every == eval_offset)


def specbench_prompts(
    tokenizer: Any,
    path: str | None = None,
    max_prompt_tokens: int = 64,
    chat_template: bool = True,
    eval_every: int = 6,
    eval_offset: int = 5,
    limit: int | None = None,
) -> list[Prompt]:
    """The Spec-Bench dev questions as token ids (see module doc)."""
    path = Path(path) if path else DATA_DIR / "specbench" / "question.dev.jsonl"
    out = []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    for i, line in enumerate(lines[:limit] if limit else lines):
        d = json.loads(line)
        content = d["turns"][0]
        ids = tokenizer.encode(content, add_special_tokens=False)
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            content = tokenizer.decode(ids[:max_prompt_tokens])
        if chat_template and getattr(tokenizer, "chat_template", None):
            ids = chat_ids(tokenizer, content)
        else:
            ids = tokenizer.encode(content)
        out.append(Prompt(str(d["question_id"]), d["category"], list(ids),
                          _split(i, eval_every, eval_offset)))
    return out


def specbench_split(
    tokenizer: Any,
    max_prompt_tokens: int = 64,
    eval_every: int = 6,
    eval_offset: int = 5,
    path: str | None = None,
) -> tuple[list[Prompt], list[Prompt]]:
    """The Spec-Bench dev questions as ``(train, held_out)``, built as ``specbench_prompts``
    builds them (first turn cut to ``max_prompt_tokens`` content tokens, chat template):
    question ``i`` is held out iff ``i % eval_every == eval_offset``, every other one is in
    ``train``; the two are disjoint and together are the whole file."""
    prompts = specbench_prompts(tokenizer, path, max_prompt_tokens, eval_every=eval_every,
                                eval_offset=eval_offset)
    return [p for p in prompts if p.split == 0], [p for p in prompts if p.split == 1]


def random_prompts(
    num_prompts: int, prompt_len: int, vocab_size: int, eval_every: int = 4,
    eval_offset: int = 3, seed: int = 0, avoid: tuple[int, ...] = (),
) -> list[Prompt]:
    """Random token-id prompts (for tiny random models in tests)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_prompts):
        ids = torch.randint(1, vocab_size, (prompt_len,), generator=gen).tolist()
        ids = [t if t not in avoid else 1 for t in ids]
        out.append(Prompt(str(i), "random", ids, _split(i, eval_every, eval_offset)))
    return out


def shared_prefix(prompts: list[Prompt]) -> int:
    """Length of the token prefix every prompt shares (the chat template's system part),
    at most the shortest prompt's length minus one."""
    ids = [p.ids for p in prompts]
    n = min(len(x) for x in ids) - 1
    i = 0
    while i < n and all(x[i] == ids[0][i] for x in ids):
        i += 1
    return i
