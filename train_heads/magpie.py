"""Training prompts the target writes itself (Magpie, Xu et al. 2024), and their answers.

An instruction-tuned model given its chat template up to the start of a user turn writes a
plausible user message: the distribution of questions it was aligned on.  Each prompt is
drawn at ``temperature`` from ``prefix + opener`` (``prefix``: the template's tokens before a
user message's content; ``opener``: optional first words, prompt ``j`` of a chunk takes
``openers[j % len(openers)]``, ``""`` = the bare template), until any special token (the
end of the turn; small models also close with ``<|im_start|>`` or ``<|endoftext|>``) or
``max_prompt_tokens``.  The text of a draw ends at the first turn marker written out as plain text
(``TURN_MARKERS``: small models often spell ``<|im_start|>`` in ordinary tokens instead of
closing the turn, then answer their own question).  A drawn prompt is kept iff

- it ended (a special token closed the turn or a turn marker was written: a cut-off
  question is not a question),
- it has at least ``MIN_WORDS`` words and no earlier kept prompt has the same text,
- it shares no ``NGRAM``-token run with any held-out evaluation prompt, compared uncut and
  without the chat template (disjoint from what is measured: the count dropped for this is
  recorded).

Kept prompts are wrapped in the chat template as a user turn and answered greedily by the
target with every position's ``h_N`` (``train_heads.generate``), like the Spec-Bench
training questions.  Chunk ``i`` (``chunk`` prompts drawn, seeded ``seed * 1_000_003 + i``)
is cached twice under the data folder: ``<name>-prompts_<i>.json`` (the drawn texts) and
``<name>_<i>.safetensors`` (the answers), ``name`` carrying a hash of the drawing settings
(the seed, chunk size and held-out split are in the folder's key), so a rerun loads, an
interrupted run resumes at the next chunk, and more prompts (``n``) reuse the earlier full
chunks.  The filter runs on every load and the answers are checked against what it keeps.
Every draw, its fate and the kept text are listed in ``<name>-prompts_<n>.jsonl``
(``"prompt"`` null where dropped): the file ``head.data.prompt_files``
(``train_heads.prompt_files``) reads, so the same prompts can be answered on another
machine without drawing them again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from train_heads.feature_data import FeatureSequences, data_key
from train_heads.prompts import chat_ids

log = logging.getLogger("train_heads")
MARK = "\u2063MAGPIE\u2063"  # a content placeholder that no template contains
NGRAM = 8  # token run shared with a held-out prompt that drops a drawn prompt
MIN_WORDS = 3
TURN_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def prompt_text(drawn: str, closed: bool) -> tuple[str, bool]:
    """``(text, ended)`` of a draw: ``drawn`` (its decoded tokens, without the special token
    that closed it, if ``closed``) cut at the first ``TURN_MARKERS`` text; ``ended`` iff it
    was closed or a marker was found."""
    cuts = [i for i in (drawn.find(m) for m in TURN_MARKERS) if i >= 0]
    if cuts:
        return drawn[: min(cuts)].strip(), True
    return drawn.strip(), closed


def user_prefix(tokenizer: Any) -> list[int]:
    """The chat template's tokens before a user message's content (system turn included,
    as ``chat_ids`` writes it): what the target continues to write a prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}],
                                         add_generation_prompt=False, tokenize=False)
    if MARK not in text:
        raise ValueError("the tokenizer's chat template drops the user message's content")
    return list(tokenizer.encode(text.split(MARK)[0], add_special_tokens=False))


def template_bounds(tokenizer: Any) -> tuple[int, int]:
    """``(prefix_len, suffix_len)``: how many ids the chat template puts before and after a
    user message's content (``chat_ids``), read off two one-word messages (their common head
    and tail), so any tokenizer with a chat template works, whether or not it renders text."""
    a, b = chat_ids(tokenizer, "hello"), chat_ids(tokenizer, "world")
    n = min(len(a), len(b))
    head = next((i for i in range(n) if a[i] != b[i]), n)
    tail = next((i for i in range(n) if a[-1 - i] != b[-1 - i]), n)
    return head, min(tail, n - head)


