"""Published Medusa heads (``FasterDecoding/Medusa``) beside a placed target.

A folder with ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``
(read with ``torch.load(weights_only=True)``).  Head ``j`` (``j = 0 .. K-1``) reads the
target's normed last hidden state ``a_p = RMSNorm_g(h_N,p)`` at the last position the target
processed and predicts the token ``j + 2`` positions on (the target's own LM head predicts
the next one):

    x^0     = a_p                                                   [H]
    x^{l+1} = x^l + silu(W_{j,l} x^l + b_{j,l})        l < L        [H]   (residual blocks)
    q_j     = softmax( U_j x^L )                                    [V]   (t_{p+j+2})

Keys: ``{j}.{l}.linear.weight [H, H]``, ``{j}.{l}.linear.bias [H]``, ``{j}.{L}.weight
[V, H]``.  Published configs may state fewer heads than the file holds; the keys decide.
The target check: ``H`` and ``V`` must be the target's (Medusa files carry no fingerprint;
``base_model_name_or_path`` is only reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specflow.errors import ConfigError
from specflow.kv.base import ModelInfo
from specflow.models.checkpoint_files import Checkpoint, detect_format, read_checkpoint
from specflow.models.decoder_params import place_matrix, place_vector
from specflow.models.exit_heads import default_heads_path
from specflow.models.native import NativeLM, linear, packing_available

_FIX = "fetch the checkpoint folder again, as published (config.json + medusa_lm_head.*)"


@dataclass(frozen=True)
class MedusaHeads:
    """``blocks[j][l] = (W [H, H], b [H])`` and ``lm[j] = U [V, H]`` per head (float32)."""

    source: str
    base_model: str
    blocks: list[list[tuple[torch.Tensor, torch.Tensor]]]
    lm: list[torch.Tensor]

    @property
    def num_heads(self) -> int:
        return len(self.lm)


def medusa_heads_from(ckpt: Checkpoint, info: ModelInfo) -> MedusaHeads:
    """The heads in ``ckpt``, checked against the target ``info``."""
    h, v = info.hidden_size, info.vocab_size
    keys = ckpt.tensors.keys()
    count = 1 + max((int(k.split(".")[0]) for k in keys if k.split(".")[0].isdigit()),
                    default=-1)
    if count == 0:
        raise ckpt.problem("0.0.linear.weight", "is missing (no Medusa head in the file)", _FIX)
    layers = int(ckpt.config.get("medusa_num_layers") or sum(
        1 for k in keys if k.startswith("0.") and k.endswith(".linear.weight")))
    other = (f"the heads were made for another target model than {info.name!r} (base model "
             f"{ckpt.config.get('base_model_name_or_path', '?')!r}); fix: use Medusa heads "
             f"published for {info.name!r}")
    lm0 = ckpt.tensors.get(f"0.{layers}.weight")
    if lm0 is not None and lm0.dim() == 2 and tuple(lm0.shape) != (v, h):
        raise ConfigError(f"{ckpt.weights_file}: key '0.{layers}.weight' has shape "
                          f"{list(lm0.shape)} but the target's LM head is {[v, h]}: {other}")
    blocks = [[(ckpt.tensor(f"{j}.{m}.linear.weight", (h, h), _FIX),
                ckpt.tensor(f"{j}.{m}.linear.bias", (h,), _FIX)) for m in range(layers)]
              for j in range(count)]
    lm = [ckpt.tensor(f"{j}.{layers}.weight", (v, h), _FIX) for j in range(count)]
    return MedusaHeads(str(ckpt.folder), str(ckpt.config.get("base_model_name_or_path", "")),
                       blocks, lm)


def default_medusa_path(model_name: str) -> Path:
    """``<cache>/heads/<model>/medusa/``, beside the model's exit and feature heads
    (``default_heads_path``)."""
    return default_heads_path(model_name).with_name("medusa")


def load_medusa_folder(path: str, info: ModelInfo) -> MedusaHeads:
    """The Medusa heads in the folder (or hub id) ``path`` for the target ``info``."""
    ckpt = read_checkpoint(path)
    fmt = detect_format(ckpt)
    if fmt != "medusa":
        raise ckpt.problem("0.0.linear.weight", f"is missing: this is an {fmt} checkpoint",
                           "load it with drafter=feature (drafter.head=<folder>)")
    return medusa_heads_from(ckpt, info)


class MedusaDraftModel:
    """``MedusaHeads`` on a placed target's device and dtype (packed where the target is)."""

    def __init__(self, heads: MedusaHeads, target: NativeLM) -> None:
        device, dtype = target.device, target.dtype
        packed = target.packed and packing_available(device, dtype)
        with torch.no_grad():
            self.blocks = [[(place_matrix(w, device, dtype, packed),
                             place_vector(b, device, dtype)) for w, b in head]
                           for head in heads.blocks]
            self.lm = [place_matrix(u, device, dtype, packed) for u in heads.lm]
        self.target = target
        self.num_heads = heads.num_heads

    @torch.no_grad()
    def logits(self, final: torch.Tensor, heads: int) -> torch.Tensor:
        """``h_N [R, H]`` -> the first ``heads`` heads' logits ``[heads, R, V]`` (float32)."""
        t = self.target
        a = F.rms_norm(final, (t.hidden_size,), t.final_norm, t.eps)  # [R, H]
        out = []
        for j in range(heads):
            x = a
            for w, b in self.blocks[j]:
                x = x + F.silu(linear(x, w, b, t.min_rows))
            out.append(linear(x, self.lm[j], None, t.min_rows).float())  # [R, V]
        return torch.stack(out)


def save_medusa_folder(folder: str | Path, heads: MedusaHeads, info: ModelInfo) -> Path:
    """Write ``heads`` (for target ``info``) as a Medusa folder, in the layout
    ``load_medusa_folder`` and ``FasterDecoding/Medusa`` read: ``config.json``
    (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``) and
    ``medusa_lm_head.safetensors`` (``{j}.{l}.linear.weight/bias``, ``{j}.{L}.weight``).
    An LM head that bfloat16 holds exactly (a copy of a bf16 target's) is written in
    bfloat16, halving the file; any other tensor in float32."""
    import json

    from safetensors.torch import save_file

    layers = len(heads.blocks[0]) if heads.blocks else 0
    tensors: dict[str, torch.Tensor] = {}
    for j in range(heads.num_heads):
        for m, (w, b) in enumerate(heads.blocks[j]):
            tensors[f"{j}.{m}.linear.weight"] = w.float().contiguous()
            tensors[f"{j}.{m}.linear.bias"] = b.float().contiguous()
        u = heads.lm[j].float()
        exact = torch.equal(u.to(torch.bfloat16).float(), u)
        tensors[f"{j}.{layers}.weight"] = (u.to(torch.bfloat16) if exact else u).contiguous()
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": layers,
              "base_model_name_or_path": info.name, "hidden_size": info.hidden_size,
              "vocab_size": info.vocab_size}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    return folder
