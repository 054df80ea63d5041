"""Trained early-exit heads: definition, safetensors save/load, and the base-model check.

An exit head maps the hidden state ``h_L [T, H]`` at exit ``L`` to the input of the shared,
frozen LM head, replacing the final norm: ``logits = W_lm · E_L(h_L)``.  With ``u = h/rms(h)``
(RMS over the hidden axis, no weight) and ``g`` initialised to the final norm's weight:

    norm:    E(h) = g ⊙ u                                       (a re-learned final norm)
    linear:  E(h) = RMSNorm_g(u + W u + b)                      (tuned-lens style, H² params)
    mlp:     E(h) = RMSNorm_g(u + U silu(D (a ⊙ u)) + c)        (low-rank residual MLP,
                                                                 D: r×H, U: H×r, a: [H])

The residual branch starts at zero (``W``, ``b``, ``U``, ``c`` are zero-initialised), so an
untrained head computes exactly what the model's own final norm computes at that exit:
training starts from the "cut the model at L" baseline and can only move away from it by
what the distillation loss asks for.  Everything is position-wise (no attention), so a head
needs no cache and self-speculation keeps sharing the base model's KV cache.

Files: one ``.safetensors`` holding every exit's tensors (``exit.{L}.{param}``) and, in the
header metadata, the base model's name and weights fingerprint, the layers, the head type
and per-layer head config; a human-readable ``.json`` sidecar repeats the metadata.  Loading
refuses heads made for another base model (``ConfigError`` naming both).  Training lives in
the ``train_heads/`` sub-project; inference needs only this module (no Lightning).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specflow.cache_root import cache_root
from specflow.errors import ConfigError
from specflow.kv.base import LayeredLM, ModelInfo
from specflow.models.adapter_head import AdapterHead

if TYPE_CHECKING:
    from specflow.models.native import NativeLM

HEAD_TYPES = ("norm", "linear", "mlp")
FORMAT = "specflow-exit-heads"
FORMAT_VERSION = "1"
_META_KEY = "specflow_exit_heads"


class ExitHead(nn.Module):
    """One exit's head ``E(h)`` (see module doc); output feeds the shared LM head.

    Args:
        hidden_size: H.
        head_type: ``norm``, ``linear`` or ``mlp``.
        rank: r, the bottleneck width of ``mlp`` (ignored otherwise).
        eps: the RMS-norm epsilon (use the base model's).
        norm_weight: initial ``g`` (the base model's final-norm weight); ones if omitted.
    """

    def __init__(
        self,
        hidden_size: int,
        head_type: str = "mlp",
        rank: int = 256,
        eps: float = 1e-6,
        norm_weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ConfigError(f"head_type={head_type!r} is unknown; use one of {HEAD_TYPES}")
        if head_type == "mlp" and rank < 1:
            raise ConfigError(f"an mlp exit head needs rank >= 1, got {rank}")
        self.hidden_size = hidden_size
        self.head_type = head_type
        self.rank = rank if head_type == "mlp" else 0
        self.eps = float(eps)
        g = torch.ones(hidden_size) if norm_weight is None else norm_weight.detach().float()
        if g.shape != (hidden_size,):
            raise ConfigError(f"norm_weight has shape {tuple(g.shape)}, expected ({hidden_size},)")
        self.out_norm = nn.Parameter(g.clone())
        if head_type == "linear":
            self.proj = nn.Linear(hidden_size, hidden_size)
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)
        elif head_type == "mlp":
            self.in_norm = nn.Parameter(torch.ones(hidden_size))
            self.down = nn.Linear(hidden_size, rank)
            self.up = nn.Linear(rank, hidden_size)
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)

    def config(self) -> dict[str, Any]:
        """The constructor arguments (minus weights) that rebuild this head's shape."""
        return {
            "hidden_size": self.hidden_size,
            "head_type": self.head_type,
            "rank": self.rank,
            "eps": self.eps,
        }

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``h [..., H] -> E(h) [..., H]`` in ``h``'s dtype (see module doc)."""
        h = self.hidden_size
        u = F.rms_norm(hidden, (h,), None, self.eps)
        if self.head_type == "linear":
            u = u + self.proj(u)
        elif self.head_type == "mlp":
            u = u + self.up(F.silu(self.down(u * self.in_norm)))
        return F.rms_norm(u, (h,), self.out_norm, self.eps)


def default_heads_path(model_name: str, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/heads/<model>/heads.safetensors``; cache = ``cache_root(cache_dir)`` (the
    run's ``runner.cache_dir``, ``$SPECFLOW_CACHE`` or ``~/.cache/specflow`` unless given; a
    path-like model name is reduced to its last component)."""
    safe = Path(model_name).name if "/" in model_name else model_name
    return cache_root(cache_dir) / "heads" / safe / "heads.safetensors"


def _check_heads(heads: Mapping[int, nn.Module], info: ModelInfo) -> None:
    if not heads:
        raise ConfigError("no exit heads given")
    for layer, head in heads.items():
        if not isinstance(head, ExitHead | AdapterHead):
            raise ConfigError(f"exit head at layer {layer} is a {type(head).__name__}, "
                              "not an ExitHead or AdapterHead")
        if isinstance(head, AdapterHead) and not 1 <= int(layer) < info.num_layers:
            raise ConfigError(f"an adapter needs an early exit in 1..{info.num_layers - 1} "
                              f"({info.name}), got {layer}")
        if not 1 <= int(layer) <= info.num_layers:
            raise ConfigError(f"exit head at layer {layer} is outside 1..{info.num_layers} "
                              f"({info.name} has {info.num_layers} layers)")
        if head.hidden_size != info.hidden_size:
            raise ConfigError(f"exit head at layer {layer} has hidden size {head.hidden_size}, "
                              f"but {info.name} has {info.hidden_size}")


def save_heads(
    path: str | Path,
    heads: Mapping[int, nn.Module],
    info: ModelInfo,
    head_type: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``heads`` (exit layer -> ``ExitHead``) for base model ``info`` to ``path``.

    Also writes ``path.with_suffix('.json')`` with the same metadata.  ``head_type``
    defaults to the heads' own (it must match them); ``extra`` is any JSON-able dict
    (training config, metrics) kept in the metadata.  Returns the path written.
    """
    from safetensors.torch import save_file

    _check_heads(heads, info)
    types = sorted({h.head_type for h in heads.values()})
    head_type = head_type or "+".join(types)
    if head_type != "+".join(types):
        raise ConfigError(f"head_type={head_type!r} but the heads are {types}")
    tensors = {
        f"exit.{int(layer)}.{name}": t.detach().to("cpu", torch.float32).contiguous()
        for layer, head in heads.items()
        for name, t in head.state_dict().items()
    }
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "base_model": info.name,
        "weights_fingerprint": info.weights_fingerprint,
        "tokenizer_fingerprint": info.tokenizer_fingerprint,
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "head_type": head_type,
        "layers": sorted(int(layer) for layer in heads),
        "heads": {str(int(layer)): head.config() for layer, head in heads.items()},
        "extra": dict(extra or {}),
    }
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta, default=str)})
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return path


