"""A feature-level draft head (EAGLE-style): one decoder layer on the target's own features.

The target's last decoder layer outputs ``f_p = h_N`` at position ``p`` (before the final
norm); its logits for token ``p+1`` are ``W · RMSNorm_g(f_p)``.  The head predicts the next
feature from this one and the token that followed:

    x_p    = W_fc [ u(e(t_{p+1})) ; u(f_p) ] + b_fc                [H]   (e: target embedding,
                                                                      u(v) = v / rms(v))
    f^_{p+1} = DecoderLayer(x_0 .. x_p)_p                          [H]   (causal, own KV cache)
    q(t_{p+2}) = softmax( W_sub · RMSNorm_g(f^_{p+1}) )            over the draft vocabulary

``DecoderLayer`` has the target's shape (attention with RoPE and GQA, SwiGLU MLP) and is
initialised from the target's last layer; ``g`` and ``W`` are the target's frozen final norm
and LM head, ``W_sub`` its rows for the draft vocabulary (``vocab_ids``, the most frequent
next tokens of the training data: the head's LM-head cost shrinks by about |sub| / V).  Both
inputs are RMS-normalised (no weight): Qwen2.5-1.5B's embedding rows have RMS 0.017 against
about 5 for ``h_N`` (two dimensions near 90), so unnormalised the token half of ``W_fc``
would need weights 300x larger to matter (measured: held-out agreement 11 % after half an
epoch without it); the same normalisation applies to a predicted feature fed back.

Drafting k tokens after the committed ``t_0 .. t_{n-1}`` (target features known for
``[0, n-1)``: the last committed token is not yet processed by the target):

    step 0: rows p in [c, n-1) with the *target's* f_p (c = positions the head's KV cache holds)
            -> f^_{n-1} -> d_1
    step j: the row p = n-2+j with (f^_{n-2+j}, d_j) -> f^_{n-1+j} -> d_{j+1}

after which the head's cache is cut back to ``n-1`` positions (only true features stay in
it; the accepted tokens' rows are recomputed from the target's features next round).  The
target verifies every token, so a draft head changes speed, never output.

Training (``train_heads``): feature regression on the normalised features plus a
distillation loss against ``softmax(W_sub · RMSNorm_g(f_{p+1}))``.  Inference runs the layer
through ``NativeLM.run_layer`` (the one decoder-layer function: same attention backends,
packed weights) on a one-layer ``NativeLM`` sharing the target's tables.

Files: ``.safetensors`` with the head's tensors and, in the metadata, the base model's name
and weights fingerprint, the head's shape and anything the trainer adds (data, held-out
prompt ids, metrics); a ``.json`` sidecar repeats the metadata.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specflow.errors import ConfigError
from specflow.kv.base import KVSpec, LayerBatch, ModelInfo
from specflow.models.decoder_params import (
    copy_from_native,
    place_matrix,
    place_vector,
    rope_tables,
    to_native,
)
from specflow.models.exit_heads import check_base_model, default_heads_path
from specflow.models.native import NativeLM, dense, linear, pack, packing_available

FORMAT = "specflow-feature-head"
FORMAT_VERSION = "1"
_META_KEY = "specflow_feature_head"


@dataclass(frozen=True)
class FeatureHeadShape:
    """The decoder layer's shape (the target's)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    qkv_bias: bool
    rope_theta: float
    style: str = "specflow"  # or "eagle" (class doc of ``FeatureHead``)


def _unit(f: torch.Tensor) -> torch.Tensor:
    """``f / rms(f)`` over the last axis (float32 inside)."""
    return F.rms_norm(f.float(), (f.shape[-1],), None, 1e-6).to(f.dtype)


STYLES = ("specflow", "eagle")


