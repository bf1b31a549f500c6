"""``pipeline_model_parallel_layout`` at config load and against the model: roll's parser agrees with
megatron-core's, every bad input is one ConfigError naming the key, the virtual pipeline size is
derived from the layout, and the per-rank layer counts the planner and the Qwen3-VL check read are
megatron's placement. Pure checks (megatron-core only for the parser comparison)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers

sys.path.insert(0, str(Path(__file__).parent.parent))

from tiny_qwen3_vl import tiny_qwen3_vl_config  # noqa: E402
from tiny_vl import build_tiny_vl_tokenizer  # noqa: E402

from roll.configs.build import build_dataclass  # noqa: E402
from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.pipeline_layout import PipelineLayout  # noqa: E402
from roll.configs.strategy_configs import MegatronConfig  # noqa: E402
from roll.models.megatron import model_fit  # noqa: E402

PATH = "actor_train.strategy_args.strategy_config"
KEY = f"{PATH}.pipeline_model_parallel_layout"
ROLL_397A17 = "E|(tt|)*30,L"
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200}


def load(layout: str, pp: int = 2, **kwargs) -> MegatronConfig:
    data = {"pipeline_model_parallel_size": pp, "pipeline_model_parallel_layout": layout, **kwargs}
    return build_dataclass(MegatronConfig, data, PATH)


@pytest.mark.parametrize("text", [ROLL_397A17, "Ettt|(tt|)*29,m|L", "E|t*3|tt,|L", "Et|tttL", "E(t|)*2,tL"])
def test_parser_agrees_with_megatron(text: str) -> None:
    layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    chars = {"embedding": "E", "decoder": "t", "loss": "L", "mtp": "m"}
    theirs = layout_module.PipelineParallelLayerLayout.parse_str_to_list(text)
    assert PipelineLayout.parse(text).stages == tuple("".join(chars[t.name] for t in s) for s in theirs)


@pytest.mark.parametrize(
    "layout, kwargs, words",
    [
        ("E|tt|tX|L", {}, "unknown layer character(s) ['X']"),
        ("t|Et|tt|L", {}, "must open its first stage with the one embedding E"),
        ("EE|tt|tt|L", {}, "must open its first stage with the one embedding E"),
        ("E|tt|tt|t", {}, "must close its last stage with the one loss L"),
        ("E|tt|L|L", {}, "must close its last stage with the one loss L"),
        ("E|tt|ttL|", {}, "must close its last stage with the one loss L"),
        ("|Ett|tt|L", {}, "must open its first stage with the one embedding E"),
        ("Et|tt|tL", {}, "3 stages are not a multiple of pipeline_model_parallel_size 2"),
        ("E|tt|tt|mL", {}, "no multi-token-prediction layers"),
        ("E(t)*999999999|L", {}, "unrolls past"),
        ("Et|tttL", {"pp": 1}, "needs pipeline_model_parallel_size > 1"),
        ("E|tt|tt|L", {"virtual_pipeline_model_parallel_size": 4}, "make virtual pipeline size 2"),
        ("E|tt|tt|L", {"num_layers_in_first_pipeline_stage": 1}, "remove num_layers_in_first_pipeline_stage"),
        ("E|tt|tt|L", {"num_layers_in_last_pipeline_stage": 1}, "remove num_layers_in_last_pipeline_stage"),
        ("E|tt|tt|L", {"account_for_embedding_in_pipeline_split": True}, "remove account_for_embedding"),
        ("E|tt|tt|L", {"account_for_loss_in_pipeline_split": True}, "remove account_for_loss"),
    ],
)
def test_bad_layout_is_one_error_naming_the_key(layout: str, kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(layout, **kwargs)
    assert info.value.path == KEY
    assert words in info.value.message


@pytest.mark.parametrize(
    "layout, pp, given, vpp",
    [
        (ROLL_397A17, 16, None, 2),
        (ROLL_397A17, 8, None, 4),
        (ROLL_397A17, 8, 4, 4),
        ("Et|tttL", 2, None, None),
    ],
)
def test_virtual_pipeline_size_comes_from_the_layout(layout: str, pp: int, given, vpp) -> None:
    kwargs = {} if given is None else {"virtual_pipeline_model_parallel_size": given}
    cfg = load(layout, pp, **kwargs)
    assert cfg.virtual_pipeline_model_parallel_size == vpp
    cfg.validate(pp, PATH)  # the device checks see the derived size
    assert cfg.parallel_sizes(pp).vpp == (vpp or 1)


def test_rank_layers_of_the_roll_file() -> None:
    cfg = load(ROLL_397A17, 16)
    layers = cfg.pipeline_rank_layers(60)
    assert layers[0] == [0, 2] and layers[-1] == [2, 0] and all(r == [2, 2] for r in layers[1:-1])


@pytest.mark.parametrize(
    "kwargs, num_layers, layers",
    [
        ({"pipeline_model_parallel_size": 2}, 8, [[4], [4]]),
        ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, 8, [[2, 2], [2, 2]]),
        (
            {"pipeline_model_parallel_size": 4, "num_layers_in_first_pipeline_stage": 1},
            7,
            [[1], [2], [2], [2]],
        ),
        ({"pipeline_model_parallel_size": 3, "num_layers_in_last_pipeline_stage": 4}, 8, [[2], [2], [4]]),
        (
            {
                "pipeline_model_parallel_size": 2,
                "account_for_embedding_in_pipeline_split": True,
                "account_for_loss_in_pipeline_split": True,
            },
            6,
            [[3], [3]],  # (6 + 2) / 2 = 4 per stage, less the embedding / the loss
        ),
    ],
)
def test_rank_layers_without_a_layout(kwargs: dict, num_layers: int, layers: list) -> None:
    assert MegatronConfig(**kwargs).pipeline_rank_layers(num_layers) == layers


def test_model_check_counts_the_layouts_decoder_layers() -> None:
    hf = transformers.Qwen2Config(**TINY, intermediate_size=128, num_hidden_layers=4)
    model_fit.check_model_fits(hf, load("E|tt|tt|L"), PATH)
    with pytest.raises(ConfigError) as info:
        model_fit.check_model_fits(hf, load("E|ttt|tt|L"), PATH)
    assert info.value.path == KEY and "places 5 decoder layers (t), the model has 4" in info.value.message


def test_qwen3_vl_deepstack_layers_need_a_first_chunk_that_holds_them() -> None:
    hf = tiny_qwen3_vl_config(build_tiny_vl_tokenizer())  # 4 layers, deepstack after layers 0 and 1
    with pytest.raises(ConfigError) as info:
        model_fit.check_model_fits(hf, load("E|tt|tt|L"), PATH)
    assert (
        info.value.path == KEY and "puts 0 decoder layers in the first pipeline chunk" in info.value.message
    )
    model_fit.check_model_fits(hf, load("Ett|t|t|L"), PATH)


def test_converter_takes_the_layout_and_names_its_flag(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from roll.models.megatron import convert

    transformers.Qwen2Config(**TINY, intermediate_size=128, num_hidden_layers=4).save_pretrained(tmp_path)
    cfg = convert.layout_config(1, 2, 1, layout="E|tt|tt|L")
    assert cfg.virtual_pipeline_model_parallel_size == 2 and convert.world_size(cfg) == 2
    convert.check_layout(tmp_path, cfg)
    again = convert.layout_config(**{k: getattr(cfg, v) for k, v in convert.LAYOUT_KEYS.items()})
    assert again == cfg  # the manifest's layout reads back
    for bad, words in (("E|ttt|tt|L", "places 5 decoder layers"), ("E|tt|tt", "close its last stage")):
        with pytest.raises(ConfigError) as info:
            convert.check_layout(tmp_path, convert.layout_config(1, 2, 1, layout=bad))
        assert info.value.path == "--layout" and words in info.value.message
