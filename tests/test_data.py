"""Prompt files (good, bad, too long, missing) and the prompt sampler (mixing, determinism, resume)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from roll.configs.errors import ConfigError
from roll.configs.role import DataArgs
from roll.pipeline.rlvr.data.dataset import PromptDataset, PromptRow, load_prompt_files
from roll.pipeline.rlvr.data.sampler import PromptSampler, to_batch

CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class CharTokenizer:
    """One token per character; enough of the tokenizer interface for the loader."""

    def __init__(self, chat_template: str | None = CHAT_TEMPLATE):
        self.chat_template = chat_template

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        import jinja2

        text = jinja2.Template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )
        assert not tokenize
        return text

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(
    tmp_path: Path, files: list[str], prompt_length: int = 200, tokenizer=None, **kwargs
) -> PromptDataset:
    args = DataArgs(file_name=files, dataset_dir=str(tmp_path), **kwargs)
    return load_prompt_files(args, tokenizer or CharTokenizer(), prompt_length, "actor_train.data_args")


def test_messages_and_prompt_rows(tmp_path):
    write_jsonl(
        tmp_path / "math.jsonl",
        [
            {"messages": [{"role": "user", "content": "1+1?"}], "ground_truth": "2", "tag": "gsm"},
            {"prompt": "2+2?", "ground_truth": 4},
        ],
    )
    ds = load(tmp_path, ["math.jsonl"])
    assert len(ds) == 2 and not ds.bad_rows
    first, second = ds[0], ds[1]
    assert first.prompt_text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert first.prompt_ids == [ord(c) for c in first.prompt_text]
    assert (first.tag, first.domain, first.ground_truth) == ("gsm", "gsm", "2")
    # A plain prompt becomes one user message; the tag defaults to the file's stem.
    assert second.prompt_text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert (second.tag, second.ground_truth) == ("math", "4")
    assert first.source.endswith("math.jsonl:1") and second.source.endswith("math.jsonl:2")


def test_custom_field_names_and_plain_template(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"question": "hi", "answer": "x", "kind": "k"}])
    ds = load(tmp_path, ["a.jsonl"], prompt="question", ground_truth="answer", tag="kind", template="plain")
    assert (ds[0].prompt_text, ds[0].ground_truth, ds[0].tag) == ("user: hi\nassistant: ", "x", "k")
    # A tokenizer with no chat template falls back to the plain template too.
    ds = load(tmp_path, ["a.jsonl"], prompt="question", ground_truth="answer", tokenizer=CharTokenizer(None))
    assert ds[0].prompt_text == "user: hi\nassistant: "


def test_bad_rows_are_reported_with_file_and_line_and_skipped(tmp_path, caplog):
    good = {"prompt": "ok", "ground_truth": "1"}
    write_jsonl(
        tmp_path / "bad.jsonl",
        [
            good,
            "{not json",
            {"ground_truth": "1"},
            {"prompt": "no truth"},
            {"prompt": 5, "ground_truth": "1"},
            {"messages": [{"role": "user"}], "ground_truth": "1"},
            {"prompt": "x", "ground_truth": ["a"]},
            "[1, 2]",
            "",
            good,
        ],
    )
    with caplog.at_level(logging.WARNING):
        ds = load(tmp_path, ["bad.jsonl"])
    assert len(ds) == 2
    lines = {b.line: b.reason for b in ds.bad_rows}
    assert sorted(lines) == [2, 3, 4, 5, 6, 7, 8]
    assert lines[2].startswith("invalid JSON")
    assert "missing field" in lines[3] and "missing field: 'ground_truth'" in lines[4]
    assert all("wrong type" in lines[n] for n in (5, 6, 7))
    assert "expected a JSON object" in lines[8]
    assert all(b.file.endswith("bad.jsonl") for b in ds.bad_rows)
    assert "bad.jsonl:2: invalid JSON" in caplog.text


def test_long_prompts_dropped_and_counted(tmp_path, caplog):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x" * n, "ground_truth": "1"} for n in (1, 50, 2, 80)])
    overhead = len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    with caplog.at_level(logging.WARNING):
        ds = load(tmp_path, ["a.jsonl"], prompt_length=overhead + 10)
    assert len(ds) == 2 and ds.num_too_long == 2
    assert all(len(r.prompt_ids) <= overhead + 10 for r in ds.rows)
    assert "dropped 2 prompts longer than prompt_length" in caplog.text


def test_missing_file_and_empty_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"actor_train\.data_args\.file_name: 'nope\.jsonl': no such file"):
        load(tmp_path, ["nope.jsonl"])
    with pytest.raises(ConfigError, match="no prompt files given"):
        load_prompt_files(DataArgs(), CharTokenizer(), 10, "actor_train.data_args")
    write_jsonl(tmp_path / "junk.jsonl", ["{", "{"])
    with pytest.raises(ConfigError, match="no usable prompt rows"):
        load(tmp_path, ["junk.jsonl"])


def test_several_files_route_by_tag_and_max_samples(tmp_path):
    write_jsonl(tmp_path / "math.jsonl", [{"prompt": f"m{i}", "ground_truth": "1"} for i in range(3)])
    write_jsonl(
        tmp_path / "code.jsonl", [{"prompt": f"c{i}", "ground_truth": "1", "tag": "py"} for i in range(2)]
    )
    ds = load(tmp_path, ["math.jsonl", "code.jsonl"])
    assert [r.tag for r in ds.rows] == ["math"] * 3 + ["py"] * 2
    assert ds.domains() == ["math", "py"]
    assert ds.indices_by_domain() == {"math": [0, 1, 2], "py": [3, 4]}
    assert len(load(tmp_path, ["math.jsonl", "code.jsonl"], max_samples=4)) == 4


def make_dataset(sizes: dict[str, int]) -> PromptDataset:
    rows = [
        PromptRow([1] * (1 + i % 3), f"{d}{i}", str(i), d, d, f"{d}.jsonl:{i + 1}")
        for d, n in sizes.items()
        for i in range(n)
    ]
    return PromptDataset(rows)


def test_domain_interleave_proportions():
    ds = make_dataset({"a": 50, "b": 7, "c": 30})
    sampler = PromptSampler(ds, batch_size=10, seed=0, domain_interleave_probs={"a": 0.5, "b": 0.3, "c": 0.2})
    counts = Counter()
    for n in range(1, 31):
        batch = sampler.next_batch()
        assert len(batch) == 10
        counts.update(r.domain for r in batch)
        for d, p in {"a": 0.5, "b": 0.3, "c": 0.2}.items():
            assert abs(counts[d] - p * 10 * n) <= 1
    # "b" has 7 rows and was drawn 90 times: it cycled through epochs, each a full permutation.
    assert sampler.streams["b"].epoch == 12


def test_domain_probability_zero_and_errors():
    ds = make_dataset({"a": 5, "b": 5})
    sampler = PromptSampler(ds, 4, 0, {"a": 1.0, "b": 0.0})
    assert {r.domain for _ in range(5) for r in sampler.next_batch()} == {"a"}
    with pytest.raises(ConfigError, match=r"domain_interleave_probs\.z: no prompt rows have the tag 'z'"):
        PromptSampler(ds, 4, 0, {"a": 0.5, "z": 0.5})
    with pytest.raises(ConfigError, match="sum to 0.9"):
        PromptSampler(ds, 4, 0, {"a": 0.5, "b": 0.4})
    with pytest.raises(ConfigError, match=r"\['b'\] have rows but no probability"):
        PromptSampler(ds, 4, 0, {"a": 1.0})
    with pytest.raises(ConfigError, match=r"x\.b: must be a number >= 0"):
        PromptSampler(ds, 4, 0, {"a": 1.5, "b": -0.5}, path="x")


@pytest.mark.parametrize("probs", [None, {"a": 0.6, "b": 0.4}])
def test_sampler_is_deterministic_and_resumes_exactly(probs):
    ds = make_dataset({"a": 11, "b": 6})
    first = PromptSampler(ds, 5, seed=3, domain_interleave_probs=probs)
    sequence = [[r.source for r in first.next_batch()] for _ in range(9)]
    again = PromptSampler(ds, 5, seed=3, domain_interleave_probs=probs)
    assert [[r.source for r in again.next_batch()] for _ in range(9)] == sequence
    other_seed = PromptSampler(ds, 5, seed=4, domain_interleave_probs=probs)
    assert [[r.source for r in other_seed.next_batch()] for _ in range(9)] != sequence

    resumed = PromptSampler(ds, 5, seed=3, domain_interleave_probs=probs)
    for _ in range(4):
        resumed.next_batch()
    state = json.loads(json.dumps(resumed.state_dict()))  # survives a JSON round trip
    fresh = PromptSampler(ds, 5, seed=3, domain_interleave_probs=probs)
    fresh.load_state_dict(state)
    assert [[r.source for r in fresh.next_batch()] for _ in range(5)] == sequence[4:]


def test_epochs_cover_every_row_and_reshuffle():
    ds = make_dataset({"a": 12})
    sampler = PromptSampler(ds, 4, seed=0)
    epoch0 = [r.source for _ in range(3) for r in sampler.next_batch()]
    epoch1 = [r.source for _ in range(3) for r in sampler.next_batch()]
    assert sorted(epoch0) == sorted(epoch1) == sorted(r.source for r in ds.rows)
    assert epoch0 != epoch1
    with pytest.raises(ValueError, match="sampler state is for 12 rows"):
        PromptSampler(make_dataset({"a": 13}), 4, 0).load_state_dict(sampler.state_dict())


def test_to_batch_left_pads_prompts():
    rows = [
        PromptRow([5, 6, 7], "t0", "1", "a", "a", "f:1"),
        PromptRow([8], "t1", "2", "b", "b", "f:2"),
    ]
    batch = to_batch(rows, pad_token_id=0, prompt_length=4)
    assert batch["prompts"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert batch["prompt_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert batch["prompts"].dtype == torch.long
    assert batch["ground_truth"].tolist() == ["1", "2"]
    assert batch["tag"].tolist() == ["a", "b"] and batch["domain"].tolist() == ["a", "b"]
    assert batch["prompt_text"].tolist() == ["t0", "t1"]
    with pytest.raises(ValueError, match="f:1 has 3 tokens, more than prompt_length=2"):
        to_batch(rows, 0, 2)


def test_domain_probs_keyed_by_reward_role_cover_its_tags():
    # alibaba/ROLL keys domain_interleave_probs by reward role: math_rule covers both of its tags.
    ds = make_dataset({"deepmath": 6, "aime": 2, "KodCode": 8})
    roles = {"math_rule": ["deepmath", "aime"], "code_sandbox": ["KodCode"]}
    sampler = PromptSampler(ds, 8, 0, {"math_rule": 0.75, "code_sandbox": 0.25}, role_tags=roles)
    tags = Counter(r.tag for _ in range(4) for r in sampler.next_batch())
    assert tags["deepmath"] + tags["aime"] == 24 and tags["KodCode"] == 8
    assert tags["aime"] > 0  # the role's stream draws from both tags' rows
    with pytest.raises(ConfigError, match=r"\['KodCode'\] have rows but no probability") as info:
        PromptSampler(ds, 8, 0, {"math_rule": 1.0}, role_tags=roles)
    assert "routed by rewards.code_sandbox: add code_sandbox: 0" in str(info.value)
    with pytest.raises(ConfigError, match=r"domain_interleave_probs\.math_rule: no prompt rows"):
        PromptSampler(ds, 8, 0, {"math_rule": 0.5, "KodCode": 0.5})  # no role named math_rule