def read_heads_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata stored in an exit-heads file (``ConfigError`` if it is not one)."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"exit heads file {path} does not exist; train heads with "
            f"`python -m train_heads.train model=<model>` (see docs/heads.md)"
        )
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(_META_KEY)
    meta = json.loads(raw) if raw else {}
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a specflow exit-heads file (no {_META_KEY!r} metadata)")
    return meta


def check_base_model(meta: Mapping[str, Any], info: ModelInfo, path: str | Path = "",
                     check_name: bool = True) -> None:
    """Raise ``ConfigError`` unless heads with metadata ``meta`` were made for ``info``."""
    want = (meta.get("base_model"), meta.get("weights_fingerprint"))
    have = (info.name, info.weights_fingerprint)
    fp_differs = want[1] != have[1] or not have[1]
    if fp_differs or (check_name and want[0] != have[0]):
        what = "weights" if fp_differs else "model name"
        hint = "" if fp_differs else (
            "; if this is the same model under another name (e.g. a local path), "
            "load with check_name=False")
        raise ConfigError(
            f"exit heads {path} were trained for base model {want[0]!r} (weights "
            f"{want[1] or '?'}), but the model is {have[0]!r} (weights {have[1] or '?'}): "
            f"the {what} differ, and heads only fit the exact model they were trained on. "
            f"Train heads for it with `python -m train_heads.train model={have[0]}` or point "
            f"the exit-heads path at heads made for {have[0]!r}{hint}"
        )
    if int(meta.get("hidden_size", info.hidden_size)) != info.hidden_size:
        raise ConfigError(f"exit heads {path} have hidden size {meta['hidden_size']}, "
                          f"but {info.name} has {info.hidden_size}")


def new_head(cfg: Mapping[str, Any]) -> nn.Module:
    """An untrained head of the shape a file's per-exit config names (an ``ExitHead``, or an
    ``AdapterHead`` for ``head_type = "adapter"``)."""
    if cfg.get("head_type") == AdapterHead.head_type:
        return AdapterHead(**cfg)
    return ExitHead(**cfg)


def load_heads(path: str | Path, info: ModelInfo, check_name: bool = True
               ) -> dict[int, nn.Module]:
    """Exit heads from ``path`` for base model ``info`` (float32, eval mode, frozen).

    Raises:
        ConfigError: no such file, not an exit-heads file, or heads trained for another
            base model (different weights fingerprint, or name when ``check_name``).
    """
    from safetensors.torch import load_file

    meta = read_heads_metadata(path)
    check_base_model(meta, info, path, check_name)
    tensors = load_file(str(Path(path).expanduser()))
    heads: dict[int, nn.Module] = {}
    for key, cfg in meta["heads"].items():
        layer = int(key)
        head = new_head(cfg)
        prefix = f"exit.{layer}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        head.load_state_dict(state, strict=True)
        heads[layer] = head.eval().requires_grad_(False)
    _check_heads(heads, info)
    return heads


