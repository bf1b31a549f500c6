"""``ModelUpdateGroup``: the driver's handle on moving a trainer role's weights into an inference role.

Set up once, used every ``model_update_frequency`` steps::

    group = ModelUpdateGroup(clusters["actor_train"], clusters["actor_infer"], config)
    group.setup()                       # links, process groups, IPC paths, probe batch
    metrics = group.sync(version=step)  # every trainer rank sends, every engine loads, then checks

Layout: each trainer rank gets a *link* to every inference worker (see ``link.py``). A worker on
the sender's own device maps the sender's buckets (CUDA IPC / shared memory); the others receive a
broadcast (NCCL / gloo). Trainer ranks whose ``iter_hf_weights`` yields nothing (FSDP ranks > 0,
Megatron TP peers) send one empty bucket. Partial overlap needs nothing special: each pair is
colocated or not on its own.

Checks after every sync (``ModelUpdateError`` on failure):

1. every tensor came from exactly one trainer rank, and every engine worker received every
   tensor with the sender's checksum (names the first tensor that differs). A link whose engine
   receives into its own parameters (SGLang's ``update_weights_from_distributed``) returns no
   checksums: its names are still checked, the missing checksums are logged once and counted in
   ``model_update/links_without_checksums``, and the probe is what checks those weights;
2. probe (``model_update_probe_size`` > 0): the engines' log-probs on a fixed batch against the
   trainer's, logged as ``model_update/probe_logprob_diff``. Non-finite log-probs, or a difference
   above ``model_update_probe_tolerance`` when set, raise; above the dtype's warning threshold
   (``probe.PROBE_WARN_THRESHOLDS``) the trainer sends the weights again and each engine compares
   them with what it holds: a tensor that differs raises (named), equal weights give a warning.

Generation and updates never overlap: the pipeline calls ``sync`` between steps, and each engine
worker applies a whole update inside one Ray call (see ``worker_mixin``), bumping its version last.

Colocated devices (trainer and engine time-share a GPU), in the pipeline's order:
``actor_train.offload_states()`` (optimizer state and gradients leave, parameters stay) ->
``actor_infer.reload_states()`` (engine weights back; vLLM sleep level 2 wakes weights only) ->
``group.sync(step)`` (engines that dropped their KV cache restore it in ``finish_model_update``) ->
generation. The sync needs the trainer's parameters on the device, not its optimizer state.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from roll.configs.pipeline_config import RLVRConfig
from roll.core.batch import Batch
from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.model_update.probe import (
    ProbeVerdict,
    build_probe_batch,
    classify_probe,
    logprob_diff,
    probe_warn_threshold,
)
from roll.distributed.model_update.receiver import ReceiveResult
from roll.distributed.model_update.sender import SendResult
from roll.distributed.model_update.worker_mixin import (
    DeviceInfo,
    ModelUpdateReceiverMixin,
    ModelUpdateSenderMixin,
    VerifyResult,
)
from roll.distributed.scheduler.cluster import get_all
from roll.distributed.transport.link import LinkSpec

if TYPE_CHECKING:
    from roll.distributed.scheduler.cluster import Cluster

PREFIX = "model_update/"
logger = logging.getLogger("roll")


class ModelUpdateGroup:
    """Trainer role -> inference role weight sync; see the module docstring."""

    def __init__(
        self,
        train_cluster: Cluster,
        infer_cluster: Cluster,
        config: RLVRConfig,
        probe_batch: Batch | None = None,
    ):
        if config.model_update_buffer_size_mb < 1:
            raise ModelUpdateError(
                f"model_update_buffer_size_mb must be >= 1, got {config.model_update_buffer_size_mb}"
            )
        self.train = train_cluster
        self.infer = infer_cluster
        self.config = config
        self.bucket_bytes = config.model_update_buffer_size_mb << 20
        self.probe_batch = probe_batch
        self.name = f"{train_cluster.role}->{infer_cluster.role}"
        self.specs: list[LinkSpec] | None = None
        self.unchecked_ranks: list[int] = []  # engine ranks whose links return no checksums

    # ------------------------------------------------------------------------------ set up
    def setup(self) -> None:
        """Build every link (once; later calls do nothing)."""
        if self.specs is not None:
            return
        senders = self.train.call(ModelUpdateSenderMixin.model_update_device_info)
        receivers = self.infer.call(ModelUpdateReceiverMixin.model_update_device_info)
        addresses = self.train.call(ModelUpdateSenderMixin.model_update_open_port)
        specs = plan_links(self.train.role, self.infer.role, senders, receivers, addresses)
        get_all(
            self.train.async_call(
                ModelUpdateSenderMixin.model_update_connect_sender, self.name, specs, self.bucket_bytes
            ),
            self.infer.async_call(ModelUpdateReceiverMixin.model_update_connect_receiver, self.name, specs),
        )
        self.specs = specs
        if self.probe_batch is None and self.config.model_update_probe_size > 0:
            self.probe_batch = default_probe_batch(self.config)

    # -------------------------------------------------------------------------------- sync
    def sync(self, version: int) -> dict[str, float]:
        """Send the trainer's current weights as ``version``; returns ``model_update/*`` metrics."""
        self.setup()
        start = time.perf_counter()
        sent: list[SendResult]
        received: list[list[ReceiveResult]]
        sent, received = get_all(
            self.train.async_call(ModelUpdateSenderMixin.model_update_send, self.name, version),
            self.infer.async_call(ModelUpdateReceiverMixin.model_update_receive, self.name, version),
        )
        elapsed = time.perf_counter() - start
        check_update(sent, received, self.train.role, self.infer.role)
        self.note_unchecked(received)
        metrics = update_metrics(sent, received, elapsed, version)
        if self.probe_batch is not None:
            metrics |= self.probe(version)
        return metrics

    def note_unchecked(self, received: list[list[ReceiveResult]]) -> None:
        """Log once which engine ranks return no checksums (they receive into their own parameters)."""
        ranks = [rank for rank, links in enumerate(received) if any(r.checksums is None for r in links)]
        if ranks and ranks != self.unchecked_ranks:
            probe = (
                "the probe checks their weights"
                if self.probe_batch is not None
                else ("no probe runs (model_update_probe_size is 0), so nothing checks their weights")
            )
            logger.info(
                "model update %s: %s ranks %s receive in the engine's own processes and return no "
                "checksums; %s",
                self.name,
                self.infer.role,
                ranks,
                probe,
            )
        self.unchecked_ranks = ranks

    def probe(self, version: int) -> dict[str, float]:
        """Trainer vs engine log-probs on the probe batch, classified by ``probe.classify_probe``:
        non-finite or above an explicit tolerance raises; above the dtype's warning threshold the
        weights are compared tensor by tensor (unequal: raises; equal: a warning)."""
        start = time.perf_counter()
        trainer, engines = get_all(
            self.train.async_call(ModelUpdateSenderMixin.model_update_probe_log_probs, self.probe_batch),
            self.infer.async_call(ModelUpdateReceiverMixin.model_update_probe_log_probs, self.probe_batch),
        )
        reference = next((out for out in trainer if out is not None), None)
        if reference is None:
            raise ModelUpdateError(f"{self.train.role}: no rank returned probe log-probs")
        mask = self.probe_batch["response_mask"]
        diffs = {
            rank: logprob_diff(reference, out, mask) for rank, out in enumerate(engines) if out is not None
        }
        worst_rank = max(diffs, key=diffs.get)
        diff = diffs[worst_rank]
        pair = f"{self.train.role} and {self.infer.role} rank {worst_rank}"
        between = f"mean |log-prob difference| {diff:.4g} between {pair}"
        tolerance = self.config.model_update_probe_tolerance
        verdict = classify_probe(diff, tolerance, self.warn_threshold)
        if verdict is ProbeVerdict.ERROR and not math.isfinite(diff):  # broken weights whatever the tolerance
            raise ModelUpdateError(
                f"weights of version {version}: probe log-probs are not finite on "
                f"{non_finite_sides(self.train.role, reference, self.infer.role, engines)}; "
                f"{self.locate_mismatch(version)[1]}"
            )
        if verdict is ProbeVerdict.ERROR:
            raise ModelUpdateError(
                f"weights of version {version}: {between} exceeds model_update_probe_tolerance={tolerance}; "
                f"{self.locate_mismatch(version)[1]}"
            )
        if verdict is ProbeVerdict.CHECK:
            self.check_weights(version, between)
        return {
            f"{PREFIX}probe_logprob_diff": diff,
            f"{PREFIX}probe_above_threshold": float(verdict is ProbeVerdict.CHECK),
            f"{PREFIX}probe_time_s": time.perf_counter() - start,
        }

    @property
    def warn_threshold(self) -> float:
        dtypes = (self.config.actor_train.model_args.dtype, self.config.actor_infer.model_args.dtype)
        return probe_warn_threshold(*dtypes)

    def check_weights(self, version: int, between: str) -> None:
        """A difference above the warning threshold: raise if the engines' weights differ from the
        trainer's, else warn (the two forwards differ numerically, nothing is corrupted)."""
        differs, where = self.locate_mismatch(version)
        above = f"{between} is above the warning threshold {self.warn_threshold:g} for these dtypes"
        if differs:
            raise ModelUpdateError(f"weights of version {version}: {above}; {where}")
        logger.warning("model update %d: %s; %s", version, above, where)

    def locate_mismatch(self, version: int) -> tuple[bool | None, str]:
        """Send the weights again and let every engine compare them with its own. Returns whether a
        tensor differs (None: the engines cannot tell) and a sentence naming the first that does."""
        able = self.infer.call(ModelUpdateReceiverMixin.model_update_can_verify, self.name)
        if not all(able):
            ranks = [rank for rank, ok in enumerate(able) if not ok]
            checked = (
                f"ranks {self.unchecked_ranks} received into the engine's own parameters without checksums"
                if self.unchecked_ranks
                else "every received tensor matched the sender's checksum"
            )
            return None, (
                f"{self.infer.role} ranks {ranks} cannot show their weights by HF name, so the tensor "
                f"cannot be named; {checked}"
            )
        verdicts: list[VerifyResult]
        _, verdicts = get_all(
            self.train.async_call(ModelUpdateSenderMixin.model_update_send, self.name, version),
            self.infer.async_call(ModelUpdateReceiverMixin.model_update_verify, self.name, version),
        )
        for rank, verdict in enumerate(verdicts):
            if verdict.first_mismatch is not None:
                return True, (
                    f"first mismatching tensor: {verdict.first_mismatch!r} on {self.infer.role} rank {rank} "
                    f"({verdict.difference}; {verdict.mismatches} tensor(s) differ from the trainer's)"
                )
        return False, (
            "every engine holds exactly the tensors the trainer sends (the forward passes differ, not the weights)"
        )


