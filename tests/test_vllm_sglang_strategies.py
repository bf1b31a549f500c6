"""The vllm/sglang strategies' engine-facing code, run against fake ``vllm``/``sglang`` modules.

Neither engine can be installed here, so a fixture puts small stand-ins into ``sys.modules`` that
have the public API surface the strategies call (``vllm.LLM``, ``llm.llm_engine``,
``collective_rpc``, ``sglang.Engine``, ...), record every call and answer with canned outputs.
The vLLM worker extension runs for real inside the fake's "workers" (threads, like vLLM's worker
processes), including a gloo broadcast from a sender built with the model-update package.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import importlib
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from launch_files import launch_overrides, make_launch_files, point_at_files
from torch import nn

from roll.configs.errors import ConfigError
from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs
from roll.configs.strategy_configs import SGLangConfig, VLLMConfig
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.registry import load_strategy_class
from roll.distributed.strategy.vllm_worker_extension import RollWorkerExtension
from roll.distributed.transport.bucket import pack_bucket
from roll.distributed.transport.checksum import bucket_checksums
from roll.models.vision import response_excluded_tokens

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
PAD = 0


# =============================================================================== fake engines


def canned_tokens(prompt: list[int], sample: int, max_tokens: int) -> list[int]:
    """What the fake engines "generate": depends on the prompt's last token and the sample index."""
    length = min(max_tokens, 2 + (prompt[-1] + sample) % 3)
    return [3 + (prompt[-1] + sample + k) % 50 for k in range(length)]


def canned_logprob(token: int) -> float:
    return -0.01 * token


class TinyEngineModel(nn.Module):
    """A model with vLLM/SGLang's ``load_weights(weights)`` contract: HF-named full tensors in."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.loaded: list[str] = []

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            self.loaded.append(name)
        return set(params)


# ------------------------------------------------------------------------------------ vllm


@dataclasses.dataclass
class FakeEngineArgs:
    model: str = ""
    dtype: str = "auto"
    trust_remote_code: bool = False
    seed: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    block_size: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    enable_sleep_mode: bool = False
    load_format: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    enable_chunked_prefill: bool | None = None
    worker_extension_cls: str = ""
    distributed_executor_backend: str | None = None
    logprobs_mode: str = "raw_logprobs"
    compilation_config: Any = None
    swap_space: float = 4
    kv_cache_memory_bytes: int | None = None


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeSamplingParams:
    def __init__(self, **kwargs):
        defaults = {"n": 1, "max_tokens": 16, "logprobs": None, "prompt_logprobs": None, "seed": None}
        self.__dict__.update({**defaults, **kwargs})


class FakeLLMEngine:
    """``llm.llm_engine``: finishes one request per step, the most recently added first."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], FakeSamplingParams]] = {}
        self.added: list[tuple[str, list[int], FakeSamplingParams]] = []
        self.prompts: list[dict] = []
        self.aborted: list[str] = []
        self.stall = False  # never finish anything (to test abort)
        self.encoder_resets = 0
        self.rename = False  # keep requests under internal ids, like vLLM 0.24 (``<id>-<8 random>``)

    def reset_encoder_cache(self) -> None:
        self.encoder_resets += 1

    def add_request(self, request_id, prompt, params):
        """vLLM 0.24 returns an internal id, but outputs and aborts use the caller's id. A prompt
        with images (a vision-language model's) is kept whole in ``prompts``."""
        assert isinstance(prompt, dict) and "prompt_token_ids" in prompt
        assert set(prompt) <= {"prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
        assert params.output_kind is RequestOutputKind.FINAL_ONLY
        self.prompts.append(prompt)
        self.requests[request_id] = (list(prompt["prompt_token_ids"]), params)
        self.added.append((request_id, list(prompt["prompt_token_ids"]), params))
        return request_id + "-1a2b3c4d" if self.rename else request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.requests.pop(rid, None)
        self.aborted += list(request_ids)

    def step(self):
        if self.stall or not self.requests:
            time.sleep(0.001)
            return []
        rid = list(self.requests)[-1]
        prompt, params = self.requests.pop(rid)
        return [self._output(rid, prompt, params)]

    @staticmethod
    def _output(rid, prompt, params):
        outputs = []
        for index in range(params.n):
            tokens = canned_tokens(prompt, index + (params.seed or 0), params.max_tokens)
            lps = None
            if params.logprobs is not None:
                lps = [{t: SimpleNamespace(logprob=canned_logprob(t))} for t in tokens]
            reason = "length" if len(tokens) == params.max_tokens else "stop"
            outputs.append(
                SimpleNamespace(index=index, token_ids=tokens, logprobs=lps, finish_reason=reason, text="")
            )
        plp = None
        if params.prompt_logprobs is not None:
            plp = [None] + [{t: SimpleNamespace(logprob=canned_logprob(t))} for t in prompt[1:]]
        return SimpleNamespace(request_id=rid, outputs=outputs[::-1], finished=True, prompt_logprobs=plp)


class FakeWorkerBase:
    """What vLLM's GPU worker offers an extension: ``device``, ``rank``, ``model_runner.model``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=TinyEngineModel())


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.llm_engine = FakeLLMEngine()
        module, cls = kwargs["worker_extension_cls"].rsplit(".", 1)
        worker_cls = type("Worker", (FakeWorkerBase, getattr(importlib.import_module(module), cls)), {})
        self.workers = [worker_cls(rank) for rank in range(kwargs["tensor_parallel_size"])]
        self.inside, self.overlaps, self.rpc_delay_s = 0, 0, 0.0
        self._inside_lock = threading.Lock()
        FakeLLM.instances.append(self)

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Like vLLM: every worker runs the method at once (threads here, processes there); the
        arguments cross a process boundary, so they are pickled. ``overlaps`` counts calls that
        began while another was still running (vLLM's multiprocess executor does not allow it)."""
        self.calls.append(("collective_rpc", method))
        with self._inside_lock:
            self.inside += 1
            self.overlaps += self.inside > 1
        try:
            time.sleep(self.rpc_delay_s)
            return self._run_on_workers(method, args, kwargs)
        finally:
            with self._inside_lock:
                self.inside -= 1

    def _run_on_workers(self, method, args, kwargs):
        args = pickle.loads(pickle.dumps(args))
        with ThreadPoolExecutor(len(self.workers)) as pool:
            futures = [pool.submit(getattr(w, method), *args, **(kwargs or {})) for w in self.workers]
            return [f.result(timeout=60) for f in futures]


# ---------------------------------------------------------------------------------- sglang


@dataclasses.dataclass
class FakeServerArgs:
    model_path: str = ""
    dtype: str = "auto"
    trust_remote_code: bool = False
    random_seed: int | None = None
    tp_size: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    enable_memory_saver: bool = False
    load_format: str = "auto"
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    attention_backend: str | None = None
    mm_attention_backend: str | None = None
    sampling_backend: str | None = None
    disable_cuda_graph: bool = False
    enable_deterministic_inference: bool = False
    log_level: str = "error"


class FakeTokenizerManager:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)


