"""``Batch``: tensors and non-tensor fields that share a leading batch dimension.

>>> b = Batch.from_dict({"input_ids": torch.zeros(4, 8, dtype=torch.long)}, {"tag": ["a", "b", "a", "b"]})
>>> left, right = b.chunk(2)          # split across 2 data-parallel ranks
>>> Batch.concat([left, right]).non_tensors["tag"].tolist()
['a', 'b', 'a', 'b']

Tensors live in ``tensors``; per-sample Python objects (strings, dicts) in ``non_tensors`` as numpy
object arrays; ``meta`` holds batch-level values (step number, sampling params) that are not split.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array of ``values`` (a non-tensor field; numpy would stack equal-shaped items)."""
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {
            k: v if isinstance(v, np.ndarray) else object_array(v) for k, v in self.non_tensors.items()
        }
        sizes = {k: v.shape[0] for k, v in self.tensors.items()} | {
            k: len(v) for k, v in self.non_tensors.items()
        }
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Sequence[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Batch:
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta or {}))

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(
            f"{key!r} is not in the batch (fields: {sorted(self.tensors) + sorted(self.non_tensors)})"
        )

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def select(self, keys: Iterable[str] | None = None, meta: bool = True) -> Batch:
        """A batch with only ``keys`` (all when None); the arrays are shared, not copied."""
        keys = self.keys() if keys is None else list(keys)
        for key in keys:
            self[key]  # raises a KeyError naming the missing field
        return Batch(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            dict(self.meta) if meta else {},
        )

    def index(self, idx: slice | Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        """Rows ``idx`` of every field (a slice, a list of ints or a boolean mask)."""
        if isinstance(idx, slice):
            np_idx: Any = idx
            t_idx: Any = idx
        else:
            np_idx = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
            if np_idx.size == 0:
                np_idx = np_idx.astype(np.int64)  # numpy reads [] as float
            if np_idx.dtype == bool:
                np_idx = np.nonzero(np_idx)[0]
            t_idx = torch.as_tensor(np_idx, dtype=torch.long)
        return Batch(
            {
                k: v[t_idx.to(v.device) if isinstance(t_idx, torch.Tensor) else t_idx]
                for k, v in self.tensors.items()
            },
            {k: v[np_idx] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def chunk(self, n: int) -> list[Batch]:
        """``n`` equal parts in order; the batch size must divide by ``n``."""
        size = len(self)
        if n < 1 or size % n:
            raise ValueError(f"cannot chunk a batch of {size} rows into {n} equal parts")
        return self.split(size // n)

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of ``size`` rows (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; fields must match; meta is taken from the first."""
        batches = [b for b in batches if b is not None]
        if not batches:
            return Batch()
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise ValueError(
                    f"cannot concat batches with different fields: {sorted(keys)} vs {sorted(b.keys())}"
                )
        first = batches[0]
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            dict(first.meta),
        )

    def union(self, other: Batch) -> Batch:
        """Fields of both (same rows). A key in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not torch.equal(tensors[k], v):
                raise ValueError(f"union: field {k!r} differs between the batches")
            tensors[k] = v
        non_tensors = dict(self.non_tensors)
        non_tensors.update(other.non_tensors)
        return Batch(tensors, non_tensors, {**self.meta, **other.meta})

    def repeat_interleave(self, n: int) -> Batch:
        """Each row ``n`` times in a row: [a, b] -> [a, a, b, b] for n=2."""
        return Batch(
            {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()},
            {k: np.repeat(v, n) for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            {k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors), dict(self.meta)
        )
