"""The GPU kernels of the translator's product (translator/product_triton.py) on a CPU, by Triton's interpreter.

Not collected by itself (not test_*.py): tests/ot/test_gpu_kernels.py runs it in a pytest of its own with
TRITON_INTERPRET=1 in the environment from the start, because Triton reads that switch when it is first imported
(imported earlier, e.g. by torch.compile in the same process, its own helpers stay compiled-only)."""
import os

import pytest
import torch

import s2t2_dist.translator.module as module
import s2t2_dist.translator.product as product
import s2t2_dist.translator.product_triton as product_triton
from s2t2_dist.translator import TokenTranslator
from s2t2_dist.translator.product import plan_product
from s2t2_dist.utils.syncs import count_host_syncs
from tests.translator.test_plan_product import _sparse_rows, _start

@pytest.fixture
def interpreted(monkeypatch):
    """The GPU code path of the op on CPU tensors: the op's non-CPU kernels in place of its CPU ones (what a CUDA
    device runs), Triton in its interpreter."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setattr(product, "_product", product._product_gpu)
    monkeypatch.setattr(product, "_grad_p", product._grad_p_gpu)
    assert product_triton.available()


@pytest.mark.parametrize("live,dtype", [(37, torch.float32), (0, torch.float32), (150, torch.float32),
                                        (37, torch.bfloat16)])
def test_triton_kernels_against_the_dense_product(interpreted, live, dtype):
    """Shapes off the block sizes (v 150, u 70, d 40), no live row, every row live, a bf16 M cast as read."""
    v, u, d = 150, 70, 40
    P, keep = _sparse_rows(v, u, live=live, seed=3)
    P = P.float()
    M = torch.randn(v, d).to(dtype)
    G = torch.randn(u, d)
    out = product_triton.live_product(P, M)
    assert out.dtype == torch.float32
    assert torch.allclose(out, P.t() @ M.float(), atol=1e-5, rtol=1e-5)
    dP = product_triton.live_grad_p(P, M, G)
    ref = M.float() @ G.t()
    assert torch.allclose(dP[keep], ref[keep], atol=1e-5, rtol=1e-5)
    if live < v:
        assert dP[~keep].abs().max() == 0


def test_triton_device_index_reads_nothing_back():
    """The live rows and their count are found by ops the counter does not flag (a stable sort, a sum)."""
    P, _ = _sparse_rows(300, 20, live=45, seed=4)
    with count_host_syncs() as c:
        idx, n = product_triton.live_index(P)
    assert c.total == 0, c.summary()
    live = P.ne(0).any(1)
    assert int(n) == int(live.sum()) > 30
    assert torch.equal(idx[: int(n)].long(), live.nonzero().squeeze(1))  # in order


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_translator_gradient_through_the_triton_kernels(interpreted, monkeypatch, floor):
    """The whole sparse translator with the GPU kernels (float32, dead rows): C's gradient as with the dense
    product; the unconstrained kind (sparse=False) takes the dense GEMMs there."""
    v, u, d = 120, 16, 12
    P0, g = _start(v, u, dead=70, seed=2)
    E = torch.randn(v, d, generator=g, dtype=torch.float64).float()
    G = torch.randn(u, d, generator=g, dtype=torch.float64).float()
    move = (0.3 / v * torch.sign(torch.randn(v, u, dtype=torch.float64, generator=g))).float()
    calls = []
    real = product_triton.live_product
    monkeypatch.setattr(product_triton, "live_product", lambda *a: calls.append(1) or real(*a))

    def grad(kind, prod):
        monkeypatch.setattr(module, "plan_product", prod)
        tr = TokenTranslator(v, u, kind=kind, mu=P0.sum(1), nu=P0.sum(0), floor=floor if kind == "sparse" else 0.0)
        tr.init_from_dense(P0)
        with torch.no_grad():
            tr.C.add_(torch.where(P0 > 0, move, torch.zeros(())))
        E_new, _ = tr.embed_and_head(E, E)
        E_new.backward(G)
        return tr.C.grad

    for kind in ("sparse", "unconstrained"):
        calls.clear()
        g_gpu = grad(kind, plan_product)
        assert len(calls) == (1 if kind == "sparse" else 0), (kind, calls)
        g_dense = grad(kind, lambda P, M, sparse=False: P.t() @ M.to(P.dtype))
        assert g_dense.abs().max() > 0
        assert torch.allclose(g_gpu, g_dense, atol=1e-6 * float(g_dense.abs().max()), rtol=0), kind


def test_a_kernel_that_fails_warns_once_and_the_dense_product_follows(monkeypatch, caplog):
    monkeypatch.setattr(product, "_warned", [])

    def broken(*a):
        raise RuntimeError("no such GPU")

    monkeypatch.setattr(product_triton, "live_product", broken)
    P, _ = _sparse_rows(50, 8, live=5)
    P, M = P.float(), torch.randn(50, 4)
    for _ in range(2):
        assert torch.allclose(product._product_gpu(P, M, True), P.t() @ M)
    assert sum("Triton live-row kernel failed" in r.message for r in caplog.records) == 1


def test_column_major_plans_are_read_in_place():
    """The Sinkhorn's CUDA route gives P column-major: the kernels read it (and write dP) with its strides."""
    v, u, d = 150, 70, 40
    P, keep = _sparse_rows(v, u, live=37, seed=5)
    Pc = P.float().t().contiguous().t()
    assert Pc.stride() == (1, v)
    M, G = torch.randn(v, d), torch.randn(u, d)
    assert torch.allclose(product_triton.live_product(Pc, M), P.float().t() @ M, atol=1e-5, rtol=1e-5)
    dP = product_triton.live_grad_p(Pc, M, G)
    assert dP.stride() == (1, v)
    assert torch.allclose(dP[keep], (M @ G.t())[keep], atol=1e-5, rtol=1e-5) and dP[~keep].abs().max() == 0
