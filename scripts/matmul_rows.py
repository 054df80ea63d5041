"""Time a decoder layer's packed matmuls at 1..N rows (the rows of one forward pass).

    python scripts/matmul_rows.py --rows 1 2 3 4 5 6 --layers 6 --repeats 25

The four matrices of a layer of Qwen2.5-1.5B's shape by default (fused qkv, o, fused
gate/up, down), packed as the native model packs them (``specflow.models.native.pack``),
``--layers`` distinct copies so that no weight stays in cache between passes (a model's
layers are read from memory once per forward), timed as ``model.min_rows=null`` probes a
model (``specflow.models.row_padding.time_rows``).
Prints the median milliseconds per layer for each row count.  On the AVX-512 `AMD EPYC` of
``docs/benchmarks.md`` §16.3, 1 and 2 rows were about 25 % slower than 4 and 5.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specflow.models.native import pack  # noqa: E402
from specflow.models.row_padding import choose_min_rows, time_rows  # noqa: E402


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
    shapes = [(args.qkv, h), (h, h), (2 * i, h), (h, i)]  # qkv, o, gate/up, down
    layers = [[pack(torch.randn(*s) * 0.02) for s in shapes] for _ in range(args.layers)]
    seconds = time_rows(layers, args.rows, args.repeats)
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"packed fp32 matmuls of one layer (hidden {h}, intermediate {i}), "
          f"{args.threads} threads, median of {args.repeats}, {isa}; "
          f"chosen min_rows: {choose_min_rows(seconds)}")
    for m, t in seconds.items():
        print(f"  rows {m}: {t / args.layers * 1000:.2f} ms per layer")


if __name__ == "__main__":
    main()