class FakeSGLangEngine:
    instances: list[FakeSGLangEngine] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.vlm_cache_env = os.environ.get("SGLANG_VLM_CACHE_SIZE_MB")  # what its schedulers would read
        self.calls: list[tuple] = []
        self.generate_calls: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager()
        self.model = TinyEngineModel()
        self.stall = False
        FakeSGLangEngine.instances.append(self)

    def generate(
        self, input_ids=None, sampling_params=None, return_logprob=False, rid=None, logprob_start_len=None
    ):
        self.generate_calls.append(
            dict(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob, rid=rid)
        )
        if self.stall:  # run the loop (as Engine.generate does) until every request was aborted
            self.loop.run_until_complete(self._until_aborted(rid))
        outs = []
        for i, ids in enumerate(input_ids):
            sp = sampling_params[i]
            tokens = canned_tokens(ids, sp.get("sampling_seed", 0), sp["max_new_tokens"])
            reason = {"type": "length" if len(tokens) == sp["max_new_tokens"] else "stop"}
            if rid is not None and rid[i] in self.tokenizer_manager.aborted:
                tokens, reason = tokens[:1], {"type": "abort"}
            meta = {"id": rid[i] if rid else f"auto{i}", "finish_reason": reason}
            if return_logprob:
                meta["output_token_logprobs"] = [(canned_logprob(t), t, None) for t in tokens]
                start = (logprob_start_len or [0] * len(input_ids))[i]
                meta["input_token_logprobs"] = [
                    (None if p == 0 else canned_logprob(ids[p]), ids[p], None) for p in range(start, len(ids))
                ]
            outs.append({"text": "", "output_ids": tokens, "meta_info": meta})
        return outs

    async def _until_aborted(self, rids):
        for _ in range(5000):
            if set(rids) <= set(self.tokenizer_manager.aborted):
                return
            await asyncio.sleep(0.001)
        raise TimeoutError("requests were never aborted")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tags))

    def flush_cache(self):
        self.calls.append(("flush_cache",))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))
        self.model.load_weights(named_tensors)
        return True, "ok"

    def init_weights_update_group(self, **kwargs):
        self.calls.append(("init_weights_update_group", kwargs))
        return True, "ok"

    def update_weights_from_distributed(self, **kwargs):
        self.calls.append(("update_weights_from_distributed", kwargs))
        return True, "ok"


# ----------------------------------------------------------------------------------- fixture


