"""``LightningDataModule``s over a ``HiddenCache``: batches of positions (exit heads) or of
whole sequences (attention adapters, ``AdapterDataModule`` below).

Exit heads are position-wise, so a training example is one cached position: its hidden
states at every exit being trained, the teacher's top-k and the next token.  Batches are
drawn by indexing the flat cache tensors with a tensor of row ids (no per-item Python).
Training rows: every position of the train sequences after the shared prompt prefix.
Validation rows: the generated positions of the held-out sequences (what a drafter
actually sees), at most ``val_max_rows`` of them (an evenly spaced subset).
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

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


def loss_rows(cache: HiddenCache, layers: list[int], skip: int, val_max_rows: int | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows heads train and validate on: every position of the train sequences after the
    shared prefix (``skip``), and the held-out generated positions after it (an evenly spaced
    ``val_max_rows`` of them).  ``ValueError`` when a layer is not in the cache."""
    missing = [layer for layer in layers if layer not in cache.hidden]
    if missing:
        raise ValueError(f"layers {missing} are not in the cache (has {cache.layers})")
    val = cache.rows(1, generated_only=True, skip=skip)
    if val_max_rows is not None and val.shape[0] > val_max_rows:
        pick = torch.linspace(0, val.shape[0] - 1, val_max_rows).round().long()
        val = val[pick]
    return cache.rows(0, skip=skip), val


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
        self.cache = cache
        self.layers = list(layers)
        self.batch_size = batch_size
        self.skip = skip
        self.val_max_rows = val_max_rows
        self.seed = seed
        self.train_rows, self.val_rows = loss_rows(cache, layers, skip, val_max_rows)

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


# ---------------------------------------------------------------------- attention adapters
class SequencesDataset(Dataset):
    """``dataset[list_of_sequences]`` -> a padded batch of whole sequences of ``cache``.

    An attention adapter (``specflow.models.adapter_head.AdapterHead``) reads every position
    of a sequence, so a training example is a sequence: rows ``p = 0 .. len-1`` are ``h_L``
    of positions ``p`` and the teacher's distribution of token ``p + 1``.  A batch of ``B``
    sequences, the longest ``T`` rows:

        h{L}        [B, T, H]  float32, zero on padding
        key_valid   [B, T]     bool, False on padding (keys the adapter's attention may read)
        loss_mask   [B, T]     bool, the rows the loss is taken on (``loss_rows``; never padding)
        topk_logp, topk_ids, next   [R, k], [R, k], [R]: those R rows, row-major
                                    (``a[loss_mask]`` lines up with them)
    """

    def __init__(self, cache: HiddenCache, layers: list[int], loss_rows: torch.Tensor) -> None:
        self.cache = cache
        self.layers = layers
        self.lengths = cache.offsets[1:] - cache.offsets[:-1]  # [S]
        self.loss = torch.zeros(cache.num_rows, dtype=torch.bool)
        self.loss[loss_rows] = True

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, seqs: list[int]) -> dict[str, torch.Tensor]:
        c = self.cache
        s = torch.as_tensor(seqs, dtype=torch.long)
        lengths = self.lengths[s]  # [B]
        t = int(lengths.max())
        steps = torch.arange(t)
        valid = steps[None, :] < lengths[:, None]  # [B, T]
        idx = torch.where(valid, c.offsets[s][:, None] + steps[None, :], 0)  # [B, T] rows
        loss = valid & self.loss[idx]
        r = idx[loss]  # [R]
        batch = {f"h{layer}": c.hidden[layer][idx] * valid[..., None] for layer in self.layers}
        batch.update(key_valid=valid, loss_mask=loss, topk_logp=c.topk_logp[r],
                     topk_ids=c.topk_ids[r], next=c.next_token[r])
        return batch


