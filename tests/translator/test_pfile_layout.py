"""The P file is written in whichever layout is smaller (CSC for a sparse P, dense for a dense one); both load."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from s2t2_dist.translator.pfile import FORMAT, SparseP, load_p, save_p
from s2t2_dist.errors import PFileError


def _p(density: float, v: int = 300, u: int = 200, seed: int = 0) -> SparseP:
    g = torch.Generator().manual_seed(seed)
    D = torch.rand(v, u, generator=g) * (torch.rand(v, u, generator=g) < density)
    D[0, :] += 1e-3  # no empty column
    D = D / D.sum(0, keepdim=True) / u  # columns sum to nu = 1/u: a plan that load_p's marginal check accepts
    idx = (D != 0).nonzero().t().contiguous()
    return SparseP(idx, D[idx[0], idx[1]], torch.full((v,), 1.0 / v), torch.full((u,), 1.0 / u),
                   torch.arange(v) + 3, "src", "tgt")


def _layout(path):
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()["layout"], set(f.keys())


@pytest.mark.parametrize("density,layout", [(0.02, "csc"), (0.4, "csc"), (0.7, "dense")])
def test_smaller_layout_round_trips(tmp_path, density, layout):
    p = _p(density)
    path = save_p(tmp_path / "P.safetensors", p)
    got, keys = _layout(path)
    assert got == layout and ("indices" not in keys)
    dense_bytes = 4 * p.shape[0] * p.shape[1]
    size = path.stat().st_size
    if layout == "csc":  # 8 bytes per non-zero (+ header, marginals): far below the old 20
        assert size < 8 * p.values.numel() + 8 * 1024 + 16 * (p.shape[0] + p.shape[1])
        assert size < dense_bytes
    else:
        assert size < 8 * p.values.numel()
    q = load_p(path)
    torch.testing.assert_close(q.dense(), p.dense(), rtol=0, atol=0)
    assert torch.equal(q.indices, p.indices)  # row-major, as written by training
    assert q.stats()["nnz"] == p.stats()["nnz"]


def test_old_coo_files_still_load_and_a_bad_layout_is_named(tmp_path):
    p = _p(0.1)
    meta = {"format": FORMAT, "shape": json.dumps(list(p.shape)), "source_tokenizer_hash": "src",
            "target_tokenizer_hash": "tgt", "kind": "sparse", "normalization": "convex"}
    t = {"indices": p.indices, "values": p.values, "mu": p.mu, "nu": p.nu, "source_ids": p.source_ids}
    save_file(t, str(tmp_path / "old.safetensors"), metadata=meta)
    torch.testing.assert_close(load_p(tmp_path / "old.safetensors").dense(), p.dense(), rtol=0, atol=0)
    save_file(t, str(tmp_path / "bad.safetensors"), metadata={**meta, "layout": "csr"})
    with pytest.raises(PFileError, match="unknown P layout 'csr'"):
        load_p(tmp_path / "bad.safetensors")
    path = save_p(tmp_path / "P.safetensors", p)
    with safe_open(str(path), framework="pt") as f:
        t2 = {k: f.get_tensor(k) for k in f.keys()}
        m2 = f.metadata()
    t2["col_ptr"][-1] += 1
    save_file(t2, str(tmp_path / "ptr.safetensors"), metadata=m2)
    with pytest.raises(PFileError, match="col_ptr"):
        load_p(tmp_path / "ptr.safetensors")