def non_finite_sides(train_role: str, trainer, infer_role: str, engines: list) -> str:
    """Which side's probe log-probs hold NaN/inf: the trainer's, and/or which engine ranks."""
    sides = [train_role] if not torch.isfinite(trainer).all() else []
    bad = [rank for rank, out in enumerate(engines) if out is not None and not torch.isfinite(out).all()]
    if bad:
        sides.append(f"{infer_role} ranks {bad}")
    return " and ".join(sides) or "neither side (the difference overflowed)"


def plan_links(
    train_role: str,
    infer_role: str,
    senders: list[DeviceInfo],
    receivers: list[DeviceInfo],
    addresses: list[tuple[str, int]],
) -> list[LinkSpec]:
    """One ``LinkSpec`` per trainer rank from the workers' ``model_update_device_info``.

    A receiver is colocated with a sender when its global device ids include the sender's device.
    """
    kinds = {info.cuda for info in senders + receivers}
    if len(kinds) > 1:
        raise ModelUpdateError(
            f"{train_role} and {infer_role} must both run on CUDA or both on CPU for a model update"
        )
    backend = "nccl" if kinds == {True} else "gloo"
    specs = []
    for rank, (info, (host, port)) in enumerate(zip(senders, addresses)):
        device = info.device_ids[0] if info.device_ids else None
        local = tuple(device is not None and device in r.device_ids for r in receivers)
        remote = [r for r, is_local in zip(receivers, local) if not is_local]
        if len({r.engine_group for r in remote}) > 1:
            raise ModelUpdateError(
                f"{infer_role}: some workers receive from {train_role} rank {rank} on their engine's own "
                "group and others do not; one link needs one kind (check model_update_transport)"
            )
        specs.append(
            LinkSpec(
                name=f"{train_role}->{infer_role}/{rank}",
                sender=rank,
                host=host,
                port=port,
                receivers=tuple(range(len(receivers))),
                local=local,
                backend=backend,
                sender_device=device,
                data_ranks=tuple(r.data_ranks for r in receivers),
                engine_group=bool(remote) and remote[0].engine_group,
            )
        )
    return specs


