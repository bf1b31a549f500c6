"""alibaba/ROLL's own RLVR example files (tests/configs/roll_examples/, copied at one commit with only
paths changed) dry-run in roll, or stop at one line that names what roll lacks.

Each file runs from a directory where the hub names it gives (``Qwen/Qwen2.5-7B``) are local model
directories holding the published ``config.json`` (random_checkpoint's presets, so the Megatron
layout and memory checks see the real shapes) and a tokenizer file, and where ``data/`` holds
stand-ins of ROLL's prompt files in ROLL's row format (``messages`` as a JSON string) with the tags
ROLL's files carry. docs/migrating_from_roll.md has the table of these files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll.launch.rlvr import main
from roll.models.random_checkpoint import preset_config

EXAMPLES = Path(__file__).parent / "configs" / "roll_examples"

MODELS = {
    "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "virtuoussy/Qwen2.5-7B-Instruct-RLVR": "qwen2.5-7b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-8B-Base": "qwen3-8b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b",
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2.5-vl-3b",
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2.5-vl-7b",
    "Qwen/Qwen3-VL-4B-Thinking": "qwen3-vl-4b",
    "Qwen/Qwen3-VL-32B-Thinking": "qwen3-vl-32b",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3-vl-30b-a3b",
    "Qwen/Qwen3.5-27B": "qwen3.5-27b",
    "Qwen/Qwen3.5-35B-A3B": "qwen3.5-35b-a3b",
    "Qwen/Qwen3.5-122B-A10B": "qwen3.5-122b-a10b",
    "Qwen/Qwen3.5-397B-A17B": "qwen3.5-397b-a17b",
    "Qwen/Qwen3-Omni-30B-A3B-Thinking": "qwen3-omni-30b-a3b",
}
# ROLL's data files and the tags their rows carry (math_benchmarks: validation rows whose tags no
# reward role lists, which ROLL scores with math_rule).
DATA = {
    "code_KodCode_data.jsonl": ["KodCode"],
    "llm_judge_Multi-subject-RLVR_deal_new.jsonl": ["RLVR"],
    "math_deepmath_deal.jsonl": ["deepmath_103k"],
    "general_ifeval_train_deal.jsonl": ["ifeval"],
    "general_CrossThink-QA_deal.jsonl": ["crossthinkqa"],
    "math_benchmarks.jsonl": ["MATH-500", "aime2024", "aime2025"],
    "aime24_25_deal.jsonl": ["aime2025"],
    # The vision-language file's (Orsta-Data-47k's layout, roll.pipeline.rlvr.data.vision).
    "train_detection_v3det_4000.parquet": ["v3det_train"],
    "train_math_mmmath_3539.parquet": ["mm_math"],
    # The video file's (Video-R1's layout, roll.pipeline.rlvr.data.video): a JSON list of rows.
    "Video-R1-116k-video.json": ["video"],
    "test_math_megabench_237.parquet": ["megabench_math"],
    "test_detection_coco_test_multi_2000.parquet": ["coco_val_multi_test"],
    # The Qwen3-Omni audio file's (ROLL's audio rows: prompt text, audios under audio_folder).
    "mc_speech.jsonl": ["the-mc-speech-dataset"],
}

VIDEO_FILE = "video-rlvr__video_r1.yaml"
# File -> the words of its one-line refusal (what roll lacks); every other file dry-runs.
REFUSED: dict[str, str] = {}


@pytest.fixture(scope="module")
def roll_workdir(tmp_path_factory) -> Path:
    """Model directories at ROLL's hub names and ROLL-format stand-in prompt files under data/."""
    root = tmp_path_factory.mktemp("roll_examples")
    for name, preset in MODELS.items():
        model = root / name
        model.mkdir(parents=True)
        preset_config(preset).to_json_file(model / "config.json")
        (model / "tokenizer.json").write_text("{}")
    (root / "data").mkdir()
    for file_name, tags in DATA.items():
        if file_name.endswith(".parquet"):
            write_vision_rows(root / "data" / file_name, tags)
            continue
        if file_name.endswith(".json"):
            write_video_r1_rows(root / "data" / file_name, tags)
            continue
        if file_name == "mc_speech.jsonl":
            write_audio_rows(root / "data", file_name, tags)
            continue
        rows = [
            {
                "id": str(i),
                "messages": json.dumps([{"role": "user", "content": f"What is {i} + 1?"}]),
                "ground_truth": str(i + 1),
                "tag": tag,
                **({"domain": "math_rule"} if file_name == "math_benchmarks.jsonl" else {}),
            }
            for i, tag in enumerate(tags * 2)
        ]
        (root / "data" / file_name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def write_vision_rows(path: Path, tags: list[str]) -> None:
    """ROLL's vision-language rows (data_source, images as bytes, prompt messages with <image>,
    reward_model) as parquet; without pyarrow, a file that is not parquet (its test then skips)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_text("pyarrow is not installed")
        return
    png = bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c49444154789c63f8cfc0"
        "00000301010018dd8db00000000049454e44ae426082"
    )  # a 1 x 1 PNG
    rows = [
        {
            "data_source": tag,
            "images": [{"bytes": png, "path": f"{i}.png"}],
            "prompt": [{"role": "user", "content": f"<image>What is {i} + 1?"}],
            "reward_model": {
                "ground_truth": f"\\boxed{{{i + 1}}}",
                "accuracy_ratio": 1.0,
                "format_ratio": 0.1,
            },
        }
        for i, tag in enumerate(tags * 2)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_video_r1_rows(path: Path, tags: list[str]) -> None:
    """Video-R1 rows (problem, problem_type, solution, video, modality_type) as one JSON list; the
    dry run reads rows, not videos, so the videos are not written."""
    kinds = ["multiple choice", "numerical", "OCR", "free-form", "regression"]
    rows = [
        {
            "modality_type": tag,
            "problem": f"What is {i} + 1?",
            "solution": f"<answer>{i + 1}</answer>",
            "video": f"videos/{i}.mp4",
            "problem_type": kinds[i % len(kinds)],
        }
        for i, tag in enumerate(tags * 2)
    ]
    path.write_text(json.dumps(rows))


def write_audio_rows(data: Path, file_name: str, tags: list[str]) -> None:
    """ROLL's audio rows (prompt text, ``audios`` file names under the file's ``audio_folder``,
    ability, data_source, reward_model) as JSON lines, and their audio: 0.1 s of 16 kHz mono
    silence each, written with the stdlib ``wave``."""
    import wave

    (data / "audios").mkdir(exist_ok=True)
    rows = []
    for i, tag in enumerate(tags * 2):
        with wave.open(str(data / "audios" / f"{i}.wav"), "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(16000)
            out.writeframes(b"\0\0" * 1600)
        answer = f"word {i}"
        rows.append(
            {
                "prompt": "Accurately transcribe the audio into plain text.",
                "audios": [f"{i}.wav"],
                "ability": "speech_recognition",
                "data_source": tag,
                "reward_model": {"answer": answer, "ground_truth": answer, "accuracy_ratio": 1.0},
            }
        )
    (data / file_name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_every_copied_file_is_listed():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert len(names) == 51 and set(REFUSED) <= names


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_roll_example_dry_runs_or_names_what_roll_lacks(name, roll_workdir, monkeypatch, capsys):
    if (
        name.startswith(
            ("qwen2_5-vl", "qwen2.5-vl", "qwen3.5-27B", "qwen3.5-35BA3", "qwen3-vl", "qwen3-omni__rlvr")
        )
        and "video" not in name
    ):
        pytest.importorskip("pyarrow")  # its data files are parquet
    monkeypatch.chdir(roll_workdir)
    code = main(["--config_path", str(EXAMPLES), "--config_name", name, "--dry_run"])
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("ConfigError")]
    if name in REFUSED:
        assert code == 2 and len(errors) == 1, out.err
        assert REFUSED[name] in errors[0], errors[0]
    else:
        assert code == 0, out.err
        assert "actor_infer" in out.out and not errors
    if name == "qwen3-30BA3B-rlvr_fsdp2__rlvr_config_ep.yaml":  # ROLL's fsdp2 expert parallelism
        assert "EP=8 DP=8 SP=4 (Ulysses)" in out.out and "EP=8 DP=16 SP=2 (Ulysses)" in out.out, out.out


def test_megatron_infer_rollouts_of_qwen3_next_are_refused_before_launch(roll_workdir, monkeypatch, capsys):
    """kv_generate's cache has no place for Gated DeltaNet's recurrent state: the dry run says so."""
    monkeypatch.chdir(roll_workdir)
    name = "qwen3-next-80BA3B-rlvr_megatron__rlvr_config.yaml"
    infer = "actor_infer.strategy_args"
    overrides = [f"{infer}.strategy_name=megatron_infer", f"{infer}.strategy_config={{}}"]
    code = main(["--config_path", str(EXAMPLES), "--config_name", name, "--dry_run", *overrides])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err[-1].startswith(
        "ConfigError: actor_infer.strategy_args.strategy_name: megatron_infer cannot generate with "
        "model_type 'qwen3_next'"
    ), err[-5:]


def test_qwen3_5_397b_plans_its_layout_context_parallelism_and_engines_across_nodes(
    roll_workdir, monkeypatch, capsys
):
    """ROLL's Qwen3.5-397B-A17B file, as it is: context_parallel_size 4 (actor_train) and 2
    (reference) over the Gated DeltaNet layers' 16 key heads at TP 1, its pipeline layout, and vLLM
    engines at TP 16 on 8-device nodes (distributed_executor_backend: ray, each on two whole nodes)."""
    name = "qwen3.5-397A17-rlvr_megatron__rlvr_megatron_80GB.yaml"
    monkeypatch.chdir(roll_workdir)
    code = main(["--config_path", str(EXAMPLES), "--config_name", name, "--dry_run"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "CP=4" in out.out and "CP=2" in out.out, out.out


VL_FILE = "qwen2_5-vl-3B-rlvr_fsdp2__rlvr_fsdp2_offload.yaml"


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["reference.model_args.freeze_module_prefix=model.visual"],
            "ConfigError: reference.model_args.freeze_module_prefix: is applied by fsdp2_train and megatron_train "
            "trainers only (strategy 'hf_infer' here); remove it",
        ),
        (
            [
                "actor_infer.strategy_args.strategy_name=megatron_infer",
                "actor_infer.strategy_args.strategy_config={}",
            ],
            "ConfigError: actor_infer.strategy_args.strategy_name: megatron_infer cannot generate with model_type "
            "'qwen2_5_vl' (its KV-cached loop takes no images; generate with vllm",
        ),
        (
            ["actor_train.strategy_args.strategy_config.sequence_packing=true"],
            "ConfigError: actor_train.strategy_args.strategy_config.sequence_packing: true does not run with a "
            "vision-language model",
        ),
        (
            ["actor_train.model_args.lora_rank=8", "actor_train.model_args.lora_target=q_proj"],
            "ConfigError: actor_train.model_args.lora_rank: 8: roll has not run LoRA adapters on a vision-language model",
        ),
        (
            ["rollout_dump.mode=dump", "rollout_dump.dir=dumps"],
            "ConfigError: rollout_dump.mode: 'dump' does not write or read vision-language rollouts",
        ),
        (
            ["pretrain=zai-org/GLM-4.1V"],
            "ConfigError: actor_train.model_args.model_name_or_path: vision-language model_type 'glm4v': "
            "roll's vision-language RLVR runs qwen2_5_vl, qwen3_vl",
        ),
    ],
)
def test_vision_language_layouts_roll_has_not_run_are_refused_before_launch(
    overrides, line, roll_workdir, monkeypatch, capsys
):
    """Vision-language layouts roll has not run (megatron_infer rollouts, packing, Qwen3-VL, ...) stop
    on one line naming the key."""
    pytest.importorskip("pyarrow")
    monkeypatch.chdir(roll_workdir)
    glm = roll_workdir / "zai-org/GLM-4.1V"
    if not glm.exists():
        glm.mkdir(parents=True)
        config = json.loads((roll_workdir / "Qwen/Qwen2.5-VL-3B-Instruct/config.json").read_text())
        (glm / "config.json").write_text(json.dumps({**config, "model_type": "glm4v"}))
        (glm / "tokenizer.json").write_text("{}")
    code = main(["--config_path", str(EXAMPLES), "--config_name", VL_FILE, "--dry_run", *overrides])
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("ConfigError")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(line), errors


def test_qwen3_vl_video_rows_dry_run_on_fsdp2(roll_workdir, monkeypatch, capsys):
    """Qwen3-VL's video rows (each frame's time in the prompt, roll.models.video_prompt) dry-run on
    fsdp2_train / hf_infer as on Megatron (the parametrized test above runs ROLL's file as it is)."""
    monkeypatch.chdir(roll_workdir)
    overrides = [
        "track_with=tensorboard",
        "pretrain=Qwen/Qwen3-VL-4B-Thinking",
        "actor_train.strategy_args={strategy_name: fsdp2_train}",
        "reference.strategy_args={strategy_name: hf_infer}",
        "actor_train.training_args.gradient_accumulation_steps=2",
    ]
    code = main(["--config_path", str(EXAMPLES), "--config_name", VIDEO_FILE, "--dry_run", *overrides])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "actor_train            fsdp2_train" in out.out


def test_sglang_rollouts_dry_run_for_qwen2_5_vl_and_stop_for_qwen3_5(roll_workdir, monkeypatch, capsys):
    """SGLang takes Qwen2.5-VL's rows with their pixel inputs (sglang_vision); a vision-language
    model type it has not run (StrategySpec.vision_model_types) stops on one line naming the key."""
    pytest.importorskip("pyarrow")
    monkeypatch.chdir(roll_workdir)
    sglang = [
        "actor_infer.strategy_args={strategy_name: sglang, strategy_config: {mem_fraction_static: 0.6}}"
    ]
    code = main(["--config_path", str(EXAMPLES), "--config_name", VL_FILE, "--dry_run", *sglang])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "actor_infer            sglang" in out.out
    name = "qwen3.5-27B-rlvr_megatron__rlvr_megatron_80GB.yaml"
    code = main(["--config_path", str(EXAMPLES), "--config_name", name, "--dry_run", *sglang])
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("ConfigError")]
    assert code == 2 and errors == [
        "ConfigError: actor_infer.strategy_args.strategy_name: sglang runs vision-language model_type "
        "qwen2_5_vl, qwen3_vl, qwen3_vl_moe in roll, not 'qwen3_5'; use one of hf_infer, megatron_infer, vllm"
    ], errors