def pack_sequences(seqs: list[int], lengths: list[int], batch_rows: int, batch_sequences: int,
                   pool: int | None = None) -> list[list[int]]:
    """Batches of sequences: in order, at most ``batch_sequences`` per batch and at most
    ``batch_rows`` padded rows (sequences x the longest; a longer sequence is a batch of its
    own).  With ``pool``, each run of ``pool`` sequences is sorted by length first (less
    padding; the batches are still drawn from a random order when ``seqs`` is shuffled)."""
    order = list(seqs)
    if pool:
        order = [s for i in range(0, len(order), pool)
                 for s in sorted(order[i : i + pool], key=lambda s: lengths[s])]
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for s in order:
        n = lengths[s]
        if cur and (len(cur) + 1 > batch_sequences
                    or (len(cur) + 1) * max(longest, n) > batch_rows):
            batches.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


class BatchList(Sampler[list[int]]):
    """Fixed batches (lists of sequence ids), in a new random order every epoch when
    ``shuffle`` (a seeded generator that advances, as ``RandomSampler``'s does)."""

    def __init__(self, batches: list[list[int]], shuffle: bool, seed: int = 0) -> None:
        self.batches = batches
        self.shuffle = shuffle
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        order = (torch.randperm(len(self.batches), generator=self.gen).tolist()
                 if self.shuffle else range(len(self.batches)))
        for i in order:
            yield self.batches[i]


class AdapterDataModule(L.LightningDataModule):
    """Train/val loaders of padded whole-sequence batches over a ``HiddenCache`` (attention
    adapters; ``SequencesDataset``).

    The loss rows are the ones ``ExitDataModule`` trains and validates exit heads on:
    training, every position of the train sequences after the shared prompt prefix
    (``skip``); validation, the held-out generated positions after it (an evenly spaced
    ``val_max_rows`` of them).  Every row of a sequence before them (the prefix too) is
    still attention context.  Sequences without a loss row are left out.

    Args:
        cache, layers, skip, val_max_rows, seed: as ``ExitDataModule``.
        batch_rows: padded rows (sequences x the longest) per batch, at most.
        batch_sequences: sequences per batch, at most.
        pool: training sequences are shuffled (``seed``), then sorted by length within runs
            of ``pool`` before packing (less padding); the batches' order is reshuffled
            every epoch.
    """

    def __init__(
        self,
        cache: HiddenCache,
        layers: list[int],
        batch_rows: int = 512,
        batch_sequences: int = 8,
        skip: int = 0,
        val_max_rows: int | None = 1024,
        seed: int = 0,
        pool: int = 64,
    ) -> None:
        super().__init__()
        if batch_rows < 1 or batch_sequences < 1:
            raise ValueError(f"batch_rows={batch_rows} and batch_sequences={batch_sequences} "
                             "must be >= 1")
        self.cache = cache
        self.layers = list(layers)
        self.skip = skip
        self.train_rows, self.val_rows = loss_rows(cache, layers, skip, val_max_rows)
        val = self.val_rows
        lengths = (cache.offsets[1:] - cache.offsets[:-1]).tolist()
        train_seqs = torch.unique(cache.seq_id[self.train_rows]).tolist()
        perm = torch.randperm(len(train_seqs), generator=torch.Generator().manual_seed(seed))
        self.train_batches = pack_sequences([train_seqs[i] for i in perm.tolist()], lengths,
                                            batch_rows, batch_sequences, pool)
        self.val_batches = pack_sequences(torch.unique(cache.seq_id[val]).tolist(), lengths,
                                          batch_rows, batch_sequences)
        self.seed = seed

    def padded_rows(self, batches: list[list[int]]) -> int:
        """Rows the adapter runs over for ``batches``, padding included."""
        lengths = self.cache.offsets[1:] - self.cache.offsets[:-1]
        return sum(len(b) * int(lengths[b].max()) for b in batches)

    def _loader(self, rows: torch.Tensor, batches: list[list[int]], shuffle: bool
                ) -> DataLoader:
        ds = SequencesDataset(self.cache, self.layers, rows)
        return DataLoader(ds, sampler=BatchList(batches, shuffle, self.seed), batch_size=None)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_rows, self.train_batches, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, self.val_batches, shuffle=False)
