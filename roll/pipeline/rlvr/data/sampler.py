"""Deterministic, resumable batches of prompts, optionally mixed per domain.

    sampler = PromptSampler(dataset, batch_size=32, seed=42, domain_interleave_probs={"math": 0.7, "code": 0.3})
    rows = sampler.next_batch()                      # list[PromptRow]
    batch = to_batch(rows, tokenizer.pad_token_id, prompt_length=64)
    state = sampler.state_dict()                     # store with the checkpoint ...
    sampler.load_state_dict(state)                   # ... and the next batch after resume is the same

Without domain probabilities, batches walk through a fresh permutation of all rows each epoch (a
batch that crosses the end of an epoch continues into the next one). With them, each key is its own
stream of permutations (a key is a tag, or as in alibaba/ROLL the name of a reward role: all the
tags its ``tag_included`` lists), and each slot of a batch goes to the key furthest below its share
so far, so after n prompts every key has round(p * n) of them within one (exact mixing, no sampling
noise); a probability of 0 leaves a key out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from roll.configs.errors import ConfigError
from roll.core.batch import Batch
from roll.pipeline.rlvr.data.dataset import PromptDataset, PromptRow
from roll.pipeline.rlvr.data.vision import VISION_ROWS, vision_fields

ALL = "*"  # the one stream of the unmixed sampler


class _Stream:
    """Indices of one domain in a new permutation each epoch, seeded by (seed, stream id, epoch)."""

    def __init__(self, indices: list[int], seed: int, stream_id: int):
        self.indices = indices
        self.seed = seed
        self.stream_id = stream_id
        self.epoch = 0
        self.pos = 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        rng = np.random.default_rng([self.seed, self.stream_id, self.epoch])
        return [self.indices[i] for i in rng.permutation(len(self.indices))]

    def take(self) -> int:
        if self.pos == len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation()
        self.pos += 1
        return self._order[self.pos - 1]

    def restore(self, epoch: int, pos: int) -> None:
        self.epoch, self.pos = epoch, pos
        self._order = self._permutation()


class PromptSampler:
    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        seed: int,
        domain_interleave_probs: dict[str, float] | None = None,
        path: str = "domain_interleave_probs",
        role_tags: dict[str, list[str]] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not len(dataset):
            raise ValueError("cannot sample from an empty prompt dataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        if domain_interleave_probs:
            self.probs = check_domain_probs(domain_interleave_probs, dataset.domains(), path, role_tags)
            key_of = interleave_keys(self.probs, dataset.domains(), role_tags)
            groups: dict[str, list[int]] = {key: [] for key in self.probs}
            for domain, indices in dataset.indices_by_domain().items():
                groups[key_of[domain]].extend(indices)
            self.streams = {d: _Stream(groups[d], seed, i) for i, d in enumerate(sorted(self.probs))}
        else:
            self.probs = {ALL: 1.0}
            self.streams = {ALL: _Stream(list(range(len(dataset))), seed, 0)}
        self.drawn = dict.fromkeys(self.probs, 0)

    @property
    def epoch(self) -> int:
        """Epochs completed by the slowest stream that is sampled."""
        return min(s.epoch for d, s in self.streams.items() if self.probs[d] > 0)

    def next_batch(self) -> list[PromptRow]:
        rows = []
        for _ in range(self.batch_size):
            total = sum(self.drawn.values()) + 1
            domain = max(self.probs, key=lambda d: self.probs[d] * total - self.drawn[d])
            self.drawn[domain] += 1
            rows.append(self.dataset[self.streams[domain].take()])
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "num_rows": len(self.dataset),
            "drawn": dict(self.drawn),
            "streams": {d: [s.epoch, s.pos] for d, s in self.streams.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_rows"] != len(self.dataset) or set(state["streams"]) != set(self.streams):
            raise ValueError(
                f"sampler state is for {state['num_rows']} rows in domains {sorted(state['streams'])}, "
                f"but the dataset has {len(self.dataset)} rows in {sorted(self.streams)}"
            )
        self.seed = state["seed"]
        self.drawn = dict(state["drawn"])
        for domain, (epoch, pos) in state["streams"].items():
            self.streams[domain].seed = self.seed
            self.streams[domain].restore(epoch, pos)


def interleave_keys(
    probs: dict[str, Any], domains: list[str], role_tags: dict[str, list[str]] | None = None
) -> dict[str, str]:
    """Each domain (tag) -> the key of ``probs`` that covers it: the tag itself, else (ROLL's
    spelling) the name of the reward role whose ``tag_included`` lists it; a domain no key covers
    maps to itself."""
    by_role = {t: name for name, tags in (role_tags or {}).items() for t in tags if name in probs}
    return {d: d if d in probs else by_role.get(d, d) for d in domains}


def check_domain_probs(
    probs: dict[str, float], domains: list[str], path: str, role_tags: dict[str, list[str]] | None = None
) -> dict[str, float]:
    """The probabilities, checked: every key is one of the data's ``domains`` or the name of a
    reward role (``role_tags``: name -> tag_included) whose tags have rows, every domain is covered
    by one key, sum ~1 (also run before launch on the files' tags: roll.launch.files)."""
    key_of = interleave_keys(probs, domains, role_tags)
    for key, p in probs.items():
        if key not in key_of.values():
            raise ConfigError(
                f"{path}.{key}",
                f"no prompt rows have the tag {key!r}, nor a tag that a reward role of that name routes; "
                f"tags in the data: {domains}",
            )
        if not isinstance(p, (int, float)) or p < 0:
            raise ConfigError(f"{path}.{key}", f"must be a number >= 0, got {p!r}")
    missing = [d for d in domains if key_of[d] not in probs]
    if missing:
        raise ConfigError(
            path, f"domains {missing} have rows but no probability; {_what_to_write(missing, role_tags)}"
        )
    total = sum(probs.values())
    if abs(total - 1.0) > 1e-6:
        raise ConfigError(path, f"probabilities must sum to 1, they sum to {total:g}")
    return {d: float(p) for d, p in probs.items()}


def _what_to_write(missing: list[str], role_tags: dict[str, list[str]] | None) -> str:
    """Name the reward role that routes each missing tag, and the key to add (ROLL drops the rows
    of a domain it leaves out; roll asks for the 0)."""
    role_of = {t: name for name, tags in (role_tags or {}).items() for t in tags}
    roles = sorted({role_of[d] for d in missing if d in role_of})
    if not roles:
        return "give each tag, or its reward role, one (0 leaves it out)"
    keys = ", ".join(f"{name}: 0" for name in roles)
    named = ", ".join(f"rewards.{name}" for name in roles)
    return f"they are routed by {named}: add {keys} (0 leaves its rows out, as ROLL does) or a probability"


def to_batch(
    rows: Sequence[PromptRow],
    pad_token_id: int,
    prompt_length: int,
    processor: Any = None,
    lazy: bool = False,
) -> Batch:
    """``prompts``/``prompt_mask`` [B, prompt_length], LEFT-padded, plus the rows' text fields;
    with a vision-language model's ``processor``, each row's images and model inputs too
    (``data.vision.vision_fields``), or with ``lazy`` the rows, whose fields
    ``data.vision.with_vision_fields`` builds for each part of the batch when it is used."""
    prompts = torch.full((len(rows), prompt_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), prompt_length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.prompt_ids)
        if n > prompt_length:
            raise ValueError(f"prompt {row.source} has {n} tokens, more than prompt_length={prompt_length}")
        if n:
            prompts[i, prompt_length - n :] = torch.tensor(row.prompt_ids, dtype=torch.long)
            mask[i, prompt_length - n :] = 1
    fields = {
        "prompt_text": [r.prompt_text for r in rows],
        "ground_truth": [r.ground_truth for r in rows],
        "tag": [r.tag for r in rows],
        "domain": [r.domain for r in rows],
    }
    if processor is not None:
        fields |= {VISION_ROWS: list(rows)} if lazy else vision_fields(rows, processor)
    elif any(r.images for r in rows):
        raise ValueError(
            f"prompt {next(r.source for r in rows if r.images)} has images but no processor was given"
        )
    return Batch.from_dict({"prompts": prompts, "prompt_mask": mask}, fields)