def test_video_r1_dry_runs_on_megatron_and_on_fsdp2(roll_workdir, monkeypatch, capsys):
    """ROLL's video file: ``ml_tracker`` -> tensorboard, VideoR1RewardWorker and its Video-R1 row reader
    map, and its Megatron trainer and reference (TP 2 + SP x CP 2, video rows on packed rows)
    dry-run with its vllm rollouts; with fsdp2_train / hf_infer it dry-runs too (gradient
    accumulation 2: ROLL's 8 on Megatron's DP 4 is 2 on fsdp2's DP 16)."""
    monkeypatch.chdir(roll_workdir)
    args = ["--config_path", str(EXAMPLES), "--config_name", VIDEO_FILE, "--dry_run"]
    code = main(args)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "track_with: 'ml_tracker' (ROLL's internal tracker) -> 'tensorboard'" in out.err
    assert "megatron_train" in out.out and "CP=2" in out.out, out.out
    overrides = [
        "actor_train.strategy_args={strategy_name: fsdp2_train}",
        "reference.strategy_args={strategy_name: hf_infer}",
        "actor_train.training_args.gradient_accumulation_steps=2",
    ]
    code = main(args + overrides)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "rewards.videor1.worker_cls VideoR1RewardWorker -> reward_fn: video_r1" in out.err
    assert (
        "actor_train.data_args.custom_data_kwargs_func video_r1_get_data_kwargs -> row_layout: video_r1"
        in out.err
    )
    assert "actor_infer            vllm" in out.out and "fsdp2_train        16" in out.out