@pytest.fixture
def fake_engines(monkeypatch):
    """Install fake ``vllm`` and ``sglang`` packages for the duration of one test."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.EngineArgs = FakeLLM, FakeSamplingParams, FakeEngineArgs
    vllm.sampling_params = types.ModuleType("vllm.sampling_params")
    vllm.sampling_params.RequestOutputKind = RequestOutputKind
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = FakeEngineArgs
    sglang = types.ModuleType("sglang")
    sglang.Engine = FakeSGLangEngine
    srt = types.ModuleType("sglang.srt")
    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.ServerArgs = FakeServerArgs
    for name, module in {
        "vllm": vllm,
        "vllm.sampling_params": vllm.sampling_params,
        "vllm.engine": types.ModuleType("vllm.engine"),
        "vllm.engine.arg_utils": arg_utils,
        "sglang": sglang,
        "sglang.srt": srt,
        "sglang.srt.server_args": server_args,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.instances.clear()
    FakeSGLangEngine.instances.clear()
    yield SimpleNamespace(vllm=vllm, sglang=sglang)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A word-level tokenizer (pad id 0) saved like a checkpoint's: the strategies read the pad id."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 64)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return str(path)


def make_role(name: str, cfg, path: str) -> RoleConfig:
    args = StrategyArgs(name, cfg)
    return RoleConfig(model_args=ModelArgs(model_name_or_path=path, dtype="bf16"), strategy_args=args)


def ctx(role: str = "actor_infer", rank: int = 0) -> WorkerContext:
    return WorkerContext(
        role=role, rank=rank, world_size=2, local_rank=0, device=torch.device("cpu"), seed=100
    )


def prompt_batch(rows: list[list[int]], width: int = 4) -> Batch:
    prompts = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for i, row in enumerate(rows):
        prompts[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return Batch.from_dict(
        {"prompts": prompts, "prompt_mask": mask}, {"uid": [f"u{i}" for i in range(len(rows))]}
    )


def assert_rows_close(values: torch.Tensor, mask: torch.Tensor, want: list[list[float]]) -> None:
    """The masked part of each row equals ``want`` (to float32 precision)."""
    got = [row[m].tolist() for row, m in zip(values, mask)]
    assert [len(g) for g in got] == [len(w) for w in want]
    assert [x for g in got for x in g] == pytest.approx([x for w in want for x in w], abs=1e-6)


def vllm_strategy(tokenizer_dir, role="actor_infer", **cfg):
    cls = load_strategy_class("vllm")
    config = VLLMConfig(**cfg)
    strategy = cls(make_role("vllm", config, tokenizer_dir), ctx(role))
    strategy.initialize()
    return strategy, FakeLLM.instances[-1]


def sglang_strategy(tokenizer_dir, role="actor_infer", **cfg):
    cls = load_strategy_class("sglang")
    strategy = cls(make_role("sglang", SGLangConfig(**cfg), tokenizer_dir), ctx(role))
    strategy.initialize()
    return strategy, FakeSGLangEngine.instances[-1]


# ===================================================================================== vllm


def test_vllm_engine_start_options(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(
        tokenizer_dir, tensor_parallel_size=2, sleep_level=2, load_format="dummy", max_model_len=512
    )
    kw = llm.kwargs
    assert kw["model"] == tokenizer_dir and kw["dtype"] == "bfloat16" and kw["seed"] == 100
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    assert kw["enable_sleep_mode"] is True and kw["load_format"] == "dummy" and kw["max_model_len"] == 512
    assert kw["worker_extension_cls"] == "roll.distributed.strategy.vllm_worker_extension.RollWorkerExtension"
    assert (
        kw["block_size"] == 16 and kw["gpu_memory_utilization"] == 0.8 and kw["enable_prefix_caching"] is True
    )
    assert strategy.pad_token_id == PAD and strategy.model_update_ranks() == 2
    assert "kv_cache_memory_bytes" not in kw  # sized by gpu_memory_utilization unless given
    # dummy weights: generating before the first model update is an error, not garbage
    with pytest.raises(RuntimeError, match="model update"):
        strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=4))


def test_vllm_generate_batch_layout_order_and_seeds(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(tokenizer_dir, seed_mode="request")
    rows = [[5, 6], [7], [9, 10, 11]]
    out = strategy.generate(
        prompt_batch(rows), SamplingParams(n=2, max_new_tokens=3, temperature=0.5, seed=40)
    )
    # one request of n=2 per row, all submitted before stepping; seeds 40, 42, 44 (vLLM adds the index)
    assert [
        (rid.rsplit("-", 1)[1], p.n, p.seed, p.max_tokens, p.temperature)
        for rid, _, p in llm.llm_engine.added
    ] == [
        ("0", 2, 40, 3, 0.5),
        ("1", 2, 42, 3, 0.5),
        ("2", 2, 44, 3, 0.5),
    ]
    assert [p.logprobs for _, _, p in llm.llm_engine.added] == [0, 0, 0]
    # the fake finished the rows in reverse order and listed outputs in reverse; rows come back in order
    expected = [canned_tokens(row, 40 + 2 * i + j, 3) for i, row in enumerate(rows) for j in range(2)]
    mask = out["response_mask"].bool()
    assert [r[m].tolist() for r, m in zip(out["responses"], mask)] == expected
    assert out["responses"].shape == (6, 3) and out["input_ids"].shape == (6, 7)
    want_lp = [[canned_logprob(t) for t in toks] for toks in expected]
    assert_rows_close(out["infer_logprobs"], mask, want_lp)
    assert list(out["uid"]) == ["u0", "u0", "u1", "u1", "u2", "u2"] and out.meta["temperature"] == 0.5
    assert strategy.registry.in_flight() == [] and strategy._finished == {}


def test_vllm_generate_sends_each_rows_images_with_one_token_per_image(fake_engines, tmp_path):
    """A vision-language model (roll.models.vision): rows with images go to the engine as one image
    token per image plus the images and the file's pixel bounds; a text row as its ids; every
    request biases the vision tokens out; the Batch keeps roll's expanded prompt ids."""
    from tiny_vl import build_tiny_vl_tokenizer, tiny_vl_config

    tok = build_tiny_vl_tokenizer()
    tok.save_pretrained(tmp_path)
    tiny_vl_config(tok).save_pretrained(tmp_path)
    image, start = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|vision_start|>")
    cls = load_strategy_class("vllm")
    strategy = cls(make_role("vllm", VLLMConfig(seed_mode="request"), str(tmp_path)), ctx())
    strategy.initialize()
    llm = FakeLLM.instances[-1]
    rows = [[5, start, image, image, image, 6], [7, 8], [start, image, image, 9]]
    batch = prompt_batch(rows, width=6)
    pictures = ["picture-0", "picture-2"]  # stand-ins: the strategy hands them over as they are
    batch.non_tensors["multi_modal_data"] = np.array(
        [
            {"image": [pictures[0]]},
            None,
            {"image": [pictures[1]], "mm_processor_kwargs": {"max_pixels": 3136}},
        ],
        dtype=object,
    )
    out = strategy.generate(batch, SamplingParams(n=2, max_new_tokens=3, seed=1))
    sent = llm.llm_engine.prompts
    assert sent[0] == {"prompt_token_ids": [5, start, image, 6], "multi_modal_data": {"image": ["picture-0"]}}
    assert sent[1] == {"prompt_token_ids": [7, 8]}
    assert sent[2]["prompt_token_ids"] == [start, image, 9] and sent[2]["mm_processor_kwargs"] == {
        "max_pixels": 3136
    }
    excluded = {t: -1.0e4 for t in response_excluded_tokens(tiny_vl_config(tok))}
    assert excluded and all(p.logit_bias == excluded for _, _, p in llm.llm_engine.added)
    assert torch.equal(out["prompts"][::2], batch["prompts"])  # the expanded ids stay in the batch
    out.non_tensors["multi_modal_inputs"] = np.array(
        [{"pixel_values": torch.zeros(1)}, None] * 3, dtype=object
    )
    with pytest.raises(ValueError, match="scores text rows only"):
        strategy.compute_log_probs(out)


