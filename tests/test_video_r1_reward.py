"""The video_r1 reward (ROLL's VideoR1RewardWorker scoring) on hand-computed cases."""

import pytest

from roll.pipeline.rewards.registry import load_reward_fn
from roll.pipeline.rewards.video_r1 import accuracy, format_score, rouge_f, video_r1_reward, word_error_rate

GOOD = "<think>let me think</think>\n<answer>{}</answer>"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("<answer>B. a cat</answer>", "<answer>B</answer>", 1.0),  # first character
        ("<answer> .C </answer>", "<answer>C</answer>", 1.0),  # outer spaces and dots stripped
        ("<answer>\\boxed{D}</answer>", "<answer>D</answer>", 1.0),  # the last box
        ("<answer>A</answer>", "<answer>B</answer>", 0.0),
        ("B", "<answer>B</answer>", 1.0),  # no answer tag: the whole text
    ],
)
def test_multiple_choice(response, truth, expected):
    assert accuracy(response, truth, "multiple choice") == expected


@pytest.mark.parametrize(
    "out, gt, expected",
    [
        ("3.14159", "3.14", 1.0),  # 2 decimals agree
        ("3.15", "3.14", 0.0),
        ("3.0", "3", 0.0),  # a decimal point on one side only
        ("1,000", "1000", 0.0),  # a comma counts as a decimal mark for that check
        ("1,000", "1,000.0", 1.0),  # both have one: commas dropped, 1000 == 1000
        ("many", "4", 0.0),
    ],
)
def test_numerical(out, gt, expected):
    assert accuracy(f"<answer>{out}</answer>", f"<answer>{gt}</answer>", "numerical") == expected


@pytest.mark.parametrize(
    "ref, hyp, wer",
    [
        ("the cat sat", "the cat sit", 1 / 3),  # one substitution
        ("the cat sat", "the cat sat on mat", 2 / 3),  # two insertions
        ("a b c d", "a x c", 2 / 4),  # a substitution and a deletion
        ("a b", "", 1.0),
        ("", "x", 1.0),  # reference of no words: divided by 1
    ],
)
def test_word_error_rate(ref, hyp, wer):
    assert word_error_rate(ref, hyp) == pytest.approx(wer)


def test_ocr_is_one_minus_wer_clipped():
    assert accuracy("<answer>the cat sit</answer>", "<answer>the cat sat</answer>", "OCR") == pytest.approx(
        2 / 3
    )
    assert accuracy("<answer>x y z w v u</answer>", "<answer>a</answer>", "OCR") == 0.0  # WER 6 -> 0


def test_free_form_rouge():
    # rouge1: overlap 2, P 1, R 2/3 -> 0.8; rouge2: 1 of (the cat, cat sat) -> P 1, R 1/2 -> 2/3;
    # rougeL: LCS 2 -> 0.8; mean 0.7556
    assert rouge_f("the cat sat", "the cat") == pytest.approx((0.8 + 2 / 3 + 0.8) / 3)
    assert rouge_f("The Cat!", "the cat") == pytest.approx(1.0)  # lower case, punctuation dropped
    assert rouge_f("a b", "c d") == 0.0
    # rougeL counts order: "b a" vs "a b": unigrams 1.0, bigrams 0, LCS 1 -> 0.5
    assert accuracy("<answer>b a</answer>", "<answer>a b</answer>", "free-form") == pytest.approx(
        (1 + 0 + 0.5) / 3
    )


@pytest.mark.parametrize(
    "out, expected",
    [("8", 0.8), ("12", 0.8), ("10", 1.0), ("25", 0.0), ("abc", 0.0)],  # 1 - |out - 10| / 10
)
def test_regression(out, expected):
    assert accuracy(f"<answer>{out}</answer>", "<answer>10</answer>", "regression") == pytest.approx(expected)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>x</think> <answer>y</answer>", 1.0),
        ("<think>a\nb</think>\n\n<answer>\nc\n</answer>", 1.0),
        ("so <think>x</think><answer>y</answer>", 0.0),  # text before
        ("<think>x</think><answer>y</answer> done", 0.0),  # text after
        ("<answer>y</answer>", 0.0),
    ],
)
def test_format(response, expected):
    assert format_score(response) == expected


def test_reward_is_accuracy_plus_format_with_the_rows_question_type():
    fn = load_reward_fn("video_r1")
    assert fn is video_r1_reward
    context = {"problem_type": "multiple choice"}
    assert fn(GOOD.format("A"), "<answer>A</answer>", context=context) == 2.0
    assert fn("<answer>A</answer>", "<answer>A</answer>", context=context) == 1.0
    assert fn(GOOD.format("B"), "<answer>A</answer>", context=context) == 1.0
    # the row's type wins over the option; the option serves rows without one
    assert fn(GOOD.format("A B"), "<answer>A</answer>", question_type="OCR", context=context) == 2.0
    assert fn(GOOD.format("A B"), "<answer>A</answer>", question_type="OCR") == 1.0  # WER 1
    assert fn(GOOD.format("7.0"), "<answer>7</answer>", question_type="numerical") == 1.0
    assert fn(GOOD.format("7"), "<answer>7</answer>", question_type="unheard of") == 1.0  # accuracy 0


def test_no_question_type_is_one_error():
    with pytest.raises(ValueError, match="problem_type or reward_kwargs.question_type"):
        video_r1_reward("<answer>A</answer>", "A")
