"""The GPU check: ours vs HF ``generate`` on the same prompts, one table.

    python scripts/gpu_check.py [--device cuda] [--dtype bfloat16] [--requests 24]
        [--tokens 128] [--hf-requests 8] [--out DIR]
        [--target NAME_OR_FOLDER] [--head FOLDER] [--exit-layer N]

SmolLM2-135M-Instruct (or ``--target``: a registry name or a local HF folder) on the first
turns of ``--requests`` Spec-Bench dev questions (chat template), greedy, EOS honoured, at
most ``--tokens`` new tokens each:

- ours: plain decoding at batch 1 / 8 / 32, prompt lookup (k = 8) and prompt lookup with the
  adaptive draft length at batch 1 / 8, through the scheduler with paged KV and (on CUDA)
  CUDA graphs.  With ``--head`` (a published EAGLE-1/2 or EAGLE-3 folder of the target, or
  a ``feature_head.safetensors``) also ``eagle`` (the head's chains, k = 4) and
  ``eagle_pld`` (prompt lookup, else the head), and with ``--exit-layer`` ``layerskip``
  (the first N layers draft 6 tokens through the shared final norm and LM head, as
  ``+experiment=layerskip``), each at batch 1 / 8.  Each configuration decodes the whole
  workload twice: the first pass warms up (and captures every graph shape it meets), the
  second is timed.
- HF ``generate`` on a separately loaded copy: plain at batch 1 and 8 (left padding), prompt
  lookup (``prompt_lookup_num_tokens=10``) at batch 1, on the first ``--hf-requests``
  requests (HF at batch 1 is slow; tokens/s is comparable across request counts).
- fidelity: each of ours against our own plain decoding at batch 1 in the same dtype; HF
  against ours likewise; and an fp32 identity check (ours plain at batch 8 vs HF plain,
  fp32, 4 requests x 32 tokens).

Columns: tokens/s (new tokens / wall seconds of the pass), ratio to our plain batch 1,
ratio to HF plain at the same batch size, fidelity, the kernels that ran, CUDA graphs
(shapes captured, capture seconds).  ``--out`` gets ``gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

import torch  # noqa: E402

from specflow.engine import SpeculativePipeline  # noqa: E402
from specflow.kv.stores import KVLayout  # noqa: E402
from specflow.models.loading import load_model  # noqa: E402
from specflow.runner import build_prompt  # noqa: E402
from specflow.scheduler import Scheduler, SeqRequest  # noqa: E402
from specflow.settings import RunSettings  # noqa: E402
from specflow.workload import SpecBench  # noqa: E402
from stages.acceptors.standard import StandardAcceptor  # noqa: E402
from stages.draft_length.adaptive import AdaptiveDraftLength  # noqa: E402
from stages.drafters.fallback import FallbackDrafter  # noqa: E402
from stages.drafters.feature import FeatureDrafter  # noqa: E402
from stages.drafters.model import ModelDrafter  # noqa: E402
from stages.drafters.pld import PLDDrafter  # noqa: E402
from stages.verifiers.full import FullVerifier  # noqa: E402

MODEL = "smollm2-135m"


def make_drafter(method: str, lm, args):
    """The drafter of one configuration (``None``: plain decoding)."""
    if method == "ar":
        return None
    if method in ("pld", "pld_adaptive"):
        return PLDDrafter(k=8)
    if method == "eagle":
        return FeatureDrafter(lm, head=args.head, k=4)
    if method == "eagle_pld":
        return FallbackDrafter(PLDDrafter(k=8, min_ngram=2), FeatureDrafter(lm, head=args.head,
                                                                            k=4))
    if method == "layerskip":
        return ModelDrafter(lm, exit_layer=args.exit_layer, k=6)
    raise ValueError(method)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ours(lm, method: str, batch: int, prompts, args, eos, layout: KVLayout) -> dict:
    drafter = make_drafter(method, lm, args)
    policy = AdaptiveDraftLength() if method == "pld_adaptive" else None
    pipe = SpeculativePipeline(FullVerifier(lm), StandardAcceptor(), drafter, draft_length=policy)
    max_context = max(map(len, prompts)) + args.tokens + 16
    sched = Scheduler(pipe, batch, layout, max_context=max_context)
    reqs = [SeqRequest(p, args.tokens, stop_token_ids=eos, tag=i) for i, p in enumerate(prompts)]
    sched.generate(reqs)  # warm-up pass: allocator, kernels, every graph shape it meets
    sync(args.device)
    t0 = time.perf_counter()
    results = sched.generate(reqs)
    sync(args.device)
    wall = time.perf_counter() - t0
    tokens = {r.request.tag: r.generation.tokens for r in results}
    sched.kv.check_no_leaks()
    return {
        "tokens": [tokens[i] for i in range(len(prompts))],
        "new_tokens": sum(map(len, tokens.values())),
        "wall_s": wall,
        "report": sched.kv.report(),
    }


def hf_generate(model, prompts, batch: int, max_new: int, eos, device: str, **kw) -> dict:
    """HF ``generate`` over ``prompts`` in batches (left padding), greedy."""
    pad = eos[0]
    outs: list[list[int]] = []
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=list(eos),
                pad_token_id=pad,
                **kw,
            )
        for row in out[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            outs.append(row[:cut])
    sync(device)
    wall = time.perf_counter() - t0
    return {"tokens": outs, "new_tokens": sum(map(len, outs)), "wall_s": wall}


def hf_model(target: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    from specflow.models.prepare import prepared_dir

    folder = Path(target).expanduser()
    folder = folder if folder.is_dir() else prepared_dir(target)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def same(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(1, min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=8)
    ap.add_argument("--batches", default="1,8,32", help="batch sizes of our plain decoding")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps on CUDA")
    ap.add_argument("--out", default=None)
    ap.add_argument("--target", default=MODEL, help="a registry name or a local HF folder")
    ap.add_argument("--head", default=None,
                    help="a feature head of the target: an EAGLE-1/2 or EAGLE-3 folder")
    ap.add_argument("--exit-layer", type=int, default=None,
                    help="LayerSkip self-speculation from this layer (early-exit-trained models)")
    args = ap.parse_args()
    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.target, dtype="float32", backend="native", trust_remote_code=False,
                        packed_weights=None)
    lm, tok = loaded.lm, loaded.tokenizer
    eos = tuple(lm.info.eos_token_ids)
    reqs = SpecBench(per_category=-(-args.requests // 6)).requests()[: args.requests]
    prompts = [
        build_prompt(tok, [{"role": "user", "content": r.turns[0]}], RunSettings()) for r in reqs
    ]
    cuda = args.device.startswith("cuda")
    decode = "graphs" if cuda and not args.no_graphs else "eager"
    layout = KVLayout(kind="paged", device=args.device, dtype=args.dtype, decode=decode)
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[tuple[str, int], dict] = {}
    methods = ["pld", "pld_adaptive"] + (["eagle", "eagle_pld"] if args.head else []) + (
        ["layerskip"] if args.exit_layer else [])
    plan = [("ar", b) for b in batches] + [(m, b) for m in methods for b in batches[:2]]
    for method, b in plan:
        runs[("ours_" + method, b)] = ours(lm, method, b, prompts, args, eos, layout)
        print(f"  ours_{method} b{b}: {time.perf_counter() - start:.0f}s", flush=True)
    hf = hf_model(args.target, dtype, args.device)
    few = prompts[: args.hf_requests]
    hf_generate(hf, few[:1], 1, 8, eos, args.device)  # warm-up
    runs[("hf_ar", 1)] = hf_generate(hf, few, 1, args.tokens, eos, args.device)
    runs[("hf_ar", 8)] = hf_generate(hf, few, 8, args.tokens, eos, args.device)
    runs[("hf_pld", 1)] = hf_generate(
        hf, few, 1, args.tokens, eos, args.device, prompt_lookup_num_tokens=10
    )
    print(f"  hf: {time.perf_counter() - start:.0f}s", flush=True)
    del hf  # before the fp32 copy (a large target's two copies need not fit together)
    if cuda:
        torch.cuda.empty_cache()

    # fp32 identity: ours plain (batch 8) vs HF plain, 4 requests x 32 tokens.
    fp32 = KVLayout(kind="paged", device=args.device, dtype="float32", decode=decode)
    small = argparse.Namespace(**{**vars(args), "tokens": 32})
    ours32 = ours(lm, "ar", 8, prompts[:4], small, eos, fp32)["tokens"]
    hf32 = hf_generate(hf_model(args.target, torch.float32, args.device), prompts[:4], 1, 32, eos,
                       args.device)
    fp32_same = same(ours32, hf32["tokens"])

    ref = runs[("ours_ar", 1)]["tokens"]
    rate = {key: r["new_tokens"] / r["wall_s"] for key, r in runs.items()}
    gpu = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    print()
    print(
        f"{gpu}; torch {torch.__version__}; {args.target} {args.dtype}"
        f"{'; head ' + args.head if args.head else ''}; {len(prompts)} Spec-Bench dev "
        f"requests (HF: first {len(few)}), <= {args.tokens} new tokens, greedy; decode={decode}"
    )
    head = f"{'config':<20}{'batch':>6}{'tok/s':>10}{'vs ours b1':>12}{'vs HF':>8}{'same':>7}"
    print(head + "  kernels / graphs")
    for (name, b), r in runs.items():
        hf_key = ("hf_ar", b)
        vs_hf = rate[(name, b)] / rate[hf_key] if hf_key in rate else float("nan")
        fid = same(r["tokens"], ref)
        rep = r.get("report", {})
        graphs = f"{rep.get('graphs_captured', 0)} graphs {rep.get('capture_s', 0.0):.1f}s"
        kernels = ",".join(rep.get("kernels", ["hf"]))
        tps = rate[(name, b)]
        print(
            f"{name:<20}{b:>6}{tps:>10.1f}{tps / rate[('ours_ar', 1)]:>12.2f}"
            f"{vs_hf:>8.2f}{fid:>7.2f}  {kernels} / {graphs}"
        )
    print(f"fp32 identity, ours plain b8 vs HF generate (4 x 32 tokens): {fp32_same:.2f}")
    print(f"total {time.perf_counter() - start:.0f}s")
    if args.out:
        out = {
            f"{name}@{b}": {k: v for k, v in r.items() if k != "tokens"}
            | {"tok_s": rate[(name, b)]}
            for (name, b), r in runs.items()
        }
        out["fp32_identity"] = fp32_same
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "gpu_check.json").write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