@pytest.mark.parametrize("tp, serialized", [(2, True), (1, False)])
def test_vllm_calls_into_tp_workers_one_at_a_time(fake_engines, tokenizer_dir, tp, serialized):
    # a model update calls the engine from one thread per trainer rank; with TP > 1 (vLLM's
    # multiprocess executor, one unlocked shared-memory queue) those calls must not overlap
    strategy, llm = vllm_strategy(tokenizer_dir, tensor_parallel_size=tp)
    llm.rpc_delay_s = 0.02
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: strategy.workers.call(RollWorkerExtension.roll_weight_version), range(8)))
    assert (llm.overlaps == 0) is serialized


def test_vllm_kv_cache_in_gib_reaches_the_engine_in_bytes(fake_engines, tokenizer_dir):
    _, llm = vllm_strategy(tokenizer_dir, kv_cache_memory_gb=1.5)
    assert llm.kwargs["kv_cache_memory_bytes"] == 3 << 29


def test_vllm_step_seed_goes_to_the_workers_generators_not_the_requests(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(tokenizer_dir, tensor_parallel_size=2)
    torch.manual_seed(1)
    strategy.generate(prompt_batch([[5], [6]]), SamplingParams(n=2, max_new_tokens=2, seed=40))
    # the requests carry no seed (vLLM samples them in one batch), every TP worker was seeded with 40
    assert [p.seed for _, _, p in llm.llm_engine.added] == [None, None]
    assert llm.calls.count(("collective_rpc", "roll_manual_seed")) == 1
    drawn = torch.rand(3)
    torch.manual_seed(40)
    assert torch.equal(drawn, torch.rand(3))
    # unseeded calls leave the generators alone
    strategy.generate(prompt_batch([[5]]), SamplingParams(n=1, max_new_tokens=2))
    assert llm.calls.count(("collective_rpc", "roll_manual_seed")) == 1


def test_vllm_generate_without_logprobs_and_renamed_ids(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(tokenizer_dir)
    llm.llm_engine.rename = True
    out = strategy.generate(prompt_batch([[5], [6]]), SamplingParams(n=1, max_new_tokens=2, logprobs=False))
    assert "infer_logprobs" not in out and out["responses"].shape == (2, 2)
    assert [p.logprobs for _, _, p in llm.llm_engine.added] == [None, None]


def test_vllm_generate_one_and_abort_from_another_thread(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(tokenizer_dir)
    done = strategy.generate_one([5, 6], SamplingParams(n=3, max_new_tokens=4, seed=7), request_id="job1")
    assert [c.token_ids for c in done] == [canned_tokens([5, 6], 7 + j, 4) for j in range(3)]
    assert [rid for rid, _, _ in llm.llm_engine.added] == ["job1-0-0", "job1-0-1", "job1-0-2"]
    assert all(p.n == 1 for _, _, p in llm.llm_engine.added)

    llm.llm_engine.stall = True
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            c=strategy.generate_one([8], SamplingParams(n=2, max_new_tokens=4), "job2")
        )
    )
    worker.start()
    for _ in range(2000):
        if len(strategy.registry.in_flight()) == 2:
            break
        time.sleep(0.001)
    assert strategy.abort(["job2"]) == ["job2-0-0", "job2-0-1"]
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert [(c.token_ids, c.finish_reason) for c in result["c"]] == [([], "abort"), ([], "abort")]
    assert sorted(llm.llm_engine.aborted) == ["job2-0-0", "job2-0-1"]
    assert strategy.registry.in_flight() == []


def test_vllm_concurrent_generate_one_share_the_engine(fake_engines, tokenizer_dir):
    strategy, _ = vllm_strategy(tokenizer_dir)
    prompts = [[i + 2] for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        results = list(
            pool.map(
                lambda p: strategy.generate_one(p, SamplingParams(n=2, max_new_tokens=4, seed=0)), prompts
            )
        )
    for prompt, completions in zip(prompts, results):
        assert [c.token_ids for c in completions] == [canned_tokens(prompt, j, 4) for j in range(2)]


def test_vllm_compute_log_probs_from_prompt_logprobs(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(tokenizer_dir, role="reference")
    gen = strategy.generate(prompt_batch([[5, 6], [7]]), SamplingParams(n=2, max_new_tokens=3))
    out = strategy.compute_log_probs(gen)["log_probs"]
    scored = llm.llm_engine.added[-4:]
    assert all(p.prompt_logprobs == 0 and p.max_tokens == 1 for _, _, p in scored)
    mask = gen["response_mask"].bool()
    want = [[canned_logprob(t) for t in r[m].tolist()] for r, m in zip(gen["responses"], mask)]
    assert_rows_close(out, mask, want)
    assert out[~mask].abs().sum() == 0
    hot = strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=2, temperature=0.7))
    with pytest.raises(ValueError, match="temperature 1"):
        strategy.compute_log_probs(hot)


def test_vllm_sleep_levels(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(tokenizer_dir, sleep_level=1)
    strategy.offload_states()
    strategy.offload_states()  # already asleep: no second sleep
    strategy.reload_states()
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights", "kv_cache"])]
    strategy.offload_states()
    strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=2))  # wakes itself up
    assert llm.calls[-2:] == [("sleep", 1), ("wake_up", ["kv_cache", "weights"])]

    strategy, llm = vllm_strategy(tokenizer_dir, sleep_level=2)
    strategy.offload_states()
    strategy.reload_states()
    assert llm.calls == [("sleep", 2), ("wake_up", ["weights"])]
    with pytest.raises(RuntimeError, match="model update"):
        strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=2))
    strategy.load_shared_bucket(*shm_bucket(llm, version=3))
    strategy.finish_model_update(3)
    assert llm.calls[-3:] == [
        ("collective_rpc", "roll_finish_update"),
        ("reset_prefix_cache",),
        ("wake_up", ["kv_cache"]),
    ]
    assert strategy.weight_version == 3 and llm.llm_engine.encoder_resets == 1  # old images' embeddings
    assert strategy.workers.call(RollWorkerExtension.roll_weight_version) == [3]
    strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=2))

    strategy, llm = vllm_strategy(tokenizer_dir, sleep_level=0)
    strategy.offload_states()
    strategy.reload_states()
    assert llm.calls == []