def attach_heads(
    lm: LayeredLM, heads: Mapping[int, nn.Module], path: str | None = None
) -> NativeLM:
    """Make ``heads`` the exit heads of ``lm`` (a ``NativeLM``; ``path``: where they came from).

    Heads are moved to ``lm``'s device and dtype, frozen and put in eval mode; any heads
    attached before are replaced.  Note ``load_model`` caches models per process, so every
    stage sharing that model sees the heads.  Returns ``lm``.
    """
    from specflow.models.native import NativeLM

    if not isinstance(lm, NativeLM):
        raise ConfigError(
            f"{type(lm).__name__} does not support exit heads; load the model with "
            f"backend='native' (Llama/Qwen2 family)"
        )
    _check_heads(heads, lm.info)
    placed = {
        int(layer): head.to(device=lm.device, dtype=lm.dtype).eval().requires_grad_(False)
        for layer, head in heads.items()
    }
    adapters = {
        layer: head.native_layer(lm.device, lm.dtype, lm.packed)
        for layer, head in placed.items() if isinstance(head, AdapterHead)
    }
    lm.set_exit_heads(placed, path, adapters)
    return lm


def load_and_attach(
    lm: LayeredLM, path: str | Path, check_name: bool = True
) -> dict[int, nn.Module]:
    """``attach_heads(lm, load_heads(path, lm.info))``; returns the attached heads."""
    heads = load_heads(path, lm.info, check_name)
    return attach_heads(lm, heads, str(path)).exit_heads


def merge_heads(path: str | Path, sources: list[tuple[str | Path, list[int] | None]]) -> Path:
    """Write one exit-heads file holding the chosen exits of several (e.g. the mlp heads of
    exits 4 and 14 from one training run and the adapter of exit 7 from another), so that
    one ``model.exit_heads=FILE`` serves a drafter, an intermediate verifier and a pool's arm
    at different exits.

    ``sources``: ``(file, exits)`` pairs; ``exits=None`` takes every exit of the file.  The
    files must be made for the same base model (name, weights, tokenizer, shape), and each
    exit may come from one file only.  Tensors are copied unchanged; the metadata's
    ``extra.merged_from`` records which file each exit came from (and that file's ``extra``).

    Raises:
        ConfigError: a source is not an exit-heads file, an exit is not in its file, an exit
            is given twice, or the files were made for different base models.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    same = ("base_model", "weights_fingerprint", "tokenizer_fingerprint", "num_layers",
            "hidden_size", "vocab_size")
    base: dict[str, Any] | None = None
    tensors: dict[str, torch.Tensor] = {}
    heads: dict[str, Any] = {}
    merged_from: dict[str, Any] = {}
    for src, exits in sources:
        meta = read_heads_metadata(src)
        if base is None:
            base = meta
        differ = [k for k in same if meta.get(k) != base.get(k)]
        if differ:
            raise ConfigError(
                f"cannot merge exit heads: {src} differs from the first file in "
                f"{', '.join(f'{k} ({meta.get(k)} vs {base.get(k)})' for k in differ)}"
            )
        have = [int(e) for e in meta["heads"]]
        chosen = have if exits is None else exits
        for e in chosen:
            if e not in have:
                raise ConfigError(f"cannot merge exit heads: {src} has exits {have}, not {e}")
            if str(e) in heads:
                raise ConfigError(
                    f"cannot merge exit heads: exit {e} is given by {merged_from[str(e)]['file']}"
                    f" and by {src}; take it from one file (FILE:EXITS)"
                )
            heads[str(e)] = meta["heads"][str(e)]
            merged_from[str(e)] = {"file": str(src), "extra": meta.get("extra", {})}
        prefixes = tuple(f"exit.{e}." for e in chosen)
        with safe_open(str(Path(src).expanduser()), framework="pt") as f:  # once per file
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key.startswith(prefixes):
                    tensors[key] = f.get_tensor(key)
    if base is None or not heads:
        raise ConfigError("cannot merge exit heads: no exits chosen")
    types = sorted({cfg.get("head_type", "mlp") for cfg in heads.values()})
    meta = {
        **{k: base[k] for k in ("format", "version", *same)},
        "head_type": "+".join(types),
        "layers": sorted(int(e) for e in heads),
        "heads": {e: heads[e] for e in sorted(heads, key=int)},
        "extra": {"merged_from": merged_from},
    }
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta, default=str)})
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return path
