"""Tiny random-init HF models for tests: seconds to build, exact to compare against.

``tiny_hf_model`` builds a ``LlamaForCausalLM`` ("llama") or ``Qwen2ForCausalLM`` ("qwen2")
with 4 attention heads over 2 KV heads (GQA), ``head_dim = hidden_size // 4``,
``intermediate_size = 2 * hidden_size``, 512 positions and ``eos_token_id = vocab_size - 1``
(bos 0, no pad).  Llama unties its embeddings, Qwen2 ties them (like Qwen2.5-0.5B) and has
q/k/v biases; both can be overridden through ``**overrides`` (any config field).

A default-init random model (std 0.02) is nearly a constant function: its greedy
continuation collapses into one repeated token and tests comparing two implementations
cannot tell positions apart.  So weights use ``initializer_range=0.25`` and every norm
weight and bias is randomised too (HF inits them to ones/zeros, which would hide a swapped
norm or a dropped bias).  Greedy continuations of these models vary (see the tests).
"""

from __future__ import annotations

import hashlib

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specflow.kv.base import ModelInfo

_ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_hf_model(
    arch: str = "llama",
    *,
    num_layers: int = 4,
    vocab_size: int = 128,
    hidden_size: int = 64,
    seed: int = 0,
    **overrides,
) -> PreTrainedModel:
    """A random float32 HF causal LM in eval mode; the same arguments give the same weights.

    The global torch RNG is left untouched.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {sorted(_ARCHS)}")
    config_cls, model_cls = _ARCHS[arch]
    kwargs: dict = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.25,
        bos_token_id=0,
        eos_token_id=vocab_size - 1,
        pad_token_id=None,
        tie_word_embeddings=arch == "qwen2",
    )
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def weights_fingerprint(hf_model: PreTrainedModel) -> str:
    """A short hash of every parameter's bytes (fine for tiny models, slow for big ones)."""
    h = hashlib.sha256()
    for name, p in sorted(hf_model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def tiny_model_info(hf_model: PreTrainedModel, name: str) -> ModelInfo:
    """``ModelInfo`` of a tiny model; its tokenizer fingerprint depends only on the vocab size."""
    cfg = hf_model.config
    eos = cfg.eos_token_id
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return ModelInfo(
        name=name,
        num_layers=cfg.num_hidden_layers,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        max_positions=cfg.max_position_embeddings,
        eos_token_ids=eos_ids,
        tokenizer_fingerprint=f"tiny-vocab-{cfg.vocab_size}",
        weights_fingerprint=weights_fingerprint(hf_model),
    )
