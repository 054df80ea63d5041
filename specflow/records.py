"""A request's metrics from its generations (the fields of a ``requests.jsonl`` record)."""

from __future__ import annotations

from typing import Any

from specflow.engine import Generation
from specflow.workload import Request


def task_scores(request: Request, text: str) -> dict[str, float]:
    try:
        from specflow.tasks.scoring import score_request
    except ImportError:  # pragma: no cover - tasks are optional extras
        return {}
    return score_request(request.category, text, request.reference, request.extra.get("problem"))


def generation_metrics(gens: list[Generation]) -> dict[str, Any]:
    rounds = sum(g.stats.rounds for g in gens)
    accepted = sum(g.stats.accepted for g in gens)
    drafted = sum(g.stats.drafted for g in gens)
    total_s = sum(g.total_s for g in gens)
    new_tokens = sum(len(g.tokens) for g in gens)
    times: dict[str, float] = {}
    for g in gens:
        for k, v in g.times.as_dict(g.total_s).items():
            times[k] = times.get(k, 0.0) + v
        for level, nested in g.nested_times.items():
            for k, v in vars(nested).items():
                key = f"nested/{level}/{k}"
                times[key] = times.get(key, 0.0) + v
    levels: dict[str, list[int]] = {}
    for g in gens:
        for level, d in g.stats.level_drafted.items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += d
            acc[1] += g.stats.level_accepted[level]
        for level, nested in g.nested_stats.items():
            acc = levels.setdefault(level, [0, 0])
            acc[0] += nested.drafted
            acc[1] += nested.accepted
    return {
        "new_tokens": new_tokens,
        "total_s": total_s,
        "tokens_per_s": new_tokens / total_s if total_s else 0.0,
        "rounds": rounds,
        "target_calls": sum(g.stats.target_calls for g in gens),
        "drafted": drafted,
        "accepted": accepted,
        "tau": 1.0 + accepted / rounds if rounds else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "levels": levels,
        "time_per_stage": times,
        "k_per_round": [k for g in gens for k in g.stats.chosen_k],
        "rounds_skipped": sum(1 for g in gens for k in g.stats.chosen_k if k == 0),
        "drafted_per_round": [k for g in gens for k in g.stats.drafted_per_round],
        "accepted_per_round": [a for g in gens for a in g.stats.accepted_per_round],
        **pool_metrics(gens),
    }


def pool_metrics(gens: list[Generation]) -> dict[str, Any]:
    """A drafter pool's (MetaSD) per-round arms and rewards, arm counts and catch-up cost."""
    stats = [s for g in gens for s in (g.stats, *g.nested_stats.values())]
    arms = [a for s in stats for a in s.arms]
    if not arms:
        return {}
    return {
        "arms": arms,
        "arm_rewards": [r for s in stats for r in s.rewards],
        "arm_counts": [arms.count(i) for i in range(max(arms) + 1)],
        "catchup_tokens": sum(s.catchup_tokens for s in stats),
        "catchup_s": sum(s.catchup_s for s in stats),
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vals = sorted(values)
    return vals[min(len(vals) - 1, round(q * (len(vals) - 1)))]
