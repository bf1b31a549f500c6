"""Rollout throughput: the same prompts and model through roll's inference strategies and raw vLLM.

Each row runs in its own process (so GPU memory and peaks do not mix), generating ``--new_tokens``
tokens past EOS (``ignore_eos``) for every one of ``--prompts`` random prompts of ``--prompt_len``
tokens at temperature 1, with the sampled tokens' log-probs, on one GPU in bf16:

- ``raw_vllm``: vLLM's engine driven directly (``llm.llm_engine.add_request`` / ``step``) with what
  roll's strategy sends: its engine options, the engine core in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the requests of ``vllm_generate_requests`` (our ids, ``n``
  per request, ``logprobs=0``, final output only), seeded as the strategy's ``seed_mode`` (the
  engine's generator once per call; ``--seed_mode request``: every request);
- ``raw_vllm_mp``: the same requests through ``vllm.LLM.generate`` in vLLM's default layout (engine
  core in its own process), as vLLM users call it;
- ``vllm``: roll's ``vllm`` strategy (the same requests, plus its bookkeeping and Batch conversion);
- ``raw_sglang``: one ``sglang.Engine.generate`` call with what roll's strategy sends: its engine
  options and the requests of ``sglang_generate_requests`` (one per sample, our ids, per-request
  seeds, ``return_logprob``);
- ``sglang``: roll's ``sglang`` strategy;
- ``hf_infer``: roll's transformers ``generate`` strategy, ``--hf_batch`` prompts at a time;
- ``megatron_infer``: roll's megatron-core KV-cached generation, ``--hf_batch`` prompts at a time.

The raw rows and roll's share the engine options (``roll.distributed.strategy.engine_options``),
the sampling parameters (``sampling_params``) and the request builders
(``roll.distributed.strategy.engine_requests``), so a raw row against roll's is the strategy's own
overhead. Peak memory is the device's used memory (all
processes), sampled every 50 ms.

    python examples/make_random_checkpoint.py --preset qwen2.5-1.5b --out output/qwen2.5-1.5b-random
    python benchmarks/rollout.py --model output/qwen2.5-1.5b-random --rows raw_vllm,vllm,hf_infer,megatron_infer
    python benchmarks/rollout.py --model output/default_example/sft_model --prompts 64 --new_tokens 32 --rows vllm  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from roll.configs.strategy_configs import VLLM_SEED_MODES  # noqa: E402

ROWS = ("raw_vllm", "raw_vllm_mp", "vllm", "raw_sglang", "sglang", "hf_infer", "megatron_infer")
WARMUP_PROMPTS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory (with its tokenizer)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=512)
    parser.add_argument(
        "--hf_batch", type=int, default=128, help="prompts per call for hf_infer/megatron_infer"
    )
    parser.add_argument(
        "--gpu_memory_utilization", type=float, default=0.85, help="vLLM's; SGLang's mem_fraction_static"
    )
    parser.add_argument(
        "--enforce_eager", action="store_true", help="engine rows without CUDA graphs (and vLLM's compile)"
    )
    parser.add_argument(
        "--torch_compile",
        action="store_true",
        help="vLLM rows with torch.compile (the strategy's torch_compile: true)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seed_mode",
        choices=VLLM_SEED_MODES,
        default="step",
        help="vLLM rows: seed the engine's generator once per call (roll's default) or every request",
    )
    parser.add_argument(
        "--no_logprobs", action="store_true", help="do not ask for the sampled tokens' log-probs"
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one row, write JSON
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------- one row


def prompt_ids(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    return torch.randint(3, min(vocab, 30000), (args.prompts, args.prompt_len), generator=gen).tolist()


def role_config(args: argparse.Namespace, strategy: str, **strategy_config):
    from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs

    sargs = StrategyArgs(strategy, strategy_config=strategy_config)
    return RoleConfig(
        model_args=ModelArgs(model_name_or_path=args.model, dtype="bf16"),
        strategy_args=sargs,
        infer_batch_size=args.hf_batch,
    )


def vllm_config(args: argparse.Namespace) -> dict:
    return dict(
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        torch_compile=args.torch_compile,
        sleep_level=0,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        seed_mode=args.seed_mode,
    )


def sglang_config(args: argparse.Namespace) -> dict:
    return dict(
        mem_fraction_static=args.gpu_memory_utilization,
        disable_cuda_graph=args.enforce_eager,
        context_length=args.prompt_len + args.new_tokens + 16,
    )


def sampling_params(args: argparse.Namespace):
    """What every row asks for: one sample a prompt, ``--new_tokens`` past EOS, temperature 1, the
    sampled tokens' log-probs (unless ``--no_logprobs``), seeded."""
    from roll.core.sampling import SamplingParams

    return SamplingParams(
        n=1,
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        ignore_eos=True,
        logprobs=not args.no_logprobs,
        seed=args.seed,
    )


