"""Load a model by registry name, local folder or hub id into a ``LayeredLM``.

    settings = dict(dtype="float32", backend="auto", trust_remote_code=False,
                    packed_weights=None)
    loaded = load_model("qwen2.5-coder-1.5b", **settings)  # registry name: prepared on first use
    loaded = load_model("/path/to/hf_folder", **settings)  # config.json + safetensors, or a .gguf
    loaded.lm.head(...), loaded.tokenizer, loaded.info

The settings have no defaults here: a run takes them from its ``model`` config
(``conf/model/*.yaml``, where a model's settings are declared), and code that loads a model
without Hydra (scripts, tests) says what it wants.

Models are cached in-process by (name, dtype, backend, packed_weights, quantize): two stages naming
the same model share one instance.  ``backend="auto"`` picks the native layered
implementation when it supports the architecture and the HF-backed one otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specflow.cpu import check_cpu_weights, resolve_dtype
from specflow.cpu.int8_weights import QUANTIZE_CHOICES
from specflow.errors import ConfigError, ModelNotFoundError
from specflow.kv.base import LayeredLM, ModelInfo, check_same_tokenizer  # noqa: F401 (re-export)
from specflow.models.registry import REGISTRY
from specflow.quant.requantize import REQUANTIZE_TYPES, requantized_fingerprint

log = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "hf")
# float: the weights as float tensors (a GGUF dequantized); gguf: a GGUF file's quantized
# blocks as published, multiplied by the quantized rows kernel (specflow.quant)
WEIGHTS = ("float", "gguf")


@dataclass
class LoadedModel:
    """A loaded model: its layered interface, tokenizer, the HF module and its facts."""

    lm: LayeredLM
    tokenizer: Any
    hf_model: Any
    info: ModelInfo


_MODELS: dict[tuple, LoadedModel] = {}
_TOKENIZER_FPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def clear_model_cache() -> None:
    """Forget every model ``load_model`` has cached in this process."""
    _MODELS.clear()


# ----------------------------------------------------------------------------- fingerprints


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's sorted ``(token, id)`` vocabulary (added tokens included).

    Cached per tokenizer object (and its size, which changes when tokens are added).
    """
    size = len(tokenizer)
    try:
        cached = _TOKENIZER_FPS.get(tokenizer)
    except TypeError:  # not weak-referenceable / hashable: just compute
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    items = sorted(tokenizer.get_vocab().items())
    blob = json.dumps(items, ensure_ascii=False).encode("utf-8", "surrogatepass")
    fp = hashlib.sha256(blob).hexdigest()
    try:
        _TOKENIZER_FPS[tokenizer] = (size, fp)
    except TypeError:
        pass
    return fp


def _sample(t: torch.Tensor, n: int = 64) -> bytes:
    """A few evenly spaced values of ``t``, rounded to bfloat16 so that a float32 and a
    bfloat16 load of the same weights give the same bytes."""
    flat = t.detach().reshape(-1)
    n = min(n, flat.numel())
    idx = torch.arange(n, dtype=torch.int64) * (flat.numel() - 1) // max(n - 1, 1)
    return flat[idx].to(torch.bfloat16).float().numpy().tobytes()


def weights_fingerprint(hf_model: Any, num_layers: int) -> str:
    """A cheap stable hash of the weights: shapes + sampled values of the input embedding,
    the LM head and the last decoder layer's parameters (first 16 hex digits)."""
    digest = hashlib.sha256()
    tensors: list[tuple[str, torch.Tensor]] = [
        ("embed", hf_model.get_input_embeddings().weight)
    ]
    head = hf_model.get_output_embeddings()
    if head is not None:
        tensors.append(("head", head.weight))
    marker = f".layers.{num_layers - 1}."
    tensors += sorted((n, p) for n, p in hf_model.named_parameters() if marker in n)
    for name, t in tensors:
        short = name.split(marker)[-1]
        digest.update(f"{short}:{tuple(t.shape)};".encode())
        digest.update(_sample(t))
    return digest.hexdigest()[:16]


