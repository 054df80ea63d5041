"""Every config composes; every stage node instantiates; bad keys fail with clear messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specflow.config import register_configs
from specflow.engine import SpeculativePipeline
from specflow.errors import ConfigError
from specflow.graph import build_pipeline, instantiate_checked
from specflow.models.loading import LoadedModel
from specflow.models.native import NativeLM
from tests.conftest import make_pair

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["drafter", "intermediate_verifier", "target_verifier", "acceptor", "selector",
          "workload", "callbacks", "model", "runner"]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

register_configs()


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


_DRAFTS: dict = {}  # id(hf model) -> the draft model's LoadedModel (tiny_models)


@pytest.fixture(scope="module")
def deep_tiny():
    """A tiny random model as deep as Qwen2.5-Coder-1.5B (28 layers), so configured exits fit."""
    return make_pair("llama", seed=5, num_layers=28)


@pytest.fixture(scope="module")
def deep_tiny_feature_head(deep_tiny, tmp_path_factory):
    """An (untrained) feature head file for the deep tiny model."""
    import torch

    from specflow.models.feature_head import FeatureHead, save_feature_head

    lm = deep_tiny[1]
    path = tmp_path_factory.mktemp("fh") / "feature_head.safetensors"
    head = FeatureHead.from_target(lm, torch.arange(lm.info.vocab_size))
    return save_feature_head(path, head, lm.info)


@pytest.fixture(scope="module")
def deep_tiny_medusa(deep_tiny, tmp_path_factory):
    """A folder of (untrained) Medusa heads for the deep tiny model, as published."""
    import json

    import torch

    h, v = deep_tiny[1].info.hidden_size, deep_tiny[1].info.vocab_size
    folder = tmp_path_factory.mktemp("medusa")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2,
                                                    "medusa_num_layers": 1}))
    sd = {}
    for j in range(2):
        sd |= {f"{j}.0.linear.weight": torch.zeros(h, h), f"{j}.0.linear.bias": torch.zeros(h),
               f"{j}.1.weight": torch.zeros(v, h)}
    torch.save(sd, folder / "medusa_lm_head.pt")
    return folder


@pytest.fixture
def tiny_models(monkeypatch, deep_tiny, deep_tiny_feature_head, deep_tiny_medusa):
    """Every model name resolves to the tiny model (no real weights, no exit heads needed;
    the default feature head is one made for it)."""
    hf, lm = deep_tiny
    loaded = LoadedModel(lm=lm, tokenizer=None, hf_model=hf, info=lm.info)
    # The draft model's name gets a model of its own (the same weights): a drafter that
    # sees part of the prompt (context_window) must not be the target.
    if id(hf) not in _DRAFTS:
        _DRAFTS[id(hf)] = LoadedModel(lm=NativeLM.from_hf(hf, lm.info), tokenizer=None,
                                      hf_model=hf, info=lm.info)
    draft = _DRAFTS[id(hf)]
    monkeypatch.setattr("specflow.models.loading.load_model",
                        lambda name, *a, **k: draft if "0.5b" in str(name) else loaded)
    monkeypatch.setattr("specflow.models.resolve.attach_exit_heads", lambda *a, **k: None)
    monkeypatch.setattr("stages.drafters.feature.default_feature_head_path",
                        lambda name: deep_tiny_feature_head)
    monkeypatch.setattr("stages.drafters.medusa.default_medusa_path",
                        lambda name: deep_tiny_medusa)
    return loaded


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_builds(experiment, tiny_models):
    cfg = _compose([f"+experiment={experiment}"])
    assert cfg.method
    pipe = build_pipeline(cfg)
    assert isinstance(pipe, SpeculativePipeline)
    workload = instantiate_checked("workload", cfg.workload)
    assert workload.requests()


@pytest.mark.parametrize(
    ("group", "option"),
    [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))],
)
def test_every_group_option_composes(group, option, tiny_models):
    overrides = [f"{group}={option}"]
    if (group, option) == ("workload", "prompts"):
        overrides.append(f"workload.path={Path(__file__).parent / 'data' / 'prompts.txt'}")
    cfg = _compose(overrides)
    node = cfg.get(group)
    if group in ("model", "runner"):
        return  # typed by the schema: composing is the check
    if group == "callbacks":
        for name, sub in (node or {}).items():
            assert instantiate_checked(f"callbacks.{name}", sub) is not None
        return
    obj = instantiate_checked(group, node)
    assert (obj is None) == (not node)


def test_misspelled_runner_key_fails_at_composition():
    with pytest.raises(Exception, match="max_new_tokenz"):
        _compose(["runner.max_new_tokenz=3"])


def test_wrong_type_fails_at_composition():
    with pytest.raises(Exception, match="max_new_tokens"):
        _compose(["runner.max_new_tokens=lots"])


def test_unknown_stage_key_is_named(tiny_models):
    cfg = _compose(["drafter=pld", "+drafter.kk=3"])
    with pytest.raises(ConfigError, match=r"drafter: 'kk' is not an argument .*valid keys"):
        build_pipeline(cfg)


def test_unknown_stage_target_is_named(tiny_models):
    cfg = _compose(["drafter=pld", "drafter._target_=stages.nope.Nope"])
    with pytest.raises(ConfigError, match="unknown stage _target_ 'stages.nope.Nope'"):
        build_pipeline(cfg)


def test_unknown_stage_option_lists_choices():
    with pytest.raises(Exception, match="Available options"):
        _compose(["drafter=nope"])


def test_k_below_one_is_refused(tiny_models):
    cfg = _compose(["drafter=pld", "drafter.k=0"])
    with pytest.raises(ConfigError, match="k must be >= 1, got 0"):
        build_pipeline(cfg)


def test_resolved_config_is_plain_yaml():
    cfg = _compose(["+experiment=sps"])
    assert "qwen2.5-coder-0.5b" in OmegaConf.to_yaml(cfg)


def test_sampling_group_is_the_engines_sampling_params():
    from specflow.sampling import SamplingParams

    cfg = _compose(["sampling.temperature=0.7", "sampling.top_k=5"])
    assert OmegaConf.to_object(cfg.sampling) == SamplingParams(0.7, 5, 1.0)
    bad = _compose(["sampling.top_p=0"])  # composes; checked when the run starts
    with pytest.raises(ConfigError, match=r"sampling.top_p must be in \(0, 1\], got 0.0"):
        OmegaConf.to_object(bad.sampling)
    with pytest.raises(Exception, match="temperatur"):
        _compose(["sampling.temperatur=1"])


def test_model_values_come_from_conf_model_only():
    from specflow.config import ModelConfig

    schema = OmegaConf.structured(ModelConfig)
    assert OmegaConf.missing_keys(schema) == set(schema)  # types only, no values
    for option in sorted(p.stem for p in (CONF / "model").glob("*.yaml")):
        model = _compose([f"model={option}"]).model
        assert OmegaConf.missing_keys(model) == set(), option
        variant = option.removesuffix("-gguf")  # the same model, its GGUF blocks as published
        assert model.name == variant
        assert model.weights == ("gguf" if variant != option else "float")


def test_model_min_rows_reaches_the_loaded_model(tiny_models, deep_tiny):
    """``model.min_rows`` sets the shared model's row padding when the stages resolve it; 0
    is refused with its name; the default (null) takes the probed row count."""
    from specflow.cpu.row_padding import RowProbe

    lm = deep_tiny[1]
    try:
        build_pipeline(_compose(["+experiment=pld", "model.min_rows=3"]))
        assert lm.min_rows == 3
        with pytest.raises(ConfigError, match="model.min_rows"):
            build_pipeline(_compose(["+experiment=pld", "model.min_rows=0"]))
        lm.row_probe = RowProbe({1: 1.0, 4: 0.5}, 4)  # as if probed: the default takes it
        build_pipeline(_compose(["+experiment=pld"]))
        assert lm.min_rows == 4
    finally:
        lm.min_rows, lm.row_probe = 1, None