def raw_sglang_requests(args: argparse.Namespace, prompts: list[list[int]], prefix: str, context_len):
    """``Engine.generate`` keyword arguments with exactly what roll's sglang strategy passes."""
    from roll.distributed.strategy.engine_requests import RequestPlan, sglang_generate_requests

    params = sampling_params(args)
    plan = RequestPlan(prefix, len(prompts), params.n, per_sample=True)
    requests = sglang_generate_requests(plan, prompts, params, context_len)
    return {
        "input_ids": [r.prompt_ids for r in requests],
        "sampling_params": [r.sampling for r in requests],
        "return_logprob": params.logprobs,
        "rid": [r.request_id for r in requests],
    }


def raw_vllm_requests(args: argparse.Namespace, prompts: list[list[int]], prefix: str):
    """``(request id, prompt ids, vllm.SamplingParams kwargs)`` as roll's vllm strategy submits them
    (with ``--seed_mode step``, unseeded: the caller seeds the engine's generator instead)."""
    import dataclasses

    from roll.distributed.strategy.engine_requests import RequestPlan, vllm_generate_requests

    params = sampling_params(args)
    if args.seed_mode == "step":
        params = dataclasses.replace(params, seed=None)
    plan = RequestPlan(prefix, len(prompts), params.n, per_sample=False)
    return [(r.request_id, r.prompt_ids, r.sampling) for r in vllm_generate_requests(plan, prompts, params)]


def run_raw_sglang(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[int, float]:
    """SGLang's offline engine with roll's engine options and roll's requests, one call."""
    import sglang

    from roll.configs.strategy_configs import SGLangConfig
    from roll.distributed.strategy.engine_options import sglang_engine_options

    cfg = SGLangConfig(**sglang_config(args))
    options = sglang_engine_options(cfg, role_config(args, "sglang", **sglang_config(args)), "raw", args.seed)
    engine = sglang.Engine(**options.kwargs)
    context = getattr(engine.tokenizer_manager, "context_len", None)
    engine.generate(**raw_sglang_requests(args, prompts[:WARMUP_PROMPTS], "warm", context))
    request = raw_sglang_requests(args, prompts, "raw", context)
    start = time.perf_counter()
    outs = engine.generate(**request)
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return sum(o["meta_info"]["completion_tokens"] for o in outs), elapsed


def _vllm_llm(args: argparse.Namespace, in_process: bool):
    import vllm

    from roll.configs.strategy_configs import VLLMConfig
    from roll.distributed.strategy.engine_options import vllm_engine_options

    if in_process:  # as roll's strategy runs it (vllm_strategy.py's module docstring)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cfg = VLLMConfig(**vllm_config(args))
    options = vllm_engine_options(cfg, role_config(args, "vllm", **vllm_config(args)), "raw", args.seed, "")
    drop = ("worker_extension_cls", "distributed_executor_backend")
    return vllm.LLM(**{k: v for k, v in options.kwargs.items() if k not in drop})


def run_raw_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[int, float]:
    """vLLM's engine loop in-process with roll's options and requests (see the module docstring)."""
    import torch
    import vllm

    engine = _vllm_llm(args, in_process=True).llm_engine
    final_only = vllm.sampling_params.RequestOutputKind.FINAL_ONLY

    def run(requests) -> int:
        if args.seed_mode == "step":  # what the strategy's roll_manual_seed does in the worker
            torch.manual_seed(args.seed)
        for rid, prompt, kwargs in requests:
            engine.add_request(
                rid, {"prompt_token_ids": prompt}, vllm.SamplingParams(**kwargs, output_kind=final_only)
            )
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(c.token_ids) for o in engine.step() if o.finished for c in o.outputs)
        return tokens

    run(raw_vllm_requests(args, prompts[:WARMUP_PROMPTS], "warm"))
    requests = raw_vllm_requests(args, prompts, "raw")
    start = time.perf_counter()
    tokens = run(requests)
    return tokens, time.perf_counter() - start


