"""Held-out agreement of the exit heads (and of the feature head) against training positions,
Qwen2.5-Coder-1.5B, from committed metrics only.  In-domain data: the 100 non-held-out
Spec-Bench questions' greedy answers (14,302 rows after the shared prefix; mlp heads, 2
epochs) and those + the answers to 760 prompts the target wrote itself (115,105 rows; mlp
heads of exits 4 and 7 and the attention adapter of exit 4, 1 epoch each; 2026-12-02,
seventh session), and for exit 7 the answers to the 1,280 draws' prompts (171,382 rows,
1 epoch; ninth session).  For reference the exit-7 mlp head on local text (1 epoch) and the feature
head (3 epochs; its x is positions, prompt rows included).  Writes exits_vs_data.png next
to this file.

    .venv/bin/python docs/data/issue24/plot_exits_vs_data.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
ISSUE23 = HERE.parent / "issue23"


def exit_point(name: str, exit_layer: int) -> tuple[int, float]:
    m = json.loads((HERE / name).read_text())
    return m["train_rows"], m["after"][str(exit_layer)]["agree"]


fig, ax = plt.subplots(figsize=(5.5, 3.4))
for exit_layer, color in ((4, "tab:blue"), (7, "tab:green")):
    pts = [
        exit_point("mlp_4_7_14_specbench.metrics.json", exit_layer),
        exit_point("mlp_4_7_magpie.metrics.json", exit_layer),
    ]
    if exit_layer == 7:  # the 1,280-draw data (2026-12-03, ninth session)
        pts.append(exit_point("mlp7_magpie3.metrics.json", 7))
    ax.plot(
        [p[0] for p in pts],
        [p[1] for p in pts],
        "o-",
        color=color,
        label=f"exit {exit_layer}, mlp, in-domain",
    )
adapter = exit_point("adapter4_magpie.metrics.json", 4)
ax.plot([adapter[0]], [adapter[1]], "D", color="tab:blue", label="exit 4, attention adapter")
local = json.loads((HERE / "exit7_vs_positions.json").read_text())
ax.plot(
    [r["train_rows"] for r in local],
    [r["agreement"] for r in local],
    "s--",
    ms=4,
    color="tab:green",
    alpha=0.5,
    label="exit 7, mlp, local text",
)
feat = []
for name in (
    "feature_sb_greedy.metrics.json",
    "feature_sb_magpie.metrics.json",
    "feature_sb_magpie2.metrics.json",
):
    m = json.loads((ISSUE23 / name).read_text())
    feat.append((m["data"]["train_positions"], m["after"]["agreement"]))
ax.plot(
    [p[0] for p in feat],
    [p[1] for p in feat],
    "^-",
    color="tab:red",
    label="feature head (on h_28), in-domain",
)
ax.set_xscale("log")
ax.set_xlabel("training positions (rows)")
ax.set_ylabel("held-out top-1 agreement")
ax.set_title("Qwen2.5-Coder-1.5B, the same 956 held-out positions", fontsize=9)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(HERE / "exits_vs_data.png", dpi=120)
print("wrote", HERE / "exits_vs_data.png")