def new_weights(model: nn.Module, fill: float) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.full_like(p, fill + i)) for i, (name, p) in enumerate(model.named_parameters())]


def shm_bucket(llm, version: int, fill: float = 2.0):
    from roll.distributed.transport.ipc import allocate_shared

    named = new_weights(llm.workers[0].model_runner.model, fill)
    total = pack_bucket(named, version, 0, True)[0].nbytes
    flat, handle = allocate_shared(total, torch.device("cpu"), key=("test", version))
    meta, _ = pack_bucket(named, version, 0, True, out=flat)
    return meta, handle


def assert_workers_hold(llm, named):
    for worker in llm.workers:
        params = dict(worker.model_runner.model.named_parameters())
        for name, tensor in named:
            torch.testing.assert_close(params[name].data, tensor)


def test_vllm_shared_bucket_and_load_weights_reach_every_tp_worker(fake_engines, tokenizer_dir):
    strategy, llm = vllm_strategy(tokenizer_dir, tensor_parallel_size=2)
    meta, handle = shm_bucket(llm, version=1, fill=5.0)
    sums = strategy.load_shared_bucket(meta, handle, verify=True)
    named = new_weights(llm.workers[0].model_runner.model, 5.0)
    assert_workers_hold(llm, named)
    assert sums == [tuple(s) for s in bucket_checksums(*pack_bucket(named, 1, 0, True)).tolist()]

    named = new_weights(llm.workers[0].model_runner.model, -1.0)
    strategy.load_weights(iter(named))
    assert_workers_hold(llm, named)
    assert ("collective_rpc", "roll_load_tensors") in llm.calls and llm.calls[-1] == ("reset_prefix_cache",)
    assert llm.llm_engine.encoder_resets == 1  # load_weights is a whole update (the bucket waits for finish)


def test_vllm_broadcast_bucket_over_gloo(fake_engines, tokenizer_dir):
    """A sender built from roll.distributed.model_update (store + gloo group + BroadcastTransport)
    sends two buckets; both TP workers of the engine receive and load them."""
    from roll.distributed.transport.broadcast import BroadcastTransport
    from roll.distributed.transport.process_group import new_group, open_store
    from roll.utils.ports import free_port

    strategy, llm = vllm_strategy(tokenizer_dir, tensor_parallel_size=2)
    port = free_port()
    store = open_store("127.0.0.1", port, world_size=3, is_master=True)
    first = new_weights(llm.workers[0].model_runner.model, 3.0)
    buckets = [pack_bucket(first[:1], 1, 0, False), pack_bucket(first[1:], 1, 1, True)]
    errors = []

    def sender():
        try:
            transport = BroadcastTransport(new_group("gloo", store, "link0/data", 0, 3), 0)
            for _, flat in buckets:
                transport.send(flat).wait()
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=sender)
    thread.start()
    assert strategy.join_model_update_group("127.0.0.1", port, "link0/data", 1, 3, backend="gloo") == [1, 2]
    for meta, _ in buckets:
        # queued; checksums at the end
        assert strategy.receive_bucket("link0/data", meta, verify=True) is None
    sums = strategy.take_checksums("link0/data")
    thread.join(timeout=30)
    assert not errors and not thread.is_alive()
    assert_workers_hold(llm, first)
    assert sums == [tuple(s) for meta, flat in buckets for s in bucket_checksums(meta, flat).tolist()]
    strategy.finish_model_update(1)
    strategy.leave_model_update_group()


