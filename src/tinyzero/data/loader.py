"""A resumable, seeded, epoch-aware sampler and dataloader that yields DataProto batches.

    loader = StatefulDataLoader(dataset, batch_size=256, shuffle=True, seed=1)
    for epoch in range(loader.epoch, total_epochs):
        for batch in loader:            # the rest of the current epoch
            ...
            ckpt["dataloader"] = loader.state_dict()
    loader.load_state_dict(ckpt["dataloader"])   # continues with exactly the next batch

The order of epoch e is a torch permutation seeded with seed + e, computed on the CPU from
nothing but (seed, epoch, len(dataset)), so every rank builds the same global batch and a
resumed run sees exactly the batches an uninterrupted run would. The state is three ints:
epoch, the number of batches already taken in it, and the seed (plus the dataset length,
checked on load). With `prefetch=True` (the default) the next batch is fetched and tokenized
in a background thread while the caller works on the current one (the tokenizers release
the GIL); the order and the saved state are the same as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tinyzero.protocol import DataProto

__all__ = ["collate_to_dataproto", "StatefulSampler", "StatefulDataLoader"]


def collate_to_dataproto(items: list[dict], meta_info: dict | None = None) -> DataProto:
    """Stack tensor fields and gather every other field into 1-D numpy object arrays."""
    if not items:
        raise ValueError("collate_to_dataproto: empty batch")
    keys = list(items[0].keys())
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, np.ndarray] = {}
    for key in keys:
        values = [item.get(key) for item in items]
        if isinstance(values[0], torch.Tensor):
            tensors[key] = torch.stack(values, dim=0)
        else:
            arr = np.empty(len(values), dtype=object)
            for i, v in enumerate(values):
                arr[i] = v
            non_tensors[key] = arr
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)


class StatefulSampler:
    """Index order for every epoch, seeded by (seed, epoch); resumable at any batch boundary."""

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        if drop_last and num_samples < batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one batch of {batch_size}; lower the "
                "batch size (data.train_batch_size) or add data"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batches_taken = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def batch_indices(self, epoch: int, batch: int) -> list[int]:
        order = self.epoch_order(epoch)
        return order[batch * self.batch_size:(batch + 1) * self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """Batches left in the current epoch; when it is exhausted the epoch counter advances."""
        if self.batches_taken >= len(self):  # the previous pass stopped right after its last batch
            self.epoch += 1
            self.batches_taken = 0
        order = self.epoch_order(self.epoch)
        while self.batches_taken < len(self):
            start = self.batches_taken * self.batch_size
            self.batches_taken += 1
            yield order[start:start + self.batch_size].tolist()
        self.epoch += 1
        self.batches_taken = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_taken": self.batches_taken, "seed": self.seed,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples", self.num_samples) != self.num_samples:
            raise ValueError(
                f"the dataloader state was saved for {state['num_samples']} samples but this dataset has "
                f"{self.num_samples}; resume with the same data files and truncation settings"
            )
        self.epoch = int(state["epoch"])
        self.batches_taken = int(state["batches_taken"])
        self.seed = int(state["seed"])


class StatefulDataLoader:
    """Yields collated DataProto batches in the sampler's order; `state_dict` resumes mid-epoch."""

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 collate_fn: Callable[[list[dict]], DataProto] | None = None, prefetch: bool = True):
        self.dataset = dataset
        self.prefetch = prefetch
        self.sampler = StatefulSampler(len(dataset), batch_size, shuffle, seed, drop_last)
        self.collate_fn = collate_fn or collate_to_dataproto

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.sampler.epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.sampler)

    def _fetch(self, indices: list[int]) -> list[dict]:
        if hasattr(self.dataset, "__getitems__"):
            return self.dataset.__getitems__(indices)
        return [self.dataset[i] for i in indices]

    def _load(self, indices: list[int]) -> DataProto:
        return self.collate_fn(self._fetch(indices))

    def __iter__(self) -> Iterator[DataProto]:
        if not self.prefetch:
            for indices in self.sampler:
                yield self._load(indices)
            return
        # Same order as the sampler's own iterator; the sampler state only advances when a batch
        # is handed out, so a checkpoint never counts a batch that was prefetched but not used.
        s = self.sampler
        if s.batches_taken >= len(s):
            s.epoch += 1
            s.batches_taken = 0
        order = s.epoch_order(s.epoch)
        num_batches = len(s)

        def indices(k: int) -> list[int]:
            return order[k * s.batch_size:(k + 1) * s.batch_size].tolist()

        with ThreadPoolExecutor(1, thread_name_prefix="data-prefetch") as pool:
            pending = pool.submit(self._load, indices(s.batches_taken)) if s.batches_taken < num_batches else None
            while pending is not None:
                batch = pending.result()
                k = s.batches_taken + 1
                pending = pool.submit(self._load, indices(k)) if k < num_batches else None
                s.batches_taken = k
                yield batch
        s.epoch += 1
        s.batches_taken = 0

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
