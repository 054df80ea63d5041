"""Published EAGLE heads (``SafeAILab/EAGLE``) as feature drafters of a placed target.

**EAGLE-1/2** (``eagle/model/cnets1.py``; a folder with a Llama ``config.json`` of
``num_hidden_layers: 1`` and ``model.safetensors`` or ``pytorch_model.bin``).  The features
are the target's *normed* last hidden states ``a_p = RMSNorm_g(h_N,p)`` (what the target's
LM head multiplies), and at position ``p``:

    x_p       = W_fc [ e(t_{p+1}) ; a_p ] + b_fc                     [H]   (e: target embedding)
    y_p       = x_p + W_o Attn(RoPE(W_q x), RoPE(W_k x), W_v x)_p     [H]   (no input norm)
    a^_{p+1}  = y_p + W_down( silu(W_gate n(y_p)) * W_up n(y_p) )    [H]   (n: post-attention
                                                                              RMSNorm)
    q(t_{p+2}) = softmax( W a^_{p+1} )                                      (target LM head,
                                                                              no norm)

Drafting feeds ``a^`` back as the next row's feature (the head's output lives in the space
of the normed features).  Keys: ``fc.weight [H, 2H]``, ``fc.bias [H]`` (absent when the
config says ``"bias": false``), ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (q/k/v biases
where the file holds them), ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.post_attention_layernorm.weight``; ``embed_tokens.weight`` where published is
compared with the target's (the head's fingerprint of its target) and otherwise unused.

**EAGLE-3** heads: ``specflow.models.eagle3_head``; a folder of either kind is read by
``specflow.models.published_heads.load_published_head``.

The target check (``check_target``): the config's ``hidden_size``, ``vocab_size`` and
attention shape must be the target's, a published ``embed_tokens.weight`` must equal the
target's embedding, and a head exported here carries the target's weights fingerprint
(config key ``specflow_target``) which must match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specflow.errors import ConfigError
from specflow.kv.base import KVSpec, LayerBatch, ModelInfo
from specflow.models.checkpoint_files import Checkpoint
from specflow.models.decoder_params import place_matrix, place_vector, rope_tables
from specflow.models.native import LLAMA3_ROPE_KEYS, NativeLM, linear, packing_available

TARGET_KEY = "specflow_target"  # config.json: {"name", "weights_fingerprint"} of an export
_FIX_REFETCH = "fetch the checkpoint folder again, as published (config.json + weights)"


@dataclass(frozen=True)
class EagleHead:
    """An EAGLE-1/2 head's weights (float32, CPU), as published; shapes in the module doc.

    ``wq [NH*D, H]``, ``wk``/``wv [KH*D, H]`` (``bq``/``bk``/``bv`` or ``None``),
    ``wo [H, NH*D]``, ``ln2 [H]``, ``gate``/``up [I, H]``, ``down [H, I]``,
    ``fc_w [H, 2H]``, ``fc_b [H]`` or ``None``.
    """

    source: str
    fc_w: torch.Tensor
    fc_b: torch.Tensor | None
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor
    ln2: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None = None  # llama3 RoPE's parameters (None: default RoPE)
    layer_inputs: tuple[int, ...] = ()  # the target layers whose inputs it reads: none

    def place(self, target: NativeLM) -> EagleDraftModel:
        """The head ready to draft beside the placed ``target``."""
        return EagleDraftModel(self, target)


def check_target(ckpt: Checkpoint, info: ModelInfo, embed: torch.Tensor | None,
                 fix: str) -> None:
    """``ConfigError`` unless the checkpoint was made for the target ``info`` (module doc):
    its config's sizes, its published embedding (``embed [V, H]``, the target's) and an
    exported head's weights fingerprint."""
    other = (f"the head was made for another target model than {info.name!r}; fix: use the "
             f"head published for {info.name!r}, or {fix}")
    for key, have in (("hidden_size", info.hidden_size), ("vocab_size", info.vocab_size)):
        want = ckpt.config.get(key)
        if want is not None and int(want) != have:
            raise ConfigError(f"{ckpt.folder / 'config.json'}: key {key!r} is {want} but "
                              f"the target's is {have}: {other}")
    mark = ckpt.config.get(TARGET_KEY)
    if isinstance(mark, dict) and mark.get("weights_fingerprint") != info.weights_fingerprint:
        raise ConfigError(
            f"{ckpt.folder / 'config.json'}: key {TARGET_KEY!r} names weights "
            f"{mark.get('weights_fingerprint')!r} of {mark.get('name')!r}, but the target's "
            f"are {info.weights_fingerprint!r}: {other}")
    published = ckpt.tensors.get("embed_tokens.weight")
    if published is not None and embed is not None:
        same = tuple(published.shape) == tuple(embed.shape) and torch.allclose(
            published.float(), embed.detach().float().cpu(), rtol=1e-2, atol=1e-3)
        if not same:
            raise ConfigError(f"{ckpt.weights_file}: key 'embed_tokens.weight' is not the "
                              f"target's embedding: {other}")