class FeatureHead(nn.Module):
    """The trainable head (module doc): ``fc`` + one decoder layer; float32 training path.

    ``shape.style``: ``specflow`` is the module doc's math; ``eagle`` is EAGLE-1/2's, which
    the published layout holds (``specflow.models.eagle_head``): the input features are the
    target's *normed* ones ``a = RMSNorm_g(h_N)`` (``features``), ``fc`` reads
    ``[e(t); a]`` unnormalised, the layer has no input norm (``ln1`` unused), and its output
    ``a^`` lives in the normed space: the LM head multiplies it as it is (``lm_input``).

    ``forward(feats [B, T, H], next_emb [B, T, H], key_valid [B, T])[0] -> f^ [B, T, H]``:
    row ``p`` is the prediction of ``f_{p+1}`` from features ``f_0..f_p`` and tokens
    ``t_1..t_{p+1}`` (causal; padded keys masked); further list entries are later drafting
    steps (``depth``).
    """

    def __init__(self, shape: FeatureHeadShape, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        h, nh, kh, d, i = (shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                           shape.head_dim, shape.intermediate_size)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.ln1 = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, nh * d, bias=shape.qkv_bias)
        self.k = nn.Linear(h, kh * d, bias=shape.qkv_bias)
        self.v = nn.Linear(h, kh * d, bias=shape.qkv_bias)
        self.o = nn.Linear(nh * d, h, bias=False)
        self.ln2 = nn.Parameter(torch.ones(h))
        self.gate = nn.Linear(h, i, bias=False)
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())  # [S] ascending

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, lm: NativeLM, vocab_ids: torch.Tensor, style: str = "specflow"
                    ) -> FeatureHead:
        """A head shaped like ``lm``'s layers, its layer initialised from ``lm``'s last one;
        ``fc`` passes the (normalised) feature through (the token half starts at zero).

        Style ``eagle`` also zeroes ``W_o`` and ``W_down``: the layer starts as the identity
        (``a^_{p+1} = a_p``: the target's own distribution one position early) instead of
        the last layer's map, whose output is not in the normed space the LM head reads
        without a norm (measured on a tiny target, 80 steps: 87 % agreement against 4 %)."""
        if style not in STYLES:
            raise ConfigError(f"feature head style must be one of {STYLES}, got {style!r}")
        last = lm.layers[-1]
        nh, kh, d = lm.num_heads, lm.num_kv_heads, lm.head_dim
        w_gate_up = dense(last.w_gate_up).float()
        shape = FeatureHeadShape(
            hidden_size=lm.hidden_size, num_heads=nh, num_kv_heads=kh, head_dim=d,
            intermediate_size=w_gate_up.shape[0] // 2, eps=float(lm.eps),
            qkv_bias=last.bqkv is not None, rope_theta=float(lm.rope_theta), style=style,
        )
        head = cls(shape, vocab_ids)
        h = shape.hidden_size
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, h:] = torch.eye(h)
            head.fc.bias.zero_()
        copy_from_native(head, last, nh, kh, d)
        if style == "eagle":
            with torch.no_grad():
                head.o.weight.zero_()
                head.down.weight.zero_()
        return head

    # ------------------------------------------------------------------ training path
    @property
    def eagle(self) -> bool:
        return self.shape.style == "eagle"

    def features(self, f: torch.Tensor, final_norm: torch.Tensor, eps: float) -> torch.Tensor:
        """The target's ``h_N [.., H]`` as this head reads them: unchanged (``specflow``:
        ``forward`` normalises) or ``RMSNorm_g(h_N)`` (``eagle``)."""
        return F.rms_norm(f, (f.shape[-1],), final_norm, eps) if self.eagle else f

    def lm_input(self, pred: torch.Tensor, final_norm: torch.Tensor, eps: float
                 ) -> torch.Tensor:
        """What the LM head multiplies for a prediction ``[.., H]``: ``RMSNorm_g(f^)``
        (``specflow``) or ``a^`` itself (``eagle``)."""
        return pred if self.eagle else F.rms_norm(pred, (pred.shape[-1],), final_norm, eps)

    def rope(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin_signed [T, D]`` exactly as ``NativeLM`` builds them (float32)."""
        return rope_tables(length, self.shape.head_dim, self.shape.rope_theta, device)

    def forward(self, feats: torch.Tensor, next_emb: torch.Tensor, key_valid: torch.Tensor,
                depth: int = 1) -> list[torch.Tensor]:
        """Predictions of ``depth`` drafting steps, each ``[B, T, H]`` (training path).

        Step 1 is teacher-forced: row ``p`` reads the target's ``f_p``.  Step ``s > 1`` replays
        what drafting does ``s - 1`` tokens past the last target feature (EAGLE-3's
        training-time test): row ``p`` reads step ``s-1``'s prediction from row ``p-1`` and
        attends to the step-1 keys of rows ``<= p-s+1`` (computed from target features) and,
        of each step ``b = 2..s``, the one key of row ``p-s+b`` (its own chain).  Rows
        ``p < s-1`` have no such chain and must be left out of a loss.
        """
        b, t, h = feats.shape
        s = self.shape
        nh, kh, d = s.num_heads, s.num_kv_heads, s.head_dim
        cos, sin = self.rope(t, feats.device)  # [T, D]
        cos, sin = cos[None, :, None], sin[None, :, None]
        pos = torch.arange(t, device=feats.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        inp = feats
        for step in range(1, depth + 1):
            if self.eagle:  # EAGLE: raw inputs, no input norm (class doc)
                x0 = self.fc(torch.cat([next_emb, inp], dim=-1))  # [B, T, H]
                x = x0
            else:
                x0 = self.fc(torch.cat([_unit(next_emb), _unit(inp)], dim=-1))  # [B, T, H]
                x = F.rms_norm(x0, (h,), self.ln1, s.eps)
            q = self.q(x).view(b, t, nh, d)
            k = self.k(x).view(b, t, kh, d)
            q = q * cos + q.roll(d // 2, -1) * sin
            keys.append(k * cos + k.roll(d // 2, -1) * sin)
            values.append(self.v(x).view(b, t, kh, d))
            blocks = [pos[None, :] <= pos[:, None] - step + 1]  # [T, T] target-feature keys
            blocks += [pos[None, :] == pos[:, None] - (step - blk) for blk in range(2, step + 1)]
            mask = torch.cat(blocks, dim=1)[None, None] & key_valid.repeat(1, step)[:, None, None]
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
                torch.cat(values, 1).transpose(1, 2), attn_mask=mask, scale=d**-0.5,
                enable_gqa=nh != kh,
            )  # [B, NH, T, D]
            x0 = x0 + self.o(att.transpose(1, 2).reshape(b, t, nh * d))
            x = F.rms_norm(x0, (h,), self.ln2, s.eps)
            out = x0 + self.down(F.silu(self.gate(x)) * self.up(x))  # [B, T, H]
            outs.append(out)
            inp = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        return outs

    def config(self) -> dict[str, Any]:
        return asdict(self.shape)


# ---------------------------------------------------------------------- files
def default_feature_head_path(model_name: str, cache_dir: str | Path | None = None) -> Path:
    """``<cache>/heads/<model>/feature_head.safetensors``, beside the model's exit heads
    (``default_heads_path``: the cache is ``specflow.cache_root.cache_root(cache_dir)``)."""
    return default_heads_path(model_name, cache_dir).with_name("feature_head.safetensors")


def save_feature_head(path: str | Path, head: FeatureHead, info: ModelInfo,
                      extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``head`` for base model ``info`` (+ a ``.json`` sidecar); returns the path."""
    from safetensors.torch import save_file

    if head.shape.hidden_size != info.hidden_size:
        raise ConfigError(f"feature head hidden size {head.shape.hidden_size} != "
                          f"{info.name}'s {info.hidden_size}")
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in head.state_dict().items()}
    tensors = {k: (t if k == "vocab_ids" else t.float()) for k, t in tensors.items()}
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION, "base_model": info.name,
        "weights_fingerprint": info.weights_fingerprint,
        "tokenizer_fingerprint": info.tokenizer_fingerprint,
        "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
        "shape": head.config(), "draft_vocab_size": int(head.vocab_ids.numel()),
        "extra": dict(extra or {}),
    }
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta, default=str)})
    path.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return path


