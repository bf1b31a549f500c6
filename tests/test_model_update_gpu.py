"""Model update on 2 GPUs: NCCL broadcast and CUDA IPC links, bit-identical, with the same members
as the CPU tests (``test_model_update``) on ``cuda:0``/``cuda:1``.

- two senders (GPU 0, GPU 1) and two receivers (GPU 0, GPU 1): each receiver maps its own GPU's
  sender's buffers by CUDA IPC and gets the other sender's buckets by NCCL broadcast;
- one sender (GPU 0) and one receiver (GPU 1): NCCL only;
- megatron-core TP2 / PP2 / EP2 trainer ranks -> the same two receivers.
"""

from __future__ import annotations

import pytest
import torch
from test_model_update import run_megatron_to_receivers, run_transport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.timeout(300)
def test_nccl_broadcast_and_cuda_ipc_links_bit_identical():
    # Sender 0 and receiver 0 share GPU 0, sender 1 and receiver 1 share GPU 1.
    run_transport(num_senders=2, num_receivers=2, local={0: {0}, 1: {1}}, backend="nccl", bucket_bytes=4096)


@pytest.mark.timeout(300)
def test_nccl_broadcast_only_bit_identical():
    # Disaggregated: one sender on GPU 0, one receiver on GPU 1, many small double-buffered buckets.
    run_transport(
        num_senders=1, num_receivers=1, local={}, backend="nccl", bucket_bytes=1024, receiver_gpus=[1]
    )


@pytest.mark.timeout(300)
def test_megatron_trainer_to_receivers_over_nccl_and_ipc_bit_identical(tmp_path):
    pytest.importorskip("megatron.core")
    per_sender = run_megatron_to_receivers(tmp_path, "nccl")
    assert per_sender["TP2"][1] == 0 and per_sender["TP2"][0] > 0
    assert min(per_sender["PP2"]) > 0 and min(per_sender["EP2"]) > 0
