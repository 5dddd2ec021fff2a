"""One gloo rank of tests/stages/test_evaluate.py::test_lockstep_forward_calls_and_exact_sums (a small module so
that the spawned processes import little)."""

import os

import torch
import torch.distributed as dist

from s2t2_dist.eval.scoring import score_documents_batched


def rank_main(rank, world_size, port, docs, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    head = torch.randn(8, 8)
    calls = [0]

    def collective_logits(ids):  # like a ZeRO-3 / FSDP forward: every call is a collective
        calls[0] += 1
        t = torch.ones(1)
        dist.all_reduce(t)
        return head[ids] * 0.5

    mine = docs[:1] if rank == 0 else docs[1:]  # very uneven shares
    local = score_documents_batched(collective_logits, mine, context_len=3, batch_size=2)
    total = local.all_reduce()
    out.put((rank, calls[0], total.to_dict()))
    dist.destroy_process_group()
