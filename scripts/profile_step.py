"""Where a forward of T new tokens spends its time, per op.

    python scripts/profile_step.py --model qwen2.5-coder-1.5b --context 300 --tokens 1,2,3,5,9
    python scripts/profile_step.py --weights gguf --tokens 1,2,3,5,8,12 --no-profile
    python scripts/profile_step.py --weights gguf --tokens 1,2,3,5,8,12,128 --llamacpp

For each T: a session holding ``--context`` positions runs a forward of T more positions
(the verify of a draft of T-1 tokens; T = 1 is a plain decoding step), then rolls back.
Prints the median wall time per T, its ratio to T = 1, and a torch.profiler breakdown
(self CPU time per op, summed over the forward) so matmuls, attention, the LM head and
everything else are separated.  ``--llamacpp`` prices llama.cpp's passes on the same GGUF
file instead (``llama_decode`` of T rows with logits for each, after the same context;
llama-cpp-python installed): the row prices of both engines, one after the other.  Run it
with nothing else on the machine.

``--kernels NAME=PATH ... [--prefill N]`` (with ``--weights gguf``) compares builds of the
quantized kernel library (``specflow.quant.kernel``; e.g. the one built from the last
commit's sources and the working tree's) on ONE loaded model: each repeat runs every T with
each library in turn, and every library's logits must equal the first's (a kernel change
that keeps the bits).  ``--prefill N`` adds a prompt's prefill of N tokens (a new
session's hidden states, no logits) to each library's turn, its hidden states equal to the
first's too.  Build a library from other sources with the compiler line in
``specflow.quant.kernel.build_library``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "AUTO")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from specflow.kv.base import LayeredLM  # noqa: E402
from specflow.kv.session import ModelSession  # noqa: E402
from specflow.models.loading import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--tokens", default="1,2,3,5,9")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=12, help="ops shown per breakdown")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--packed-weights", choices=["auto", "true", "false"], default="auto",
        help="oneDNN-packed matrices (auto: on a CPU in float32)",
    )
    ap.add_argument("--weights", choices=["float", "gguf"], default="float",
                    help="gguf: the GGUF file's quantized blocks (model.weights=gguf)")
    ap.add_argument("--int8", action="store_true",
                    help="every pass on int8 copies of the weights (model.quantize=int8)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="price llama.cpp's passes on the model's GGUF file instead")
    ap.add_argument("--kernels", nargs="+", metavar="NAME=PATH",
                    help="quantized kernel libraries to alternate on one model (--weights gguf)")
    ap.add_argument("--prefill", type=int, metavar="N",
                    help="with --kernels: also time a prompt's prefill of N tokens per library")
    args = ap.parse_args()
    counts = [int(t) for t in args.tokens.split(",")]
    if args.kernels:
        if args.weights != "gguf":
            ap.error("--kernels compares the quantized kernel: add --weights gguf")
        compare_kernels(args.model, args.context, counts, args.repeats, args.kernels,
                        args.prefill)
        return
    if args.prefill:
        ap.error("--prefill compares kernel libraries' prefills: add --kernels")
    if args.llamacpp:
        llamacpp_prices(args.model, args.context, counts, args.repeats)
        return

    packed = {"auto": None, "true": True, "false": False}[args.packed_weights]
    loaded = load_model(args.model, dtype=args.dtype, backend="auto", trust_remote_code=False,
                        packed_weights=packed, weights=args.weights)
    lm = loaded.lm
    if args.int8:
        lm.make_int8_copies()
        lm.set_int8_rows(frozenset(range(1, args.context + max(counts) + 1)))
    step = pass_after_context(lm, args.context, max(counts))

    for t in counts:  # warm-up
        step(t)
    times: dict[int, list[float]] = {t: [] for t in counts}
    for _ in range(args.repeats):
        for t in counts:  # interleaved
            t0 = time.perf_counter()
            step(t)
            times[t].append(time.perf_counter() - t0)
    base = statistics.median(times[counts[0]])
    print(
        f"{args.model} {args.dtype}, weights {args.weights}, packed weights "
        f"{getattr(lm, 'packed', False)}, int8 "
        f"{args.int8}, context "
        f"{args.context}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'T':>3}{'ms':>10}{'vs T=' + str(counts[0]):>10}")
    for t in counts:
        med = statistics.median(times[t])
        print(f"{t:>3}{med * 1e3:>10.1f}{med / base:>10.2f}")
    if args.no_profile:
        return
    for t in counts:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(3):
                step(t)
        print(f"\n--- T = {t}: self CPU time per op (3 forwards), by op and input shapes")
        print(
            prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=28,
                max_shapes_column_width=60,
            )
        )


def pass_after_context(lm: LayeredLM, context: int, most: int) -> Callable[[int], torch.Tensor]:
    """A session of ``lm`` holding ``context`` positions of ordinary token ids, and
    ``step(t)``: a forward of t more positions (logits ``[t, V]``), then rolled back so that
    every step starts from the same cache (``most``: the largest t)."""
    n_layers = lm.info.num_layers
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 1000, (context + most,), generator=gen).tolist()
    sess = ModelSession(lm, context + most + 1)
    sess.set_tokens(prompt[:context])
    sess.hidden(n_layers, context - 1)

    def step(t: int) -> torch.Tensor:
        sess.set_tokens(prompt[: context + t - 1])
        logits = sess.logits(n_layers, context - 1, context + t - 1)
        sess.set_tokens(prompt[: context - 1])  # back: positions < context-1 computed
        return logits

    return step


def prefill_after_nothing(lm: LayeredLM, tokens: int) -> Callable[[], torch.Tensor]:
    """``prefill()``: a new session's prefill of ``tokens`` ordinary token ids (the last
    layer's hidden states, no logits), as a request's prompt is run."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 1000, (tokens,), generator=gen).tolist()

    def prefill() -> torch.Tensor:
        sess = ModelSession(lm, tokens + 1)
        sess.set_tokens(prompt)
        return sess.hidden(lm.info.num_layers, tokens - 1)[0]

    return prefill


