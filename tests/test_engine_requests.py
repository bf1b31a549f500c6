"""Engine-neutral request handling of the vllm/sglang strategies (no engine needed)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from roll.configs.errors import ConfigError
from roll.configs.role import GeneratingArgs, ModelArgs, RoleConfig, StrategyArgs
from roll.configs.strategy_configs import SGLangConfig, VLLMConfig
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.distributed.strategy.engine_options import (
    sglang_engine_options,
    vllm_engine_options,
)
from roll.distributed.strategy.engine_requests import (
    Completion,
    CompletionCollector,
    RequestPlan,
    RequestRegistry,
    aborted_completion,
    completion_from_sglang,
    completions_from_vllm,
    completions_to_batch,
    rows_to_tensor,
    scoring_requests,
    sglang_generate_requests,
    sglang_input_logprobs,
    vllm_generate_requests,
    vllm_prompt_logprobs,
)
from roll.distributed.strategy.engine_sampling import sglang_sampling_params, vllm_sampling_kwargs

torch.set_num_threads(1)
PAD = 0


def prompt_batch(rows: list[list[int]], width: int = 5) -> Batch:
    """Left-padded prompts with one non-tensor field."""
    prompts = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        prompts[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    tags = [f"t{i}" for i in range(len(rows))]
    return Batch.from_dict({"prompts": prompts, "prompt_mask": mask}, {"tag": tags})


# ------------------------------------------------------------------------------ sampling params


def test_vllm_sampling_kwargs_full_mapping():
    params = SamplingParams(
        n=4,
        max_new_tokens=32,
        min_new_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        repetition_penalty=1.1,
        stop=["</a>"],
        stop_token_ids=[7],
        seed=10,
    )
    assert vllm_sampling_kwargs(params, seed_offset=8) == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 32,
        "repetition_penalty": 1.1,
        "logprobs": 0,
        "detokenize": True,
        "top_k": 50,
        "min_tokens": 2,
        "stop": ["</a>"],
        "stop_token_ids": [7],
        "seed": 18,
    }


def test_vllm_sampling_kwargs_defaults_leave_engine_defaults():
    kwargs = vllm_sampling_kwargs(SamplingParams(n=2, max_new_tokens=8, logprobs=False), n=1)
    assert kwargs == {
        "n": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": 8,
        "repetition_penalty": 1.0,
        "logprobs": None,
        "detokenize": False,
    }
    # top_k off (-1 or 0) is left to the engine: its "off" value changed between vLLM releases.
    assert "top_k" not in vllm_sampling_kwargs(SamplingParams(top_k=0))


def test_vllm_generate_requests_one_per_row_seeded_apart():
    params = SamplingParams(n=4, max_new_tokens=8, seed=100, ignore_eos=True)
    reqs = vllm_generate_requests(RequestPlan("p", 2, 4, per_sample=False), [[5, 6], [7]], params)
    assert [(r.request_id, r.prompt_ids) for r in reqs] == [("p-0", [5, 6]), ("p-1", [7])]
    assert [(r.sampling["n"], r.sampling["seed"]) for r in reqs] == [(4, 100), (4, 104)]
    assert all(r.sampling["logprobs"] == 0 and r.sampling["ignore_eos"] for r in reqs)


def test_vllm_generate_requests_per_sample():
    params = SamplingParams(n=2, max_new_tokens=8, seed=0)
    reqs = vllm_generate_requests(RequestPlan("q", 2, 2, per_sample=True), [[5], [6]], params)
    assert [r.request_id for r in reqs] == ["q-0-0", "q-0-1", "q-1-0", "q-1-1"]
    assert [r.prompt_ids for r in reqs] == [[5], [5], [6], [6]]
    assert [(r.sampling["n"], r.sampling["seed"]) for r in reqs] == [(1, 0), (1, 1), (1, 2), (1, 3)]


def test_sglang_generate_requests_one_per_sample_within_the_context():
    params = SamplingParams(n=2, max_new_tokens=8, seed=10)
    plan = RequestPlan("s", 2, 2, per_sample=True)
    reqs = sglang_generate_requests(plan, [[1, 2, 3], [4]], params, context_len=8)
    assert [r.request_id for r in reqs] == ["s-0-0", "s-0-1", "s-1-0", "s-1-1"]
    assert [r.prompt_ids for r in reqs] == [[1, 2, 3], [1, 2, 3], [4], [4]]
    assert [r.sampling["sampling_seed"] for r in reqs] == [10, 11, 12, 13]
    assert [r.sampling["max_new_tokens"] for r in reqs] == [5, 5, 7, 7]  # 8 - prompt, at most 8
    unbounded = sglang_generate_requests(plan, [[1, 2, 3], [4]], params, context_len=None)
    assert {r.sampling["max_new_tokens"] for r in unbounded} == {8}
    with pytest.raises(ValueError, match="one per sample"):
        sglang_generate_requests(RequestPlan("s", 1, 2, per_sample=False), [[1]], params, None)


def test_sglang_sampling_params_mapping():
    params = SamplingParams(
        n=3, max_new_tokens=16, min_new_tokens=1, temperature=0.0, top_k=-1, stop=["x"], seed=5
    )
    assert sglang_sampling_params(params, seed_offset=4) == {
        "n": 1,
        "max_new_tokens": 16,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "min_new_tokens": 1,
        "stop": ["x"],
        "sampling_seed": 9,
    }
    assert "sampling_seed" not in sglang_sampling_params(SamplingParams(top_k=20))
    assert sglang_sampling_params(SamplingParams(top_k=20))["top_k"] == 20


@pytest.mark.parametrize("bad", [SamplingParams(n=0), SamplingParams(max_new_tokens=0)])
def test_sampling_params_rejected(bad):
    with pytest.raises(ValueError):
        vllm_sampling_kwargs(bad)
    with pytest.raises(ValueError):
        sglang_sampling_params(bad)


# ------------------------------------------------------------------------------ engine options


def role(strategy_name: str, config, **model) -> RoleConfig:
    args = StrategyArgs(strategy_name, config)
    return RoleConfig(model_args=ModelArgs(model_name_or_path="/m", **model), strategy_args=args)


def test_vllm_engine_options_from_config():
    cfg = VLLMConfig(tensor_parallel_size=2, sleep_level=2, load_format="dummy", max_model_len=4096)
    opts = vllm_engine_options(cfg, role("vllm", cfg, dtype="bf16"), "actor_infer", 7, "pkg.Ext")
    kw = opts.kwargs
    assert kw["model"] == "/m" and kw["dtype"] == "bfloat16" and kw["seed"] == 7
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    assert kw["enable_sleep_mode"] is True and kw["load_format"] == "dummy" and kw["max_model_len"] == 4096
    assert kw["worker_extension_cls"] == "pkg.Ext" and kw["logprobs_mode"] == "processed_logprobs"
    assert "max_num_seqs" not in kw  # None values are left to the engine
    assert opts.sources["max_model_len"] == "actor_infer.strategy_args.strategy_config.max_model_len"
    assert opts.sources["dtype"] == "actor_infer.model_args.dtype"
    single = vllm_engine_options(VLLMConfig(sleep_level=0), role("vllm", None), "r", 1, "E").kwargs
    assert single["distributed_executor_backend"] == "uni" and single["enable_sleep_mode"] is False


def test_vllm_engine_kwargs_pass_through_and_override():
    cfg = VLLMConfig(engine_kwargs={"swap_space": 0, "logprobs_mode": "raw_logprobs"})
    opts = vllm_engine_options(cfg, role("vllm", cfg), "actor_infer", 1, "E")
    assert opts.kwargs["swap_space"] == 0 and opts.kwargs["logprobs_mode"] == "raw_logprobs"
    assert opts.sources["swap_space"] == "actor_infer.strategy_args.strategy_config.engine_kwargs.swap_space"


@pytest.mark.parametrize(
    ("tp", "backend", "engine"), [(1, "mp", "uni"), (2, "mp", "mp"), (1, "ray", "ray"), (16, "ray", "ray")]
)
def test_vllm_executor_backend_comes_from_its_key(tp, backend, engine):
    cfg = VLLMConfig(tensor_parallel_size=tp, distributed_executor_backend=backend)
    opts = vllm_engine_options(cfg, role("vllm", cfg), "actor_infer", 1, "E")
    assert opts.kwargs["distributed_executor_backend"] == engine
    key = "actor_infer.strategy_args.strategy_config.distributed_executor_backend"
    assert opts.sources["distributed_executor_backend"] == key


def test_vllm_engine_across_nodes_runs_without_custom_all_reduce():
    """vLLM's custom all-reduce takes TP workers that share /dev/shm for one node's and indexes this
    node's GPU ids with the peer's rank: Ray nodes on one machine failed so (IndexError, vLLM 0.24)."""
    cfg = VLLMConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    across = vllm_engine_options(cfg, role("vllm", cfg), "actor_infer", 1, "E", spans_nodes=True)
    assert across.kwargs["disable_custom_all_reduce"] is True
    key = "actor_infer.strategy_args.strategy_config.distributed_executor_backend"
    assert across.sources["disable_custom_all_reduce"] == key
    assert (
        "disable_custom_all_reduce"
        not in vllm_engine_options(cfg, role("vllm", cfg), "actor_infer", 1, "E").kwargs
    )
    own = VLLMConfig(
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        engine_kwargs={"disable_custom_all_reduce": False},
    )
    kept = vllm_engine_options(own, role("vllm", own), "actor_infer", 1, "E", spans_nodes=True)
    assert kept.kwargs["disable_custom_all_reduce"] is False  # engine_kwargs has the last word


def test_vllm_executor_backend_in_engine_kwargs_names_the_key():
    """Placement follows the typed key (a Ray engine gets a placement group), so the engine may not
    be told another backend behind the planner's back."""
    cfg = VLLMConfig(engine_kwargs={"distributed_executor_backend": "ray"})
    with pytest.raises(
        ConfigError,
        match=r"engine_kwargs.distributed_executor_backend: is set by roll from "
        r"actor_infer.strategy_args.strategy_config.distributed_executor_backend",
    ):
        vllm_engine_options(cfg, role("vllm", cfg), "actor_infer", 1, "E")


