"""Published EAGLE-3 heads (``SafeAILab/EAGLE``, ``eagle/model/cnets.py``) as feature
drafters of a placed target.

An EAGLE-3 head reads, at position ``p``, the target's inputs of three decoder layers
``l_1 < l_2 < l_3`` (by default ``2``, ``L // 2`` and ``L - 3`` of the target's ``L``
layers; a config's ``eagle_aux_hidden_state_layer_ids`` names others, as vLLM reads it),
``g_p = [h_{l_1,p}; h_{l_2,p}; h_{l_3,p}]  [3 H]``, and the next token ``t_{p+1}``:

    x_p        = W_fc g_p                                                  [H]  (no bias)
    u_p        = [ RMSNorm_in(e(t_{p+1})) ; RMSNorm_hid(x_p) ]            [2H] (e: the
                                                                                target's
                                                                                embedding)
    y_p        = x_p + W_o Attn(RoPE(W_q u), RoPE(W_k u), W_v u)_p          [H]
    x^_{p+1}   = y_p + W_down( silu(W_gate n(y_p)) * W_up n(y_p) )          [H]  (n: post-
                                                                                attention
                                                                                RMSNorm)
    q(t_{p+2}) = softmax( W_lm RMSNorm_out(x^_{p+1}) )   over the draft vocabulary [V_d]

and draft token ``d`` is the target's token ``d + d2t[d]``.  Drafting feeds ``x^`` back as
the next row's ``x`` (``fc`` reads the target's features only).  The session keeps the three
layers' inputs beside ``h_N`` (``ModelSession.keep_layer_inputs``: the drafter's
``ModelUse.layer_inputs``), through truncation and a verified tree's path.

Keys (the decoder layer under ``midlayer.``, or ``layers.0.`` as some exporters write it):
``fc.weight [H, 3 H]``, ``midlayer.self_attn.{q,k,v}_proj.weight [NH*D | KH*D, 2H]``,
``midlayer.self_attn.o_proj.weight [H, NH*D]``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight [H]``, ``midlayer.mlp.{gate,up}_proj.weight [I, H]``,
``midlayer.mlp.down_proj.weight [H, I]``, ``norm.weight [H]``, ``lm_head.weight [V_d, H]``,
``d2t`` int64 ``[V_d]`` and ``t2d`` bool ``[V]`` (both may be absent when ``V_d = V``);
``embed_tokens.weight`` where published is the head's fingerprint of its target
(``eagle_head.check_target``).  Config: a Llama config with ``draft_vocab_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specflow.errors import ConfigError
from specflow.kv.base import KVSpec, LayerBatch, ModelInfo
from specflow.models.checkpoint_files import Checkpoint
from specflow.models.decoder_params import place_matrix, place_vector
from specflow.models.eagle_head import HeadLayer, check_target, llama3_rope, rope_theta_of
from specflow.models.native import NativeLM, linear, packing_available

_FIX_REFETCH = "fetch the checkpoint folder again, as published (config.json + weights)"
LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"


def eagle3_layers(config: dict, num_layers: int, folder: str) -> tuple[int, ...]:
    """The target layers whose inputs the head reads, ascending: the config's
    ``eagle_aux_hidden_state_layer_ids`` (top level or under ``eagle_config``), else
    EAGLE-3's ``2, L // 2, L - 3``; ``ConfigError`` when they coincide or fall outside the
    target's ``num_layers``."""
    named = config.get(LAYER_IDS_KEY) or (config.get("eagle_config") or {}).get(LAYER_IDS_KEY)
    layers = [int(x) for x in named] if named else [2, num_layers // 2, num_layers - 3]
    ordered = tuple(sorted(set(layers)))
    if len(ordered) != len(layers) or not all(0 <= x < num_layers for x in ordered):
        where = f"config.json's {LAYER_IDS_KEY}" if named else (
            f"EAGLE-3's default layers for a target of {num_layers} layers")
        raise ConfigError(
            f"{folder}/config.json: key {LAYER_IDS_KEY!r}: {where} are {layers}, which are not "
            f"distinct layers in 0..{num_layers - 1}; fix: name the layers the head was "
            f"trained on in config.json's {LAYER_IDS_KEY!r}")
    return ordered


@dataclass(frozen=True)
class Eagle3Head:
    """An EAGLE-3 head's weights (float32, CPU), as published; shapes in the module doc.

    ``fc_w [H, k H]`` (``fc_b [H]`` or ``None``), ``wq [NH*D, 2H]``, ``wk``/``wv
    [KH*D, 2H]`` (biases or ``None``), ``wo [H, NH*D]``, ``ln_in``/``ln_hid``/``ln_post``/
    ``norm [H]``, ``gate``/``up [I, H]``, ``down [H, I]``, ``lm_head [V_d, H]``, ``ids [V_d]``
    (the target's token of each draft token: ``d + d2t[d]``), ``layer_inputs`` (the target
    layers whose inputs ``fc`` reads, ascending).
    """

    source: str
    layer_inputs: tuple[int, ...]
    fc_w: torch.Tensor
    fc_b: torch.Tensor | None
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    wo: torch.Tensor
    ln_in: torch.Tensor
    ln_hid: torch.Tensor
    ln_post: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    ids: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None = None

    def place(self, target: NativeLM) -> Eagle3DraftModel:
        """The head ready to draft beside the placed ``target``."""
        return Eagle3DraftModel(self, target)


def _draft_ids(ckpt: Checkpoint, vd: int, vocab: int) -> torch.Tensor:
    """``d + d2t[d]`` for every draft token ``d`` (``[V_d]`` int64), checked against ``t2d``:
    distinct target tokens, each marked in ``t2d``."""
    if "d2t" not in ckpt.tensors and vd == vocab:
        return torch.arange(vocab)
    d2t = ckpt.tensors.get("d2t")
    if d2t is None:
        raise ckpt.problem("d2t", f"is missing (the draft vocabulary has {vd} of the "
                           f"target's {vocab} tokens)", _FIX_REFETCH)
    if tuple(d2t.shape) != (vd,) or d2t.is_floating_point():
        raise ckpt.problem("d2t", f"has shape {list(d2t.shape)} and dtype {d2t.dtype}, "
                           f"expected [{vd}] integers", _FIX_REFETCH)
    ids = torch.arange(vd) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != vd:
        raise ckpt.problem("d2t", f"maps draft tokens outside the target's {vocab} tokens or "
                           "two onto one", _FIX_REFETCH)
    t2d = ckpt.tensors.get("t2d")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise ckpt.problem("t2d", f"has shape {list(t2d.shape)}, expected [{vocab}]",
                               _FIX_REFETCH)
        if int(t2d.bool().sum()) != vd or not bool(t2d.bool()[ids].all()):
            raise ckpt.problem("t2d", "does not mark the tokens d2t maps to", _FIX_REFETCH)
    return ids


def eagle3_head_from(ckpt: Checkpoint, info: ModelInfo, embed: torch.Tensor | None = None
                     ) -> Eagle3Head:
    """The EAGLE-3 head in ``ckpt``, checked against the target ``info`` (and its embedding
    ``embed [V, H]`` when given), before any decoding."""
    check_target(ckpt, info, embed, f"train a feature head for it (python -m train_heads.train "
                 f"head=feature model={info.name}) and use drafter=feature")
    c = ckpt.config
    h, fix = info.hidden_size, _FIX_REFETCH
    ht = int(c.get("target_hidden_size") or h)
    if ht != h:
        raise ckpt.problem("target_hidden_size", f"is {ht} but the target's hidden size is {h}",
                           "use the EAGLE-3 head published for this target", in_config=True)
    if c.get("hidden_act", "silu") != "silu":
        raise ckpt.problem("hidden_act", f"is {c['hidden_act']!r}, only 'silu' is supported",
                           "use a head of a Llama/Qwen-family target", in_config=True)
    layers = eagle3_layers(c, info.num_layers, str(ckpt.folder))
    nh = int(ckpt.setting("num_attention_heads", fix))
    kh = int(c.get("num_key_value_heads") or nh)
    d = int(c.get("head_dim") or h // nh)
    inter = int(ckpt.setting("intermediate_size", fix))
    vd = int(c.get("draft_vocab_size") or info.vocab_size)
    pre = "layers.0." if "layers.0.self_attn.q_proj.weight" in ckpt.tensors else "midlayer."

    def t(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        return ckpt.tensor(key, shape, fix)

    def opt(key: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return ckpt.optional(key, shape, fix)

    attn = pre + "self_attn."
    return Eagle3Head(
        source=str(ckpt.folder), layer_inputs=layers,
        fc_w=t("fc.weight", (h, len(layers) * h)), fc_b=opt("fc.bias", (h,)),
        wq=t(attn + "q_proj.weight", (nh * d, 2 * h)),
        wk=t(attn + "k_proj.weight", (kh * d, 2 * h)),
        wv=t(attn + "v_proj.weight", (kh * d, 2 * h)),
        bq=opt(attn + "q_proj.bias", (nh * d,)), bk=opt(attn + "k_proj.bias", (kh * d,)),
        bv=opt(attn + "v_proj.bias", (kh * d,)),
        wo=t(attn + "o_proj.weight", (h, nh * d)),
        ln_in=t(pre + "input_layernorm.weight", (h,)),
        ln_hid=t(pre + "hidden_norm.weight", (h,)),
        ln_post=t(pre + "post_attention_layernorm.weight", (h,)),
        gate=t(pre + "mlp.gate_proj.weight", (inter, h)),
        up=t(pre + "mlp.up_proj.weight", (inter, h)),
        down=t(pre + "mlp.down_proj.weight", (h, inter)),
        norm=t("norm.weight", (h,)), lm_head=t("lm_head.weight", (vd, h)),
        ids=_draft_ids(ckpt, vd, info.vocab_size),
        num_heads=nh, num_kv_heads=kh, head_dim=d, eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(c), rope_scaling=llama3_rope(c),
    )


class Eagle3DraftModel:
    """An ``Eagle3Head`` placed beside a target ``NativeLM`` (a ``FeatureHeadRunner``).

    ``fc``, the norms, the LM head and the layer (``eagle_head.HeadLayer``, the same as an
    EAGLE-1/2 head's) on the target's device and dtype (packed where the target is); the
    layer runs on the head's own keys/values (``kv``: one layer) through the batch's
    attention backend.
    """

    def __init__(self, head: Eagle3Head, target: NativeLM) -> None:
        device, dtype = target.device, target.dtype
        packed = target.packed and packing_available(device, dtype)

        def w(t: torch.Tensor) -> torch.Tensor:
            return place_matrix(t, device, dtype, packed)

        def v(t: torch.Tensor | None) -> torch.Tensor | None:
            return place_vector(t, device, dtype)

        with torch.no_grad():
            self.fc_w, self.fc_b = w(head.fc_w), v(head.fc_b)  # [H, kH], [H]
            self.ln_in, self.ln_hid = v(head.ln_in), v(head.ln_hid)  # [H] each
            self.norm = v(head.norm)  # [H]
            self.lm_head = w(head.lm_head)  # [V_d, H]
        self.layer = HeadLayer.place(head, head.ln_post, target)  # q/k/v read 2H
        self.head = head
        self.target = target
        self.layer_inputs = head.layer_inputs
        self.ids = head.ids.to(device)  # [V_d]: the target's token of each draft token
        self.vocab_size = target.info.vocab_size

    @property
    def kv(self) -> KVSpec:
        """The keys/values of the head's one layer (a request's cache: ``KVCache(kv, n)``)."""
        return self.layer.kv(self.target)

    def features(self, final: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``g [R, k H]`` (the kept layer inputs; ``h_N`` unused) -> ``x = W_fc g [R, H]``."""
        g = inputs.to(self.target.dtype)
        return linear(g, self.fc_w, self.fc_b, self.target.min_rows)

    @torch.inference_mode()
    def step(self, feats: torch.Tensor, next_ids: torch.Tensor, batch: LayerBatch
             ) -> torch.Tensor:
        """``x [R, H]`` (``fc`` of target features, or fed-back predictions) and ``t_{p+1}
        [R]`` of the packed rows of a ragged batch -> ``x^ [R, H]``; appends the rows to
        each request's cache."""
        emb = self.target.embed(next_ids)  # [R, H]
        x = feats.to(emb.dtype)
        hid, eps = x.shape[-1], self.head.eps
        u = torch.cat([F.rms_norm(emb, (hid,), self.ln_in, eps),
                       F.rms_norm(x, (hid,), self.ln_hid, eps)], dim=-1)  # [R, 2H]
        return self.layer.run(u, x, batch, self.target.min_rows)

    @torch.no_grad()
    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``x^ [R, H] -> [R, V_d]`` float32: the head's norm and LM head."""
        z = F.rms_norm(predicted, (predicted.shape[-1],), self.norm, self.head.eps)
        return linear(z, self.lm_head, None, self.target.min_rows).float()

    def to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """``[R, V_d]`` distributions over the draft vocabulary -> ``[R, V]``."""
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return full.index_copy_(1, self.ids.to(probs.device), probs)
