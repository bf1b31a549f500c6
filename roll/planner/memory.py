"""Peak device memory of one rank of a role, as pure functions of model sizes and options.

Every function returns bytes by component (``params``, ``grads``, ``optimizer``, ``activations``,
``logits``, ``kv_cache``, ``engine``, ``buffers``). The formulas, per rank:

- training state (mixed precision, Adam): bf16 params 2 B + fp32 grads 4 B + fp32 main params and
  two moments 12 B per parameter; the distributed optimizer / FSDP divide the 12 B (FSDP: all
  16 B) by the data-parallel size (under HSDP by `fsdp_size`); fp32 training keeps 4 + 4 + 8 B;
- activations: per token and layer, the tensors autograd keeps (norms, q/k/v, attention output,
  MLP or top-k expert widths; Gated DeltaNet layers: in_proj, conv, the delta rule's inputs and
  per-chunk matrix, gated norm), divided by TP where Megatron splits them (all of them with
  sequence parallelism); full recompute keeps only each layer's bf16 input plus one layer's tensors;
- log-prob temporaries: bf16 logits [tokens, vocab / TP] (and their gradient when training) plus
  two fp32 row chunks of 256 MiB (roll.models.logprobs bounds the fp32 copies that way);
- KV cache: K and V of every full-attention layer for every row and position (megatron_infer
  allocates it for the whole sequence up front; transformers' cache grows by concatenation, which
  leaves about as much again in the allocator's cache), plus each Gated DeltaNet layer's fp32
  recurrent state and conv history per row.
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.planner.model_shape import ModelShape

GIB = 1 << 30
# roll.models.logprobs turns at most 2**26 logits at a time into fp32 (256 MiB); two are live.
LOGPROB_CHUNK_BYTES = 2 * (1 << 26) * 4


@dataclass(frozen=True)
class Split:
    """How one rank holds the model: Megatron's parallel sizes (all 1 for a full replica)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    vocab_multiple: int = 1  # the vocabulary is padded to a multiple of this x TP
    # Decoder layers each PP rank holds (all its virtual stages), where the split is uneven
    # (pipeline_model_parallel_layout, num_layers_in_first/last_pipeline_stage); empty: layers / PP.
    stage_layers: tuple[int, ...] = ()

    def vocab(self, shape: ModelShape) -> int:
        multiple = self.vocab_multiple * self.tp
        return -(-shape.vocab // multiple) * multiple


def rank_params(shape: ModelShape, split: Split) -> tuple[int, int]:
    """(non-expert, expert) parameters on one rank; the worst pipeline stage (the one with the
    embedding or the output head, and under an uneven split the most decoder layers)."""
    vocab = split.vocab(shape)
    if split.pp == 1:
        embedding = vocab * shape.hidden * (1 if shape.tied else 2)
    else:
        embedding = vocab * shape.hidden  # first stage: embedding; last stage: head
    most = max(split.stage_layers, default=0)
    if most and most * split.pp != shape.layers:  # uneven: the rank with the most layers
        layers_dense = shape.layer_dense_params() * most // shape.layers
        return (layers_dense + embedding) // split.tp + shape.hidden, (
            shape.expert_params() * most // (shape.layers * split.ep * split.etp)
        )
    dense = (shape.layer_dense_params() // split.pp + embedding) // split.tp + shape.hidden
    expert = shape.expert_params() // (split.pp * split.ep * split.etp)
    return dense, expert


def training_state(params: int, dtype_bytes: int, optimizer_shards: int = 1) -> dict[str, int]:
    """Parameters, gradients and Adam state of ``params`` parameters; the optimizer's share is
    divided by ``optimizer_shards`` (distributed optimizer: the data-parallel size)."""
    if dtype_bytes >= 4:
        return {"params": 4 * params, "grads": 4 * params, "optimizer": 8 * params // optimizer_shards}
    return {"params": 2 * params, "grads": 4 * params, "optimizer": 12 * params // optimizer_shards}


def _linear_attention_bytes(shape: ModelShape) -> int:
    """Per token, what one Gated DeltaNet layer keeps: in_proj's output, the conv's input and
    output, q/k repeated to the value heads, fp32 decay and beta, the per-chunk (64) triangular
    matrix of fla's kernel, and the core output, its norm and gate."""
    heads, conv, v = shape.linear_v_heads, shape.linear_conv_dim, shape.linear_v_heads * shape.linear_v_dim
    in_proj = 2 * (conv + v + 2 * heads)
    return in_proj + 4 * conv + 4 * heads * shape.linear_k_dim + 4 * 64 * heads + 8 * heads + 6 * v


def _attention_bytes(shape: ModelShape) -> int:
    """Per token of an average layer: q/k/v before and after RoPE, the attention output (and the
    output gate and gated output), Gated DeltaNet layers averaged in."""
    q, kv = shape.q_dim, shape.kv_dim
    full = 4 * (q + 2 * kv) + 2 * q + (4 * q if shape.attn_gate else 0)
    if not shape.linear_layers:
        return full
    linear = _linear_attention_bytes(shape)
    return (full * shape.attention_layers + linear * shape.linear_layers) // shape.layers


def layer_activation_bytes(shape: ModelShape, tokens: int, split: Split = Split()) -> int:
    """Bytes autograd keeps for one average layer over ``tokens`` tokens (bf16, no recompute)."""
    h = shape.hidden
    # Norm inputs/outputs and the residual in bf16, and the fp32 copies of both RMSNorms.
    per_hidden = 2 * 4 * h + 16 * h
    attention = _attention_bytes(shape)
    if shape.moe_layers:
        # Tokens are copied top_k times into the experts; router logits and probs in fp32.
        moe = shape.top_k * (2 * h + 8 * shape.moe_ffn // split.etp) + 8 * shape.experts
        dense = 8 * shape.ffn // split.tp
        mlp = (moe * shape.moe_layers + dense * (shape.layers - shape.moe_layers)) // shape.layers
    else:
        mlp = 8 * shape.ffn // split.tp
    attention //= split.tp
    if split.sequence_parallel:
        per_hidden //= split.tp
    return tokens * (per_hidden + attention + mlp) // split.cp


def forward_bytes(shape: ModelShape, tokens: int, split: Split = Split()) -> int:
    """What is live at once inside one layer of a forward pass without autograd: the layer input
    and residual, plus the larger of attention's q/k/v/output and the MLP's gate/up/product."""
    h = shape.hidden
    attention = 2 * (2 * shape.q_out + 2 * shape.kv_dim)
    if shape.linear_layers:  # in_proj's output, the conv's output and the core output
        width = shape.linear_conv_dim + 2 * shape.linear_v_heads * shape.linear_v_dim
        attention = max(attention, 2 * (width + shape.linear_conv_dim))
    attention //= split.tp
    if shape.moe_layers:
        mlp = shape.top_k * (2 * h + 6 * shape.moe_ffn // split.etp)
    else:
        mlp = 6 * shape.ffn // split.tp
    return tokens * (4 * h + max(attention, mlp)) // split.cp


def optimizer_step_bytes(main_params: int) -> int:
    """torch's foreach AdamW allocates fp32 temporaries the size of the parameters it steps."""
    return 4 * main_params


def activations(shape: ModelShape, tokens: int, split: Split = Split(), recompute: bool = False) -> int:
    """What one micro-batch of ``tokens`` keeps for the backward pass on one rank."""
    layer = layer_activation_bytes(shape, tokens, split)
    if not recompute:
        return layer * shape.layers
    kept = 2 * shape.hidden * tokens // split.cp
    if split.sequence_parallel:
        kept //= split.tp
    return kept * shape.layers + layer


def logit_bytes(shape: ModelShape, tokens: int, split: Split = Split(), train: bool = False) -> int:
    """Log-prob temporaries: bf16 logits [tokens, vocab / TP] (+ their gradient) and fp32 chunks."""
    logits = tokens * split.vocab(shape) // split.tp * 2
    return logits * (2 if train else 1) + min(LOGPROB_CHUNK_BYTES, 4 * tokens * shape.vocab)


def kv_cache_bytes(shape: ModelShape, rows: int, seq_len: int, tp: int = 1, dtype_bytes: int = 2) -> int:
    """K and V of every full-attention layer for ``rows`` sequences of ``seq_len`` positions, kv heads
    split by TP; plus each Gated DeltaNet layer's fp32 state and conv history per row."""
    heads = max(shape.kv_heads // tp, 1)
    kv = 2 * shape.attention_layers * heads * shape.head_dim * dtype_bytes * rows * seq_len
    if not shape.linear_layers:
        return kv
    state = shape.linear_v_heads * shape.linear_k_dim * shape.linear_v_dim * 4
    history = shape.linear_conv_dim * (shape.conv_kernel - 1) * dtype_bytes
    return kv + rows * shape.linear_layers * (state + history) // tp


def generation_bytes(
    shape: ModelShape, rows: int, prompt_len: int, seq_len: int, split: Split, kv_copies: int = 1
) -> dict[str, int]:
    """One generate call of ``rows`` sequences: the KV cache, the prefill's logits (Megatron
    computes them for every prompt position; transformers for the last only) and one layer's
    prefill activations."""
    prefill = rows * prompt_len
    logits_rows = prefill if kv_copies == 1 else rows
    return {
        "kv_cache": kv_copies * kv_cache_bytes(shape, rows, seq_len, split.tp),
        "logits": logits_rows * split.vocab(shape) // split.tp * 2 + rows * shape.vocab * 4,
        "activations": forward_bytes(shape, prefill, split),
    }


def megatron_train(
    shape: ModelShape,
    split: Split,
    dp: int,
    dtype_bytes: int,
    tokens: int,
    recompute: bool,
    dist_opt: bool,
    lora: int = 0,
) -> dict[str, int]:
    """One megatron_train rank during the train step (``tokens`` per micro-batch). With ``lora``
    adapter parameters on this rank (``ModelShape.megatron_lora_params``) the frozen base holds
    only its weights, and the adapters alone have grads and optimizer state."""
    dense, expert = rank_params(shape, split)
    expert_dp = max(split.tp * split.cp * dp // (split.etp * split.ep), 1)
    shards = (dp, expert_dp) if dist_opt else (1, 1)
    if lora:
        parts = training_state(lora, dtype_bytes, shards[0])
        parts["params"] += dtype_bytes * (dense + expert)
        stepped = lora // shards[0]
    else:
        parts = training_state(dense, dtype_bytes, shards[0])
        for key, value in training_state(expert, dtype_bytes, shards[1]).items():
            parts[key] += value
        stepped = dense // shards[0] + expert // shards[1]
    parts["activations"] = activations(shape, tokens, split, recompute)
    parts["logits"] = logit_bytes(shape, tokens, split, train=True)
    # The optimizer step runs after the activations are gone; its temporaries may be larger.
    step = optimizer_step_bytes(stepped)
    if step > parts["activations"] + parts["logits"]:
        parts["activations"], parts["logits"] = step, 0
    return parts


def fsdp2_train(
    shape: ModelShape,
    shard_ranks: int,
    dtype_bytes: int,
    tokens: int,
    recompute: bool,
    sharded: bool,
    mixed: bool,
    lora: int = 0,
    ulysses: int = 1,
    ep: int = 1,
    expert_shards: int = 1,
) -> dict[str, int]:
    """One fsdp2_train rank: fp32 master params, grads and Adam state sharded over ``shard_ranks``
    (the world size, or ``fsdp_size`` under HSDP; mixed precision) plus two layers of gathered
    compute-dtype params. With ``lora`` adapter
    parameters (``ModelShape.lora_params``) the params are the base model's plus the adapters, and
    only the adapters have grads and optimizer state. ``ulysses``: ranks that split each sequence;
    a rank keeps the activations and computes the logits of 1/ulysses of the micro-batch's tokens
    (inside attention it holds every token of 1/ulysses of the heads: the same bytes), so both
    divide by it like context parallelism's. ``ep`` > 1 (expert parallelism): a rank holds 1/ep of
    the experts, sharded over ``expert_shards`` ranks (efsdp_size x ep: their state per rank), and
    gathers only those of a layer."""
    params = shape.total_params() + lora
    trained = lora or params
    shards = shard_ranks if sharded else 1
    state = 4 if mixed else dtype_bytes
    layer = (shape.layer_dense_params() + shape.expert_params() // ep) // max(shape.layers, 1)
    held = params // shards
    if ep > 1:  # no LoRA with expert parallelism: every parameter is trained
        experts = shape.expert_params()
        held = trained = (params - experts) // shards + experts // expert_shards
        shards = 1
    return {
        "params": state * held + (2 * layer * dtype_bytes if sharded else 0),
        "grads": state * trained // shards,
        "optimizer": 2 * state * trained // shards,
        "activations": activations(shape, tokens, Split(cp=ulysses), recompute=recompute),
        "logits": logit_bytes(shape, -(-tokens // ulysses), train=True),
    }
