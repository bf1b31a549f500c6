"""The llm_judge model reward: prompt building, verdict parsing, and a run through hf_infer."""

from __future__ import annotations

import pytest
import torch

from roll.configs.errors import ConfigError
from roll.configs.role import GeneratingArgs, ModelArgs, RewardConfig, StrategyArgs
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.generation import build_generation_batch, prompt_token_lists
from roll.pipeline.rewards.llm_judge import (
    DEFAULT_JUDGE_PROMPT,
    build_judge_prompt,
    check_judge_prompt,
    encode_judge_prompt,
    judge,
    judge_options,
    parse_judge_score,
)
from roll.pipeline.rewards.registry import load_reward_fn
from tests.tiny_models import PAD_ID, build_tiny_model_dir, build_tiny_tokenizer

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "text, scale, want",
    [
        ("[[yes]]", 10, 1.0),
        ("The answer is wrong. [[No]]", 10, 0.0),
        ("Rating: [[7]]", 10, 0.7),
        ("[[12]]", 10, 1.0),
        ("[[-3]]", 10, 0.0),
        ("[[8/10]]", 10, 0.8),
        ("[[0.5]]", 1, 0.5),
        ("[[no]] ... on reflection [[yes]]", 10, 1.0),  # the last verdict counts
        ("I'd give it 3 / 4.", 10, 0.75),
        ("Yes, that matches.", 10, 1.0),
        ("Incorrect: the reference says 4.", 10, 0.0),
        ("It is hard to say.", 10, None),
        ("[[maybe]]", 10, None),
        ("", 10, None),
        ("[[3/0]]", 10, None),
    ],
)
def test_parse_judge_score(text, scale, want):
    assert parse_judge_score(text, scale) == (pytest.approx(want) if want is not None else None)


def test_judge_prompt_template_checks():
    check_judge_prompt(DEFAULT_JUDGE_PROMPT)
    check_judge_prompt("Q {question} A {response} {{literal}}")
    with pytest.raises(ConfigError, match=r"unknown placeholder \{answer\}"):
        check_judge_prompt("Q {question} A {answer}")
    with pytest.raises(ConfigError, match="not a valid template"):
        check_judge_prompt("Q {question")
    text = build_judge_prompt("Q:{question}|A:{response}|R:{reference}", "1+1?", "2 {x}", "2")
    assert text == "Q:1+1?|A:2 {x}|R:2"  # braces inside values are left alone
    assert judge_options({"score_scale": 5})["score_scale"] == 5
    with pytest.raises(ConfigError, match="reward_kwargs.tempreature"):
        judge_options({"tempreature": 0.0})


class FakeJudgeStrategy:
    """Answers each judge prompt with a canned verdict chosen from the prompt's text."""

    def __init__(self, tokenizer, verdicts: dict[str, str]):
        self.tokenizer = tokenizer
        self.verdicts = verdicts
        self.calls: list[tuple[Batch, SamplingParams]] = []

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        self.calls.append((batch, params))
        texts = [self.tokenizer.decode(ids) for ids in prompt_token_lists(batch)]
        answers = [next(v for key, v in self.verdicts.items() if key in t) for t in texts]
        responses = [
            self.tokenizer(a, add_special_tokens=False)["input_ids"][: params.max_new_tokens] for a in answers
        ]
        return build_generation_batch(
            batch, responses, None, 1, self.tokenizer.pad_token_id, params.max_new_tokens
        )


def judge_role(template=None, **kwargs) -> RewardConfig:
    return RewardConfig(
        reward_fn="llm_judge",
        judge_prompt=template,
        reward_kwargs=kwargs,
        generating_args=GeneratingArgs(max_new_tokens=24, temperature=0.9, num_return_sequences=4),
        model_args=ModelArgs(model_name_or_path="/unused"),
        strategy_args=StrategyArgs(strategy_name="hf_infer"),
    )


def test_llm_judge_reward_with_a_fake_strategy():
    tok = build_tiny_tokenizer()
    strategy = FakeJudgeStrategy(tok, {"Q=one": "[[yes]]", "Q=two": "[[3]]", "Q=three": "hard to say"})
    batch = Batch.from_dict(
        non_tensors={
            "prompt_text": ["Q=one", "Q=two", "Q=three"],
            "response_text": ["1", "22", "333"],
            "ground_truth": ["1", "2", "3"],
        }
    )
    template = "{question} | {response} | {reference} -> verdict:"
    scores = load_reward_fn("llm_judge")(
        strategy, batch, judge_role(template, unparsed_score=0.25, score_scale=4)
    )
    assert scores == [1.0, 0.75, 0.25]
    sent, params = strategy.calls[0]
    # greedy, one sample, no log-probs, the judge role's max_new_tokens
    assert (params.n, params.temperature, params.logprobs, params.max_new_tokens) == (1, 0.0, False, 24)
    prompts = [tok.decode(ids) for ids in prompt_token_lists(sent)]
    assert prompts == [
        "Q=one | 1 | 1 -> verdict:",
        "Q=two | 22 | 2 -> verdict:",
        "Q=three | 333 | 3 -> verdict:",
    ]
    assert (sent["prompts"][:, 0] == PAD_ID).sum() == 2  # left-padded to the longest prompt
    assert load_reward_fn("llm_judge")(strategy, batch.index(slice(0, 0)), judge_role()) == []


def test_long_responses_are_cut_to_the_prompt_budget():
    tok = build_tiny_tokenizer()
    ids = encode_judge_prompt(
        tok, "Q:{question} R:{reference} A:{response} ?", "why", "x" * 500, "because", 60, False
    )
    text = tok.decode(ids)
    assert len(ids) <= 60 and text.startswith("Q:why R:because A:x") and text.endswith(" ... ?")
    short = encode_judge_prompt(tok, "{question}{response}{reference}", "a", "b", "c", 60, False)
    assert tok.decode(short) == "abc"


def test_chat_template_wraps_the_judge_prompt():
    tok = build_tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    ids = encode_judge_prompt(tok, "{question}{response}{reference}", "a", "b", "c", 100, True)
    assert tok.decode(ids) == "<user>abc</user><assistant>"
    plain = encode_judge_prompt(tok, "{question}{response}{reference}", "a", "b", "c", 100, False)
    assert tok.decode(plain) == "abc"


def test_llm_judge_through_hf_infer(tmp_path):
    """The real path on a tiny random model: prompts built, greedy generation, verdicts parsed."""
    from roll.distributed.strategy.hf_strategy import HFInferStrategy

    path = build_tiny_model_dir(tmp_path / "judge")
    role = judge_role(unparsed_score=0.5)
    role.model_args = ModelArgs(model_name_or_path=str(path), dtype="fp32")
    role.generating_args = GeneratingArgs(max_new_tokens=6)
    ctx = WorkerContext(role="rewards.judge", rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    strategy = HFInferStrategy(role, ctx)
    strategy.initialize()
    batch = Batch.from_dict(
        non_tensors={"prompt_text": ["2+2?", "3+3?"], "response_text": ["4", "7"], "ground_truth": ["4", "6"]}
    )
    scores = load_reward_fn("llm_judge")(strategy, batch, role)
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
    verdicts = judge(
        strategy,
        strategy.tokenizer,
        ["2+2?", "3+3?"],
        ["4", "7"],
        ["4", "6"],
        params=SamplingParams(max_new_tokens=6),
        unparsed_score=0.5,
    )
    assert [v.score for v in verdicts] == scores  # greedy: the same verdicts every time
    for v in verdicts:
        parsed = parse_judge_score(v.text)
        assert v.parsed == (parsed is not None) and v.score == (0.5 if parsed is None else parsed)
