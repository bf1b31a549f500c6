"""roll/distributed/strategy/vllm_omni_positions.py on CPU (no vLLM): the probe's expected positions
are transformers' thinker's (get_rope_index on the tiny Qwen3-Omni), and the fix turns a model that
reads offsets as vLLM 0.24 does (an item's offset taken for its start token's) into one that matches,
leaves a right one alone and refuses what it cannot mend. The real vLLM class is checked on a GPU:
tests/test_vllm_qwen3_omni_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_qwen3_omni import build_tiny_omni_tokenizer, tiny_qwen3_omni_config  # noqa: E402

from roll.distributed.strategy import vllm_omni_positions as omni  # noqa: E402


def test_probe_positions_are_transformers_thinkers() -> None:
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    tok = build_tiny_omni_tokenizer()
    config = tiny_qwen3_omni_config(tok).thinker_config
    text = tok("hi", add_special_tokens=False)["input_ids"][:1]
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    prompt = text + [ids[0]] + [ids[1]] * 4 + [ids[2]] + text
    assert len(prompt) == omni.PROBE_LENGTH and prompt.index(ids[1]) == omni.PROBE_PAD_OFFSET
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration(config)
    input_ids = torch.tensor([prompt])
    positions, _ = thinker.model.get_rope_index(
        input_ids, torch.tensor([omni.PROBE_GRID]), None, torch.ones_like(input_ids)
    )
    assert positions[:, 0].long().tolist() == omni.PROBE_POSITIONS


class StartTokenOffsets:
    """A stand-in for vLLM 0.24's method: each item's offset taken as its start token's (one text
    run, then start, grid, end, as ``get_mrope_input_positions`` there lays them)."""

    def iter_mm_features(self, mm_features):
        for f in mm_features:
            t, h, w = f.data["image_grid_thw"].data.tolist()
            yield f.mm_position.offset, "image", (t, h // 2, w // 2)

    def get_mrope_input_positions(self, input_tokens, mm_features):
        rows, st, nxt = [[], [], []], 0, 0
        for offset, _, (t, h, w) in self.iter_mm_features(mm_features):
            for i in range(offset - st + 1):  # the text, then the start token
                [r.append(nxt + i) for r in rows]
            base = nxt + offset - st + 1
            grid = [(a, b, c) for a in range(t) for b in range(h) for c in range(w)]
            for a, b, c in grid:
                rows[0].append(base + a), rows[1].append(base + b), rows[2].append(base + c)
            end = max(max(r[-len(grid) :]) for r in rows) + 1
            [r.append(end) for r in rows]
            st, nxt = offset + 1 + len(grid) + 1, end + 1
        for i in range(len(input_tokens) - st):
            [r.append(nxt + i) for r in rows]
        return torch.tensor(rows), 0


def model_class(base: type) -> type:
    return type("Qwen3OmniMoeThinkerForConditionalGeneration", (base,), {})


def test_fix_turns_start_token_offsets_into_transformers_positions() -> None:
    cls = model_class(StartTokenOffsets)
    model = cls()
    assert omni.probe_positions(model) != omni.PROBE_POSITIONS  # the shifted image, as on vLLM 0.24
    assert omni.fix_qwen3_omni_positions(model) == "fixed"
    assert omni.probe_positions(model) == omni.PROBE_POSITIONS
    assert omni.fix_qwen3_omni_positions(cls()) == "correct"  # once is enough, for every instance


def test_fix_leaves_right_models_and_others_alone_and_refuses_what_it_cannot_mend() -> None:
    class Right(StartTokenOffsets):
        def iter_mm_features(self, mm_features):
            for offset, modality, grid in super().iter_mm_features(mm_features):
                yield offset - 1, modality, grid

    assert omni.fix_qwen3_omni_positions(model_class(Right)()) == "correct"
    assert omni.fix_qwen3_omni_positions(StartTokenOffsets()) == "not qwen3-omni"

    class Wrong(StartTokenOffsets):
        def get_mrope_input_positions(self, input_tokens, mm_features):
            return torch.zeros(3, len(input_tokens), dtype=torch.long), 0

    with pytest.raises(RuntimeError, match="transformers' is"):
        omni.fix_qwen3_omni_positions(model_class(Wrong)())
