"""The cache root is declared once (``specflow.cache_root``) and a run's ``runner.cache_dir``
reaches every path resolved under it: prepared models, exit heads, feature heads (the
baselines: tests/test_runner_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specflow.cache_root import cache_root, configured_cache_root
from specflow.models import loading, prepare
from specflow.models.exit_heads import default_heads_path
from specflow.models.feature_head import default_feature_head_path
from specflow.models.registry import REGISTRY
from tests.test_configs import _compose
from tests.test_models_loading import SETTINGS, WORDS, _fake_entry, _FileParts, _tiny_folder


def test_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    with configured_cache_root(tmp_path / "run") as root:
        assert root == cache_root() == tmp_path / "run"
        assert cache_root(tmp_path / "arg") == tmp_path / "arg"  # an explicit one wins
        with configured_cache_root(None):  # None keeps the root in force
            assert cache_root() == tmp_path / "run"
    assert cache_root() == tmp_path / "env"  # the block's root ends with it
    monkeypatch.delenv("SPECFLOW_CACHE")
    assert cache_root() == Path.home() / ".cache" / "specflow"
    assert cache_root("~/elsewhere") == Path.home() / "elsewhere"


def test_configured_root_reaches_every_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path / "env"))
    with configured_cache_root(tmp_path / "run"):
        assert prepare.prepared_dir("m") == tmp_path / "run" / "models" / "m"
        assert default_heads_path("m") == tmp_path / "run" / "heads" / "m" / "heads.safetensors"
        assert default_feature_head_path("m") == (
            tmp_path / "run" / "heads" / "m" / "feature_head.safetensors"
        )


@pytest.mark.parametrize("how", ["configured", "argument"])
def test_load_model_finds_a_registry_model_under_a_non_default_root(monkeypatch, tmp_path, how):
    """A model prepared under another root loads from there; the default root is empty."""
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path / "empty"))
    entry = _fake_entry("fake-cached", _FileParts(()), sha="ab" * 32)
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    root = tmp_path / "other"
    folder = _tiny_folder(prepare.prepared_dir(entry.name, root), WORDS)
    (folder / prepare.MARKER_FILE).write_text('{"gguf_sha256": "%s"}' % ("ab" * 32))
    monkeypatch.setattr(prepare, "convert_gguf", lambda *a: pytest.fail("prepared again"))
    loading.clear_model_cache()
    try:
        if how == "configured":
            with configured_cache_root(root):
                loaded = loading.load_model(entry.name, **SETTINGS)
        else:
            loaded = loading.load_model(entry.name, cache_dir=root, **SETTINGS)
    finally:
        loading.clear_model_cache()
    assert loaded.info.num_layers == 3 and loaded.info.name == entry.name
    assert not (tmp_path / "empty").exists()


class _Stop(Exception):
    pass


def test_runner_cache_dir_reaches_stages_and_load_model(monkeypatch, tmp_path):
    """``specflow.app`` builds the stages and loads the target under ``runner.cache_dir``."""
    from specflow import app

    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path / "env"))
    seen: dict[str, object] = {}

    def build(cfg):
        seen["stages"] = default_heads_path(cfg.model.name)
        return object()

    def load(name, **kwargs):
        seen["load"] = (cache_root(), kwargs["cache_dir"])
        raise _Stop

    monkeypatch.setattr(app, "build_pipeline", build)
    monkeypatch.setattr(loading, "load_model", load)
    cfg = _compose([f"runner.cache_dir={tmp_path / 'run'}"])
    with pytest.raises(_Stop):
        app._run(cfg, tmp_path / "out")
    run = tmp_path / "run"
    assert seen["stages"] == run / "heads" / cfg.model.name / "heads.safetensors"
    assert seen["load"] == (run, str(run))
    assert cache_root() == tmp_path / "env"  # only for the run