def test_vllm_linear_attention_models_prefill_with_triton_without_flashinfer(tmp_path, monkeypatch):
    """vLLM's "auto" GDN prefill picks FlashInfer on Hopper and fails to start without it: a model
    with linear-attention layers gets "triton" where FlashInfer is not installed; others get nothing."""
    import importlib.util
    import json

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a))

    def options(config: dict, **cfg) -> dict:
        model = tmp_path / str(len(list(tmp_path.iterdir())))
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        vllm = VLLMConfig(**cfg)
        args = StrategyArgs("vllm", vllm)
        role_config = RoleConfig(model_args=ModelArgs(model_name_or_path=str(model)), strategy_args=args)
        return vllm_engine_options(vllm, role_config, "actor_infer", 1, "E").kwargs

    hybrid = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}
    assert options(hybrid)["gdn_prefill_backend"] == "triton"
    assert options({"model_type": "qwen3_next"})["gdn_prefill_backend"] == "triton"  # no layer_types
    assert "gdn_prefill_backend" not in options({"model_type": "qwen2"})
    chosen = options(hybrid, engine_kwargs={"gdn_prefill_backend": "flashinfer"})
    assert chosen["gdn_prefill_backend"] == "flashinfer"  # the user's choice through engine_kwargs
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "flashinfer" else real(n, *a)
    )
    assert "gdn_prefill_backend" not in options(hybrid)  # with FlashInfer installed vLLM chooses