def run_raw_vllm_mp(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[int, float]:
    """The same requests through ``LLM.generate``, engine core in its own process (vLLM's default)."""
    import vllm

    llm = _vllm_llm(args, in_process=False)

    def run(requests) -> int:
        inputs = [{"prompt_token_ids": prompt} for _, prompt, _ in requests]
        params = [vllm.SamplingParams(**kwargs) for _, _, kwargs in requests]
        outs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    run(raw_vllm_requests(args, prompts[:WARMUP_PROMPTS], "warm"))
    requests = raw_vllm_requests(args, prompts, "raw")
    start = time.perf_counter()
    tokens = run(requests)
    return tokens, time.perf_counter() - start


def run_strategy(args: argparse.Namespace, name: str, prompts: list[list[int]]) -> tuple[int, float]:
    import torch

    from roll.core.batch import Batch
    from roll.core.worker_context import WorkerContext
    from roll.distributed.strategy.registry import load_strategy_class

    extra = {"vllm": vllm_config, "sglang": sglang_config}.get(name, lambda _: {})(args)
    ctx = WorkerContext(
        role="actor_infer", rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), seed=args.seed
    )
    strategy = load_strategy_class(name)(role_config(args, name, **extra), ctx)
    strategy.initialize()
    params = sampling_params(args)

    def batch(rows: list[list[int]]) -> Batch:
        t = torch.tensor(rows, dtype=torch.long)
        return Batch.from_dict(
            {"prompts": t, "prompt_mask": torch.ones_like(t)}, {"uid": [str(i) for i in range(len(rows))]}
        )

    strategy.generate(batch(prompts[:WARMUP_PROMPTS]), params)  # warm-up: compile, graphs, allocator
    step = len(prompts) if name in ("vllm", "sglang") else args.hf_batch
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), step):
        out = strategy.generate(batch(prompts[i : i + step]), params)
        tokens += int(out["response_mask"].sum())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if hasattr(strategy, "shutdown"):
        strategy.shutdown()
    return tokens, elapsed


def run_one(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig

    from roll.utils.memory import DeviceMemoryMonitor

    monitor = DeviceMemoryMonitor(torch.device("cuda", 0))
    prompts = prompt_ids(args, AutoConfig.from_pretrained(args.model).vocab_size)
    raw = {"raw_vllm": run_raw_vllm, "raw_vllm_mp": run_raw_vllm_mp, "raw_sglang": run_raw_sglang}
    if args.one in raw:
        tokens, elapsed = raw[args.one](args, prompts)
    else:
        tokens, elapsed = run_strategy(args, args.one, prompts)
    peak = monitor.take_peak() / 2**30
    monitor.stop()
    Path(args.result).write_text(
        json.dumps({"row": args.one, "tokens": tokens, "seconds": elapsed, "peak_gib": peak})
    )


# ---------------------------------------------------------------------------------- the table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        run_one(args)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    results = []
    for row in rows:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            given = sys.argv[1:] if argv is None else argv
            cmd = [sys.executable, __file__, *given, "--one", row, "--result", out.name]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=os.environ.copy())
            if proc.returncode != 0:
                print(f"{row}: failed with exit code {proc.returncode}", flush=True)
                continue
            result = json.loads(Path(out.name).read_text())
            result["wall_s"] = time.perf_counter() - t0
            results.append(result)
            print(f"{row}: {result['tokens'] / result['seconds']:.0f} tokens/s", flush=True)
    print_table(args, results)
    return 0


def print_table(args: argparse.Namespace, results: list[dict]) -> None:
    """tokens/s per row, relative to raw vLLM and to the raw run of the row's own engine."""
    rate = {r["row"]: r["tokens"] / r["seconds"] for r in results}

    def rel(row: str, base: str) -> str:
        return f"{rate[row] / rate[base]:.2f}x" if base in rate else "-"

    print(
        f"\n{args.prompts} prompts x {args.prompt_len} tokens -> {args.new_tokens} new tokens, bf16, {Path(args.model).name}, "
        f"vLLM seeds per {args.seed_mode}, log-probs {'off' if args.no_logprobs else 'on'}"
    )
    print(
        f"{'row':<16}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}{'vs raw vLLM':>13}{'vs raw same':>13}"
        f"{'peak GiB':>10}{'process s':>11}"
    )
    for r in results:
        row = r["row"]
        own = "raw_sglang" if "sglang" in row else "raw_vllm"
        print(
            f"{row:<16}{r['tokens']:>10}{r['seconds']:>10.2f}{rate[row]:>12.0f}{rel(row, 'raw_vllm'):>13}"
            f"{rel(row, own) if own != row else '-':>13}{r['peak_gib']:>10.1f}{r['wall_s']:>11.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
