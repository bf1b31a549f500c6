"""KV-cached autoregressive sampling over megatron GPT model chunks (no TE, no inference engine).

Prompts are LEFT-padded into one [N, L] block; megatron's ``StaticInferenceContext`` keeps each
layer's keys/values ([max_seq, N, groups * dim]), so after the prefill every step feeds one token
per row. Attention masks (bool, True = masked) hide the left padding: query q may see key k when
k <= q and k is a real token (or k == q, so padding rows never attend to nothing). RoPE runs on
column indices; with left padding that shifts all of a row's positions equally, which leaves
every query-key angle, and so the attention, unchanged.

With PP > 1 each forward goes through megatron's pipeline schedule (one micro-batch); the last
stage samples, and the tokens are broadcast over TP and PP so every rank keeps the same state.

>>> tokens, logps = generate_tokens(chunks, prompts, params, eos_ids, vocab_size=151936, pad_id=0)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from roll.configs.errors import ConfigError
from roll.core.sampling import SamplingParams
from roll.models.megatron.sampling import sample_next


def attention_mask(valid: torch.Tensor, q_start: int) -> torch.Tensor:
    """[N, 1, q, k] bool mask (True = masked) for queries at columns q_start.. of ``valid`` [N, k]."""
    keys = valid.shape[1]
    q_pos = torch.arange(q_start, keys, device=valid.device)[:, None]
    k_pos = torch.arange(keys, device=valid.device)[None, :]
    allowed = (k_pos <= q_pos) & (valid[:, None, :] | (k_pos == q_pos))
    return ~allowed.unsqueeze(1)


def _last_logits(chunks: list[torch.nn.Module], ids, positions, mask, context) -> torch.Tensor | None:
    """Full-vocab logits [N, V] of the last column (None off the last pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if ps.get_pipeline_model_parallel_world_size() == 1:
        out = chunks[0](ids, positions, mask, inference_context=context, runtime_gather_output=True)
        return out[:, -1]

    def step(data_iterator, model):
        next(data_iterator)
        out = model(ids, positions, mask, inference_context=context, runtime_gather_output=True)
        return out, lambda logits: (torch.zeros((), device=logits.device), {"logits": logits[:, -1]})

    payloads = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([None]),
        model=chunks[0],
        num_microbatches=1,
        seq_length=ids.shape[1],
        micro_batch_size=ids.shape[0],
        forward_only=True,
    )
    return payloads[0]["logits"] if payloads else None


def _shared_sample(sampled: tuple[torch.Tensor, torch.Tensor] | None, rows: int, device: torch.device):
    """(token ids [N] long, log-probs [N] fp32) as the last stage's TP rank 0 drew them, on every
    rank of this model-parallel replica (one broadcast of both; none without TP or PP)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1:
        return sampled[0], sampled[1].float()
    picked = None if sampled is None else torch.stack([sampled[0].float(), sampled[1].float()])
    picked = _share(picked, (2, rows), device)
    return picked[0].long(), picked[1]


def _share(tensor: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The last stage's TP-rank-0 fp32 tensor, on every rank of this model-parallel replica."""
    from megatron.core import parallel_state as ps

    out = tensor if tensor is not None else torch.empty(shape, dtype=torch.float32, device=device)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(
            out, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group()
        )
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            out, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    return out


def _agree(width: int, rows: int, group, device: torch.device) -> int:
    """The widest prompt over ``group``; its ranks must hold the same number of rows."""
    if group is None or dist.get_world_size(group) == 1:
        return width
    sizes = torch.tensor([width, rows, -rows], device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[1]) != -int(sizes[2]):
        raise ValueError(
            "expert-parallel generation needs the same number of prompts on every data-parallel rank"
        )
    return int(sizes[0])


