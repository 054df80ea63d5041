"""specflow's benchmark: pipelines composed from conf/ next to HF generate and llama.cpp.

    .venv/bin/python scripts/bench_vs_hf.py --preset quick     # how fast on this machine
    .venv/bin/python scripts/bench_vs_hf.py --out outputs/bench/mine \\
        --common "model=qwen2.5-coder-1.5b workload.ids=[101,125] runner.max_new_tokens=128" \\
        --method ar=+experiment=ar \\
        --method +experiment=pld_sps \\
        --method pld_sps_fixed="+experiment=pld_sps draft_length=fixed" \\
        --method hf_plain --method llamacpp_lookup

A method is an experiment plus overrides: ``--method [NAME=]OVERRIDES`` is composed from
``conf/`` exactly as ``python run.py <common> OVERRIDES`` composes it (Hydra's compose API,
``+experiment=default`` where no experiment is picked, as run.py does) and built and run by
``specflow.app.prepare_run``, the code path of ``run.py`` (its checks, its row probe and
whole-pass check before a CPU run, its results folder ``OUT/NAME``).  NAME defaults to the
experiment's config name (with the other overrides: ``pld_sps,draft_length=fixed``).  The
first method is the reference (plain decoding, ``+experiment=ar``).  ``NAME OVERRIDES`` as
two arguments is accepted too.  Any override works, so a model setting (a dtype, other
weights) is one more method.

Baseline methods, by name (their overrides, if any, compose the config they read: the
target, the workload, ``runner.max_new_tokens``, and for ``llamacpp_draft`` the draft
model, e.g. ``llamacpp_draft=+experiment=pld_sps``):

    hf_plain          HF ``generate``, greedy, on an untouched fp32 copy of the target
    hf_lookup         the same with its prompt lookup (``prompt_lookup_num_tokens=10``)
    llamacpp_plain    llama.cpp on the target's GGUF as installed (``specflow.llamacpp``)
    llamacpp_lookup   llama.cpp with prompt lookup (``LlamaPromptLookupDecoding``'s search)
    llamacpp_draft    llama.cpp with the draft model's GGUF, greedy chain verification

Every method decodes the same chat-templated prompt token ids greedily with the same stop
ids, interleaved request by request (request ``i`` by every method, the order rotated by one
per request, so machine drift spreads over all); each warms up once on a prompt outside the
workload.  Records are appended to ``OUT/NAME/requests.jsonl`` as they are produced; the
report (``OUT/report.md``, ``OUT/report.json``, printed) has per method: tokens/s, × plain
(pooled seconds of the reference over the method's on the same requests) and × plain TPOT
(time per output token after the first), TTFT (median) and TPOT, τ, verify rows per round,
a round's verify cost in plain steps, and identical outputs (against the plain decoding of
the same weights: a pipeline on GGUF blocks against plain decoding of them where the run has
it, HF's against specflow's plain decoding of the float weights, llama.cpp's against
``llamacpp_plain``; else against the reference);
then × plain (τ) per category, and the table of the README's "Which pipeline" for this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("MKL_CBWR", "AUTO")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from run import with_default_experiment  # noqa: E402
from specflow.app import PreparedRun, model_configs, prepare_run  # noqa: E402
from specflow.config import register_configs  # noqa: E402
from specflow.errors import ConfigError, SpecflowError  # noqa: E402
from specflow.llamacpp import Decoded  # noqa: E402
from specflow.results.baselines import machine_description  # noqa: E402
from specflow.results.measure import generation_metrics, task_scores  # noqa: E402
from specflow.results.paired import paired_report  # noqa: E402
from specflow.results.records import RequestRecord, TurnRecord  # noqa: E402
from specflow.results.run_folder import REQUESTS_FILE, RunFolder, read_records, results_fingerprint  # noqa: E402
from specflow.runner import WARM_UP, build_prompt, set_aside_long_lived_objects  # noqa: E402
from specflow.scheduler import Generation  # noqa: E402
from specflow.state import RoundStats, StageTimes  # noqa: E402
from specflow.workload import Request  # noqa: E402

BASELINES = {
    "hf_plain": "HF generate",
    "hf_lookup": "HF generate, prompt lookup",
    "llamacpp_plain": "llama.cpp, the GGUF as installed",
    "llamacpp_lookup": "llama.cpp, prompt lookup",
    "llamacpp_draft": "llama.cpp, the draft model's GGUF drafts",
}
MAIN = ["ar=+experiment=ar", "+experiment=pld_sps",
        "pld_sps_fixed=+experiment=pld_sps draft_length=fixed", "+experiment=pld_tree_sps",
        "+experiment=suffix_recycle", "+experiment=pld"]
BASELINE_ROWS = ["hf_plain", "hf_lookup", "llamacpp_plain", "llamacpp_lookup"]
PRESETS: dict[str, tuple[str, list[str]]] = {  # name: (common overrides, methods)
    # the README's main pipelines on the 1.5B, twelve questions (the 0.5B drafts)
    "full": ("model=qwen2.5-coder-1.5b workload.per_category=2 runner.max_new_tokens=128",
             [*MAIN, *BASELINE_ROWS, "llamacpp_draft=+experiment=pld_sps"]),
    # the default job on SmolLM2-135M's GGUF file (no draft model exists for it) beside plain
    # decoding of the file, the same two on its float weights, HF and llama.cpp: a few minutes
    "quick": ("workload.per_category=1 runner.max_new_tokens=64",
              ["ar=+experiment=ar model=smollm2-135m-gguf", "+experiment=default",
               "ar_float=+experiment=ar model=smollm2-135m",
               "default_float=+experiment=default model=smollm2-135m", *BASELINE_ROWS]),
}
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass
class Method:
    """One ``--method``: its name, overrides, composed config and baseline kind (``None``
    for a specflow pipeline)."""

    name: str
    overrides: list[str]
    cfg: DictConfig
    baseline: str | None = None


def parse_method(words: list[str]) -> tuple[str | None, list[str]]:
    """``[NAME=]OVERRIDES`` (or ``NAME OVERRIDES``) -> (NAME or ``None``, overrides).  A
    leading ``NAME=`` is a name where what follows it is empty or starts with an override
    (``pld_sps_fixed=+experiment=pld_sps draft_length=fixed``), not a value
    (``draft_length=fixed`` is an override)."""
    if len(words) > 2:
        raise ConfigError(f"--method {' '.join(words)}: give [NAME=]OVERRIDES as one argument "
                          f"(quoted) or NAME and OVERRIDES as two")
    if len(words) == 2:
        return words[0], shlex.split(words[1])
    text = words[0]
    if text in BASELINES:
        return text, []
    head, eq, rest = text.partition("=")
    rest_words = shlex.split(rest)
    if eq and NAME.fullmatch(head) and (not rest_words or "=" in rest_words[0]):
        return head, rest_words
    return None, shlex.split(text)


def default_name(overrides: list[str], cfg: DictConfig) -> str:
    """The experiment's config name, then the other overrides (``pld_sps,draft_length=x``)."""
    picked = [o.split("=", 1)[1] for o in overrides if o.lstrip("+~").startswith("experiment=")]
    rest = [o for o in overrides if not o.lstrip("+~").startswith("experiment=")]
    return ",".join([picked[0] if picked else str(cfg.method), *rest])