def check_update(
    sent: list[SendResult], received: list[list[ReceiveResult]], train_role: str, infer_role: str
) -> None:
    """Every tensor from one trainer rank only, and every engine got each with the sent checksum
    (``received[r][s]``: what engine rank r got over sender s's link; a link whose checksums are
    None received into the engine's own parameters: its names are checked, not its bytes)."""
    owner: dict[str, int] = {}
    for rank, result in enumerate(sent):
        for name in result.names:
            if name in owner:
                raise ModelUpdateError(
                    f"tensor {name!r} was sent by {train_role} ranks {owner[name]} and {rank}; "
                    "iter_hf_weights must yield each tensor on one rank only"
                )
            owner[name] = rank
    if not owner:
        raise ModelUpdateError(
            f"no {train_role} rank yielded any weights (iter_hf_weights is empty everywhere)"
        )
    for infer_rank, links in enumerate(received):
        for sender, link in enumerate(links):
            if link.checksums is None:
                want, got = list(sent[sender].names), list(link.names)
                if got != want:
                    raise ModelUpdateError(
                        f"{infer_role} rank {infer_rank}: got tensors {got[:3]}... ({len(got)}) from "
                        f"{train_role} rank {sender}, which sent {want[:3]}... ({len(want)})"
                    )
                continue
            want = list(zip(sent[sender].names, sent[sender].checksums))
            got = list(zip(link.names, link.checksums))
            for (name, want_sum), got_pair in zip(want, got):
                if got_pair != (name, tuple(want_sum)):
                    raise ModelUpdateError(
                        f"{infer_role} rank {infer_rank}: tensor {name!r} from {train_role} rank {sender} "
                        f"arrived different from what was sent (checksum {tuple(got_pair[1])} != {tuple(want_sum)})"
                    )
            if len(got) != len(want):
                raise ModelUpdateError(
                    f"{infer_role} rank {infer_rank}: got {len(got)} tensors from {train_role} rank {sender}, "
                    f"which sent {len(want)}"
                )