def test_vllm_start_up_options_become_its_compilation_config():
    # Default: no torch.compile, whole decode steps as CUDA graphs at powers of two up to 512.
    kw = vllm_engine_options(VLLMConfig(), role("vllm", None), "actor_infer", 1, "E").kwargs
    assert kw["compilation_config"] == {
        "mode": "NONE",
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
    }
    compiled = VLLMConfig(torch_compile=True, cuda_graph_sizes=[64, 8, 8])
    kw = vllm_engine_options(compiled, role("vllm", compiled), "actor_infer", 1, "E").kwargs
    assert kw["compilation_config"] == {"mode": "VLLM_COMPILE", "cudagraph_capture_sizes": [8, 64]}
    # enforce_eager: vLLM compiles and captures nothing, so roll sends no compilation_config.
    eager = VLLMConfig(enforce_eager=True, torch_compile=True)
    assert "compilation_config" not in vllm_engine_options(eager, role("vllm", eager), "r", 1, "E").kwargs
    # vLLM's own compilation_config through engine_kwargs replaces roll's.
    own = VLLMConfig(engine_kwargs={"compilation_config": 3})
    opts = vllm_engine_options(own, role("vllm", own), "actor_infer", 1, "E")
    assert opts.kwargs["compilation_config"] == 3
    assert opts.sources["compilation_config"].endswith("engine_kwargs.compilation_config")
    with pytest.raises(ConfigError) as err:
        VLLMConfig(cuda_graph_sizes=[]).validate(1, "actor_infer.strategy_args.strategy_config")
    assert err.value.path == "actor_infer.strategy_args.strategy_config.cuda_graph_sizes"


