"""Training prompts read from JSONL files (``head.data.prompt_files``), answered by the target.

Each line of a file is a JSON object whose ``"prompt"`` is one user message, or ``null``
for a line to skip: the self-written prompts a run kept (``self_written_prompts.jsonl`` in
its run folder, ``train_heads.magpie``; dropped draws have ``"prompt": null``) can be fed
back as they are, on any machine, without drawing them again, and so can any prompt list a
user brings.  A prompt is kept iff, in the chat template (``chat_ids``),

- it fits ``max_prompt_tokens`` (``long`` otherwise),
- no earlier prompt of these files, nor a self-written prompt of the same run, has the
  same text (``duplicate``),
- it shares no ``NGRAM``-token run with a held-out evaluation prompt, both compared without
  the template (``heldout_overlap``; the same check as the self-written prompts).

The kept prompts of each file are answered greedily with every position's ``h_N``
(``generate_chunked``), cached as ``file<max_new_tokens>-<hash>_<i>.safetensors`` under the
data folder, ``hash`` covering the file's kept prompts in order: a rerun loads, an
interrupted run resumes at the next chunk, an edited file is answered again, and the files
never change the data folder's key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specflow.errors import ConfigError
from train_heads.feature_data import FeatureSequences, data_key, generate_chunked
from train_heads.magpie import content_ids, held_out_ngrams, ngrams, template_bounds
from train_heads.prompts import chat_ids


def read_prompt_file(path: Path) -> list[str | None]:
    """The ``"prompt"`` of every line of a JSONL file (``None`` where it is null); blank
    lines skipped.  ``ConfigError`` naming the file and line for a missing file, a line that
    is not a JSON object with a ``"prompt"`` string or null."""
    if not path.is_file():
        raise ConfigError(f"head.data.prompt_files: {path} is not a file (give JSONL files "
                          "with one {\"prompt\": \"...\"} object per line)")
    prompts: list[str | None] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"head.data.prompt_files: {path} line {n} is not JSON ({e.msg})"
                              ) from None
        prompt = row.get("prompt", ...) if isinstance(row, dict) else ...
        if prompt is not None and not isinstance(prompt, str):
            raise ConfigError(f"head.data.prompt_files: {path} line {n} has no \"prompt\" "
                              "string (use {\"prompt\": \"...\"}, or null to skip the line)")
        prompts.append(prompt)
    return prompts


def file_chunk_name(max_new_tokens: int, kept: list[list[int]]) -> str:
    """The chunks' name: ``file<max_new_tokens>-<hash of the kept prompts' ids>``."""
    return f"file{max_new_tokens}-{data_key({'ids': kept})[:8]}"


def file_prompts(lm: Any, tokenizer: Any, files: list[str], directory: Path, *,
                 max_new_tokens: int, max_prompt_tokens: int, batch_size: int, chunk: int,
                 eos: tuple[int, ...], held_out: list[list[int]],
                 trained: frozenset[str] = frozenset()
                 ) -> tuple[FeatureSequences, dict[str, Any]]:
    """The kept prompts of ``files`` (module doc) and their greedy answers, as feature
    sequences; plus the counts per reason and the seconds and positions built this run.
    ``held_out``: the evaluation prompts' ids in the chat template, uncut; ``trained``: texts
    the run already trains on (its self-written prompts), dropped as duplicates."""
    if not files:
        return FeatureSequences.empty(lm.info.hidden_size), {}
    bounds = template_bounds(tokenizer)
    held = held_out_ngrams(held_out, bounds)
    stats: dict[str, Any] = {"files_read": 0, "files_kept": 0, "files_long": 0,
                             "files_duplicate": 0, "files_heldout_overlap": 0,
                             "files_built_s": 0.0, "files_built_positions": 0, "files_chunks": []}
    seen: set[str] = set(trained)
    parts = []
    for file in files:
        kept: list[list[int]] = []
        for text in read_prompt_file(Path(file)):
            if text is None:
                continue
            stats["files_read"] += 1
            ids = chat_ids(tokenizer, text)
            if len(ids) > max_prompt_tokens:
                why = "long"
            elif text in seen:
                why = "duplicate"
            elif ngrams(content_ids(ids, *bounds)) & held:
                why = "heldout_overlap"
            else:
                why = "kept"
                seen.add(text)
                kept.append(ids)
            stats[f"files_{why}"] += 1
        if not kept:
            continue
        name = file_chunk_name(max_new_tokens, kept)
        part, built = generate_chunked(lm, kept, directory, name, max_new_tokens,
                                       batch_size, chunk, eos)
        stats["files_built_s"] += built[f"{name}_built_s"]
        stats["files_built_positions"] += built[f"{name}_built_positions"]
        stats["files_chunks"].append(f"{name}_*")
        parts.append(part)
    seqs = FeatureSequences.concat(parts) if parts else FeatureSequences.empty(lm.info.hidden_size)
    return seqs, stats
