"""The benchmark (scripts/bench_vs_hf.py): methods composed from conf/ as run.py composes
them, their names and overrides; one tiny run on SmolLM2-135M end to end."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    """scripts/bench_vs_hf.py as a module (scripts/ is not a package)."""
    if "bench_vs_hf" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_vs_hf",
                                                      ROOT / "scripts" / "bench_vs_hf.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_vs_hf"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_vs_hf"]


@pytest.fixture(scope="module")
def bench():
    return load_bench()


@pytest.mark.parametrize("text, name, overrides", [
    ("+experiment=pld_sps", None, ["+experiment=pld_sps"]),
    ("pld_sps=+experiment=pld_sps", "pld_sps", ["+experiment=pld_sps"]),
    ("pld_sps_fixed=+experiment=pld_sps draft_length=fixed", "pld_sps_fixed",
     ["+experiment=pld_sps", "draft_length=fixed"]),
    ("draft_length=fixed", None, ["draft_length=fixed"]),
    ("draft_length=fixed drafter.k=4", None, ["draft_length=fixed", "drafter.k=4"]),
    ("model.weights=gguf", None, ["model.weights=gguf"]),
    ("plain=", "plain", []),
    ("hf_plain", "hf_plain", []),
    ("llamacpp_draft=+experiment=pld_sps", "llamacpp_draft", ["+experiment=pld_sps"]),
])
def test_parse_method(bench, text: str, name: str | None, overrides: list[str]) -> None:
    assert bench.parse_method([text]) == (name, overrides)


def test_parse_method_two_words(bench) -> None:
    """``NAME OVERRIDES`` as two arguments (the former bench_interleaved form)."""
    assert bench.parse_method(["eagle", "+experiment=eagle drafter.k=6"]) == (
        "eagle", ["+experiment=eagle", "drafter.k=6"])


def test_parse_method_refuses_three_words(bench) -> None:
    from specflow.errors import ConfigError

    with pytest.raises(ConfigError, match="quoted"):
        bench.parse_method(["x", "+experiment=pld", "drafter.k=4"])


@pytest.mark.parametrize("preset", ["full", "quick"])
def test_each_default_method_composes_with_its_name_and_overrides(bench, preset: str) -> None:
    common, methods = bench.PRESETS[preset]
    composed = bench.compose_methods(shlex.split(common), [[t] for t in methods])
    by_name = {m.name: m for m in composed}
    assert list(by_name) == [bench.parse_method([t])[0] or t.split("=", 1)[1] for t in methods]
    ref = composed[0]
    ref_overrides = ["+experiment=ar"] + ([] if preset == "full" else ["model=smollm2-135m-gguf"])
    assert (ref.name, ref.overrides, ref.cfg.method) == ("ar", ref_overrides, "ar")
    assert ref.cfg.drafter is None or ref.cfg.drafter.get("_target_") is None
    model = "qwen2.5-coder-1.5b" if preset == "full" else "smollm2-135m"
    for m in composed:
        assert m.cfg.model.name == model, m.name
        assert m.cfg.callbacks is None or not m.cfg.callbacks, m.name  # no per-request tables
        assert m.cfg.runner.baseline is False, m.name  # the reference is a method of its own
        assert m.baseline == (m.name if m.name in bench.BASELINES else None)
        if not m.baseline:  # a config name: the experiment it composes (and a variant's)
            assert m.overrides[0].startswith("+experiment=")
            assert m.name.startswith(m.overrides[0].split("=")[1]), m.name
    for name in ("hf_plain", "hf_lookup", "llamacpp_plain", "llamacpp_lookup"):
        assert by_name[name].overrides == []
    if preset == "full":
        for name in ("pld_sps", "pld_tree_sps", "suffix_recycle", "pld"):
            assert by_name[name].overrides == [f"+experiment={name}"]
            assert by_name[name].cfg.method == name
        fixed, adaptive = by_name["pld_sps_fixed"], by_name["pld_sps"]
        assert fixed.overrides == ["+experiment=pld_sps", "draft_length=fixed"]
        assert fixed.cfg.draft_length._target_.endswith("FixedDraftLength")
        assert adaptive.cfg.draft_length._target_.endswith("AdaptiveDraftLength")
        assert fixed.cfg.drafter == adaptive.cfg.drafter
        assert by_name["pld_sps"].cfg.runner.max_new_tokens == 128
    else:
        default = by_name["default"].cfg  # the default job's pipeline
        assert default.method == "pld_adaptive"
        assert default.drafter._target_.endswith("PLDDrafter")
        assert default.draft_length._target_.endswith("AdaptiveDraftLength")
        assert by_name["default_float"].overrides == ["+experiment=default", "model=smollm2-135m"]
        assert by_name["default"].cfg.workload.per_category == 1  # common wins over the job's
        weights = {name: m.cfg.model.weights for name, m in by_name.items()}
        assert weights["ar"] == weights["default"] == "gguf"  # the default job: the GGUF file
        assert weights["ar_float"] == weights["default_float"] == "float"
        # each compared with the plain decoding of its own weights
        own = {name: bench.own_plain(m, composed) for name, m in by_name.items()}
        assert own == {"ar": "ar", "default": "ar", "ar_float": "ar_float",
                       "default_float": "ar_float", "hf_plain": "ar_float",
                       "hf_lookup": "ar_float", "llamacpp_plain": "llamacpp_plain",
                       "llamacpp_lookup": "llamacpp_plain"}


def test_unnamed_methods_take_their_config_name(bench) -> None:
    (plain, fixed) = bench.compose_methods(
        ["model=smollm2-135m"], [["+experiment=ar"], ["+experiment=pld draft_length=fixed"]])
    assert plain.name == "ar"
    assert fixed.name == "pld,draft_length=fixed"


def test_no_experiment_composes_the_default_job_as_run_py_does(bench) -> None:
    (m,) = bench.compose_methods([], [["plain=runner.max_new_tokens=8"]])
    assert m.cfg.method == "pld_adaptive" and m.cfg.runner.max_new_tokens == 8


def test_repeated_names_and_a_baseline_reference_are_refused(bench) -> None:
    from specflow.errors import ConfigError

    with pytest.raises(ConfigError, match="repeat"):
        bench.compose_methods([], [["+experiment=ar"], ["+experiment=ar"]])
    with pytest.raises(ConfigError, match="reference"):
        bench.compose_methods([], [["hf_plain"], ["+experiment=ar"]])


def test_bench_interleaved_is_the_same_program() -> None:
    text = (ROOT / "scripts" / "bench_interleaved.py").read_text()
    assert "bench_vs_hf.py" in text and "def " not in text


@pytest.mark.slow
def test_tiny_run_end_to_end(bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M, one prompt, 8 new tokens: plain decoding of the GGUF file, the default job
    (prompt lookup, adaptive length, on it), plain decoding of the float weights, HF generate
    and (where installed) llama.cpp; every record and the report written, each method's tokens
    equal to its own plain decoding's."""
    from specflow.models.prepare import is_prepared

    if not is_prepared("smollm2-135m"):
        pytest.skip("smollm2-135m is not prepared (bash scripts/setup.sh)")
    methods = ["ar=+experiment=ar model=smollm2-135m-gguf", "+experiment=default",
               "ar_float=+experiment=ar model=smollm2-135m", "hf_plain"]
    if importlib.util.find_spec("llama_cpp") is not None:
        methods += ["llamacpp_plain", "llamacpp_lookup"]
    argv = ["bench_vs_hf.py", "--preset", "quick", "--out", str(tmp_path), "--common",
            "workload.per_category=null workload.ids=[121] runner.max_new_tokens=8"]
    for m in methods:
        argv += ["--method", m]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rep = json.loads((tmp_path / "report.json").read_text())
    names = [bench.parse_method([m])[0] or "default" for m in methods]
    assert list(rep["methods"]) == names
    for name in names:
        row = rep["methods"][name]
        assert row["requests"] == 1 and row["tokens"] > 0
        assert (tmp_path / name / "requests.jsonl").exists()
        assert row["tpot_s"] and row["ttft_s"]
    assert rep["methods"]["ar"]["identical"] == [1, 1]
    # the default job (prompt lookup on the GGUF file) against plain decoding of the file
    assert rep["methods"]["default"]["identical_to"] == "ar"
    assert rep["methods"]["default"]["identical"] == [1, 1]
    # HF generate against specflow's plain decoding of the float weights
    assert rep["methods"]["hf_plain"]["identical_to"] == "ar_float"
    assert rep["methods"]["hf_plain"]["identical"] == [1, 1]
    if "llamacpp_lookup" in rep["methods"]:
        assert rep["methods"]["llamacpp_lookup"]["identical"] == [1, 1]
        assert rep["methods"]["llamacpp_lookup"]["identical_to"] == "llamacpp_plain"
    text = (tmp_path / "report.md").read_text()
    assert "| pipeline | command |" in text and "`python run.py +experiment=default`" in text


def test_any_model_setting_is_one_more_method(bench) -> None:
    """A model setting (quantized GGUF weights) beside the same pipeline in float weights."""
    methods = bench.compose_methods(["model=smollm2-135m"], [
        ["ar=+experiment=ar"], ["+experiment=pld"],
        ["pld_gguf=+experiment=pld model.weights=gguf"]])
    assert [m.name for m in methods] == ["ar", "pld", "pld_gguf"]
    assert methods[2].overrides == ["+experiment=pld", "model.weights=gguf"]
    assert (methods[1].cfg.model.weights, methods[2].cfg.model.weights) == ("float", "gguf")