def test_engine_kwargs_may_not_repeat_a_config_key():
    cfg = VLLMConfig(engine_kwargs={"tensor_parallel_size": 2})
    with pytest.raises(ConfigError) as err:
        vllm_engine_options(cfg, role("vllm", cfg), "actor_infer", 1, "E")
    assert err.value.path == "actor_infer.strategy_args.strategy_config.engine_kwargs.tensor_parallel_size"
    assert "strategy_config.tensor_parallel_size" in str(err.value)


def test_option_check_names_the_key_with_did_you_mean():
    cfg = VLLMConfig(engine_kwargs={"swap_spcae": 1})
    opts = vllm_engine_options(cfg, role("vllm", cfg), "actor_infer", 1, "E")
    accepted = set(opts.kwargs) - {"swap_spcae"} | {"swap_space"}
    with pytest.raises(ConfigError) as err:
        opts.check(accepted, "vLLM", "vllm")
    assert err.value.path == "actor_infer.strategy_args.strategy_config.engine_kwargs.swap_spcae"
    assert "did you mean 'swap_space'" in str(err.value) and "pip install -e .[vllm]" in str(err.value)
    # A config field the installed engine lacks is reported under the config key the user wrote.
    with pytest.raises(ConfigError) as err:
        opts.check(set(opts.kwargs) - {"block_size"}, "vLLM", "vllm")
    assert err.value.path == "actor_infer.strategy_args.strategy_config.block_size"


def test_sglang_engine_options():
    cfg = SGLangConfig(tensor_parallel_size=2, mem_fraction_static=0.5, engine_kwargs={"log_level": "info"})
    opts = sglang_engine_options(cfg, role("sglang", cfg, dtype="fp16"), "rewards.judge", 3)
    kw = opts.kwargs
    assert kw["model_path"] == "/m" and kw["tp_size"] == 2 and kw["mem_fraction_static"] == 0.5
    assert kw["dtype"] == "float16" and kw["random_seed"] == 3 and kw["log_level"] == "info"
    assert kw["enable_memory_saver"] is True and "context_length" not in kw
    assert opts.sources["tp_size"] == "rewards.judge.strategy_args.strategy_config.tensor_parallel_size"
    with pytest.raises(ConfigError, match="engine_kwargs.tp_size"):
        sglang_engine_options(SGLangConfig(engine_kwargs={"tp_size": 1}), role("sglang", None), "r", 1)


# ------------------------------------------------------------------------------ bookkeeping


def test_request_plan_ids_and_locate():
    per_row = RequestPlan("w0-1", num_rows=2, n=3, per_sample=False)
    assert per_row.request_ids() == ["w0-1-0", "w0-1-1"]
    assert per_row.locate("w0-1-1") == (1, None)
    per_sample = RequestPlan("w0-1", num_rows=2, n=2, per_sample=True)
    assert per_sample.request_ids() == ["w0-1-0-0", "w0-1-0-1", "w0-1-1-0", "w0-1-1-1"]
    assert per_sample.locate("w0-1-1-0") == (1, 0)
    for bad in ("w0-2-0-0", "w0-1-2-0", "w0-1-0", "w0-1-0-x"):
        with pytest.raises(KeyError):
            per_sample.locate(bad)


def test_collector_reorders_completion_order_per_sample():
    plan = RequestPlan("p", num_rows=2, n=2, per_sample=True)
    collector = CompletionCollector(plan)
    ids = plan.request_ids()
    for rid in reversed(ids):  # finish in reverse order
        collector.add(rid, [Completion([int(rid.split("-", 1)[1].replace("-", ""))])])
        assert collector.done == (rid == ids[0])
    assert [c.token_ids for c in collector.ordered()] == [[0], [1], [10], [11]]