def _all_done(done: torch.Tensor, group) -> bool:
    finished = done.all().to(torch.int32).reshape(1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(finished, op=dist.ReduceOp.MIN, group=group)
    return bool(finished)


@torch.no_grad()
def generate_tokens(
    chunks: list[torch.nn.Module],
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: list[int],
    vocab_size: int,
    pad_id: int,
    stop_check: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    sync_group=None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample up to ``params.max_new_tokens`` tokens for each prompt (one row per prompt).

    Returns each row's tokens (cut after the first EOS / stop token, or where ``stop_check``
    fired) and their log-probs. ``stop_check(generated [N, t], t)`` returns rows to stop.
    ``sync_group``: data-parallel ranks that must step together (expert-parallel MoE layers
    exchange tokens every forward): they agree on the prompt width and stop when all are done.
    """
    from megatron.core.inference.contexts import StaticInferenceContext

    if len(chunks) > 1:
        raise ValueError("megatron_infer generation does not support virtual pipeline stages")
    if chunks[0].config.sequence_parallel:
        raise ValueError("megatron_infer generation needs sequence_parallel: false")
    if getattr(chunks[0].config, "experimental_attention_variant", None) is not None:
        raise ConfigError(
            "strategy_args.strategy_name",
            "megatron_infer cannot generate with linear-attention layers (Qwen3-Next's Gated "
            "DeltaNet keeps no cache here); generate with vllm or sglang",
        )
    device = next(chunks[0].parameters()).device
    rows, width = len(prompts), _agree(max(len(p) for p in prompts), len(prompts), sync_group, device)
    total = width + params.max_new_tokens
    tokens = torch.full((rows, total), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(rows, total, dtype=torch.bool, device=device)
    for i, prompt in enumerate(prompts):
        tokens[i, width - len(prompt) : width] = torch.as_tensor(prompt, device=device)
        valid[i, width - len(prompt) : width] = True
    context = StaticInferenceContext(rows, total)
    eos = torch.as_tensor(eos_ids or [-1], device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.full((rows,), params.max_new_tokens, dtype=torch.long, device=device)
    logps = torch.zeros(rows, params.max_new_tokens, dtype=torch.float32, device=device)
    positions = torch.arange(total, device=device).expand(rows, -1)
    # Decode steps' masks, kept up to date instead of rebuilt: True = a key later queries must not
    # see (left padding, a finished row's padding). A step's own column stays False until its
    # forward is done, so the query sees itself (attention_mask's k == q) whatever its row's state.
    blocked = ~valid
    blocked[:, width:] = False
    start, cur = 0, width
    for step in range(params.max_new_tokens):
        mask = attention_mask(valid[:, :cur], start) if step == 0 else blocked[:, None, None, :cur]
        logits = _last_logits(chunks, tokens[:, start:cur], positions[:, start:cur], mask, context)
        context.sequence_len_offset += cur - start
        if step == 0:
            context.enable_decode_mode()
        else:
            torch.logical_not(valid[:, start], out=blocked[:, start])
        sampled = None
        if logits is not None:
            sampled = sample_next(
                logits[:, :vocab_size], params, tokens[:, :cur], valid[:, :cur], step, eos_ids
            )
        nxt, logp = _shared_sample(sampled, rows, device)
        nxt = nxt.masked_fill(done, pad_id)
        tokens[:, cur], valid[:, cur], logps[:, step] = nxt, ~done, logp
        finished = ~done & torch.isin(nxt, eos)
        if stop_check is not None:
            finished |= ~done & stop_check(tokens[:, width : cur + 1], step + 1)
        lengths.masked_fill_(finished, step + 1)
        done |= finished
        start, cur = cur, cur + 1
        if _all_done(done, sync_group):
            break
    out_tokens = tokens[:, width:].tolist()
    out_logps = logps.tolist()
    return [t[:n] for t, n in zip(out_tokens, lengths.tolist())], [
        p[:n] for p, n in zip(out_logps, lengths.tolist())
    ]


def make_stop_check(stop: list[str], tokenizer, min_new_tokens: int) -> Callable | None:
    """A ``stop_check`` that fires when a row's recent text contains a stop string (None if none)."""
    stop = [s for s in stop or [] if s]
    if not stop:
        return None
    window = max(len(s) for s in stop) + 8

    def check(generated: torch.Tensor, count: int) -> torch.Tensor:
        hit = torch.zeros(generated.shape[0], dtype=torch.bool, device=generated.device)
        if count < max(1, min_new_tokens):
            return hit
        for row, ids in enumerate(generated[:, -window:].tolist()):
            hit[row] = any(s in tokenizer.decode(ids) for s in stop)
        return hit

    return check