def compose_methods(common: list[str], specs: list[list[str]]) -> list[Method]:
    """Compose ``common + overrides`` of each method as ``run.py`` would; no decoding."""
    register_configs()
    given = {o.lstrip("+~").split("=")[0] for o in common}
    # the reference decodes plainly; callbacks (console tables per request) only add noise
    extra = [o for o in ("callbacks=none", "runner.baseline=false") if o.split("=")[0] not in given]
    out: list[Method] = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for words in specs:
            name, own = parse_method(words)
            overrides = with_default_experiment(["run.py", *common, *own])[1:] + extra
            cfg = compose("config", overrides=overrides)
            name = name or default_name(own, cfg)
            kind = name if name in BASELINES else None
            out.append(Method(name, own, cfg, kind))
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"method names repeat: {names}; name them (--method NAME=OVERRIDES)")
    if out and out[0].baseline:
        raise ConfigError(f"the first method is the reference, a specflow pipeline, not "
                          f"{out[0].name!r} (e.g. --method ar=+experiment=ar first)")
    return out


def check_shared_models(methods: list[Method]) -> None:
    """Refuse methods that give one model different exit heads or ``min_rows``: they attach
    to the one model object every method shares (the in-process model cache), so the last
    attached would serve them all.  A method that gives none (``exit_heads: null``) runs with
    whatever the others attached (give the same file in --common, or bench it apart)."""
    seen: dict[str, tuple[str, Any]] = {}
    rows_seen: dict[str, tuple[str, Any]] = {}
    for m in methods:
        for _, model in model_configs(m.cfg) if not m.baseline else []:
            name, heads, rows = model["name"], model.get("exit_heads"), model.get("min_rows", 1)
            if name in seen and seen[name][1] != heads and heads is not None:
                raise ConfigError(
                    f"methods {seen[name][0]!r} and {m.name!r} give model {name!r} different "
                    f"exit heads ({seen[name][1]} vs {heads}); they share one model: put both "
                    f"exits in one heads file and pass model.exit_heads=FILE in --common")
            if heads is not None or name not in seen:
                seen[name] = (m.name, heads)
            if rows_seen.setdefault(name, (m.name, rows))[1] != rows:
                raise ConfigError(
                    f"methods {rows_seen[name][0]!r} and {m.name!r} give model {name!r} "
                    f"different min_rows ({rows_seen[name][1]} vs {rows}); they share one "
                    f"model: pass model.min_rows in --common")