def _eos_ids(hf_model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(hf_model, "generation_config", None)
    for value in (
        getattr(gen, "eos_token_id", None),
        getattr(hf_model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


def build_model_info(name: str, hf_model: Any, tokenizer: Any) -> ModelInfo:
    """The ``ModelInfo`` of a loaded HF causal LM."""
    cfg = hf_model.config.get_text_config()
    head = hf_model.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else cfg.vocab_size
    num_layers = int(cfg.num_hidden_layers)
    return ModelInfo(
        name=name,
        num_layers=num_layers,
        vocab_size=int(vocab),
        hidden_size=int(cfg.hidden_size),
        max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 2048),
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        weights_fingerprint=weights_fingerprint(hf_model, num_layers),
    )


# ----------------------------------------------------------------------------- resolution


def _not_found(value: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"cannot load model {value!r}: {why}. Use a registry name "
        f"({', '.join(REGISTRY)}; prepare with `python -m specflow.models.prepare NAME`) "
        f"or a local folder (a Hugging Face folder with config.json, or one holding a .gguf)"
    )


def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - old huggingface_hub
        return False


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or value.endswith(".gguf")


def _load_hf(
    source: str, kwargs: dict[str, Any], gguf_file: str | None
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_kwargs = {k: v for k, v in kwargs.items() if k in ("trust_remote_code",
                                                              "local_files_only")}
    if gguf_file is not None:
        kwargs = {**kwargs, "gguf_file": gguf_file}
        tok_kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if gguf_file is not None:  # dequantized plain tensors; do not pretend to be quantized
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model, tokenizer


def _load_folder(folder: Path, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    if (folder / "config.json").is_file():
        if any(folder.glob("*.safetensors")):
            kwargs = {**kwargs, "use_safetensors": True}
        # (without safetensors transformers loads .bin files with weights_only=True)
        return _load_hf(str(folder), kwargs, None)
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if len(ggufs) == 1:
        log.info("loading %s from GGUF (dequantizing; slow: prepare a safetensors copy)",
                 folder / ggufs[0])
        return _load_hf(str(folder), kwargs, ggufs[0])
    if ggufs:
        raise _not_found(str(folder), f"the folder holds several .gguf files ({', '.join(ggufs)})"
                         "; pass the path of one of them")
    raise _not_found(str(folder), "the folder has neither config.json nor a .gguf file")


def _load_source(value: str, kwargs: dict[str, Any], cache_dir: str | Path | None
                 ) -> tuple[Any, Any]:
    if value in REGISTRY:
        from specflow.models.prepare import prepare_model

        return _load_folder(prepare_model(value, cache_dir), kwargs)
    path = Path(value).expanduser()
    if path.is_dir():
        return _load_folder(path, kwargs)
    if path.is_file() and path.suffix == ".gguf":
        log.info("loading %s from GGUF (dequantizing; slow)", path)
        return _load_hf(str(path.parent), kwargs, path.name)
    if _looks_like_path(value) or path.exists():
        raise _not_found(value, "no such folder (or .gguf file)")
    # A hub id: the local HF cache first, then (unless offline) the network.
    try:
        return _load_hf(value, {**kwargs, "local_files_only": True}, None)
    except (OSError, ValueError) as local_err:
        if _hub_offline():
            raise _not_found(value, f"not a registry name or local folder, and not in the "
                             f"Hugging Face cache (offline): {local_err}") from None
    try:
        return _load_hf(value, kwargs, None)
    except (OSError, ValueError) as err:
        raise _not_found(value, f"not a registry name or local folder, and the Hugging Face "
                         f"hub could not provide it: {str(err).splitlines()[0]}") from None


def _make_lm(
    hf_model: Any, info: ModelInfo, backend: str, packed_weights: bool | None
) -> LayeredLM:
    if backend == "hf":
        from specflow.models.hf_backend import HFBackendLM

        log.info("%s: HF backend (requested)", info.name)
        return HFBackendLM(hf_model, info)
    from specflow.models.native import NativeLM, supports

    ok, reason = supports(hf_model.config)
    if ok:
        log.info("%s: native layered backend (%s)", info.name,
                 reason or f"model_type {hf_model.config.model_type!r} supported")
        return NativeLM.from_hf(hf_model, info, packed=packed_weights)
    if backend == "native":
        raise ConfigError(
            f"backend='native' cannot run {info.name!r}: {reason}; use backend='hf' or 'auto'"
        )
    from specflow.models.hf_backend import HFBackendLM

    log.info("%s: HF backend (native unsupported: %s)", info.name, reason)
    return HFBackendLM(hf_model, info)


def load_model(
    name_or_path: str,
    *,
    dtype: str,
    backend: str,
    trust_remote_code: bool,
    packed_weights: bool | None,
    cache_dir: str | Path | None = None,
    quantize: str | None = None,
    weights: str = "float",
) -> LoadedModel:
    """Load a model as a ``LoadedModel`` (cached in-process by name, dtype, backend, packing
    and quantization).

    The model settings (``dtype``, ``backend``, ``trust_remote_code``, ``packed_weights``)
    are required: a run passes its ``model`` config's (``conf/model/*.yaml``).

    Args:
        name_or_path: a registry name (prepared automatically when its packages are
            installed), a local folder (HF folder with config.json, or a folder / path of a
            .gguf file), or a Hugging Face hub id (only works where the hub is reachable or
            the model is in the local HF cache).
        dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto``: bfloat16 where this CPU
            multiplies it natively, else float32 (``specflow.cpu.detect``).
        backend: ``auto`` (native when supported, else HF), ``native`` or ``hf``.
        trust_remote_code: passed to transformers; leave False unless you trust the source.
        cache_dir: the specflow cache root for registry models (``None``:
            ``specflow.cache_root.cache_root()``: the run's ``runner.cache_dir``,
            ``$SPECFLOW_CACHE`` or ``~/.cache/specflow``).
        packed_weights: native backend: multiply with oneDNN-packed copies of the weights
            (``NativeLM`` doc; faster on CPU, extra memory about the model's size).  ``None``:
            packed wherever this CPU's oneDNN runs the dtype (``specflow.cpu.probe_cpu``),
            else unpacked with one INFO line saying why.  ``True`` where it cannot pack is a
            ``ConfigError`` before the weights load.
        quantize: ``int8``: the native model also keeps weight-only int8 copies of its
            matrices (``specflow.cpu.int8_weights``), used at the row counts where the row
            probe finds them faster (``specflow.cpu.row_padding``); its outputs then
            differ slightly from the model's own: for draft models.  With
            ``weights="gguf"``: ``q4_0`` or ``q4_1``, the file's blocks of more bits a weight
            re-quantized to that type at load (``specflow.quant.requantize``; draft models
            too).  ``None``: none.
        weights: ``float``: the weights as float tensors of ``dtype`` (a GGUF file is
            dequantized).  ``gguf``: a GGUF file's quantized blocks as published, kept in
            memory as they are and multiplied by the quantized rows kernel
            (``specflow.models.gguf_native``): the native backend in float32 on a CPU, no
            HF module (``LoadedModel.hf_model`` is ``None``).

    Raises:
        ModelNotFoundError: the value resolves to nothing loadable (the message lists the
            registry names) or a registry model's packages are missing.
        ConfigError: a bad dtype/backend, ``native`` forced on an unsupported model,
            ``packed_weights=True`` that this CPU cannot pack, an unknown ``quantize``, or
            one on a model the native backend does not run.
    """
    if weights not in WEIGHTS:
        raise ConfigError(f"model.weights={weights!r} is unknown; use one of {', '.join(WEIGHTS)}")
    if weights == "gguf":
        return _load_gguf_model(name_or_path, dtype, backend, packed_weights, quantize, cache_dir)
    torch_dtype = resolve_dtype(dtype)  # a clear error for an unknown name
    if quantize in REQUANTIZE_TYPES:
        raise ConfigError(f"model.quantize={quantize} re-quantizes a GGUF file's blocks: it "
                          f"goes with model.weights=gguf (float weights take "
                          f"{', '.join(QUANTIZE_CHOICES)} or null)")
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ConfigError(f"model.quantize={quantize!r} is unknown; use one of "
                          f"{', '.join(QUANTIZE_CHOICES)} or null (with model.weights=gguf: "
                          f"{', '.join(REQUANTIZE_TYPES)} or null)")
    dtype = str(torch_dtype).removeprefix("torch.")  # auto -> what it resolved to
    if packed_weights:
        check_cpu_weights(name_or_path, "", dtype, packed_weights)
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    path = Path(name_or_path).expanduser()
    name = name_or_path if name_or_path in REGISTRY or not path.exists() else str(path.resolve())
    key = (name, dtype, backend, packed_weights, quantize)
    if key in _MODELS:
        return _MODELS[key]

    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    hf_model, tokenizer = _load_source(name_or_path, kwargs, cache_dir)
    hf_model.eval()
    hf_model.requires_grad_(False)
    info = build_model_info(name_or_path, hf_model, tokenizer)
    lm = _make_lm(hf_model, info, backend, packed_weights)
    if quantize is not None:
        from specflow.models.native import NativeLM

        if not isinstance(lm, NativeLM):
            raise ConfigError(f"model.quantize={quantize} needs the native backend, which "
                              f"{info.name} does not run on: set model.quantize=null")
        lm.make_int8_copies()
        log.info("%s: int8 copies of the weights made (model.quantize=int8)", info.name)
    loaded = LoadedModel(lm=lm, tokenizer=tokenizer, hf_model=hf_model, info=info)
    _MODELS[key] = loaded
    return loaded


def _load_gguf_model(name_or_path: str, dtype: str, backend: str, packed_weights: bool | None,
                     quantize: str | None, cache_dir: str | Path | None) -> LoadedModel:
    """``load_model(..., weights="gguf")``: the settings checked, then the GGUF file's
    quantized ``NativeLM`` with the model's tokenizer and config (cached in-process)."""
    fixes = {
        "dtype": (dtype in ("float32", "auto"), f"model.dtype={dtype}", "model.dtype=float32"),
        "backend": (backend in ("auto", "native"), f"model.backend={backend}",
                    "model.backend=auto"),
        "quantize": (quantize is None or quantize in REQUANTIZE_TYPES,
                     f"model.quantize={quantize}",
                     f"model.quantize=null (or {' or '.join(REQUANTIZE_TYPES)}: a draft "
                     "model's blocks re-quantized to 4 bits)"),
        "packed": (not packed_weights, "model.packed_weights=true",
                   "model.packed_weights=null"),
    }
    for ok, given, fix in fixes.values():
        if not ok:
            raise ConfigError(f"{name_or_path}: {given} does not go with model.weights=gguf "
                              f"(the file's blocks, multiplied in float32 by the native "
                              f"backend); set {fix}, or model.weights=float")
    path = Path(name_or_path).expanduser()
    name = name_or_path if name_or_path in REGISTRY or not path.exists() else str(path.resolve())
    key = (name, "float32", "native", None, quantize, "gguf")
    if key in _MODELS:
        return _MODELS[key]
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from specflow.models.gguf_native import gguf_fingerprint, loaded_bytes, native_from_gguf

    if name_or_path in REGISTRY:
        from specflow.models.prepare import gguf_path, prepare_model

        folder = prepare_model(name_or_path, cache_dir)  # config and tokenizer
        gguf = gguf_path(name_or_path, cache_dir)
        source: dict[str, Any] = {}
    else:
        gguf = _gguf_file(path, name_or_path)
        folder, source = gguf.parent, {"gguf_file": gguf.name}
    config = AutoConfig.from_pretrained(str(folder), **source)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **source)
    try:
        generation = GenerationConfig.from_pretrained(str(folder), **source)
    except OSError:
        generation = None
    cfg = config.get_text_config()
    num_layers = int(cfg.num_hidden_layers)
    shim = SimpleNamespace(generation_config=generation, config=cfg)
    info = ModelInfo(
        name=name_or_path,
        num_layers=num_layers,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 2048),
        eos_token_ids=_eos_ids(shim, tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        weights_fingerprint=gguf_fingerprint(gguf),
    )
    if quantize is not None:  # other weights than the file's: their own fingerprint
        info = replace(info, weights_fingerprint=requantized_fingerprint(
            info.weights_fingerprint, quantize))
    lm = native_from_gguf(gguf, cfg, info, requantize=quantize)
    if lm.embed_weight.shape[0] != info.vocab_size:
        info = replace(info, vocab_size=int(lm.embed_weight.shape[0]))
        lm.info = info
    log.info("%s: the GGUF file's quantized weights (%s%s, %.2f GiB)", info.name, gguf,
             f", re-quantized to {quantize}" if quantize else "", loaded_bytes(lm) / 2**30)
    loaded = LoadedModel(lm=lm, tokenizer=tokenizer, hf_model=None, info=info)
    _MODELS[key] = loaded
    return loaded


def _gguf_file(path: Path, value: str) -> Path:
    """The one .gguf file ``value`` names (the file, or a folder holding exactly one)."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise _not_found(value, f"the folder holds several .gguf files "
                             f"({', '.join(p.name for p in ggufs)}); pass the path of one")
        raise ConfigError(f"{value}: model.weights=gguf needs a GGUF file and the folder has "
                          "none; set model.weights=float for a Hugging Face folder")
    raise _not_found(value, "model.weights=gguf needs a registry name, a .gguf file or a "
                     "folder holding one")