def eagle_head_from(ckpt: Checkpoint, info: ModelInfo, embed: torch.Tensor | None = None
                    ) -> EagleHead:
    """The EAGLE-1/2 head in ``ckpt``, checked against the target ``info`` (and its
    embedding ``embed [V, H]`` when given)."""
    train = (f"train a feature head for it (python -m train_heads.train head=feature "
             f"model={info.name}) and use drafter=feature")
    check_target(ckpt, info, embed, train)
    c = ckpt.config
    h = info.hidden_size
    nh = int(ckpt.setting("num_attention_heads", _FIX_REFETCH))
    kh = int(c.get("num_key_value_heads") or nh)
    d = int(c.get("head_dim") or h // nh)
    inter = int(ckpt.setting("intermediate_size", _FIX_REFETCH))
    if c.get("hidden_act", "silu") != "silu":
        raise ckpt.problem("hidden_act", f"is {c['hidden_act']!r}, only 'silu' is supported",
                           "use a head of a Llama/Qwen2-family target", in_config=True)
    if int(c.get("num_hidden_layers", 1)) != 1:
        raise ckpt.problem("num_hidden_layers", f"is {c['num_hidden_layers']}, an EAGLE-1/2 "
                           "head has one layer", _FIX_REFETCH, in_config=True)
    layer = "layers.0."
    fix = _FIX_REFETCH

    def t(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        return ckpt.tensor(key, shape, fix)

    def opt(key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return ckpt.optional(key, shape, fix)

    fc_b = t("fc.bias", (h,)) if c.get("bias", True) else opt("fc.bias", (h,))
    attn = layer + "self_attn."
    return EagleHead(
        source=str(ckpt.folder),
        fc_w=t("fc.weight", (h, 2 * h)), fc_b=fc_b,
        wq=t(attn + "q_proj.weight", (nh * d, h)), wk=t(attn + "k_proj.weight", (kh * d, h)),
        wv=t(attn + "v_proj.weight", (kh * d, h)),
        bq=opt(attn + "q_proj.bias", (nh * d,)), bk=opt(attn + "k_proj.bias", (kh * d,)),
        bv=opt(attn + "v_proj.bias", (kh * d,)),
        wo=t(attn + "o_proj.weight", (h, nh * d)),
        ln2=t(layer + "post_attention_layernorm.weight", (h,)),
        gate=t(layer + "mlp.gate_proj.weight", (inter, h)),
        up=t(layer + "mlp.up_proj.weight", (inter, h)),
        down=t(layer + "mlp.down_proj.weight", (h, inter)),
        num_heads=nh, num_kv_heads=kh, head_dim=d, eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(c), rope_scaling=llama3_rope(c),
    )


def rope_theta_of(config: dict) -> float:
    """A head config's RoPE base: ``rope_theta``, or the one in ``rope_parameters`` (the
    newer layout), else 10000."""
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    return float(theta or 10000.0)


def llama3_rope(config: dict) -> dict | None:
    """The head's llama3 RoPE parameters from its ``config.json`` (``rope_scaling`` or
    ``rope_parameters``), or ``None`` for default RoPE."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key) or {}
        if rope.get("rope_type", rope.get("type")) == "llama3":
            return {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_ROPE_KEYS}}
    return None


class LayerWeights(Protocol):
    """What ``HeadLayer.place`` reads of a head (``EagleHead``, ``eagle3_head.Eagle3Head``):
    its attention and MLP weights (float32, CPU; shapes in their class docs), shape and RoPE."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None


@dataclass(frozen=True)
class HeadLayer:
    """An EAGLE head's one decoder layer placed beside a target (EAGLE-1/2 and EAGLE-3 alike):

        y   = x + W_o Attn(RoPE(W_q u), RoPE(W_k u), W_v u)            [R, H]
        out = y + W_down( silu(W_gate n(y)) * W_up n(y) )               [R, H]

    with ``u = x`` (EAGLE-1/2) or ``u = [RMSNorm_in(e); RMSNorm_hid(x)]`` (EAGLE-3: q/k/v read
    2H) and ``n`` the post-attention RMSNorm (``ln_post``).  Weights on the target's device and
    dtype, packed where the target is; ``cos``/``sin_signed [P, D]``: ``rope_beside``.
    """

    wqkv: torch.Tensor  # [(NH + 2KH) D, H or 2H]
    bqkv: torch.Tensor | None  # [(NH + 2KH) D]
    wo: torch.Tensor  # [H, NH D]
    ln_post: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2I, H]
    w_down: torch.Tensor  # [H, I]
    cos: torch.Tensor
    sin_signed: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def place(cls, head: LayerWeights, ln_post: torch.Tensor, target: NativeLM
              ) -> HeadLayer:
        """The layer of ``head`` beside the placed ``target``, ``ln_post [H]`` its
        post-attention norm."""
        device, dtype = target.device, target.dtype
        packed = target.packed and packing_available(device, dtype)

        def w(t: torch.Tensor) -> torch.Tensor:
            return place_matrix(t, device, dtype, packed)

        with torch.no_grad():
            bqkv = None if head.bq is None else place_vector(
                torch.cat([head.bq, head.bk, head.bv]), device, dtype)
            cos, sin = rope_beside(target, head.head_dim, head.rope_theta, head.rope_scaling)
            return cls(w(torch.cat([head.wq, head.wk, head.wv])), bqkv, w(head.wo),
                       place_vector(ln_post, device, dtype),
                       w(torch.cat([head.gate, head.up])), w(head.down), cos, sin,
                       head.num_heads, head.num_kv_heads, head.head_dim, head.eps)

    def kv(self, target: NativeLM) -> KVSpec:
        """The keys/values of the layer (a request's cache: ``KVCache(kv, n)``)."""
        return KVSpec(1, self.num_kv_heads, self.head_dim, target.dtype, target.device)

    def run(self, u: torch.Tensor, x: torch.Tensor, batch: LayerBatch, min_rows: int
            ) -> torch.Tensor:
        """``u [R, H or 2H]`` (what q/k/v read) and the residual ``x [R, H]`` of the packed
        rows of a ragged batch -> ``out [R, H]``; appends the rows to each request's cache."""
        memo: dict = {}
        attention = batch[0][0].attention
        rows = attention.positions(batch, memo)  # [R] positions
        n, nh, kh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(u, self.wqkv, self.bqkv, min_rows)  # [R, (NH + 2KH) D]
        qk = qkv[:, : (nh + kh) * d].view(n, nh + kh, d)  # [R, NH + KH, D]
        v = qkv[:, (nh + kh) * d :].view(n, kh, d)  # [R, KH, D]
        cos, sin = self.cos[rows].unsqueeze(1), self.sin_signed[rows].unsqueeze(1)
        qk = qk * cos + qk.roll(d // 2, -1) * sin
        att = attention.attend(qk[:, :nh], qk[:, nh:], v, batch, d**-0.5, memo)  # [R, NH, D]
        y = x + linear(att.reshape(n, nh * d), self.wo, None, min_rows)  # [R, H]
        z = F.rms_norm(y, (y.shape[-1],), self.ln_post, self.eps)
        gate, up = linear(z, self.w_gate_up, None, min_rows).chunk(2, dim=-1)  # [R, I] each
        return y + linear(F.silu(gate) * up, self.w_down, None, min_rows)  # [R, H]


class EagleDraftModel:
    """An ``EagleHead`` placed beside a target ``NativeLM`` (a ``FeatureHeadRunner``).

    ``fc`` and the layer (``HeadLayer``) on the target's device and dtype (packed where the
    target is); the layer runs on the head's own keys/values (``kv``: one layer of the head's
    attention shape) through the batch's attention backend, as the target's layers do.
    """

    def __init__(self, head: EagleHead, target: NativeLM) -> None:
        device, dtype = target.device, target.dtype
        packed = target.packed and packing_available(device, dtype)
        with torch.no_grad():
            self.fc_w = place_matrix(head.fc_w, device, dtype, packed)  # [H, 2H]
            self.fc_b = place_vector(head.fc_b, device, dtype)  # [H]
        self.layer = HeadLayer.place(head, head.ln2, target)
        self.head = head
        self.target = target
        self.layer_inputs: tuple[int, ...] = ()  # it reads h_N only
        self.ids = torch.arange(target.info.vocab_size, device=device)  # [V]: full vocabulary
        self.vocab_size = target.info.vocab_size

    @property
    def cos(self) -> torch.Tensor:
        """The layer's RoPE cosines ``[P, D]`` (the target's own when the RoPE is the same)."""
        return self.layer.cos

    @property
    def kv(self) -> KVSpec:
        """The keys/values of the head's one layer (a request's cache: ``KVCache(kv, n)``)."""
        return self.layer.kv(self.target)

    def features(self, final: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``h_N [R, H]`` -> ``a = RMSNorm_g(h_N) [R, H]``, the features EAGLE reads (no
        layer inputs: ``inputs [R, 0]``)."""
        t = self.target
        return F.rms_norm(final, (t.hidden_size,), t.final_norm, t.eps)

    @torch.inference_mode()
    def step(self, feats: torch.Tensor, next_ids: torch.Tensor, batch: LayerBatch
             ) -> torch.Tensor:
        """``a [R, H]`` (features or fed-back predictions) and ``t_{p+1} [R]`` of the packed
        rows of a ragged batch -> ``a^ [R, H]``; appends the rows to each request's cache."""
        r = self.target.min_rows
        emb = self.target.embed(next_ids)  # [R, H]
        x = linear(torch.cat([emb, feats.to(emb.dtype)], dim=-1), self.fc_w, self.fc_b, r)
        return self.layer.run(x, x, batch, r)  # no input norm: q/k/v read x

    @torch.no_grad()
    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``a^ [R, H] -> [R, V]`` float32: the target's LM head, no norm."""
        return linear(predicted, self.target.head_weight, None, self.target.min_rows).float()

    def to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """Distributions over the draft vocabulary (the full one here) -> ``[R, V]``."""
        return probs


def rope_beside(target: NativeLM, head_dim: int, theta: float, scaling: dict | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin_signed [P, D]`` of a head beside ``target``: the target's own tables when
    the head's RoPE is the target's, else tables of its own (the target's dtype)."""
    if (theta == target.rope_theta and head_dim == target.head_dim
            and _same_scaling(scaling, target.rope_scaling)):
        return target.cos, target.sin_signed
    cos, sin = rope_tables(target.cos.shape[0], head_dim, theta, target.device, scaling)
    return cos.to(target.dtype), sin.to(target.dtype)


def _same_scaling(a: dict | None, b: dict | None) -> bool:
    """Whether two RoPE scalings give the same tables (``None``: default RoPE)."""
    if a is None or b is None:
        return a is None and b is None
    return all(float(a[k]) == float(b[k]) for k in LLAMA3_ROPE_KEYS)
