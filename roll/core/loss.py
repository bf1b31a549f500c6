"""The loss function a training strategy calls per micro-batch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from roll.core.batch import Batch

# loss_fn(outputs, micro_batch) -> (scalar loss, metrics). ``outputs`` holds "log_probs" and
# "entropy" ([b, R]) for policy models, or "values" ([b, R]) for value models.
LossFn = Callable[[dict[str, torch.Tensor], Batch], "tuple[torch.Tensor, dict[str, float]]"]

# Rows of a batch numbered by the driver, so outputs computed on any rank can be put back in order.
ROW_INDEX = "row_index"


class LogProbRecorder:
    """A ``LossFn`` that calls ``loss_fn`` unchanged and keeps what the forward gave it: each
    micro-batch's detached ``log_probs`` (and ``entropy``) under the micro-batch's ``row_index``.
    Before the optimizer step these are the policy's log-probs before the update, i.e. the old
    log-probs, at no extra forward::

        recorder = LogProbRecorder(loss_fn)
        strategy.train_step(micro_batches, recorder)    # micro-batches carry "row_index"
        recorded = recorder.batch()                     # row_index, log_probs, entropy (rows in call order)
    """

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        # roll.models.microbatch.loss_agg_mode_of reads the factories' partial keywords.
        self.keywords = getattr(loss_fn, "keywords", None)
        self.parts: list[Batch] = []

    def __call__(
        self, outputs: dict[str, torch.Tensor], micro: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        kept = {
            key: outputs[key].detach().float().cpu() for key in ("log_probs", "entropy") if key in outputs
        }
        self.parts.append(Batch.from_dict({ROW_INDEX: micro[ROW_INDEX].cpu(), **kept}))
        return self.loss_fn(outputs, micro)

    def batch(self) -> Batch:
        return Batch.concat(self.parts)