# =================================================================================== sglang


def test_sglang_engine_start_options(fake_engines, tokenizer_dir):
    strategy, engine = sglang_strategy(
        tokenizer_dir, tensor_parallel_size=2, mem_fraction_static=0.6, context_length=256
    )
    kw = engine.kwargs
    assert kw["model_path"] == tokenizer_dir and kw["tp_size"] == 2 and kw["mem_fraction_static"] == 0.6
    assert kw["context_length"] == 256 and kw["enable_memory_saver"] is True and kw["random_seed"] == 100
    assert kw["dtype"] == "bfloat16" and strategy.pad_token_id == PAD
    assert kw["attention_backend"] == "triton" and kw["sampling_backend"] == "pytorch"


def test_sglang_generate_one_request_per_sample(fake_engines, tokenizer_dir):
    strategy, engine = sglang_strategy(tokenizer_dir)
    rows = [[5, 6], [7]]
    out = strategy.generate(prompt_batch(rows), SamplingParams(n=2, max_new_tokens=3, top_k=5, seed=10))
    call = engine.generate_calls[-1]
    assert call["input_ids"] == [[5, 6], [5, 6], [7], [7]] and call["return_logprob"] is True
    assert [rid.split("-", 2)[2] for rid in call["rid"]] == ["0-0", "0-1", "1-0", "1-1"]
    assert [sp["sampling_seed"] for sp in call["sampling_params"]] == [10, 11, 12, 13]
    assert all(
        sp["n"] == 1 and sp["top_k"] == 5 and sp["max_new_tokens"] == 3 for sp in call["sampling_params"]
    )
    expected = [canned_tokens(row, 10 + 2 * i + j, 3) for i, row in enumerate(rows) for j in range(2)]
    mask = out["response_mask"].bool()
    assert [r[m].tolist() for r, m in zip(out["responses"], mask)] == expected
    assert_rows_close(out["infer_logprobs"], mask, [[canned_logprob(t) for t in toks] for toks in expected])


def test_sglang_stops_a_request_at_the_engine_context(fake_engines, tokenizer_dir):
    strategy, engine = sglang_strategy(tokenizer_dir)
    engine.tokenizer_manager.context_len = 4
    strategy.generate(prompt_batch([[5, 6], [7]]), SamplingParams(n=1, max_new_tokens=3))
    assert [sp["max_new_tokens"] for sp in engine.generate_calls[-1]["sampling_params"]] == [2, 3]


def test_sglang_abort_posts_onto_the_engine_loop(fake_engines, tokenizer_dir):
    strategy, engine = sglang_strategy(tokenizer_dir)
    engine.stall = True
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            c=strategy.generate_one([9], SamplingParams(n=2, max_new_tokens=4), "job")
        )
    )
    worker.start()
    for _ in range(2000):
        if len(strategy.registry.in_flight()) == 2:
            break
        time.sleep(0.001)
    assert strategy.abort(["job"]) == ["job-0-0", "job-0-1"]
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert sorted(engine.tokenizer_manager.aborted) == ["job-0-0", "job-0-1"]
    assert [c.finish_reason for c in result["c"]] == ["abort", "abort"] and len(result["c"][0].token_ids) == 1


def test_sglang_compute_log_probs(fake_engines, tokenizer_dir):
    strategy, engine = sglang_strategy(tokenizer_dir, role="reference")
    gen = strategy.generate(prompt_batch([[5, 6], [7]]), SamplingParams(n=1, max_new_tokens=3))
    out = strategy.compute_log_probs(gen)["log_probs"]
    mask = gen["response_mask"].bool()
    want = [[canned_logprob(t) for t in r[m].tolist()] for r, m in zip(gen["responses"], mask)]
    assert_rows_close(out, mask, want)