def content_ids(ids: list[int], prefix_len: int, suffix_len: int) -> list[int]:
    """A templated prompt's ids without the template: ``ids[prefix_len : -suffix_len]``."""
    return ids[prefix_len : len(ids) - suffix_len]


def ngrams(ids: list[int], n: int = NGRAM) -> set[tuple[int, ...]]:
    """Every run of ``n`` consecutive ids."""
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def held_out_ngrams(held_out: list[list[int]], bounds: tuple[int, int]
                    ) -> set[tuple[int, ...]]:
    """Every ``NGRAM``-run of the held-out prompts' content (``held_out``: ids in the chat
    template, uncut; ``bounds``: ``template_bounds``): what a training prompt must not share."""
    return set().union(*(ngrams(content_ids(h, *bounds)) for h in held_out))


def magpie_name(temperature: float, max_prompt_tokens: int, max_new_tokens: int,
                openers: list[str], seed: int) -> str:
    """The chunks' name: ``magpie<max_new_tokens>-<hash of the drawing settings>``."""
    digest = data_key({"t": temperature, "p": max_prompt_tokens, "o": list(openers),
                       "s": seed})[:8]
    return f"magpie{max_new_tokens}-{digest}"


def keep_reason(content_ids: list[int], text: str, ended: bool, seen: set[str],
                held: set[tuple[int, ...]]) -> str:
    """``"kept"`` or why a drawn prompt is dropped (``unfinished``, ``short``, ``duplicate``,
    ``heldout_overlap``); see the module doc."""
    if not ended:
        return "unfinished"
    if len(text.split()) < MIN_WORDS:
        return "short"
    if text in seen:
        return "duplicate"
    if ngrams(content_ids) & held:
        return "heldout_overlap"
    return "kept"


def draw_prompts(lm: Any, tokenizer: Any, prefix: list[int], openers: list[str], count: int,
                 *, temperature: float, max_prompt_tokens: int, batch_size: int,
                 stops: tuple[int, ...], seed: int) -> list[dict[str, Any]]:
    """``count`` draws from ``prefix + opener`` (prompt ``j`` takes ``openers[j % len]``):
    ``{"drawn": decoded text without the closing special token, "closed": bool}`` each."""
    from train_heads.generate import generate_with_hidden

    opener_ids = [tokenizer.encode(o, add_special_tokens=False) if o else [] for o in openers]
    starts = [prefix + opener_ids[j % len(openers)] for j in range(count)]
    gens = generate_with_hidden(lm, starts, [], max_prompt_tokens, batch_size, stops,
                                progress=False, temperature=temperature, seed=seed)
    drawn = []
    for g in gens:
        body = g.tokens[len(prefix):]
        closed = bool(body) and body[-1] in stops
        drawn.append({"drawn": tokenizer.decode(body[:-1] if closed else body),
                      "closed": closed})
    return drawn


