"""Time a decoder layer's packed matmuls at 1..N rows (the rows of one forward pass).

    python scripts/matmul_rows.py --rows 1 2 3 4 5 6 --layers 6 --repeats 25

The four matrices of a layer of Qwen2.5-1.5B's shape by default (fused qkv, o, fused
gate/up, down), packed as the native model packs them (``specflow.models.native.pack``),
``--layers`` distinct copies so that no weight stays in cache between passes (a model's
layers are read from memory once per forward), row counts interleaved in alternating order.
Prints the median milliseconds per layer for each row count.  On the AVX-512 `AMD EPYC` of
``docs/benchmarks.md`` §16.3, 1 and 2 rows were about 25 % slower than 4 and 5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specflow.models.native import linear, pack  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--qkv", type=int, default=2048, help="fused q/k/v output width")
    ap.add_argument("--intermediate", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, i = args.hidden, args.intermediate
    shapes = {"qkv": (args.qkv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    layers = [{n: pack(torch.randn(*s) * 0.02) for n, s in shapes.items()}
              for _ in range(args.layers)]
    times: dict[int, list[float]] = {m: [] for m in args.rows}
    for it in range(args.repeats):
        for m in (args.rows if it % 2 == 0 else args.rows[::-1]):
            x_h, x_i = torch.randn(m, h), torch.randn(m, i)
            t0 = time.perf_counter()
            for w in layers:
                for name, weight in w.items():
                    linear(x_i if name == "down" else x_h, weight, None)
            times[m].append((time.perf_counter() - t0) / args.layers)
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"packed fp32 matmuls of one layer (hidden {h}, intermediate {i}), "
          f"{args.threads} threads, median of {args.repeats}, {isa}")
    for m, ts in times.items():
        print(f"  rows {m}: {statistics.median(ts) * 1000:.2f} ms per layer")


if __name__ == "__main__":
    main()
