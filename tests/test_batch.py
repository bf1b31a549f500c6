"""Batch: split/concat/select/index/union/repeat round trips and error messages."""

import numpy as np
import pytest
import torch

from roll.core.batch import Batch


def make(n=4):
    return Batch.from_dict(
        {"x": torch.arange(n * 2).view(n, 2)}, {"tag": [f"t{i}" for i in range(n)]}, {"step": 3}
    )


def test_chunk_concat_round_trip():
    b = make()
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [2, 2]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["tag"].tolist() == b["tag"].tolist()
    assert back.meta == {"step": 3}


def test_chunk_requires_divisible():
    with pytest.raises(ValueError, match="cannot chunk a batch of 4 rows into 3"):
        make().chunk(3)


def test_split_last_part_shorter():
    assert [len(p) for p in make(5).split(2)] == [2, 2, 1]


def test_index_forms():
    b = make()
    assert b.index([2, 0])["tag"].tolist() == ["t2", "t0"]
    assert b.index(torch.tensor([True, False, True, False]))["x"][:, 0].tolist() == [0, 4]
    assert len(b.index([])) == 0
    assert b.index(slice(1, 3))["tag"].tolist() == ["t1", "t2"]


def test_select_and_missing_key():
    b = make()
    assert b.select(["x"]).keys() == ["x"]
    with pytest.raises(KeyError, match="'y' is not in the batch"):
        b.select(["y"])


def test_union_checks_rows_and_conflicts():
    b = make()
    other = Batch.from_dict({"y": torch.ones(4)})
    assert set(b.union(other).keys()) == {"x", "tag", "y"}
    with pytest.raises(ValueError, match="differs"):
        b.union(Batch.from_dict({"x": torch.zeros(4, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match="cannot union"):
        b.union(Batch.from_dict({"y": torch.ones(3)}))


def test_repeat_interleave_orders_samples_per_row():
    r = make(2).repeat_interleave(3)
    assert r["tag"].tolist() == ["t0", "t0", "t0", "t1", "t1", "t1"]
    assert r["x"][:, 0].tolist() == [0, 0, 0, 2, 2, 2]


def test_mismatched_sizes_rejected():
    with pytest.raises(ValueError, match="disagree"):
        Batch.from_dict({"x": torch.zeros(3)}, {"tag": ["a"]})


def test_concat_field_mismatch():
    with pytest.raises(ValueError, match="different fields"):
        Batch.concat([make(), Batch.from_dict({"x": torch.zeros(1, 2)})])


def test_non_tensor_objects_survive():
    b = Batch.from_dict(non_tensors={"d": [{"a": 1}, [1, 2]]})
    assert isinstance(b["d"], np.ndarray) and b["d"][1] == [1, 2]
