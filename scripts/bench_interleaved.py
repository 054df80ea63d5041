"""The benchmark under its former name: ``scripts/bench_vs_hf.py`` (its doc says how).

    python scripts/bench_interleaved.py --out outputs/bench/table \\
        --common "model=qwen2.5-coder-1.5b workload.ids=[101,125] runner.max_new_tokens=128" \\
        --method plain "+experiment=ar" --method pld "+experiment=pld"
"""

from __future__ import annotations

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).with_name("bench_vs_hf.py")), run_name="__main__")
