"""Which dtype and weight layout is fastest for a model on each x86 ISA level.

    python scripts/bench_cpu_dtypes.py --model qwen2.5-coder-0.5b --rounds 3

For each ISA level this CPU can run -- itself, and below it through the ISA caps of
``specflow.cpu`` (``avx512_core``: AVX-512 without bf16 instructions; ``avx2``: an AVX2-only
CPU, exactly as oneDNN/ATen/MKL behave there) -- and each (dtype, packed) the level can run,
a child process loads the model and times a decoding step (T = 1) and a 5-token verify
(T = 5) over ``--context`` cached positions: median of ``--repeats`` per child.  Children run
one at a time, interleaved over ``--rounds`` (A B C, C B A, ...), and the table gives the
median over rounds and the ratio to float32 packed at the same level.  Run it with nothing
else on the machine.  ``--out`` writes the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ISA level -> environment caps (None: the CPU as it is).
LEVELS: dict[str, dict[str, str]] = {
    "native": {},
    "avx512_core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
CONFIGS = [("float32", True), ("float32", False), ("bfloat16", True), ("bfloat16", False)]


def child(args: argparse.Namespace) -> None:
    import torch

    from specflow.cpu.detect import probe_cpu
    from specflow.kv.session import ModelSession
    from specflow.models.loading import load_model

    caps = probe_cpu()
    lm = load_model(args.model, dtype=args.dtype, backend="auto", trust_remote_code=False,
                    packed_weights=args.packed == "true").lm
    n_layers = lm.info.num_layers
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 1000, (args.context + 5,), generator=gen).tolist()
    sess = ModelSession(lm, args.context + 6)
    sess.set_tokens(prompt[: args.context])
    sess.hidden(n_layers, args.context - 1)

    def step(t: int) -> float:
        t0 = time.perf_counter()
        sess.set_tokens(prompt[: args.context + t - 1])
        sess.logits(n_layers, args.context - 1, args.context + t - 1)
        dt = time.perf_counter() - t0
        sess.set_tokens(prompt[: args.context - 1])
        return dt

    step(1), step(5)
    times = {1: [], 5: []}
    for _ in range(args.repeats):
        for t in (1, 5):
            times[t].append(step(t))
    print(json.dumps({
        "cpu": caps.as_dict(), "threads": torch.get_num_threads(),
        "ms1": statistics.median(times[1]) * 1e3, "ms5": statistics.median(times[5]) * 1e3,
    }))


def runnable(level: str, dtype: str, packed: bool) -> bool:
    """What a level can run at all (bf16 packing needs oneDNN bf16: not on AVX2)."""
    return not (level == "avx2" and dtype == "bfloat16" and packed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--levels", nargs="*", default=list(LEVELS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--packed", default="true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    jobs = [(lv, d, p) for lv in args.levels for d, p in CONFIGS if runnable(lv, d, p)]
    results: dict[tuple[str, str, bool], list[dict]] = {j: [] for j in jobs}
    for r in range(args.rounds):
        order = jobs if r % 2 == 0 else jobs[::-1]
        for i, (lv, dtype, packed) in enumerate(order, 1):
            env = {**os.environ, **LEVELS[lv]}
            cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", dtype,
                   "--packed", str(packed).lower(), "--context", str(args.context),
                   "--repeats", str(args.repeats)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(f"[round {r + 1} {i}/{len(order)}] {lv} {dtype} packed={packed}: FAILED\n"
                      f"{proc.stderr[-800:]}", flush=True)
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[(lv, dtype, packed)].append(res)
            print(f"[round {r + 1} {i}/{len(order)}] {lv:<11} {dtype:<8} packed={packed!s:<5} "
                  f"T=1 {res['ms1']:7.1f} ms  T=5 {res['ms5']:7.1f} ms  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)

    first = next((v[0] for v in results.values() if v), None)
    if first is None:
        sys.exit("no configuration ran")
    print(f"\n{args.model}, context {args.context}, {first['threads']} threads, CPU "
          f"{first['cpu']['model']}; median over {args.rounds} interleaved rounds")
    print("| ISA level (as probed) | dtype | packed | step ms (T=1) | verify 5 ms (T=5) "
          "| step vs fp32 packed |")
    print("|---|---|---|---|---|---|")
    rows = []
    for lv in args.levels:
        ref = results.get((lv, "float32", True)) or []
        ref1 = statistics.median(r["ms1"] for r in ref) if ref else None
        for dtype, packed in CONFIGS:
            runs = results.get((lv, dtype, packed))
            if runs is None:
                print(f"| {lv} | {dtype} | {packed} | cannot run | | |")
                continue
            if not runs:
                continue
            cpu = runs[0]["cpu"]
            ms1 = statistics.median(r["ms1"] for r in runs)
            ms5 = statistics.median(r["ms5"] for r in runs)
            ratio = f"{ms1 / ref1:.2f}" if ref1 else ""
            label = (f"{lv} ({cpu['isa']}, oneDNN bf16 {cpu['onednn_bf16']}, "
                     f"native {cpu['native_bf16']})")
            print(f"| {label} | {dtype} | {packed} | {ms1:.1f} | {ms5:.1f} | {ratio} |")
            rows.append({"level": lv, "dtype": dtype, "packed": packed, "ms1": ms1, "ms5": ms5,
                         "cpu": cpu, "runs": runs})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