def compare_kernels(model: str, context: int, counts: list[int], repeats: int,
                    kernels: list[str], prefill_tokens: int | None = None) -> None:
    """Median ms of a T-row pass over ``context`` positions with each kernel library, the
    libraries alternating within every repeat on one loaded GGUF model (module doc); with
    ``prefill_tokens``, also a prompt's prefill of that many tokens (min and median s)."""
    import specflow.quant.matrix as quant_matrix
    from specflow.quant import kernel

    libraries = {}
    for spec in kernels:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--kernels {spec!r}: give NAME=PATH of a built library")
        libraries[name] = kernel.load_library(Path(path), name)
    first = next(iter(libraries.values()))
    quant_matrix.kernel_status = lambda: first  # the model loads (repacks) with the first
    lm = load_model(model, dtype="float32", backend="auto", trust_remote_code=False,
                    packed_weights=None, weights="gguf").lm
    step = pass_after_context(lm, context, max(counts))
    times: dict[tuple[str, int], list[float]] = {(n, t): [] for n in libraries for t in counts}
    want: dict[int, torch.Tensor] = {}
    prefill = prefill_after_nothing(lm, prefill_tokens) if prefill_tokens else None
    prefills: dict[str, list[float]] = {n: [] for n in libraries}
    want_hidden: torch.Tensor | None = None
    for rep in range(repeats + 1):  # the first round warms up
        for name, library in libraries.items():
            quant_matrix.kernel_status = lambda library=library: library
            if prefill is not None:
                t0 = time.perf_counter()
                hidden = prefill()
                if rep:
                    prefills[name].append(time.perf_counter() - t0)
                if want_hidden is None:
                    want_hidden = hidden
                elif not torch.equal(hidden, want_hidden):
                    raise SystemExit(f"{name}: the prefill's hidden states differ from "
                                     f"{next(iter(libraries))}'s")
            for t in counts:
                t0 = time.perf_counter()
                logits = step(t)
                elapsed = time.perf_counter() - t0
                if rep:
                    times[(name, t)].append(elapsed)
                if t not in want:
                    want[t] = logits
                elif not torch.equal(logits, want[t]):
                    raise SystemExit(f"{name}: logits at T = {t} differ from "
                                     f"{next(iter(libraries))}'s")
    print(f"{model} GGUF, context {context}, {torch.get_num_threads()} threads, ms, median of "
          f"{repeats}, libraries alternating (identical logits)")
    print(f"{'T':>3}" + "".join(f"{name:>12}" for name in libraries))
    for t in counts:
        print(f"{t:>3}" + "".join(f"{statistics.median(times[(n, t)]) * 1e3:>12.1f}"
                                  for n in libraries))
    if prefill is not None:
        print(f"a {prefill_tokens}-token prefill, s, min/median of {repeats}")
        cells = (f"{min(prefills[n]):.2f}/{statistics.median(prefills[n]):.2f}" for n in libraries)
        print("   " + "".join(f"{cell:>12}" for cell in cells))


def llamacpp_prices(model: str, context: int, counts: list[int], repeats: int) -> None:
    """llama.cpp's whole pass of T rows (logits for each) after ``context`` positions of
    ordinary token ids, median of ``repeats``, interleaved over ``counts``."""
    from specflow.llamacpp import LlamaCppDecoder
    from specflow.models.prepare import gguf_path

    decoder = LlamaCppDecoder(gguf_path(model), threads=torch.get_num_threads())
    ctx = decoder.target
    ctx.feed(list(range(1000, 1000 + context)), 1)
    times: dict[int, list[float]] = {t: [] for t in counts}
    for _ in range(repeats + 1):  # the first round warms up
        for t in counts:
            t0 = time.perf_counter()
            ctx.feed(list(range(2000, 2000 + t)), t)
            times[t].append(time.perf_counter() - t0)
            ctx.truncate(context)
    decoder.close()
    print(f"llama.cpp, {model}'s GGUF, context {context}, {torch.get_num_threads()} threads, "
          f"median of {repeats}")
    base = statistics.median(times[counts[0]][1:])
    print(f"{'T':>3}{'ms':>10}{'vs T=' + str(counts[0]):>10}")
    for t in counts:
        med = statistics.median(times[t][1:])
        print(f"{t:>3}{med * 1e3:>10.1f}{med / base:>10.2f}")


if __name__ == "__main__":
    main()
