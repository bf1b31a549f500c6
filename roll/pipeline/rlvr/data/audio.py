"""Audio prompt rows: alibaba/ROLL's audio layout (its Qwen3-Omni ``audio_test_80G.yaml``), and the
audio of a row as the model and vLLM take it.

    {"prompt": "Accurately transcribe the audio into plain text.",   # the question (a string)
     "audios": ["0.wav"],                                            # data_args.audios, under data_args.audio_folder
     "data_source": "the-mc-speech-dataset",                          # the tag
     "reward_model": {"ground_truth": "hello world"}}

``data_args.row_layout: audio_test`` (what ROLL's ``custom_data_kwargs_func:
...audio_test_get_data_kwargs`` maps to) reads these rows as ROLL's reader does: a string prompt
becomes one user message holding the row's audios, then the question in ROLL's template
(``AUDIO_TEST_TEMPLATE``: think in ``<think>``, answer in ``<answer>``); a prompt that is already a
list of messages is kept as it is. Rows of the default layout may hold ``audios`` too: each
``<audio>`` of the prompt (or ``{"type": "audio"}`` part) is one audio, in order; a prompt without
any gets its audios in front of its first user message.

A relative audio path is looked up under ``data_args.audio_folder``, then beside the data file, then
from the working directory. Audio files are wav (``roll.models.audio.read_wav``); they are read once
when the file is loaded (their length decides the prompt's audio tokens) and again, for the rows of
each step, when a batch is built (``roll.pipeline.rlvr.data.audio_files``). A file that cannot be read is one ``ConfigError``
naming the row and the file.
"""

from __future__ import annotations

from typing import Any

from roll.pipeline.rlvr.data.fields import row_files
from roll.pipeline.rlvr.data.vision import REWARD_MODEL, content_text, row_context

# ROLL's audio_test_format_prompt's question template (vlm_dataset_utils.py).
AUDIO_TEST_TEMPLATE = (
    "{Question}  Output the thinking process in <think> </think> and final answer (number) in "
    "<answer> </answer> tags."
)


def row_audios(row: dict[str, Any], field: str) -> list[str] | None:
    """A row's audio file names, None when it has none; ValueError for a field of the wrong shape."""
    return row_files(row, field, "an audio file name")


def read_audio_test_row(
    row: Any, args: Any, default_tag: str
) -> tuple[list[dict[str, str]], str, str, dict[str, Any] | None]:
    """(messages, ground truth, tag, reward context) of a row in ROLL's audio layout (the module
    docstring); ValueError naming the field when it is bad."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    prompt = row.get(args.prompt)
    if isinstance(prompt, list):
        messages = [
            {**m, "content": content_text(m.get("content"))} if isinstance(m, dict) else m for m in prompt
        ]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"wrong type: each {args.prompt!r} item needs string 'role' and 'content'")
    elif isinstance(prompt, str) and prompt.strip():
        audios = row_audios(row, args.audios) or []
        question = AUDIO_TEST_TEMPLATE.format(Question=prompt)
        messages = [{"role": "user", "content": "<audio>" * len(audios) + question}]
    else:
        raise ValueError(f"missing field: {args.prompt!r} must be a non-empty string or a list of messages")
    reward_model = row.get(REWARD_MODEL)
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    truth = row.get(args.ground_truth, truth)
    if truth is None or isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise ValueError(f"missing field: {args.ground_truth!r} (or reward_model.ground_truth)")
    tag = row.get(args.tag, row.get("data_source", default_tag))
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"wrong type: field {args.tag!r} (or data_source) must be a non-empty string")
    return messages, str(truth), tag, row_context(row)
