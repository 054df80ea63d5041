"""Benchmark specflow against Hugging Face ``generate`` on the same prompts, in one run.

    python scripts/bench_vs_hf.py --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b \
        --prompts 4 --max-new-tokens 48 --repeats 2

Pairs measured side by side, interleaved per prompt (so machine drift hits all equally):
  ours plain decoding            vs  HF generate(do_sample=False)
  ours sps (draft model, k)      vs  HF generate(assistant_model=drafter)
  ours pld (prompt lookup, k)    vs  HF generate(prompt_lookup_num_tokens=10)
plus ours with the adaptive draft length, and the training-free token trees
(``ours_suffix_recycle``, ``ours_recycle``, ``ours_suffix``: conf/drafter/suffix_recycle.yaml;
with a draft model also merged with its chain: ``ours_model_and_tree``,
conf/drafter/model_and_tree.yaml, and ``ours_suffix_then_model_and_tree``: the suffix tree
alone where it matches 3 tokens or more; and ``ours_pld_tree_sps_k4``/``_k6``: prompt lookup,
else the draft model drafting k tokens, itself sped up by the token trees it verifies;
``ours_pld_sps_int8``, ``ours_pld_tree_sps_k4_int8``: the same with the draft model's
int8 copies, ``model.quantize=int8``, where the row probe finds them faster; ``*_window``:
and the draft model seeing only the last ``--context-window`` prompt tokens; ``*_aten``: the
int8 copies multiplied by ATen's kernel instead of the rows kernel, as where it cannot run;
``ours_pld_sps_int8_window_sub32k``: the draft model scoring only token ids below 32768 and
the prompt's, ``drafter.vocab_subset=32768``; ``ours_pld_sps_int8_window_adaptive``: with
``draft_length=adaptive``; ``ours_pld_sps_int8_window<N>_adaptive`` for each N of
``--context-windows``: the same at a draft context of N prompt tokens; ``<method>_onednn``:
any of ours (a copy with its own drafter state, the
models shared) with every model's passes on oneDNN's packed matrices where the float rows
kernel would run them).
Beside tokens/s end to end it reports time to first token (TTFT: prefill and the first
round) and time per output token after it (TPOT), each method's TPOT against ours plain,
and for ours the verify rows per round and a round's verify cost in plain steps.
Every run decodes greedily until EOS (the same EOS ids for everybody) or
--max-new-tokens, so all methods produce the same tokens (checked and printed).
tokens/s of a method in one repeat = all its new tokens / all its seconds; the table
shows the median over repeats and ratios of medians.  HF runs on untouched
weights: specflow's own HF module when specflow packed its weights (the CPU fp32 default),
else a separately loaded copy (``--shared-hf`` reuses specflow's, to save memory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "AUTO")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specflow.acceptance import StandardAcceptor  # noqa: E402
from specflow.cpu import probe_cpu, resolve_dtype  # noqa: E402
from specflow.engine import SpeculativePipeline  # noqa: E402
from specflow.models.loading import load_model  # noqa: E402
from specflow.models.native import NativeLM  # noqa: E402
from specflow.models.row_padding import (  # noqa: E402
    choose_row_kernels,
    row_probe,
)
from specflow.recycling import RecyclingTable  # noqa: E402
from specflow.runner import WARM_UP, build_prompt  # noqa: E402
from specflow.scheduler import generate  # noqa: E402
from specflow.settings import RunSettings  # noqa: E402
from specflow.suffix_index import SuffixIndex  # noqa: E402
from specflow.whole_pass import check_float_rows  # noqa: E402
from specflow.workload import SpecBench  # noqa: E402
from stages.draft_length import AdaptiveDraftLength  # noqa: E402
from stages.fallback_drafter import FallbackDrafter  # noqa: E402
from stages.feature_drafter import FeatureDrafter  # noqa: E402
from stages.full_verifier import FullVerifier  # noqa: E402
from stages.merged_tree_drafter import MergedTreeDrafter  # noqa: E402
from stages.model_drafter import ModelDrafter  # noqa: E402
from stages.pld_drafter import PLDDrafter  # noqa: E402
from stages.token_tree_drafter import TokenTreeDrafter  # noqa: E402

# How the script loads models (besides the dtype), said here rather than left to defaults.
SETTINGS = dict(backend="auto", trust_remote_code=False, packed_weights=None)


def hf_copy(name: str, shared: bool, dtype: str = "float32"):
    """The HF model HF ``generate`` runs: a separately loaded copy, unless ``shared`` or
    specflow's model is packed (then specflow never touched the HF tensors: they keep HF's
    own layout, and a second copy would only cost memory)."""
    loaded = load_model(name, dtype=dtype, **SETTINGS)
    if shared or (isinstance(loaded.lm, NativeLM) and loaded.lm.packed):
        return loaded.hf_model
    from transformers import AutoModelForCausalLM

    from specflow.models.prepare import prepared_dir

    path = prepared_dir(name) if (prepared_dir(name) / "config.json").exists() else name
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


class FirstTokenClock:
    """A streamer for HF ``generate`` that notes when the first generated token arrives
    (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def aten_int8_twin(lm: NativeLM) -> NativeLM:
    """``lm`` (with int8 copies) again, sharing its own weights, its int8 copies remade in
    ATen's layout and multiplied by ATen's kernel (``*_aten``), probed on its own."""
    twin = copy.copy(lm)
    twin.int8_layers, twin.int8_head, twin.int8_rows = [], None, frozenset()
    twin.row_probe = twin.whole_pass_check = None
    twin.make_int8_copies(blocked=False)
    return twin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument(
        "--drafter-dtype", default="auto",
        help="the draft model's dtype, ours and HF's assistant alike (auto: bfloat16 where "
        "this CPU multiplies it natively, else float32 -- specflow/cpu.py; lossless either "
        "way, the target verifies)",
    )
    ap.add_argument(
        "--prompts", type=int, default=None,
        help="Spec-Bench prompts (mixed categories; default 4, all with --per-category)",
    )
    ap.add_argument("--categories", nargs="*", default=None)
    ap.add_argument(
        "--ids", nargs="*", default=None,
        help="Spec-Bench question ids to keep (e.g. prompts no head trained on), before "
        "--categories / --per-category / --prompts",
    )
    ap.add_argument(
        "--per-category", type=int, default=None,
        help="take this many prompts of each category (then --prompts caps the total)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="draft length of our sps")
    ap.add_argument("--context-window", type=int, default=128,
                    help="the *_window methods' draft context (drafter.context_window)")
    ap.add_argument("--context-windows", type=int, nargs="*", default=[],
                    help="also ours_pld_sps_int8_window<N>_adaptive for each N")
    ap.add_argument("--no-int8", action="store_true",
                    help="skip loading the drafter's int8 copy (the *_int8 methods)")
    ap.add_argument("--pld-k", type=int, default=8, help="draft length of our pld")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--shared-hf", action="store_true", help="HF reuses specflow's HF model objects"
    )
    ap.add_argument(
        "--feature-head", default=None,
        help="a feature-head file (train_heads head=feature), or 'default': adds ours_feature "
        "(k = --feature-k), ours_feature_adaptive, ours_feature_k<N> for --feature-ks and "
        "ours_eagle_pld (prompt lookup first, the head at k = --feature-k where it finds "
        "nothing: conf/drafter/pld_then_feature.yaml)",
    )
    ap.add_argument("--feature-k", type=int, default=4)
    ap.add_argument(
        "--keep-tables", default=None,
        help="a folder of token-tree tables an earlier run kept (drafter.keep): adds "
        "ours_suffix_recycle_kept, the token trees starting from a copy of them",
    )
    ap.add_argument(
        "--eagle-head", default=None,
        help="an EAGLE-1/2 checkpoint folder (config.json + weights, as published, or a head "
        "train_heads exported with output.format=eagle): adds ours_eagle_pld_folder, prompt "
        "lookup first and that head at k = --feature-k (docs/draft-checkpoints.md)",
    )
    ap.add_argument(
        "--feature-tree", type=int, nargs=2, default=None, metavar=("BRANCHES", "DEPTH"),
        help="with --feature-head: adds ours_feature_tree and ours_eagle_pld_tree, the head "
        "drafting a tree of BRANCHES x DEPTH (drafter.branches, drafter.k)",
    )
    ap.add_argument(
        "--feature-trees", choices=("free_rows", "measured", "always"), default="free_rows",
        help="drafter.trees of the --feature-tree methods: free_rows (on a CPU, a tree only "
        "where its verify rows fit the padded row count), measured (also where the trees "
        "verified so far pay for their rows at the row probe's prices) or always",
    )
    ap.add_argument("--feature-ks", type=int, nargs="*", default=[])
    ap.add_argument(
        "--min-rows", type=int, default=None,
        help="adds <method>_rows for each of ours: the same pipeline with the models' packed "
        "matmuls padded to this many rows (model.min_rows; 0: the probed row count, "
        "specflow/models/row_padding.py); ours without the suffix run as --rows says",
    )
    ap.add_argument(
        "--rows", choices=("probe", "1"), default="probe",
        help="the row padding of ours (model.min_rows): probe = each model's probed row count, "
        "as run.py's default model.min_rows=null sets it (the product's default); 1 = unpadded",
    )
    ap.add_argument("--only", nargs="*", default=None, help="subset of method names to run")
    ap.add_argument("--out", default=None, help="write the raw measurements as JSON here")
    args = ap.parse_args()
    if args.prompts is None and args.per_category is None and not args.ids:
        args.prompts = 4
    if args.threads:
        torch.set_num_threads(args.threads)

    caps = probe_cpu()
    print(f"CPU: {caps.describe()}", flush=True)
    args.drafter_dtype = str(resolve_dtype(args.drafter_dtype)).removeprefix("torch.")
    target = load_model(args.target, dtype="float32", **SETTINGS)
    drafter = (load_model(args.drafter, dtype=args.drafter_dtype, **SETTINGS)
               if args.drafter else None)
    wants_int8 = args.only is None or any("_int8" in m for m in args.only)
    drafter8 = (load_model(args.drafter, dtype=args.drafter_dtype, quantize="int8", **SETTINGS)
                if args.drafter and wants_int8 and not args.no_int8 else None)
    drafter8_aten = (aten_int8_twin(drafter8.lm) if drafter8 is not None and
                     (args.only is None or any(m.endswith("_aten") for m in args.only)) else None)
    hf_target = hf_copy(args.target, args.shared_hf)
    hf_drafter = hf_copy(args.drafter, args.shared_hf, args.drafter_dtype) if drafter else None
    tok = target.tokenizer
    eos = tuple(target.info.eos_token_ids)

    requests = SpecBench(
        categories=args.categories, limit=args.prompts, per_category=args.per_category,
        ids=args.ids,
    ).requests()
    settings = RunSettings()
    prompts = [
        build_prompt(tok, [{"role": "user", "content": r.turns[0]}], settings) for r in requests
    ]

    verifier = FullVerifier(target.lm)

    def fallback_pld() -> PLDDrafter:  # the `first` of conf/drafter/pld_then_*.yaml
        return PLDDrafter(k=args.pld_k, max_ngram=4, min_ngram=2)

    ours: dict[str, SpeculativePipeline] = {
        "ours_ar": SpeculativePipeline(verifier, StandardAcceptor()),
        "ours_pld": SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=PLDDrafter(k=args.pld_k)
        ),
        "ours_pld_adaptive": SpeculativePipeline(
            verifier,
            StandardAcceptor(),
            drafter=PLDDrafter(k=args.pld_k),
            draft_length=AdaptiveDraftLength(),
        ),
    }
    def token_tree(suffix: bool, recycling: bool, branches: int = 3,
                   keep: str | None = None) -> TokenTreeDrafter:
        # conf/drafter/suffix_recycle.yaml (recycle.yaml, suffix.yaml: one source)
        return TokenTreeDrafter(
            target.lm, k=8, branches=branches, max_nodes=12,
            suffix=SuffixIndex(max_ngram=6, min_ngram=1, max_matches=16) if suffix else None,
            recycling=RecyclingTable(width=8) if recycling else None, keep=keep,
        )

    ours["ours_suffix_recycle"] = SpeculativePipeline(
        verifier, StandardAcceptor(), drafter=token_tree(True, True))
    ours["ours_recycle"] = SpeculativePipeline(
        verifier, StandardAcceptor(), drafter=token_tree(False, True))
    ours["ours_suffix"] = SpeculativePipeline(
        verifier, StandardAcceptor(), drafter=token_tree(True, False))
    if args.keep_tables:  # a copy: the run's own learning does not reach the folder
        kept = Path(tempfile.mkdtemp(prefix="kept-tables-"))
        shutil.copytree(args.keep_tables, kept, dirs_exist_ok=True)
        ours["ours_suffix_recycle_kept"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=token_tree(True, True, keep=str(kept)))
    ours["ours_suffix_recycle_chain"] = SpeculativePipeline(
        verifier, StandardAcceptor(), drafter=token_tree(True, True, branches=1))
    ours["ours_suffix_recycle_adaptive"] = SpeculativePipeline(
        verifier, StandardAcceptor(), drafter=token_tree(True, True),
        draft_length=AdaptiveDraftLength())
    if drafter:
        ours["ours_sps"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=ModelDrafter(drafter.lm, k=args.k)
        )
        ours["ours_sps_adaptive"] = SpeculativePipeline(
            verifier,
            StandardAcceptor(),
            drafter=ModelDrafter(drafter.lm, k=args.k),
            draft_length=AdaptiveDraftLength(),
        )

        def pld_then_model() -> FallbackDrafter:  # conf/drafter/pld_then_model.yaml
            return FallbackDrafter(
                fallback_pld(), ModelDrafter(drafter.lm, k=args.k),
            )

        ours["ours_pld_sps"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=pld_then_model()
        )
        ours["ours_suffix_sps"] = SpeculativePipeline(  # conf/drafter/suffix_then_model.yaml
            verifier, StandardAcceptor(), drafter=FallbackDrafter(
                TokenTreeDrafter(target.lm, k=8, branches=3, max_nodes=12,
                                 suffix=SuffixIndex(max_ngram=6, min_ngram=2, max_matches=16)),
                ModelDrafter(drafter.lm, k=args.k),
            )
        )

        def model_and_tree() -> MergedTreeDrafter:  # conf/drafter/model_and_tree.yaml
            return MergedTreeDrafter(
                ModelDrafter(drafter.lm, k=args.k),
                TokenTreeDrafter(target.lm, k=8, branches=3, max_nodes=4,
                                 suffix=SuffixIndex(max_ngram=6, min_ngram=1, max_matches=16),
                                 recycling=RecyclingTable(width=8)),
                extra_nodes=4,
            )

        def tree_sps(k: int, small: NativeLM = drafter.lm,
                     window: int | None = None) -> SpeculativePipeline:
            # conf/drafter/tree_model.yaml: the 0.5B drafts k tokens a round, itself sped up
            # by token trees it verifies.
            return SpeculativePipeline(
                FullVerifier(small), StandardAcceptor(), level="draft", k=k,
                context_window=window,
                drafter=TokenTreeDrafter(
                    small, k=8, branches=3, max_nodes=12,
                    suffix=SuffixIndex(max_ngram=6, min_ngram=1, max_matches=16),
                    recycling=RecyclingTable(width=8)),
            )

        for k in (4, 6):  # conf/drafter/pld_then_tree_model.yaml
            ours[f"ours_pld_tree_sps_k{k}"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=FallbackDrafter(fallback_pld(), tree_sps(k)))
        if drafter8 is not None:  # the same with drafter.model.quantize=int8
            ours["ours_pld_sps_int8"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=FallbackDrafter(
                    fallback_pld(), ModelDrafter(drafter8.lm, k=args.k)))
            ours["ours_pld_tree_sps_k4_int8"] = SpeculativePipeline(
                verifier, StandardAcceptor(),
                drafter=FallbackDrafter(fallback_pld(), tree_sps(4, drafter8.lm)))
            ours["ours_pld_sps_int8_window"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=FallbackDrafter(
                    fallback_pld(), ModelDrafter(drafter8.lm, k=args.k,
                                                 context_window=args.context_window)))
            windows = {"": args.context_window} | {str(w): w for w in args.context_windows}
            for label, window in windows.items():  # the adaptive one, at other windows too
                ours[f"ours_pld_sps_int8_window{label}_adaptive"] = SpeculativePipeline(
                    verifier, StandardAcceptor(), drafter=FallbackDrafter(
                        fallback_pld(), ModelDrafter(drafter8.lm, k=args.k,
                                                     context_window=window)),
                    draft_length=AdaptiveDraftLength())
            ours["ours_pld_sps_int8_window_sub32k"] = SpeculativePipeline(  # + vocab_subset
                verifier, StandardAcceptor(), drafter=FallbackDrafter(
                    fallback_pld(), ModelDrafter(drafter8.lm, k=args.k, vocab_subset=32768,
                                                 context_window=args.context_window)))
            ours["ours_pld_tree_sps_k4_int8_window"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=FallbackDrafter(
                    fallback_pld(), tree_sps(4, drafter8.lm, args.context_window)))
        if drafter8_aten is not None:  # the same, int8 by ATen's kernel
            ours["ours_pld_sps_int8_window_aten"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=FallbackDrafter(
                    fallback_pld(), ModelDrafter(drafter8_aten, k=args.k,
                                                 context_window=args.context_window)))
            ours["ours_pld_tree_sps_k4_int8_window_aten"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=FallbackDrafter(
                    fallback_pld(), tree_sps(4, drafter8_aten, args.context_window)))
        ours["ours_model_and_tree"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=model_and_tree())
        ours["ours_suffix_then_model_and_tree"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=FallbackDrafter(
                TokenTreeDrafter(target.lm, k=8, branches=3, max_nodes=12,
                                 suffix=SuffixIndex(max_ngram=6, min_ngram=3, max_matches=16)),
                model_and_tree(),
            )
        )
        ours["ours_pld_sps_adaptive"] = SpeculativePipeline(
            verifier,
            StandardAcceptor(),
            drafter=pld_then_model(),
            draft_length=AdaptiveDraftLength(),
        )

    if args.feature_head:
        def feature(k: int) -> FeatureDrafter:
            return FeatureDrafter(target.lm, head=args.feature_head, k=k)

        ours["ours_feature"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=feature(args.feature_k)
        )
        ours["ours_feature_adaptive"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=feature(max(args.feature_ks + [args.feature_k])),
            draft_length=AdaptiveDraftLength(),
        )
        for k in args.feature_ks:
            ours[f"ours_feature_k{k}"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=feature(k)
            )
        ours["ours_eagle_pld"] = SpeculativePipeline(  # conf/drafter/pld_then_feature.yaml
            verifier, StandardAcceptor(), drafter=FallbackDrafter(
                fallback_pld(), feature(args.feature_k)
            )
        )
        if args.feature_tree:
            branches, depth = args.feature_tree

            def tree() -> FeatureDrafter:
                return FeatureDrafter(target.lm, head=args.feature_head, k=depth,
                                      branches=branches, trees=args.feature_trees)

            ours["ours_feature_tree"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=tree()
            )
            ours["ours_eagle_pld_tree"] = SpeculativePipeline(
                verifier, StandardAcceptor(), drafter=FallbackDrafter(fallback_pld(), tree())
            )
    if args.eagle_head:
        ours["ours_eagle_pld_folder"] = SpeculativePipeline(
            verifier, StandardAcceptor(), drafter=FallbackDrafter(
                fallback_pld(), FeatureDrafter(target.lm, head=args.eagle_head,
                                               k=args.feature_k)
            )
        )

    padded_models = [m.lm for m in (target, drafter, drafter8) if m is not None]
    padded_models += [drafter8_aten] if drafter8_aten is not None else []
    padded_rows = args.min_rows  # the <method>_rows variants' row count (0: probe it)
    if padded_rows == 0:
        probe = row_probe(target.lm)  # the one probe (a measured tree drafter reads it)
        padded_rows = probe.chosen
        print(f"row probe (ms by rows): "
              f"{ {r: round(t * 1e3, 2) for r, t in probe.seconds.items()} } -> {padded_rows}")

    # ours' row padding by model: what run.py's model.min_rows=null chooses, or 1
    base_rows = {id(lm): row_probe(lm).chosen if args.rows == "probe" else 1
                 for lm in padded_models}
    for lm in padded_models:
        probe = row_probe(lm)
        if args.rows == "probe":  # dense, float rows kernel, int8 where they win, as run.py
            choose_row_kernels(lm, probe, base_rows[id(lm)])
        elif lm.int8_layers:  # its int8 copies at one row (model.quantize=int8)
            lm.set_int8_rows(frozenset({1}))
        print(f"{lm.info.name}: row probe ms by rows "
              f"{ {r: round(t * 1e3, 2) for r, t in {**probe.seconds, **probe.priced}.items()} }"
              f", dense { {r: round(t * 1e3, 2) for r, t in probe.dense.items()} }"
              f", int8 { {r: round(t * 1e3, 2) for r, t in probe.int8.items()} }"
              f", float rows kernel "
              f"{ {r: round(t * 1e3, 2) for r, t in probe.float_rows.items()} }"
              f", ours run with min_rows={base_rows[id(lm)]}, dense at "
              f"{sorted(lm.dense_rows) or 'no row count'}, int8 at "
              f"{sorted(lm.int8_rows) or 'no row count'}, float rows kernel at "
              f"{sorted(lm.float_rows) or 'no row count'}")
    for lm in padded_models:
        lm.min_rows = base_rows[id(lm)]  # as ours run, so the check pads as they will
    check_float_rows(padded_models)  # as run.py: the kernel only where a whole pass gains
    for lm in padded_models:
        if lm.whole_pass_check is not None:
            print(f"{lm.info.name}: whole-pass check {lm.whole_pass_check}, float rows kernel at "
                  f"{sorted(lm.float_rows) or 'no row count'}, int8 at "
                  f"{sorted(lm.int8_rows) or 'no row count'}")
    chosen_float_rows = {id(lm): lm.float_rows for lm in padded_models}

    def run_ours(pipe: SpeculativePipeline, min_rows: int | None = None,
                 float_rows: bool = True
                 ) -> Callable[[list[int]], tuple[list[int], float, float]]:
        """``pipe`` timed on one prompt; ``min_rows``: every model padded to it;
        ``float_rows=False``: oneDNN where the float rows kernel would run (``*_onednn``)."""
        def go(prompt: list[int]) -> tuple[list[int], float, float]:
            for lm in padded_models:
                lm.min_rows = base_rows[id(lm)] if min_rows is None else min_rows
                if not float_rows:
                    lm.set_float_rows(frozenset())
            try:
                gen = generate(pipe, prompt, args.max_new_tokens, stop_token_ids=eos)
            finally:
                for lm in padded_models:
                    lm.min_rows = base_rows[id(lm)]
                    lm.set_float_rows(chosen_float_rows[id(lm)])
            last_stats[0] = gen
            return gen.tokens, gen.total_s, gen.ttft_s if gen.ttft_s is not None else gen.total_s

        return go

    def run_hf(**kw) -> Callable[[list[int]], tuple[list[int], float, float]]:
        def go(prompt: list[int]) -> tuple[list[int], float, float]:
            ids = torch.tensor([prompt])
            streamer = FirstTokenClock()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = hf_target.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    eos_token_id=list(eos),
                    pad_token_id=eos[0],
                    streamer=streamer,
                    **kw,
                )
            secs = time.perf_counter() - t0
            first = streamer.first_at - t0 if streamer.first_at is not None else secs
            return out[0, len(prompt) :].tolist(), secs, first

        return go

    last_stats: list = [None]  # the Generation of the latest ours call
    methods: dict[str, Callable] = {name: run_ours(p) for name, p in ours.items()}
    if padded_rows is not None:
        methods.update({f"{name}_rows": run_ours(p, padded_rows) for name, p in ours.items()})
    # a twin of each pipeline (its drafter's state its own: token-tree tables and suffix
    # indexes keep every request's output, so a shared drafter would see the other's answer),
    # sharing the models
    shared = {id(lm): lm for lm in padded_models}
    methods.update({f"{name}_onednn": run_ours(copy.deepcopy(p, dict(shared)), float_rows=False)
                    for name, p in ours.items()
                    if not args.only or f"{name}_onednn" in args.only})
    methods["hf_ar"] = run_hf()
    methods["hf_pld"] = run_hf(prompt_lookup_num_tokens=10)
    if hf_drafter is not None:
        methods["hf_sps"] = run_hf(assistant_model=hf_drafter)
    if args.only:
        methods = {k: v for k, v in methods.items() if k in args.only or k == "ours_ar"}

    # warm-up (untimed), on a prompt none of the measured ones is: token trees keep every
    # request's output, so warming up on a measured prompt would hand them its answer
    warm = build_prompt(tok, [{"role": "user", "content": WARM_UP}], settings)
    for fn in methods.values():
        fn(warm)

    per_repeat: dict[str, list[float]] = {m: [] for m in methods}
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    # per (method, prompt): [tokens, seconds] summed over repeats (the per-category tables)
    per_prompt: dict[str, list[list[float]]] = {m: [[0, 0.0] for _ in prompts] for m in methods}
    # per method: TTFTs, and decode seconds and tokens after the first token (TPOT)
    ttfts: dict[str, list[float]] = {m: [] for m in methods}
    decode: dict[str, list[float]] = {m: [0.0, 0] for m in methods}
    # per (method, prompt): [rounds, accepted] of ours (tau = 1 + accepted / rounds)
    ours_run = [m for m in methods if m.startswith("ours_")]  # padded variants included
    per_prompt_rounds: dict[str, list[list[int]]] = {
        m: [[0, 0] for _ in prompts] for m in ours_run}
    # per method of ours, pooled: seconds per stage and drafted tokens (the cost of a draft
    # token and of a verification round)
    stage_totals: dict[str, dict[str, float]] = {
        m: dict.fromkeys(("prefill_s", "draft_s", "verify_s", "accept_s", "drafted",
                          "accepted", "rounds"), 0.0) for m in ours_run}
    started = time.perf_counter()
    for rep in range(args.repeats):
        tokens = dict.fromkeys(methods, 0)
        seconds = dict.fromkeys(methods, 0.0)
        for i, prompt in enumerate(prompts):
            order = list(methods) if (rep + i) % 2 == 0 else list(reversed(methods))
            for name in order:
                last_stats[0] = None
                out, secs, first = methods[name](prompt)
                ttfts[name].append(first)
                decode[name][0] += max(0.0, secs - first)
                decode[name][1] += max(0, len(out) - 1)
                gen = last_stats[0]
                stats = None if gen is None else gen.stats
                if gen is not None:
                    per_prompt_rounds[name][i][0] += stats.rounds
                    per_prompt_rounds[name][i][1] += stats.accepted
                    tot = stage_totals[name]
                    for key in ("prefill_s", "draft_s", "verify_s", "accept_s"):
                        tot[key] += getattr(gen.times, key)
                    for key in ("drafted", "accepted", "rounds"):
                        tot[key] += getattr(stats, key)
                ref_out = outputs["ours_ar"][i] if len(outputs["ours_ar"]) > i else None
                same = "" if ref_out is None or name == "ours_ar" or rep else (
                    "  same as ours_ar" if out == ref_out else "  DIFFERS from ours_ar"
                )
                print(
                    f"[repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompts)} "
                    f"{requests[i].category}] {name:<22} {len(out):4d} tokens {secs:7.2f} s "
                    f"{len(out) / secs:7.2f} tok/s"
                    + (f" tau {stats.tau:.2f}" if stats is not None else "")
                    + f"{same}  (elapsed "
                    f"{time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
                tokens[name] += len(out)
                seconds[name] += secs
                per_prompt[name][i][0] += len(out)
                per_prompt[name][i][1] += secs
                if rep == 0:
                    outputs[name].append(out)
        for name in methods:
            per_repeat[name].append(tokens[name] / seconds[name])
        print(
            f"repeat {rep + 1}/{args.repeats}: "
            + ", ".join(f"{m} {per_repeat[m][-1]:.2f}" for m in methods),
            flush=True,
        )

    med = {m: statistics.median(v) for m, v in per_repeat.items()}
    ref = outputs["ours_ar"]
    print()
    print(
        f"machine: {caps.describe()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    drafted_by = (f"drafter {args.drafter} ({args.drafter_dtype})" if args.drafter
                  else "no draft model")
    print(
        f"target {args.target}, {drafted_by}; "
        f"{len(prompts)} Spec-Bench prompts ({', '.join(r.category for r in requests)}), "
        f"max_new_tokens {args.max_new_tokens}, "
        f"greedy, median of {args.repeats} repeats"
    )
    print(f"{'method':<20}{'tokens/s':>10}{'vs ours_ar':>12}{'vs hf_ar':>10}{'same tokens':>13}")
    for m in methods:
        same = sum(a == b for a, b in zip(outputs[m], ref, strict=True))
        print(
            f"{m:<20}{med[m]:>10.2f}{med[m] / med['ours_ar']:>12.2f}"
            f"{med[m] / med['hf_ar'] if 'hf_ar' in med else float('nan'):>10.2f}"
            f"{same:>9}/{len(ref)}"
        )
    categories = sorted({r.category for r in requests})
    if len(categories) > 1:
        print("\nper category: tokens/s (all its prompts and repeats) and x ours_ar")
        print(f"{'method':<20}" + "".join(f"{c[:13]:>15}" for c in categories))

        def rate(m: str, cat: str) -> float:
            rows = [per_prompt[m][i] for i, r in enumerate(requests) if r.category == cat]
            return sum(t for t, _ in rows) / sum(sec for _, sec in rows)

        for m in methods:
            cells = [
                f"{rate(m, c):7.2f} {rate(m, c) / rate('ours_ar', c):5.2f}x" for c in categories
            ]
            print(f"{m:<20}" + "".join(f"{cell:>15}" for cell in cells))

        def tau(m: str, cat: str | None = None) -> float:
            rows = [per_prompt_rounds[m][i] for i, r in enumerate(requests)
                    if cat is None or r.category == cat]
            n = sum(r for r, _ in rows)
            return 1 + sum(a for _, a in rows) / n if n else float("nan")

        print("\nper category: tau (tokens per target call); last column pooled")
        print(f"{'method':<20}" + "".join(f"{c[:13]:>15}" for c in categories) + f"{'all':>8}")
        for m in per_prompt_rounds:
            if m in methods:
                print(f"{m:<20}" + "".join(f"{tau(m, c):>15.2f}" for c in categories)
                      + f"{tau(m):>8.2f}")
    print("\ntime per stage, pooled over prompts (ours): ms per drafted token, ms per "
          "verification round, verify rows per round (drafted + 1), a round's verify cost in "
          "plain steps (its ms over ours_ar's), acceptance")
    print(f"{'method':<30}{'draft ms/tok':>13}{'verify ms/round':>17}{'rows/round':>12}"
          f"{'steps/round':>13}{'accept':>8}{'tau':>6}")
    plain = stage_totals.get("ours_ar", {})
    step_ms = 1000 * plain["verify_s"] / plain["rounds"] if plain.get("rounds") else None
    for m, tot in stage_totals.items():
        if m in methods and tot["rounds"]:
            per_tok = 1000 * tot["draft_s"] / tot["drafted"] if tot["drafted"] else float("nan")
            acc = tot["accepted"] / tot["drafted"] if tot["drafted"] else float("nan")
            verify_ms = 1000 * tot["verify_s"] / tot["rounds"]
            rows = (tot["drafted"] + tot["rounds"]) / tot["rounds"]
            steps = verify_ms / step_ms if step_ms else float("nan")
            print(f"{m:<30}{per_tok:>13.1f}{verify_ms:>17.1f}{rows:>12.2f}{steps:>13.2f}"
                  f"{acc:>8.2f}{1 + tot['accepted'] / tot['rounds']:>6.2f}")

    def tpot(m: str) -> float:
        secs, toks = decode[m]
        return secs / toks if toks else float("nan")

    print("\nlatency: TTFT (time to first token: prefill and first round; median over prompts "
          "and repeats), TPOT (time per output token after the first: all decode seconds over "
          "all decode tokens) and the TPOT speed-up against ours_ar")
    print(f"{'method':<30}{'TTFT ms':>10}{'TPOT ms':>10}{'TPOT x':>9}{'tok/s x':>9}")
    for m in methods:
        print(f"{m:<30}{1000 * statistics.median(ttfts[m]):>10.1f}{1000 * tpot(m):>10.1f}"
              f"{tpot('ours_ar') / tpot(m):>9.2f}{med[m] / med['ours_ar']:>9.2f}")
    pairs = [
        ("ours_ar", "hf_ar"),
        ("ours_sps", "hf_sps"),
        ("ours_pld", "hf_pld"),
        ("ours_sps_adaptive", "hf_sps"),
        ("ours_pld_adaptive", "hf_pld"),
        ("ours_pld_sps", "hf_sps"),
        ("ours_pld_sps", "hf_pld"),
        ("ours_pld_sps_adaptive", "hf_sps"),
        ("ours_feature", "hf_sps"),
        ("ours_feature", "hf_pld"),
        ("ours_feature_adaptive", "hf_sps"),
        ("ours_feature_adaptive", "hf_pld"),
        ("ours_eagle_pld", "hf_sps"),
        ("ours_eagle_pld", "hf_pld"),
        ("ours_eagle_pld_tree", "hf_pld"),
        ("ours_eagle_pld_tree_rows", "hf_pld"),
    ]
    print()
    for a, b in pairs:
        if a in med and b in med:
            print(f"{a} / {b} = {med[a] / med[b]:.2f}x")
    hf_fast = [m for m in ("hf_sps", "hf_pld") if m in med]
    if hf_fast:  # each of ours against HF's best speculative method of this run
        best = max(hf_fast, key=med.__getitem__)
        print(f"\nHF generate's best here: {best} ({med[best]:.2f} tokens/s); ours / it:")
        for m in ours_run:
            if m in med:
                print(f"  {m:<24}{med[m] / med[best]:.2f}x")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "cpu": caps.as_dict(),
                    "categories": [r.category for r in requests],
                    "per_repeat": per_repeat,
                    "median": med,
                    "per_prompt": per_prompt,
                    "per_prompt_rounds": per_prompt_rounds,
                    "stage_totals": stage_totals,
                    "ttft_s": ttfts,
                    "decode_s_tokens": decode,
                    "prompt_ids": [r.request_id for r in requests],
                    "same_tokens": {
                        m: [a == b for a, b in zip(outputs[m], ref, strict=True)] for m in methods
                    },
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
