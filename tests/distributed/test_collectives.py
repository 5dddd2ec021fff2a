"""s2t2_dist.distributed.collectives: the one home of collectives, each on the group that serves its tensors' device.

The multi-rank tests start the default group as ``cuda:gloo``: no CPU backend, as NCCL alone on a GPU node. A CPU
collective that bypasses the module fails there exactly as it would under NCCL (checked first, so the trick is
known to bite); everything routed through the module works.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed

PKG = Path(__file__).resolve().parents[2] / "s2t2_dist"

#: torch.distributed functions that communicate (or ask the group who we are: one helper for that, too)
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "new_group", "init_process_group", "is_initialized", "get_rank",
    "get_world_size",
}


def direct_collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every torch.distributed collective called or imported by this module's source."""
    tree = ast.parse(source)
    aliases = set()  # names bound to the torch.distributed module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    aliases.add(a.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                aliases.update(a.asname or "distributed" for a in node.names if a.name == "distributed")
            if node.module == "torch.distributed":
                found += [(node.lineno, a.name) for a in node.names if a.name in COLLECTIVES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = ast.unparse(node.value)
            if base in aliases or base == "torch.distributed":
                found.append((node.lineno, node.attr))
    return sorted(found)


def test_the_scanner_finds_each_way_of_calling_a_collective():
    src = ("import torch.distributed as dist\nimport torch\nfrom torch import distributed as D\n"
           "from torch.distributed import barrier\n"
           "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.broadcast(t, 0)\n    D.get_rank()\n"
           "    x = dist.is_initialized\n    t.all_reduce()\n")
    assert direct_collective_calls(src) == [(4, "barrier"), (6, "all_reduce"), (7, "broadcast"), (8, "get_rank"),
                                            (9, "is_initialized")]


def test_no_module_outside_dist_calls_torch_distributed_collectives():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "distributed":
            continue
        offenders += [f"{rel}:{line}: {name}" for line, name in direct_collective_calls(path.read_text())]
    assert not offenders, ("collectives and rank/world queries belong in s2t2_dist/distributed/collectives.py (it puts "
                           "tensors on the group their device needs):\n" + "\n".join(offenders))


# ---------------------------------------------------------------------------------------------------------------
# multi-rank, default group without a CPU backend


def _nccl_like_rank():
    import torch.distributed as dist

    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.engines.torch_engine import TorchEngine
    from s2t2_dist.eval.bpb import EvalTotals
    from s2t2_dist.eval.scoring import DocScores, score_documents_batched
    from s2t2_dist.train.config import OptimConfig
    from s2t2_dist.translator import PStats, TokenTranslator

    out = {"backend": dist.get_backend_config()}
    r, w = coll.rank_world()
    try:  # the trick bites: what production would send to NCCL with a CPU tensor
        dist.all_reduce(torch.ones(1))
        out["direct"] = "worked"
    except Exception as e:  # noqa: BLE001 - the test records whatever the backend raises
        out["direct"] = str(e)
    out["sums"] = coll.sum_scalars([r + 1, 0.5, 2**51 + r])
    out["max"] = coll.max_scalars([r])
    out["any"] = (coll.any_rank(r == 1), coll.any_rank(False))
    out["all"] = (coll.all_ranks(r == 0), coll.all_ranks(True))
    out["objects"] = coll.all_gather_object({"rank": r})
    coll.barrier()
    try:
        coll.raise_if_any_failed(ValueError("disk full") if r == 1 else None, "writing x")
    except RuntimeError as e:
        out["failed"] = str(e)
    t = torch.tensor([float(r), 1.0])
    out["reduced"] = coll.all_reduce_(t).tolist()
    out["bcast"] = coll.broadcast_(torch.tensor([float(r) + 7])).item()
    out["group_is_not_default"] = coll.group_for("cpu") is not dist.group.WORLD

    # real code paths: a replicated and a sharded engine step, exact eval totals, lockstep scoring, P statistics
    torch.manual_seed(r)  # different replicas: the broadcast makes them equal
    lin = torch.nn.Linear(3, 1, bias=False)
    ocfg = OptimConfig(lr=0.1, eps=1e-8, warmup_frac=0.0, final_lr_frac=1.0, grad_clip=1.0)
    eng = TorchEngine.build(lin, ocfg, 2, params="replicated")
    lin(torch.full((2, 3), float(r + 1))).sum().backward()
    out["replicated"] = (eng.step(), lin.weight.detach().clone())
    shard = torch.nn.Linear(2, 1, bias=False)
    eng2 = TorchEngine.build(shard, dataclasses.replace(ocfg, grad_clip=0.0), 2, params="sharded")
    shard.weight.grad = torch.full_like(shard.weight, float(r + 1))
    out["sharded_norm"] = eng2.step()[0]
    out["totals"] = EvalTotals(1.5, 3, 10 + r, 1).all_reduce().to_dict()
    docs = [{"input_ids": [0, 1, 2, 1], "n_bytes": 3, "index": i} for i in range(r + 1)]  # uneven: lockstep
    calls = []

    def logits_fn(ids):
        calls.append(ids.shape)
        return torch.zeros(ids.shape[0], ids.shape[1], 4)

    local = score_documents_batched(logits_fn, docs, 8, batch_size=1)
    out["scored"] = (local.docs, len(calls))
    out["doc_scores"] = DocScores({10 + r: r + 0.5}, {10 + r: 2}, {10 + r: 3 + r}).gathered().to_dict()
    tr = TokenTranslator(4, 2, group=coll.group_for(torch.device("cpu")))  # one target column per rank
    p = torch.zeros(4, 1)
    p[r, 0] = 1.0
    out["p_stats"] = PStats(tr).density_stats(p)
    return out


def test_routed_collectives_work_where_direct_cpu_collectives_fail():
    res = run_distributed(_nccl_like_rank, 2, backend="cuda:gloo", timeout=120)
    for r, o in enumerate(res):
        assert o["backend"] == "cuda:gloo"
        assert "No backend type associated with device type cpu" in o["direct"]
        assert o["sums"] == [3.0, 1.0, 2.0**52 + 1]  # exact: a float32 sum would round it
        assert o["max"] == [1.0]
        assert o["any"] == (True, False) and o["all"] == (False, True)
        assert o["objects"] == [{"rank": 0}, {"rank": 1}]
        assert o["failed"] == ("writing x failed: disk full" if r == 1 else "writing x failed on another rank")
        assert o["reduced"] == [1.0, 2.0] and o["bcast"] == 7.0 and o["group_is_not_default"]
        assert o["sharded_norm"] == pytest.approx((2 * 1 + 2 * 4) ** 0.5)  # 2 entries of 1 and 2 of 2
        assert o["totals"] == {"nll_nats": 3.0, "tokens": 6, "bytes": 21, "docs": 2}
        assert o["scored"] == (r + 1, 2)  # rank 0 makes a dummy call to keep in step with rank 1
        assert o["doc_scores"] == {"index": [10, 11], "nll_nats": [0.5, 1.5], "tokens": [2, 2], "bytes": [3, 4]}
        assert o["p_stats"]["nnz"] == 2.0 and o["p_stats"]["rows_empty"] == 2.0
    (n0, ok0), w0 = res[0]["replicated"]
    (n1, ok1), w1 = res[1]["replicated"]
    assert ok0 and ok1 and n0 == n1 and torch.equal(w0, w1)


def _init_from_env_rank():
    import torch.distributed as dist

    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.distributed.env import init_distributed
    from s2t2_dist.distributed.exit import destroy_process_group

    init_distributed(timeout_s=60)
    out = (dist.get_backend_config(), coll.sum_scalars([1.0])[0])
    coll.barrier()
    destroy_process_group()
    return out


@pytest.mark.parametrize("backend,expect", [("", "cpu:gloo,cuda:gloo"), ("cuda:gloo", "cuda:gloo")])
def test_init_distributed_backend_and_its_host_group(backend, expect):
    """S2T2_DIST_BACKEND picks the default group's backend (on a GPU node the default is cpu:gloo,cuda:nccl);
    bookkeeping works either way."""
    res = run_distributed(_init_from_env_rank, 2, init=False, env={"S2T2_DIST_BACKEND": backend,
                                                                   "S2T2_DEVICE": "cpu"}, timeout=120)
    assert res == [(expect, 2.0), (expect, 2.0)]


def test_default_backend_on_gpu_nodes_serves_cpu_too(monkeypatch):
    from s2t2_dist.distributed import env

    monkeypatch.delenv("S2T2_DIST_BACKEND", raising=False)
    monkeypatch.setattr(env, "use_cuda", lambda: True)
    assert env.default_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(env, "use_cuda", lambda: False)
    assert env.default_backend() == "gloo"


def _single_rank_group():
    import torch.distributed as dist

    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.distributed.env import init_distributed
    from s2t2_dist.distributed.exit import destroy_process_group

    init_distributed(timeout_s=60)
    before = coll.initialized()
    init_distributed(timeout_s=60, single_rank_group=True)  # what finetune/evaluate do for engine.kind=fsdp
    out = (before, coll.initialized(), dist.get_world_size(), coll.sum_scalars([2.5]))
    destroy_process_group()
    return out


def test_one_process_gets_a_one_rank_group_only_when_asked():
    """FSDP2 needs a process group even on one GPU; other single-process runs need none."""
    assert run_distributed(_single_rank_group, 1, init=False, timeout=60) == [(False, True, 1, [2.5])]