def test_video_r1_dry_runs_with_sglang_rollouts(roll_workdir, monkeypatch, capsys):
    """ROLL's video file with its Qwen2.5-VL rollouts on SGLang instead of vLLM: no warning (roll's
    SGLang schedulers attend within each temporal patch, ``sglang_frames``)."""
    monkeypatch.chdir(roll_workdir)
    args = ["--config_path", str(EXAMPLES), "--config_name", VIDEO_FILE, "--dry_run"]
    assert main(args + ["actor_infer.strategy_args={strategy_name: sglang, strategy_config: {}}"]) == 0
    out = capsys.readouterr()
    assert "actor_infer            sglang" in out.out and "WARNING" not in out.err


def test_video_r1_stops_on_a_megatron_family_without_packed_rows_or_videos(roll_workdir, monkeypatch, capsys):
    """A vision-language family whose Megatron forward takes padded rows with images only (as
    Qwen2.5-VL's did) stops ROLL's video file on context parallelism, then (CP 1) on its video rows."""
    import dataclasses

    from roll.models.megatron import families

    family = dataclasses.replace(families.VISION_FAMILIES["qwen2_5_vl"], packed_vision=False, videos=False)
    monkeypatch.setitem(families.VISION_FAMILIES, "qwen2_5_vl", family)
    monkeypatch.chdir(roll_workdir)
    args = ["--config_path", str(EXAMPLES), "--config_name", VIDEO_FILE, "--dry_run"]
    assert main(args) == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("ConfigError")]
    assert len(errors) == 1 and errors[0].startswith(
        "ConfigError: actor_train.strategy_args.strategy_config.context_parallel_size: 2 does not run with "
        "qwen2_5_vl on Megatron"
    ), errors
    cp1 = [
        f"{role}.strategy_args.strategy_config.context_parallel_size=1"
        for role in ("actor_train", "reference")
    ]
    cp1.append("actor_train.training_args.gradient_accumulation_steps=4")  # DP 8 at CP 1: still 64 samples
    assert main(args + cp1) == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("ConfigError")]
    assert errors == [
        "ConfigError: actor_train.strategy_args.strategy_name: megatron_train does not run video rows with "
        "qwen2_5_vl in roll (its forward takes images only; data_args.row_layout: video_r1 reads videos); use "
        "fsdp2_train (reference: hf_infer) with vllm rollouts"
    ]


