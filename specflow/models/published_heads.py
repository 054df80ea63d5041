"""A published feature head's folder (or hub id) read as the kind it is: EAGLE-1/2
(``specflow.models.eagle_head``) or EAGLE-3 (``specflow.models.eagle3_head``); a Medusa
folder is pointed to its own drafter.  Every check runs here, before any decoding."""

from __future__ import annotations

import torch

from specflow.kv.base import ModelInfo
from specflow.models.checkpoint_files import detect_format, read_checkpoint
from specflow.models.eagle3_head import Eagle3Head, eagle3_head_from
from specflow.models.eagle_head import EagleHead, eagle_head_from


def load_published_head(path: str, info: ModelInfo, embed: torch.Tensor | None = None
                        ) -> EagleHead | Eagle3Head:
    """The EAGLE-1/2 or EAGLE-3 head in the folder (or hub id) ``path`` for the target
    ``info`` (its embedding ``embed [V, H]`` compared with a published one)."""
    ckpt = read_checkpoint(path)
    fmt = detect_format(ckpt)
    if fmt == "eagle3":
        return eagle3_head_from(ckpt, info, embed)
    if fmt != "eagle":
        raise ckpt.problem("fc.weight", f"is missing: this is a {fmt} checkpoint",
                           "load it with drafter=medusa (drafter.heads=<folder>)")
    return eagle_head_from(ckpt, info, embed)
