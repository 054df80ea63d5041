"""A ``LightningDataModule`` over a ``HiddenCache``: batches of positions, not sequences.

Exit heads are position-wise, so a training example is one cached position: its hidden
states at every exit being trained, the teacher's top-k and the next token.  Batches are
drawn by indexing the flat cache tensors with a tensor of row ids (no per-item Python).
Training rows: every position of the train sequences after the shared prompt prefix.
Validation rows: the generated positions of the held-out sequences (what a drafter
actually sees), at most ``val_max_rows`` of them (an evenly spaced subset).
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from train_heads.cache import HiddenCache


class RowsDataset(Dataset):
    """``dataset[list_of_i]`` -> a batch dict for rows ``rows[i]`` of ``cache``."""

    def __init__(self, cache: HiddenCache, rows: torch.Tensor, layers: list[int]) -> None:
        self.cache = cache
        self.rows = rows
        self.layers = layers

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, items: list[int]) -> dict[str, torch.Tensor]:
        r = self.rows[torch.as_tensor(items, dtype=torch.long)]
        c = self.cache
        batch = {f"h{layer}": c.hidden[layer][r] for layer in self.layers}
        batch.update(topk_logp=c.topk_logp[r], topk_ids=c.topk_ids[r], next=c.next_token[r])
        return batch


class ExitDataModule(L.LightningDataModule):
    """Train/val loaders over a ``HiddenCache`` (see module doc).

    Args:
        cache: the cached hidden states.
        layers: the exits being trained (each must be cached).
        batch_size: positions per batch (the frozen LM head over them dominates the cost).
        skip: positions at the start of every sequence to leave out (shared prefix).
        val_max_rows: cap on validation positions (``None``: all).
        seed: shuffling seed.
    """

    def __init__(
        self,
        cache: HiddenCache,
        layers: list[int],
        batch_size: int = 256,
        skip: int = 0,
        val_max_rows: int | None = 1024,
        seed: int = 0,
    ) -> None:
        super().__init__()
        missing = [layer for layer in layers if layer not in cache.hidden]
        if missing:
            raise ValueError(f"layers {missing} are not in the cache (has {cache.layers})")
        self.cache = cache
        self.layers = list(layers)
        self.batch_size = batch_size
        self.skip = skip
        self.val_max_rows = val_max_rows
        self.seed = seed
        self.train_rows = cache.rows(0, skip=skip)
        val = cache.rows(1, generated_only=True, skip=skip)
        if val_max_rows is not None and val.shape[0] > val_max_rows:
            pick = torch.linspace(0, val.shape[0] - 1, val_max_rows).round().long()
            val = val[pick]
        self.val_rows = val

    def _loader(self, rows: torch.Tensor, shuffle: bool) -> DataLoader:
        ds = RowsDataset(self.cache, rows, self.layers)
        if shuffle:
            gen = torch.Generator().manual_seed(self.seed)
            sampler = RandomSampler(range(len(ds)), generator=gen)
        else:
            sampler = SequentialSampler(range(len(ds)))
        return DataLoader(
            ds, sampler=BatchSampler(sampler, self.batch_size, drop_last=False), batch_size=None
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_rows, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, shuffle=False)