# ------------------------------------------------------------------------ baseline methods

Generate = Callable[[list[int], int, set[int]], Decoded]


def hf_generate(name: str, lookup: bool, cache: dict[str, Any]) -> Generate:
    """HF ``generate`` (greedy; ``lookup``: its prompt lookup) on an fp32 copy of ``name``
    loaded apart from specflow's (its tensors as HF made them), shared by both HF methods."""
    import torch
    from transformers import AutoModelForCausalLM

    from specflow.models.prepare import prepared_dir

    if name not in cache:
        path = prepared_dir(name) if (prepared_dir(name) / "config.json").exists() else name
        cache[name] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = cache[name]

    def go(prompt: list[int], max_new: int, stop: set[int]) -> Decoded:
        ids = torch.tensor([prompt])
        first: list[float] = []

        class Clock:  # a streamer: its first put is the prompt, its second the first token
            calls = 0

            def put(self, value: Any) -> None:
                Clock.calls += 1
                if Clock.calls == 2:
                    first.append(time.perf_counter())

            def end(self) -> None:
                pass

        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=sorted(stop),
                                 pad_token_id=min(stop), streamer=Clock(),
                                 **({"prompt_lookup_num_tokens": 10} if lookup else {}))
        total = time.perf_counter() - t0
        tokens = out[0, len(prompt):].tolist()
        return Decoded(tokens, total, first[0] - t0 if first else total,
                       "eos" if tokens and tokens[-1] in stop else "length")

    return go


def llamacpp_generate(m: Method, threads: int) -> Generate:
    """llama.cpp in the mode the name says, on the GGUF of the method's target (and of its
    first other model, the draft model, for ``llamacpp_draft``)."""
    from specflow.llamacpp import LlamaCppDecoder
    from specflow.models.prepare import gguf_path

    mode = m.name.removeprefix("llamacpp_")
    target = m.cfg.model.name
    draft = None
    if mode == "draft":
        others = [c["name"] for _, c in model_configs(m.cfg) if c["name"] != target]
        if not others:
            raise ConfigError(f"{m.name}: its config has no draft model; give one, e.g. "
                              f"--method {m.name}=+experiment=pld_sps")
        draft = gguf_path(others[0])
    dec = LlamaCppDecoder(gguf_path(target), mode, threads=threads, n_ctx=8192, draft_gguf=draft)
    return dec.generate