def even_batch_size(n: int, batch_size: int) -> int:
    """The batch size that splits ``n`` items into as few batches as ``batch_size`` allows,
    all of about the same size (33 at 32 a batch: 17, not 32 + 1)."""
    return -(-n // -(-n // batch_size)) if n else batch_size


def self_written(lm: Any, tokenizer: Any, n: int, directory: Path, *, temperature: float,
                 max_prompt_tokens: int, max_new_tokens: int, openers: list[str], seed: int,
                 batch_size: int, chunk: int, eos: tuple[int, ...],
                 held_out: list[list[int]]) -> tuple[FeatureSequences, dict[str, Any]]:
    """``n`` drawn prompts (module doc) and the greedy answers of those kept, as feature
    sequences; plus counts and the seconds spent this run.  ``held_out``: the evaluation
    prompts' ids in the chat template, uncut (the template's prefix and suffix are cut off
    both sides before comparing, so shared template tokens never count as overlap).

    Invariants of the cache: a prompts file holds exactly the chunk's ``count`` draws (one
    written for a smaller ``n`` is drawn again, with its answers), and an answers file
    holds exactly the chunk's kept prompts, in order (rebuilt when the kept list changed,
    e.g. after a change to the filter)."""
    from train_heads.generate import generate_with_hidden

    if n <= 0:
        return FeatureSequences.empty(lm.info.hidden_size), {}
    openers = list(openers) or [""]
    prefix = user_prefix(tokenizer)
    bounds = template_bounds(tokenizer)
    held = held_out_ngrams(held_out, bounds)
    name = magpie_name(temperature, max_prompt_tokens, max_new_tokens, openers, seed)
    stops = tuple(sorted(set(eos) | set(tokenizer.all_special_ids)))
    stats: dict[str, Any] = {"magpie_name": name, "magpie_drawn": 0, "magpie_built_s": 0.0,
                             "magpie_built_positions": 0}
    seen: set[str] = set()
    parts, records = [], []
    for c in range((n + chunk - 1) // chunk):
        count = min(chunk, n - c * chunk)
        t0 = time.perf_counter()
        ppath = directory / f"{name}-prompts_{c}.json"
        apath = directory / f"{name}_{c}.safetensors"
        drawn = json.loads(ppath.read_text()) if ppath.exists() else []
        if len(drawn) != count:  # not drawn yet, or drawn for another n: a draw of count
            apath.unlink(missing_ok=True)
            drawn = draw_prompts(lm, tokenizer, prefix, openers, count, temperature=temperature,
                                 max_prompt_tokens=max_prompt_tokens, batch_size=batch_size,
                                 stops=stops, seed=seed * 1_000_003 + c)
            tmp = ppath.with_suffix(".tmp")
            tmp.write_text(json.dumps(drawn, indent=1))
            tmp.replace(ppath)
        kept = []
        for j, d in enumerate(drawn):
            text, ended = prompt_text(d["drawn"], d["closed"])
            ids = chat_ids(tokenizer, text) if text else []
            why = keep_reason(content_ids(ids, *bounds), text, ended, seen, held)
            stats[f"magpie_{why}"] = stats.get(f"magpie_{why}", 0) + 1
            records.append({"chunk": c, "j": j, "why": why,
                            "prompt": text if why == "kept" else None, "drawn": d["drawn"]})
            if why == "kept":
                seen.add(text)
                kept.append(ids)
        stats["magpie_drawn"] += len(drawn)
        part = FeatureSequences.load(apath) if apath.exists() else None
        if part is not None and [tokens[:plen].tolist() for tokens, _, plen in
                                 map(part.seq, range(part.num_seqs))] != kept:
            log.info("[data] %s: the kept prompts of chunk %d changed; answering again",
                     name, c + 1)
            part = None
        if part is None:
            gens = generate_with_hidden(lm, kept, [], max_new_tokens,
                                        even_batch_size(len(kept), batch_size), eos,
                                        progress=False) if kept else []
            part = (FeatureSequences.from_generated(gens, lm.info.num_layers) if gens
                    else FeatureSequences.empty(lm.info.hidden_size))
            part.save(apath)
            spent = time.perf_counter() - t0
            stats["magpie_built_s"] += spent
            stats["magpie_built_positions"] += part.num_positions
            log.info("[data] %s chunk %d: %d of %d drawn prompts kept, %d answer positions "
                     "in %.0f s", name, c + 1, len(kept), len(drawn), part.num_positions, spent)
        parts.append(part)
    listing = directory / f"{name}-prompts_{n}.jsonl"
    listing.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats["magpie_prompts_file"] = str(listing)
    return FeatureSequences.concat(parts), stats
