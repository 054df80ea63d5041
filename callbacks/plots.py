"""Callback ``plots``: PNG figures in the run folder (matplotlib, Agg backend).

- ``speedup_by_category.png``: ``throughput/speedup`` per category and overall (bars), with
  plain decoding as the dashed line at 1.0.
- ``tau_hist.png``: tokens committed per round (``accepted_per_round + 1``) over all rounds.
- ``time_per_stage.png``: milliseconds per generated token, stacked by stage
  (``time/<stage>_s``), per category and overall, next to plain decoding's ms/token.
- ``arm_choices.png``: only when records carry pool metrics (``metrics.pool.arms``: the
  arm a bandit selector chose, per round): per category, each request's arm over its
  rounds, and each arm's share of the category's requests at every round index.

Each ``plot_*`` function is usable alone (the wandb logger uses them); ``make_plots``
draws every figure that has data and returns the written paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specflow.results.metrics import flatten_by_category, flatten_summary, stage_names
from specflow.results.records import RequestRecord, RunMeta, RunSummary
from specflow.results.run_folder import REQUESTS_FILE, read_records
from specflow.workload import Request

PLOT_FILES = ("speedup_by_category.png", "tau_hist.png", "time_per_stage.png", "arm_choices.png")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


def plot_speedup_by_category(summary: RunSummary, path: Path) -> Path | None:
    """Speedup bars per category + ALL; ``None`` when there is no baseline."""
    rows = [(c, f.get("throughput/speedup")) for c, f in flatten_by_category(summary).items()]
    rows.append(("ALL", flatten_summary(summary).get("throughput/speedup")))
    rows = [(c, s) for c, s in rows if s is not None]
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.8 * len(rows) + 2), 3.5))
    names = [c for c, _ in rows]
    values = [s for _, s in rows]
    colors = ["tab:blue"] * (len(rows) - 1) + ["tab:orange"]
    bars = ax.bar(names, values, color=colors)
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="plain decoding")
    ax.set_ylabel("throughput/speedup (x)")
    method = summary.meta.method
    ax.set_title(f"{'run' if method is None else method}: speedup over plain decoding")
    ax.legend(loc="upper right", fontsize=8)
    ax.tick_params(axis="x", labelrotation=30)
    return _save(fig, path)


def plot_tau_hist(records: list[RequestRecord], path: Path) -> Path | None:
    """Histogram of tokens per round (accepted + 1); ``None`` without rounds."""
    taus = [a + 1 for r in records for a in r.metrics.accepted_per_round]
    if not taus:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    edges = [x - 0.5 for x in range(1, max(taus) + 2)]
    ax.hist(taus, bins=edges, rwidth=0.85)
    mean = sum(taus) / len(taus)
    ax.axvline(mean, color="tab:red", linestyle="--", label=f"accept/tau = {mean:.2f}")
    ax.set_xlabel("tokens committed per round (accepted + 1)")
    ax.set_ylabel("rounds")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_time_per_stage(summary: RunSummary, path: Path) -> Path | None:
    """Stacked ms per generated token by stage, per category + ALL, with plain decoding."""
    groups = [*flatten_by_category(summary).items(), ("ALL", flatten_summary(summary))]
    groups = [(c, f) for c, f in groups if f.get("count/new_tokens")]
    if not groups:
        return None
    stages = stage_names({k: 0.0 for _, f in groups for k in f})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(groups) + 2), 3.8))
    names = [c for c, _ in groups]
    x = list(range(len(groups)))
    bottom = [0.0] * len(groups)
    for stage in stages:
        ms = [1000 * f.get(stage, 0.0) / f["count/new_tokens"] for _, f in groups]
        ax.bar([i - 0.2 for i in x], ms, width=0.4, bottom=bottom, label=stage)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    base = [f.get("throughput/baseline_tokens_per_s") for _, f in groups]
    if any(base):
        ax.bar(
            [i + 0.2 for i in x],
            [1000 / b if b else 0.0 for b in base],
            width=0.4,
            color="lightgray",
            edgecolor="k",
            label="plain decoding",
        )
    ax.set_xticks(x, names, rotation=30)
    ax.set_ylabel("ms per generated token")
    ax.set_title("time per stage")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_arm_choices(records: list[RequestRecord], path: Path) -> Path | None:
    """The bandit's chosen arm over the rounds of a request, one column per category.

    Top: each request's arm per round (a step line, slightly offset per request).  Bottom:
    at each round index, the share of the category's requests that chose each arm.
    ``None`` when no record carries pool metrics.
    """
    by_cat: dict[str, list[list[int]]] = {}
    for r in records:
        arms = r.metrics.pool.arms if r.metrics.pool is not None else []
        if arms:
            by_cat.setdefault(r.category, []).append(list(arms))
    if not by_cat:
        return None
    every = sorted({a for reqs in by_cat.values() for arms in reqs for a in arms})
    plt = pyplot()
    cols = len(by_cat)
    fig, axes = plt.subplots(
        2, cols, figsize=(max(4.0, 3.2 * cols), 4.8), squeeze=False, sharey="row"
    )
    for col, (cat, reqs) in enumerate(sorted(by_cat.items())):
        top, bottom = axes[0][col], axes[1][col]
        for i, arms in enumerate(reqs):
            offset = 0.25 * (i / max(1, len(reqs) - 1) - 0.5) if len(reqs) > 1 else 0.0
            top.step(range(len(arms)), [a + offset for a in arms], where="post", linewidth=0.8)
        top.set_title(f"{cat} ({len(reqs)} req.)", fontsize=9)
        top.set_yticks(every)
        length = max(len(a) for a in reqs)
        for arm in every:
            share = []
            for j in range(length):
                at_j = [a[j] for a in reqs if j < len(a)]
                share.append(sum(x == arm for x in at_j) / len(at_j))
            bottom.plot(range(length), share, label=f"arm {arm}")
        bottom.set_xlabel("round within the request")
        bottom.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("arm chosen")
    axes[1][0].set_ylabel("share of requests")
    axes[1][-1].legend(fontsize=7)
    return _save(fig, path)


def make_plots(summary: RunSummary, records: list[RequestRecord], folder: Path) -> list[Path]:
    """Every figure with data, written into ``folder``; the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [
        plot_speedup_by_category(summary, folder / PLOT_FILES[0]),
        plot_tau_hist(records, folder / PLOT_FILES[1]),
        plot_time_per_stage(summary, folder / PLOT_FILES[2]),
        plot_arm_choices(records, folder / PLOT_FILES[3]),
    ]
    return [p for p in written if p is not None]


def run_records(folder: Path, fallback: list[RequestRecord]) -> list[RequestRecord]:
    """The run folder's records (resumed ones included), else ``fallback``."""
    path = Path(folder) / REQUESTS_FILE
    return read_records(path) if path.exists() else list(fallback)


class Plots:
    """Draws ``make_plots`` into the run folder when the run ends."""

    wants_rounds = False  # on_round_end is not needed after every round

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.written: list[Path] = []

    def on_request_end(self, record: RequestRecord) -> None:
        self.records.append(record)

    def on_run_end(self, summary: RunSummary, folder: Path) -> None:
        self.written = make_plots(summary, run_records(folder, self.records), folder)

    def on_run_start(self, meta: RunMeta, num_requests: int) -> None:
        pass

    def on_request_start(self, request: Request) -> None:
        pass

    def on_round_end(self, request: Request, event: dict[str, int]) -> None:
        pass