def test_sglang_memory_release_and_weight_updates(fake_engines, tokenizer_dir):
    strategy, engine = sglang_strategy(tokenizer_dir)
    strategy.offload_states()
    strategy.reload_states()
    assert engine.calls == [
        ("release_memory_occupation", ["kv_cache", "weights"]),
        ("resume_memory_occupation", ["weights"]),
    ]
    with pytest.raises(RuntimeError, match="model update"):  # weights were released: update first
        strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=2))
    named = new_weights(engine.model, 4.0)
    strategy.load_weights(iter(named))
    strategy.finish_model_update(7)
    assert engine.calls[-3:] == [
        ("update_weights_from_tensor", [n for n, _ in named], False),
        ("resume_memory_occupation", ["kv_cache"]),
        ("flush_cache",),
    ]
    assert strategy.weight_version == 7
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(p.data, dict(named)[name])

    meta, handle = shm_bucket(
        SimpleNamespace(workers=[SimpleNamespace(model_runner=SimpleNamespace(model=engine.model))]), 8, 9.0
    )
    sums = strategy.load_shared_bucket(meta, handle, verify=True)
    assert len(sums) == len(meta.tensors) and engine.model.proj.bias[0].item() == 10.0

    with pytest.raises(RuntimeError, match="before init_weights_update_group"):
        strategy.update_weights_from_distributed("g", meta)
    strategy.init_weights_update_group("10.0.0.1", 1234, 1, 3, "g")
    strategy.update_weights_from_distributed("g", meta)
    kwargs = engine.calls[-1][1]
    assert kwargs["names"] == ["proj.weight", "proj.bias"] and kwargs["dtypes"] == ["float32", "float32"]
    assert kwargs["shapes"] == [[3, 4], [3]] and kwargs["group_name"] == "g"
    assert kwargs["load_format"] == "flattened_bucket" and kwargs["flush_cache"] is False
    assert engine.calls[-2] == (
        "init_weights_update_group",
        dict(
            master_address="10.0.0.1",
            master_port=1234,
            rank_offset=1,
            world_size=3,
            group_name="g",
            backend="nccl",
        ),
    )
    strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=2))  # flushes the radix cache first
    assert ("flush_cache",) == engine.calls[-1]