def update_metrics(
    sent: list[SendResult], received: list[list[ReceiveResult]], elapsed: float, version: int
) -> dict[str, float]:
    nbytes = sum(r.nbytes for r in sent)
    links = [link for per_rank in received for link in per_rank]
    return {
        f"{PREFIX}time_s": elapsed,
        f"{PREFIX}bytes": float(nbytes),
        f"{PREFIX}gbps": nbytes / elapsed / 1e9 if elapsed > 0 else 0.0,
        f"{PREFIX}buckets": float(sum(r.buckets for r in sent)),
        f"{PREFIX}sender_iter_s": max(r.iter_s for r in sent),
        f"{PREFIX}sender_wait_s": max(r.wait_s for r in sent),
        f"{PREFIX}sender_total_s": max(r.total_s for r in sent),
        f"{PREFIX}receiver_load_s": max((r.load_s for r in links), default=0.0),
        f"{PREFIX}receiver_wait_s": max((r.wait_s for r in links), default=0.0),
        f"{PREFIX}receiver_total_s": max((r.total_s for r in links), default=0.0),
        f"{PREFIX}links_without_checksums": float(sum(r.checksums is None for r in links)),
        f"{PREFIX}version_train": float(min(r.version for r in sent)),
        f"{PREFIX}version_infer": float(min(r.version for r in links)),
        f"{PREFIX}version": float(version),
    }


def default_probe_batch(config: RLVRConfig) -> Batch:
    """``model_update_probe_size`` random sequences within the trainer model's vocabulary."""
    from transformers import AutoConfig

    from roll.models.loading import model_path
    from roll.models.vision import response_excluded_tokens

    model_args = config.actor_train.model_args
    hf_config = AutoConfig.from_pretrained(
        model_path(model_args), trust_remote_code=model_args.trust_remote_code
    )
    vocab = getattr(hf_config, "vocab_size", None) or hf_config.get_text_config().vocab_size
    # A vision-language model's forward looks for an image behind each image token: draw below them.
    vocab = min([vocab, *response_excluded_tokens(hf_config)])
    return build_probe_batch(vocab, config.model_update_probe_size, config.seed)
