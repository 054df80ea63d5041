"""Held-out agreement of the feature head against training positions seen, for the in-domain
runs of 2026-12-02, from their metrics.json: the Spec-Bench training questions' greedy
answers alone, with three sampled answers each (both on the AMD EPYC), and with prompts the
target wrote itself (train_heads/magpie.py; 512 draws; the Intel Xeon).  Writes
sampled_vs_greedy.png.

    .venv/bin/python docs/data/issue23/plot_sampled.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RUNS = {
    "greedy answers: 16,702 positions": "feature_sb_greedy.metrics.json",
    "+ 3 sampled answers: 68,618 positions": "feature_sb_s3.metrics.json",
    "+ 319 self-written prompts: 67,755 positions": "feature_sb_magpie.metrics.json",
}

fig, ax = plt.subplots(figsize=(5.5, 3.4))
for label, name in RUNS.items():
    m = json.loads((HERE / name).read_text())
    xs = [c["positions_seen"] / 1000 for c in m["curve"]]
    ax.plot(xs, [c["agree_1"] for c in m["curve"]], marker="o", ms=3,
            label=f"{label} (end {m['after']['agreement']:.1%})")
ax.set_xlabel("training positions seen, 3 epochs (thousands)")
ax.set_ylabel("held-out top-1 agreement")
ax.set_title("feature head, Qwen2.5-Coder-1.5B, in-domain data", fontsize=9)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(HERE / "sampled_vs_greedy.png", dpi=120)
print("wrote", HERE / "sampled_vs_greedy.png")