def test_sglang_vl_engine_starts_without_the_vision_embedding_cache(
    fake_engines, tokenizer_dir, tmp_path, monkeypatch
):
    """SGLang's vision-encoder cache outlives weight updates: a VL engine starts with it off (unless
    the run set it) and sends Qwen2.5-VL weights under its loader's names; a text engine keeps both."""
    from tiny_vl import build_tiny_vl_dir

    monkeypatch.delenv("SGLANG_VLM_CACHE_SIZE_MB", raising=False)
    _, text_engine = sglang_strategy(tokenizer_dir)
    assert text_engine.vlm_cache_env is None
    vl_dir = str(build_tiny_vl_dir(tmp_path / "vl"))
    cls = load_strategy_class("sglang")
    strategy = cls(make_role("sglang", SGLangConfig(), vl_dir), ctx())
    strategy.initialize()
    engine = FakeSGLangEngine.instances[-1]
    assert engine.vlm_cache_env == "0"
    assert strategy.engine_calls.rename("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "64")
    cls(make_role("sglang", SGLangConfig(), vl_dir), ctx()).initialize()
    assert FakeSGLangEngine.instances[-1].vlm_cache_env == "64"


def test_sglang_judge_role_keeps_its_weights(fake_engines, tokenizer_dir):
    strategy, engine = sglang_strategy(tokenizer_dir, role="rewards.judge")
    strategy.offload_states()
    strategy.reload_states()
    strategy.generate(prompt_batch([[5]]), SamplingParams(max_new_tokens=2))
    assert engine.calls == [
        ("release_memory_occupation", ["kv_cache"]),
        ("resume_memory_occupation", ["kv_cache"]),
    ]
    # load_format: dummy on a judge is refused before launch (tests/test_launch_checks.py)


# ============================================================================ shared failures


@pytest.mark.parametrize(
    "name, cfg, key",
    [
        ("vllm", VLLMConfig(engine_kwargs={"swap_spcae": 1}), "engine_kwargs.swap_spcae"),
        ("sglang", SGLangConfig(engine_kwargs={"log_levle": "info"}), "engine_kwargs.log_levle"),
    ],
)
def test_unknown_engine_option_is_a_config_error(fake_engines, tokenizer_dir, name, cfg, key):
    strategy = load_strategy_class(name)(make_role(name, cfg, tokenizer_dir), ctx())
    with pytest.raises(ConfigError) as err:
        strategy.initialize()
    assert err.value.path == f"actor_infer.strategy_args.strategy_config.{key}"
    assert "did you mean" in str(err.value)


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_missing_engine_names_the_extra(monkeypatch, tokenizer_dir, name):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import <name>` raise ImportError
    with pytest.raises(ConfigError, match=rf"pip install -e \.\[{name}\]"):
        load_strategy_class(name)
    module = importlib.import_module(f"roll.distributed.strategy.{name}_strategy")
    cls = module.VLLMStrategy if name == "vllm" else module.SGLangStrategy
    cfg = VLLMConfig() if name == "vllm" else SGLangConfig()
    with pytest.raises(ConfigError) as err:
        cls(make_role(name, cfg, tokenizer_dir), ctx()).initialize()
    assert err.value.path == "actor_infer.strategy_args.strategy_name"
    assert f"pip install -e .[{name}]" in str(err.value)


# ================================================================================ configs


ENGINE_CONFIG = """
num_gpus_per_node: 4
pretrain: /tmp/model
rollout_batch_size: 8
num_return_sequences_in_group: 4
prompt_length: 64
response_length: 32
actor_train:
  model_args: {{model_name_or_path: "${{pretrain}}"}}
  training_args: {{per_device_train_batch_size: 2, gradient_accumulation_steps: 2}}
  strategy_args: {{strategy_name: fsdp2_train}}
  device_mapping: "0-3"
actor_infer:
  model_args: {{model_name_or_path: "${{pretrain}}"}}
  generating_args: {{max_new_tokens: "${{response_length}}", num_return_sequences: "${{num_return_sequences_in_group}}"}}
  strategy_args:
    strategy_name: {infer}
    strategy_config: {infer_cfg}
  device_mapping: "0-3"
rewards:
  judge:
    reward_fn: llm_judge
    judge_prompt: "Q: {{question}} A: {{response}} Ref: {{reference}} Verdict [[yes]] or [[no]]:"
    model_args: {{model_name_or_path: /tmp/judge}}
    strategy_args:
      strategy_name: {judge}
      strategy_config: {judge_cfg}
    device_mapping: "4-5"
"""


@pytest.mark.parametrize(
    "infer, infer_cfg, judge, judge_cfg",
    [
        (
            "vllm",
            "{tensor_parallel_size: 2, sleep_level: 1, load_format: dummy, max_model_len: 96}",
            "sglang",
            "{tensor_parallel_size: 2}",
        ),
        # Level 2 colocated: the engine drops its weights asleep; each wake refills them
        # (roll.pipeline.rlvr.stages.engine_awake).
        ("vllm", "{tensor_parallel_size: 2, sleep_level: 2, load_format: dummy}", "sglang", "{}"),
        (
            "sglang",
            "{tensor_parallel_size: 2, mem_fraction_static: 0.5, load_format: dummy}",
            "vllm",
            "{gpu_memory_utilization: 0.5, sleep_level: 1}",
        ),
    ],
)
def test_engine_configs_validate_and_dry_run(tmp_path, capsys, infer, infer_cfg, judge, judge_cfg):
    from roll.launch.rlvr import main

    text = ENGINE_CONFIG.format(infer=infer, infer_cfg=infer_cfg, judge=judge, judge_cfg=judge_cfg)
    (tmp_path / "engines.yaml").write_text(text.replace("num_gpus_per_node: 4", "num_gpus_per_node: 8"))
    files = make_launch_files(tmp_path / "files", ("engines",))  # model dirs and prompts must exist
    paths = [
        *launch_overrides(files, validation=False),
        f"rewards.judge.model_args.model_name_or_path={files['model']}",
    ]
    assert main(["--config_name", "engines", "--config_path", str(tmp_path), "--dry_run", *paths]) == 0
    plan = capsys.readouterr().out
    assert re.search(rf"actor_infer\s+{infer}\s", plan) and re.search(rf"rewards.judge\s+{judge}\s", plan)
    assert "TP=2" in plan
    # an option the typed config does not know is one ConfigError line naming the key
    (tmp_path / "bad.yaml").write_text(
        text.replace("strategy_config: {", "strategy_config: {block_sise: 8, ", 1)
    )
    assert main(["--config_name", "bad", "--config_path", str(tmp_path), "--dry_run"]) == 2
    assert "actor_infer.strategy_args.strategy_config.block_sise" in capsys.readouterr().err


@pytest.mark.parametrize(
    "infer_cfg, key, hint",
    [
        ("{sleep_level: 1, gpu_memory_utilization: 0.95}", "gpu_memory_utilization", "at most 0.9"),
    ],
)
def test_colocated_vllm_settings_that_cannot_time_share_are_refused_before_launch(
    tmp_path, capsys, infer_cfg, key, hint
):
    from roll.launch.rlvr import main

    text = ENGINE_CONFIG.format(infer="vllm", infer_cfg=infer_cfg, judge="vllm", judge_cfg="{sleep_level: 1}")
    (tmp_path / "bad.yaml").write_text(text.replace("num_gpus_per_node: 4", "num_gpus_per_node: 8"))
    assert main(["--config_name", "bad", "--config_path", str(tmp_path), "--dry_run"]) == 2
    err = capsys.readouterr().err
    assert f"actor_infer.strategy_args.strategy_config.{key}" in err and hint in err


def test_example_vllm_config_dry_runs_in_a_subprocess(tmp_path):
    # The shipped file names a GPU checkpoint absent here: point it at files made here.
    name = "qwen2.5-7B-rlvr_megatron_8gpus"
    raw = point_at_files(yaml.safe_load((REPO / "examples/config" / f"{name}.yaml").read_text()), tmp_path)
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [
            sys.executable,
            "examples/start_rlvr_pipeline.py",
            "--config_name",
            name,
            "--config_path",
            str(tmp_path),
            "--dry_run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "vllm" in proc.stdout


@pytest.mark.parametrize(
    "installed, ok", [("0.24.0", True), ("0.24.3.post1", True), ("0.23.1", False), ("0.25.0", False)]
)
def test_wrong_vllm_version_is_a_config_error_before_launch(monkeypatch, installed, ok):
    import importlib.metadata

    from roll.configs.strategies import check_engine_version, get_strategy_spec

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: installed if name == "vllm" else real(name)
    )
    spec = get_strategy_spec("vllm")
    if ok:
        check_engine_version(spec, "actor_infer.strategy_args.strategy_name")
    else:
        with pytest.raises(
            ConfigError, match=rf"actor_infer.strategy_args.strategy_name.*{installed} is installed"
        ):
            check_engine_version(spec, "actor_infer.strategy_args.strategy_name")


def test_engine_not_installed_where_launched_is_left_to_the_workers(monkeypatch):
    import importlib.metadata

    from roll.configs.strategies import check_engine_version, get_strategy_spec

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    check_engine_version(get_strategy_spec("vllm"), "actor_infer.strategy_args.strategy_name")
