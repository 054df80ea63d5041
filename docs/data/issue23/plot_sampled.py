"""Held-out agreement of the feature head against training positions seen, for the in-domain
runs of 2026-12-02, from their metrics.json: the Spec-Bench training questions' greedy
answers alone, with three sampled answers each (both on the AMD EPYC), and with prompts the
target wrote itself (train_heads/magpie.py; 512 draws; the Intel Xeon), and with those 319
plus 441 more (640 new draws; the AMD EPYC with AVX-512, sixth session), and with those
plus 431 more (1,280 draws; the same CPU model, eighth session), and that data trained for
five epochs instead of three (tenth session).  Writes
sampled_vs_greedy.png, and agreement_vs_data.png: each run's held-out agreement after
training against its distinct training positions.

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
    "+ 760 self-written prompts: 135,745 positions": "feature_sb_magpie2.metrics.json",
    "+ 1,190 self-written prompts: 202,342 positions": "feature_sb_magpie3.metrics.json",
}
# the same data as the last run, trained for five epochs instead of three
FIVE_EPOCHS = {"the same, 5 epochs": "feature_sb_magpie3_e5.metrics.json"}

fig, ax = plt.subplots(figsize=(5.5, 3.4))
for label, name in {**RUNS, **FIVE_EPOCHS}.items():
    m = json.loads((HERE / name).read_text())
    xs = [c["positions_seen"] / 1000 for c in m["curve"]]
    ax.plot(xs, [c["agree_1"] for c in m["curve"]], marker="o", ms=3,
            label=f"{label} (end {m['after']['agreement']:.1%})")
ax.set_xlabel("training positions seen, 3 epochs unless noted (thousands)")
ax.set_ylabel("held-out top-1 agreement")
ax.set_title("feature head, Qwen2.5-Coder-1.5B, in-domain data", fontsize=9)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(HERE / "sampled_vs_greedy.png", dpi=120)
print("wrote", HERE / "sampled_vs_greedy.png")

fig, ax = plt.subplots(figsize=(5.5, 3.4))
points = []
for label, name in RUNS.items():
    m = json.loads((HERE / name).read_text())
    points.append((m["data"]["train_positions"], m["after"]["agreement"], label.split(":")[0]))
# distinct prompts (greedy answers, then self-written prompts) as a line; drawn answers to
# the same prompts apart
line = sorted(p for p in points if "sampled" not in p[2])
ax.plot([p[0] for p in line], [p[1] for p in line], "o-", ms=4, label="distinct prompts")
other = [p for p in points if "sampled" in p[2]]
ax.plot([p[0] for p in other], [p[1] for p in other], "s", ms=5, color="tab:orange",
        label="more answers to the same prompts")
for name in FIVE_EPOCHS.values():
    m = json.loads((HERE / name).read_text())
    ax.plot([m["data"]["train_positions"]], [m["after"]["agreement"]], "*", ms=8,
            color="tab:green", label="5 epochs (the last data)")
for x, y, label in points:
    ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, -10), fontsize=6)
ax.axhline(0.6, color="gray", ls="--", lw=0.8)
ax.text(points[0][0], 0.605, "#23's aim", fontsize=7, color="gray")
ax.set_xscale("log")
ax.set_xticks([15_000, 30_000, 60_000, 120_000, 240_000])
ax.set_xticklabels(["15k", "30k", "60k", "120k", "240k"])
ax.minorticks_off()
ax.set_xlabel("distinct training positions (log)")
ax.set_ylabel("held-out top-1 agreement")
ax.set_title("feature head after 3 epochs (star: 5), Qwen2.5-Coder-1.5B, in-domain data",
             fontsize=9)
ax.grid(alpha=0.3)
ax.legend(fontsize=7, loc="lower right")
fig.tight_layout()
fig.savefig(HERE / "agreement_vs_data.png", dpi=120)
print("wrote", HERE / "agreement_vs_data.png")