def test_collector_expands_n_outputs_of_one_request():
    plan = RequestPlan("p", num_rows=2, n=3, per_sample=False)
    collector = CompletionCollector(plan)
    collector.add("p-1", [Completion([10 + j]) for j in range(3)])
    with pytest.raises(RuntimeError, match="never finished"):
        collector.ordered()
    collector.add("p-0", [Completion([j]) for j in range(3)])
    assert [c.token_ids[0] for c in collector.ordered()] == [0, 1, 2, 10, 11, 12]
    with pytest.raises(ValueError, match="finished twice"):
        collector.add("p-0", [Completion([0])] * 3)
    with pytest.raises(ValueError, match="expected 3"):
        CompletionCollector(plan).add("p-0", [Completion([0])])


def test_registry_abort_marks_only_in_flight_and_is_thread_safe():
    registry = RequestRegistry()
    registry.add(["a", "b", "c"])
    with pytest.raises(ValueError, match="already in flight"):
        registry.add(["a"])
    assert registry.request_abort(["b", "zzz"]) == ["b"]
    registry.finish("c")
    assert registry.request_abort(["c"]) == []  # finished before the abort arrived
    assert registry.take_aborts() == ["b"] and registry.take_aborts() == []
    assert registry.was_aborted("b") and not registry.was_aborted("a")
    assert "a" in registry and "b" in registry and "c" not in registry
    registry.add(["job7-0-0", "job7-0-1", "job70-0-0"])
    assert registry.request_abort(["job7"]) == ["job7-0-0", "job7-0-1"]  # by generate_one id, not job70
    registry.forget(registry.take_aborts() + ["job70-0-0"])

    registry.add([f"x{i}" for i in range(200)])
    threads = [threading.Thread(target=registry.request_abort) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken = registry.take_aborts()
    assert len(taken) == 202 and len(set(taken)) == 202  # a, b and x0..x199 once each
    registry.forget(taken)
    assert registry.in_flight() == []


# ------------------------------------------------------------------------------ engine outputs


def vllm_output(request_id: str, samples: list[list[int]], reasons=None, logprob=True):
    """A vllm.RequestOutput look-alike: logprobs as one {token: Logprob} dict per token."""
    outputs = []
    for index, tokens in reversed(list(enumerate(samples))):  # engines may list outputs in any order
        lps = [
            {t: SimpleNamespace(logprob=-0.1 * (k + 1)), 99: SimpleNamespace(logprob=-9.0)}
            for k, t in enumerate(tokens)
        ]
        reason = (reasons or ["stop"] * len(samples))[index]
        outputs.append(
            SimpleNamespace(
                index=index,
                token_ids=tokens,
                logprobs=lps if logprob else None,
                finish_reason=reason,
                text="t",
            )
        )
    return SimpleNamespace(request_id=request_id, outputs=outputs, finished=True)


def test_completions_from_vllm_sorted_with_sampled_token_logprobs():
    out = completions_from_vllm(vllm_output("r", [[5, 6], [7]], reasons=["length", None]))
    assert [c.token_ids for c in out] == [[5, 6], [7]]
    assert out[0].logprobs == pytest.approx([-0.1, -0.2]) and out[0].finish_reason == "length"
    assert out[1].finish_reason is None
    assert (
        completions_from_vllm(vllm_output("r", [[5]], logprob=False), want_logprobs=False)[0].logprobs is None
    )
    with pytest.raises(RuntimeError, match="no log-probs"):
        completions_from_vllm(vllm_output("r", [[5]], logprob=False))


def test_completion_from_sglang():
    out = {
        "text": "hi",
        "output_ids": [4, 5],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length"},
            "output_token_logprobs": [(-0.5, 4, None), [-0.25, 5, None]],
        },
    }
    c = completion_from_sglang(out)
    assert (
        c.token_ids == [4, 5]
        and c.logprobs == [-0.5, -0.25]
        and c.finish_reason == "length"
        and c.text == "hi"
    )
    del out["output_ids"]  # older releases: ids only inside the log-prob entries
    assert completion_from_sglang(out).token_ids == [4, 5]
    out["output_ids"] = [4, 6]
    with pytest.raises(RuntimeError, match="do not match"):
        completion_from_sglang(out)
    with pytest.raises(RuntimeError, match="return_logprob"):
        completion_from_sglang({"output_ids": [1], "meta_info": {}})
    assert completion_from_sglang({"output_ids": [1], "meta_info": {}}, want_logprobs=False).logprobs is None


