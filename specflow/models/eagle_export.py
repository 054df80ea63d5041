"""A feature head trained here, in EAGLE-1/2's published layout (and placed for drafting).

A head of style ``eagle`` (``FeatureHead`` class doc) computes exactly EAGLE-1/2's draft
forward, so its tensors *are* an EAGLE head: ``fc -> fc``, ``q/k/v/o -> layers.0.self_attn.
{q,k,v,o}_proj``, ``gate/up/down -> layers.0.mlp.*``, ``ln2 ->
layers.0.post_attention_layernorm`` (``ln1`` is unused by that math and not written).
``save_eagle_folder`` writes ``config.json`` (a Llama config of one layer, as EAGLE's
repository publishes, plus ``specflow_target``: the target's name and weights fingerprint)
and ``model.safetensors``; the folder loads wherever EAGLE-1/2 heads load, here through
``specflow.models.eagle_head``.  A ``specflow``-style head (unit-normalised inputs, an input
norm) has no EAGLE equivalent and is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specflow.errors import ConfigError
from specflow.kv.base import ModelInfo
from specflow.models.checkpoint_files import Checkpoint
from specflow.models.eagle_head import TARGET_KEY, EagleDraftModel, EagleHead, eagle_head_from
from specflow.models.feature_head import FeatureDraftModel, FeatureHead
from specflow.models.native import NativeLM


def eagle_tensors(head: FeatureHead, vocab_size: int) -> dict[str, torch.Tensor]:
    """The head's tensors under EAGLE-1/2's keys (float32, CPU)."""
    if not head.eagle:
        raise ConfigError(
            "a feature head of style 'specflow' (unit-normalised inputs and an input norm) "
            "cannot be written in EAGLE's layout; fix: train it with head.style=eagle "
            "(python -m train_heads.train head=feature head.style=eagle output.format=eagle)")
    if head.vocab_ids.numel() != vocab_size:
        raise ConfigError(
            f"the feature head drafts over {head.vocab_ids.numel()} of {vocab_size} tokens, "
            "but EAGLE-1/2's layout has no draft vocabulary; fix: train it over the whole "
            "vocabulary (head.style=eagle does)")
    pre, attn = "layers.0.", "layers.0.self_attn."
    named = {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias,
             attn + "q_proj.weight": head.q.weight, attn + "k_proj.weight": head.k.weight,
             attn + "v_proj.weight": head.v.weight, attn + "o_proj.weight": head.o.weight,
             pre + "mlp.gate_proj.weight": head.gate.weight,
             pre + "mlp.up_proj.weight": head.up.weight,
             pre + "mlp.down_proj.weight": head.down.weight,
             pre + "post_attention_layernorm.weight": head.ln2}
    if head.shape.qkv_bias:
        named |= {attn + "q_proj.bias": head.q.bias, attn + "k_proj.bias": head.k.bias,
                  attn + "v_proj.bias": head.v.bias}
    return {k: t.detach().float().cpu().contiguous() for k, t in named.items()}


def eagle_config(head: FeatureHead, info: ModelInfo) -> dict[str, Any]:
    """EAGLE-1/2's ``config.json`` for the head (a one-layer Llama config)."""
    s = head.shape
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True,
        "hidden_act": "silu", "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "num_hidden_layers": 1, "max_position_embeddings": info.max_positions,
        "rms_norm_eps": s.eps, "rope_theta": s.rope_theta, "vocab_size": info.vocab_size,
        "torch_dtype": "float32",
        TARGET_KEY: {"name": info.name, "weights_fingerprint": info.weights_fingerprint},
    }


def save_eagle_folder(folder: str | Path, head: FeatureHead, info: ModelInfo) -> Path:
    """Write ``head`` (style ``eagle``, for target ``info``) as an EAGLE-1/2 folder."""
    from safetensors.torch import save_file

    tensors = eagle_tensors(head, info.vocab_size)
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(eagle_config(head, info), indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def as_eagle_head(head: FeatureHead, info: ModelInfo) -> EagleHead:
    """The ``eagle``-style ``head`` as the loader of published heads reads it."""
    ckpt = Checkpoint(Path("<feature head>"), eagle_config(head, info),
                      Path("<feature head>/model.safetensors"),
                      eagle_tensors(head, info.vocab_size))
    return eagle_head_from(ckpt, info)


def place_feature_head(head: FeatureHead, target: NativeLM
                       ) -> FeatureDraftModel | EagleDraftModel:
    """``head`` ready to draft beside the placed ``target``: a ``FeatureDraftModel``, or for
    an ``eagle``-style head an ``EagleDraftModel`` (both a ``specflow.protocols.
    FeatureHeadRunner``, the role a feature drafter runs them in)."""
    if head.eagle:
        return as_eagle_head(head, target.info).place(target)
    return FeatureDraftModel(head, target)