class BaselineRun:
    """A baseline method over the workload, turn by turn as ``specflow.runner`` decodes a
    conversation (turn i+1's prompt holds turn i's answer), one record per request."""

    def __init__(self, m: Method, ref: PreparedRun, folder: RunFolder, gen: Generate) -> None:
        self.settings = ref.runner.settings  # the reference's prompts and length
        self.tokenizer = ref.runner.tokenizer
        self.stop = set(ref.runner.pipeline.info.eos_token_ids)
        self.folder, self.gen, self.warm = folder, gen, self.settings.warmup

    def decode(self, request: Request) -> None:
        s = self.settings
        if self.warm:  # untimed, on a prompt outside the workload
            self.gen(build_prompt(self.tokenizer, [{"role": "user", "content": WARM_UP}], s),
                     min(8, s.max_new_tokens), self.stop)
            self.warm = False
        messages: list[dict[str, str]] = []
        turns, gens = [], []
        for text in request.turns:
            messages.append({"role": "user", "content": text})
            prompt = build_prompt(self.tokenizer, messages, s)
            d = self.gen(prompt, s.max_new_tokens, self.stop)
            answer = self.tokenizer.decode(d.tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            stats = RoundStats(rounds=d.rounds, drafted=d.drafted, accepted=d.accepted)
            gens.append(Generation(d.tokens, stats, StageTimes(), d.total_s, d.stop_reason,
                                   ttft_s=d.ttft_s))
            turns.append(TurnRecord(len(prompt), answer, d.tokens, len(d.tokens), d.total_s,
                                    d.stop_reason, d.ttft_s))
        self.folder.append(RequestRecord(
            request.request_id, request.category, request.subcategory, turns[-1].output_text,
            turns, generation_metrics(gens), task_scores(request, turns[-1].output_text)))


def prepare_methods(methods: list[Method], out: Path) -> dict[str, Any]:
    """Every method ready to decode a request: ``PreparedRun`` (specflow's) or
    ``BaselineRun``; the models load once (shared in-process, HF's copy apart)."""
    runs: dict[str, Any] = {}
    hf: dict[str, Any] = {}
    for m in methods:
        if not m.baseline:
            runs[m.name] = prepare_run(m.cfg, out / m.name)
            continue
        ref = runs[methods[0].name]
        if m.cfg.model.name != methods[0].cfg.model.name:
            raise ConfigError(f"{m.name}: target {m.cfg.model.name}, not the reference's "
                              f"{methods[0].cfg.model.name}; put model=... in --common")
        config = {**OmegaConf.to_container(m.cfg, resolve=True), "baseline": m.name}
        folder = RunFolder(out / m.name, resume=m.cfg.resume,
                           fingerprint=results_fingerprint(config))
        threads = m.cfg.runner.threads or 2
        gen = (hf_generate(m.cfg.model.name, m.name == "hf_lookup", hf)
               if m.name.startswith("hf_") else llamacpp_generate(m, threads))
        runs[m.name] = BaselineRun(m, ref, folder, gen)
    return runs


def run_interleaved(runs: dict[str, Any]) -> None:
    """Decode request ``i`` with every method (order rotated by ``i``), then request i + 1."""
    names = list(runs)
    ref: PreparedRun = runs[names[0]]
    for name, run in runs.items():
        if isinstance(run, PreparedRun) and [r.request_id for r in run.requests] != [
                r.request_id for r in ref.requests]:
            raise ConfigError(f"{name!r} has other requests than {names[0]!r}: put the "
                              f"workload in --common")
    for i, request in enumerate(ref.requests):
        for name in names[i % len(names):] + names[: i % len(names)]:
            run = runs[name]
            folder = run.folder
            if request.request_id in folder.done_ids:
                continue
            print(f"[{i + 1}/{len(ref.requests)}] {request.request_id} ({request.category}): "
                  f"{name}", flush=True)
            if isinstance(run, PreparedRun):
                run.runner.run([request], folder, run.meta)
                # warm once: later requests find the kernels and buffers the first one made
                run.runner.settings = replace(run.runner.settings, warmup=False)
            else:
                run.decode(request)


# ------------------------------------------------------------------------ the report


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def own_plain(m: Method, methods: list[Method]) -> str:
    """The method whose tokens ``m``'s must equal: ``llamacpp_plain`` for llama.cpp's; for
    HF's, specflow's first plain decoding of the target's float weights; for a specflow
    pipeline, the first plain decoding (``method: ar``) of the same model settings (GGUF
    blocks round otherwise than their float copy); else the reference (the first method)."""
    if m.name.startswith("llamacpp_"):
        return "llamacpp_plain"
    want = (m.cfg.model.name, "float") if m.baseline else (m.cfg.model.name, m.cfg.model)
    for p in methods:
        if p.baseline or p.cfg.method != "ar":
            continue
        if (p.cfg.model.name, p.cfg.model.weights if m.baseline else p.cfg.model) == want:
            return p.name
    return methods[0].name


def bench_report(records: dict[str, list[RequestRecord]], methods: list[Method]) -> dict:
    """``specflow.results.paired.paired_report`` (against the first method) with, per method, TTFT
    and TPOT, × plain TPOT, verify rows and plain steps per round, and identical outputs
    against the method's own plain decoding (``own_plain``)."""
    reference = methods[0].name
    rep = paired_report(records, reference)
    tpot: dict[str, float | None] = {}
    for name, recs in records.items():
        secs = sum(r.metrics.decode_s or 0.0 for r in recs)
        tpot[name] = _div(secs, sum(r.metrics.decode_tokens for r in recs))
    verify = {n: _div(m["time_per_stage_s"].get("verify_s"), m["rounds"])
              for n, m in rep["methods"].items()}
    for m in methods:
        row = rep["methods"].get(m.name)
        if row is None:
            continue
        same_as = own_plain(m, methods)
        ref = {r.request_id: r for r in records.get(same_as, [])}
        pairs = [(r, ref[r.request_id]) for r in records[m.name] if r.request_id in ref]
        ttfts = [r.metrics.ttft_s for r in records[m.name] if r.metrics.ttft_s is not None]
        drafted = sum(r.metrics.drafted for r in records[m.name])
        row.update(
            overrides=" ".join(m.overrides), baseline=m.baseline,
            ttft_s=statistics.median(ttfts) if ttfts else None, tpot_s=tpot[m.name],
            tpot_speedup=_div(tpot[reference], tpot[m.name]),
            rows_per_round=_div(drafted + row["rounds"], row["rounds"]),
            verify_steps=None if m.baseline else _div(verify[m.name], verify[reference]),
            identical_to=same_as,
            identical=[sum([t.output_tokens for t in a.turns] == [t.output_tokens for t in b.turns]
                           for a, b in pairs), len(pairs)],
        )
    return rep


def _f(x: float | None, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "–" if x is None else fmt.format(x * scale)


def report_markdown(rep: dict, order: list[tuple[str, str]]) -> str:
    """The report as markdown: one table of every method, then × plain (τ) per category."""
    ms = rep["methods"]
    lines = [f"CPU: {rep['cpu']}", "", "Requests: " + ", ".join(f"{i} ({c})" for i, c in order),
             "", "| method | overrides | tok/s | × plain | × plain TPOT | TTFT ms | TPOT ms | τ "
             "| rows/round | verify steps/round | identical |", "|---" * 11 + "|"]
    for name, m in ms.items():
        lines.append(
            f"| {name} | `{m['overrides'] or '–'}` | {_f(m['tokens_per_s'])} | "
            f"{_f(m['speedup'])} | {_f(m['tpot_speedup'])} | {_f(m['ttft_s'], '{:.0f}', 1e3)} | "
            f"{_f(m['tpot_s'], '{:.1f}', 1e3)} | {_f(m['tau'])} | {_f(m['rows_per_round'])} | "
            f"{_f(m['verify_steps'])} | {m['identical'][0]}/{m['identical'][1]} "
            f"({m['identical_to']}) |")
    cats = sorted({c for m in ms.values() for c in m["by_category"]})
    lines += ["", "× plain (τ) per category:", "", "| method | " + " | ".join(cats) + " |",
              "|---" * (len(cats) + 1) + "|"]
    for name, m in ms.items():
        cells = [f"{_f(m['by_category'][c]['speedup'])} ({_f(m['by_category'][c]['tau'])})"
                 if c in m["by_category"] else "–" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def machine_table(rep: dict, common: list[str], wall_s: float) -> str:
    """The README's "Which pipeline" table for this machine: pipeline, command, × plain and
    × plain TPOT, on this CPU (model name and torch ISA), with the wall time."""
    cpu = machine_description()["cpu"]
    last = {o.split("=")[0]: o for o in common}  # the later of two values of one key
    lines = [f"On this machine: {cpu['model']} (torch ISA {cpu['isa']}), "
             f"{machine_description()['torch_threads']} threads; every method with "
             f"`{' '.join(last.values())}`; plain decoding (`{rep['reference']}`) "
             f"{_f(rep['methods'][rep['reference']]['tokens_per_s'], '{:.1f}')} tokens/s; "
             f"wall time {wall_s / 60:.1f} min", "",
             "| pipeline | command | CPU (torch ISA) | × plain | × plain TPOT |",
             "|---|---|---|---|---|"]
    for name, m in rep["methods"].items():
        command = BASELINES[name] if m["baseline"] else f"`python run.py {m['overrides']}`"
        lines.append(f"| {name} | {command} | {cpu['model']} ({cpu['isa']}) | "
                     f"{_f(m['speedup'])} | {_f(m['tpot_speedup'])} |")
    return "\n".join(lines) + "\n"


def bench(args: argparse.Namespace) -> None:
    common_text, preset_methods = PRESETS[args.preset]
    common = shlex.split(common_text) + shlex.split(args.common)
    methods = compose_methods(common, args.method or [[t] for t in preset_methods])
    out = Path(args.out or f"outputs/bench/{args.preset}")
    started = time.perf_counter()
    if args.report_only:  # the folders as they are: no model is loaded
        missing = [m.name for m in methods if not (out / m.name / REQUESTS_FILE).exists()]
        if missing:
            raise ConfigError(f"no {REQUESTS_FILE} for {missing} under {out}")
        records = {m.name: read_records(out / m.name / REQUESTS_FILE) for m in methods}
    else:
        check_shared_models(methods)
        runs = prepare_methods(methods, out)
        set_aside_long_lived_objects()  # the loaded models' objects, out of the collector's walks
        print(f"{len(runs)} methods ready in {time.perf_counter() - started:.0f} s", flush=True)
        run_interleaved(runs)
        records = {name: run.folder.records for name, run in runs.items()}
    rep = bench_report(records, methods)
    order = [(r.request_id, r.category) for r in records[methods[0].name]]
    text = report_markdown(rep, order) + "\n" + machine_table(
        rep, common, time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(rep, indent=2))
    (out / "report.md").write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full",
                    help="common overrides and methods: full (the 1.5B, the default) or "
                    "quick (SmolLM2-135M, a few minutes)")
    ap.add_argument("--out", default=None, help="one results folder per method in here "
                    "(default outputs/bench/PRESET)")
    ap.add_argument("--common", default="", help="overrides every method gets, after the "
                    "preset's (one string)")
    ap.add_argument("--method", nargs="+", action="append", default=None,
                    metavar="[NAME=]OVERRIDES", help="a method (replaces the preset's); "
                    "the first is the reference")
    ap.add_argument("--report-only", action="store_true", help="report the folders; decode nothing")
    try:
        bench(ap.parse_args())
    except SpecflowError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