def test_completions_to_batch_layout_truncation_and_logprobs():
    batch = prompt_batch([[11, 12], [13, 14, 15]])
    completions = [
        Completion([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0]),  # longer than R=3: cut
        Completion([5], [-5.0]),
        aborted_completion(),
        Completion([6, 7], [-6.0, -7.0]),
    ]
    out = completions_to_batch(batch, completions, n=2, pad_token_id=PAD, response_length=3, temperature=0.5)
    assert out["responses"].tolist() == [[1, 2, 3], [5, 0, 0], [0, 0, 0], [6, 7, 0]]
    assert out["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert out["infer_logprobs"].tolist() == [[-1, -2, -3], [-5, 0, 0], [0, 0, 0], [-6, -7, 0]]
    assert out["prompts"].tolist() == [[0, 0, 0, 11, 12]] * 2 + [[0, 0, 13, 14, 15]] * 2
    assert out["input_ids"].shape == (4, 8) and list(out["tag"]) == ["t0", "t0", "t1", "t1"]
    assert out.meta["temperature"] == 0.5
    no_lp = completions_to_batch(batch, [Completion([1])] * 4, 2, PAD, 3, with_logprobs=False)
    assert "infer_logprobs" not in no_lp
    with pytest.raises(ValueError, match="no log-probs"):
        completions_to_batch(batch, [Completion([1])] * 4, 2, PAD, 3)
    with pytest.raises(ValueError, match="4 completions"):
        completions_to_batch(batch, completions, n=3, pad_token_id=PAD, response_length=3)


def test_completion_rejects_mismatched_logprobs():
    with pytest.raises(ValueError, match="2 tokens but 1"):
        Completion([1, 2], [-1.0])


# ------------------------------------------------------------------------------ scoring


def scored_batch() -> Batch:
    batch = completions_to_batch(
        prompt_batch([[11, 12], [13, 14, 15]]), [Completion([1, 2]), Completion([3])], 1, PAD, 4, False
    )
    return batch


def test_scoring_requests_and_prompt_logprob_extraction():
    reqs = scoring_requests(scored_batch())
    assert [(r.token_ids, r.start, r.count) for r in reqs] == [
        ([11, 12, 1, 2], 2, 2),
        ([13, 14, 15, 3], 3, 1),
    ]

    def vllm_scored(req):
        plp = [None] + [{t: SimpleNamespace(logprob=-float(t))} for t in req.token_ids[1:]]
        return SimpleNamespace(prompt_logprobs=plp)

    rows = [vllm_prompt_logprobs(vllm_scored(r), r) for r in reqs]
    assert rows == [[-1.0, -2.0], [-3.0]]
    assert rows_to_tensor(rows, 4).tolist() == [[-1, -2, 0, 0], [-3, 0, 0, 0]]

    # SGLang: entries from logprob_start_len on; with or without a leading None they align from the end.
    for entries in (
        [[None, 11, None]] + [[-float(t), t, None] for t in [12, 1, 2]],
        [[-float(t), t] for t in [1, 2]],
    ):
        assert sglang_input_logprobs({"meta_info": {"input_token_logprobs": entries}}, reqs[0]) == [
            -1.0,
            -2.0,
        ]
    with pytest.raises(RuntimeError, match="not one for token"):
        sglang_input_logprobs({"meta_info": {"input_token_logprobs": [[-1.0, 9], [-2.0, 2]]}}, reqs[0])
    with pytest.raises(ValueError, match="more than the width"):
        rows_to_tensor([[1.0, 2.0]], 1)


def test_sglang_abort_keeps_only_tokens_with_log_probs():
    from roll.distributed.strategy.engine_requests import completion_from_sglang

    out = {
        "output_ids": [5, 6, 7],
        "meta_info": {
            "id": "job-0-0",
            "finish_reason": {"type": "abort", "message": "Aborted"},
            "output_token_logprobs": [(-0.5, 5, None), (-0.25, 6, None)],
        },
    }
    done = completion_from_sglang(out)
    assert done.token_ids == [5, 6] and done.logprobs == [-0.5, -0.25] and done.finish_reason == "abort"
    out["meta_info"]["finish_reason"] = {"type": "length"}
    with pytest.raises(RuntimeError, match="2 output log-probs for 3 tokens"):
        completion_from_sglang(out)


def test_generating_args_pass_logprobs_on():
    assert GeneratingArgs().sampling_params().logprobs is True
    assert GeneratingArgs(logprobs=False).sampling_params().logprobs is False
    assert vllm_sampling_kwargs(GeneratingArgs(logprobs=False).sampling_params())["logprobs"] is None