OMNI_AUDIO_FILE = "qwen3-omni__audio_test_80G.yaml"


def test_qwen3_omni_audio_rows_dry_run_and_fsdp2_is_refused(roll_workdir, monkeypatch, capsys):
    """ROLL's audio file: its row reader maps to ``row_layout: audio_test`` (audios under
    ``audio_folder``) and it dry-runs on megatron_train / megatron_infer / vllm; fsdp2_train does not
    load Qwen3-Omni's thinker: one ConfigError naming strategy_name and megatron_train."""
    monkeypatch.chdir(roll_workdir)
    args = ["--config_path", str(EXAMPLES), "--config_name", OMNI_AUDIO_FILE, "--dry_run"]
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert "audio_test_get_data_kwargs -> row_layout: audio_test" in out.out + out.err
    fsdp2 = [
        "actor_train.strategy_args={strategy_name: fsdp2_train, strategy_config: {}}",
        "actor_train.model_args.freeze_module_prefix=null",
    ]
    assert main([*args, *fsdp2]) == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("ConfigError")]
    assert errors == [
        "ConfigError: actor_train.strategy_args.strategy_name: fsdp2_train runs vision-language model_type "
        "qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe in roll, not 'qwen3_omni_moe'; use one of "
        "megatron_train"
    ], errors
    # Training the audio tower is not run: megatron_train with it trainable is refused before launch.
    assert main([*args, "actor_train.model_args.freeze_module_prefix=vision_model"]) == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("ConfigError")]
    assert len(errors) == 1 and errors[0].startswith(
        "ConfigError: actor_train.model_args.freeze_module_prefix: ['vision_model'] leaves Qwen3-Omni's audio "
        "tower trainable"
    ), errors