def read_feature_head_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a feature-head file (``ConfigError`` if missing or not one)."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"no feature head at {path}")
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(_META_KEY)
    if raw is None:
        raise ConfigError(f"{path} is not a specflow feature-head file (no {_META_KEY!r} "
                          "metadata)")
    return json.loads(raw)


def load_feature_head(path: str | Path, info: ModelInfo, check_name: bool = True
                      ) -> FeatureHead:
    """The head in ``path``, made for base model ``info`` (float32, eval mode, frozen)."""
    from safetensors.torch import load_file

    meta = read_feature_head_metadata(path)
    try:
        check_base_model(meta, info, path, check_name)
    except ConfigError as err:
        raise ConfigError(str(err).replace("exit heads", "the feature head").replace(
            "python -m train_heads.train model=", "python -m train_heads.train head=feature "
            "model=")) from None
    tensors = load_file(str(Path(path).expanduser()))
    head = FeatureHead(FeatureHeadShape(**meta["shape"]), tensors["vocab_ids"])
    head.load_state_dict(tensors)
    head.eval().requires_grad_(False)
    return head


# ---------------------------------------------------------------------- inference
class FeatureDraftModel:
    """A ``FeatureHead`` ready to draft beside a placed target ``NativeLM`` (module doc).

    Its decoder layer is a one-layer ``NativeLM`` sharing the target's embedding, final norm
    and RoPE tables, with the draft vocabulary's LM-head rows as its head (packed where the
    target is).  ``kv`` describes the keys/values of the head's layer (one cache a request).
    """

    def __init__(self, head: FeatureHead, target: NativeLM) -> None:
        device, dtype = target.device, target.dtype
        s = head.shape
        if head.eagle:
            raise ConfigError("an eagle-style feature head drafts through "
                              "specflow.models.eagle_export.place_feature_head")
        if s.hidden_size != target.hidden_size or s.head_dim != target.head_dim:
            raise ConfigError("the feature head's shape does not match the target's layers")
        packed = target.packed and packing_available(device, dtype)
        with torch.no_grad():
            layer = to_native(head, device, dtype, target.packed)
            self.ids = head.vocab_ids.to(device)  # [S]
            self.layer_inputs: tuple[int, ...] = ()  # it reads h_N only
            sub = target.lm_head.index_select(0, self.ids).contiguous()  # [S, H]
            info = ModelInfo(
                name=f"{target.info.name}/feature-head", num_layers=1,
                vocab_size=int(self.ids.numel()), hidden_size=s.hidden_size,
                max_positions=target.info.max_positions,
            )
            self.core = NativeLM(
                info, embed_weight=target.embed_weight, layers=[layer],
                final_norm=target.final_norm, lm_head=sub, num_heads=s.num_heads,
                num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, rms_eps=s.eps,
                rope_theta=s.rope_theta, max_positions=1,
                head_weight=pack(sub) if packed else None,
            )
            self.core.cos, self.core.sin_signed = target.cos, target.sin_signed
            self.fc_w = place_matrix(head.fc.weight, device, dtype, packed)  # [H, 2H]
            self.fc_b = place_vector(head.fc.bias, device, dtype)
        self.target = target
        self.vocab_size = target.info.vocab_size

    @property
    def kv(self) -> KVSpec:
        """The keys/values of the head's one layer (a request's cache: ``KVCache(kv, n)``)."""
        return self.core.kv

    def features(self, final: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``h_N [R, H]`` as the head reads it: unchanged (``step`` normalises; no layer
        inputs: ``inputs [R, 0]``)."""
        return final

    @torch.inference_mode()
    def step(self, feats: torch.Tensor, next_ids: torch.Tensor, batch: LayerBatch
             ) -> torch.Tensor:
        """``f [R, H]`` (target or predicted features) and ``t_{p+1} [R]`` of the packed rows
        of a ragged batch -> ``f^ [R, H]``; appends the rows to each request's cache."""
        self.core.min_rows = self.target.min_rows  # the target's row padding (model config)
        emb = self.target.embed(next_ids)  # [R, H]
        x = linear(torch.cat([_unit(emb), _unit(feats.to(emb.dtype))], dim=-1), self.fc_w,
                   self.fc_b, self.core.min_rows)
        return self.core.run_layer(0, x, batch, {})  # [R, H]

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``f^ [R, H] -> [R, S]`` float32 logits over the draft vocabulary."""
        self.core.min_rows = self.target.min_rows
        return self.core.head(predicted, 1)

    def to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """``[R, S]`` distributions over the draft vocabulary -> ``[R, V]``."""
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return full.index_copy_(1, self.ids.to(probs.device), probs)
