"""Exit-7 held-out agreement vs training positions (train_heads data=feature, one epoch each).

Reads outputs/train_heads/exit7_feature_{12k,50k,all}/metrics.json; writes
exit7_vs_positions.{png,json} next to this file."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
rows = []
for tag in ("12k", "50k", "all"):
    m = json.loads(Path(f"outputs/train_heads/exit7_feature_{tag}/metrics.json").read_text())
    after = m["after"]["7"]
    rows.append({"run": tag, "train_rows": m["train_rows"], "steps": m["train_steps"],
                 "agreement": after["agree"], "kl": after["kl"], "tau": after["tau"],
                 "train_s": m["times_s"]["train_s"]})
(here / "exit7_vs_positions.json").write_text(json.dumps(rows, indent=2))
fig, ax = plt.subplots(figsize=(5, 3.2))
ax.plot([r["train_rows"] for r in rows], [100 * r["agreement"] for r in rows], "o-",
        label="exit 7, local-text data (1 epoch)")
ax.axhline(23.4, ls="--", c="gray", label="7.7k in-domain Spec-Bench positions (2 epochs)")
ax.set_xscale("log")
ax.set_xlabel("training positions")
ax.set_ylabel("held-out top-1 agreement (%)")
ax.set_title("Qwen2.5-Coder-1.5B exit 7 (mlp head)")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(here / "exit7_vs_positions.png", dpi=120)
print(rows)
