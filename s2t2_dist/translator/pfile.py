"""The learned translation P as a sparse safetensors file: what stage 1 hands to finetuning and to transfer.

Tensors: `mu` (v), `nu` (u), `source_ids` (v int64: the source model's token id of each row) and P in one of two
layouts (metadata `layout`), whichever file is smaller (`save_p`): "csc", `col_ptr` (u + 1 int64), `row_idx` (nnz
int32: the source row of each non-zero, column by column) and `values` (nnz float32): 8 bytes per non-zero; or
"dense", `dense` (v x u float32): 4 bytes per entry, smaller above 50% non-zeros. Files of the first format ("coo":
`indices` 2 x nnz int64 and `values`, 20 bytes per non-zero) still load. Metadata (strings): shape, both
tokenizers' hashes, the translator kind (a name of translator/kinds.py's registry) and normalisation. Loading runs
no code (safetensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from s2t2_dist.translator.kinds import REGISTRY
from s2t2_dist.translator.stats import file_stats
from s2t2_dist.utils.io import atomic_path
from s2t2_dist.errors import PFileError

FORMAT = "s2t2-sparse-p/1"


@dataclass
class SparseP:
    indices: torch.Tensor
    values: torch.Tensor
    mu: torch.Tensor
    nu: torch.Tensor
    source_ids: torch.Tensor
    source_tokenizer_hash: str
    target_tokenizer_hash: str
    kind: str = "sparse"
    normalization: str = "convex"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.mu.numel(), self.nu.numel())

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        P = torch.zeros(self.shape, dtype=dtype)
        P[self.indices[0], self.indices[1]] = self.values.to(dtype)
        return P

    def stats(self) -> dict:
        """Shape, kind, sparsity, entropy H(P) (None for a signed P, e.g. the unconstrained translator's, which is
        not a distribution) and the entropy of the uniform P (translator/stats.py ``file_stats``)."""
        v, u = self.shape
        return {"v": v, "u": u, "kind": self.kind, **file_stats(self.indices, self.values, self.nu, self.shape)}

    def check_compatible(self, source_tokenizer_hash: str | None = None, target_tokenizer_hash: str | None = None,
                         where: str = "") -> None:
        for name, mine, theirs in (("source", self.source_tokenizer_hash, source_tokenizer_hash),
                                   ("target", self.target_tokenizer_hash, target_tokenizer_hash)):
            if theirs is not None and mine != theirs:
                raise PFileError(
                    f"{where}P was learned for a different {name} tokenizer: P file has {name} tokenizer hash "
                    f"{mine}, this run's {name} tokenizer has {theirs}"
                )


def _layout_tensors(p: SparseP) -> tuple[str, dict]:
    """P as the smaller of CSC (8 bytes per non-zero + the column pointers) and dense (4 bytes per entry)."""
    v, u = p.shape
    vals = p.values.to(torch.float32)
    keep = vals != 0
    rows, cols, vals = p.indices[0][keep], p.indices[1][keep], vals[keep]
    if 4 * v * u <= 8 * vals.numel() + 8 * (u + 1):
        dense = torch.zeros(v, u, dtype=torch.float32)
        dense[rows, cols] = vals
        return "dense", {"dense": dense}
    order = torch.argsort(cols * v + rows)  # column-major
    ptr = torch.zeros(u + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(torch.bincount(cols, minlength=u), 0)
    return "csc", {"col_ptr": ptr, "row_idx": rows[order].to(torch.int32).contiguous(),
                   "values": vals[order].contiguous()}


def save_p(path: str | Path, p: SparseP) -> Path:
    """Write P (exact zeros dropped) in whichever layout is smaller (module docstring); atomic."""
    path = Path(path)
    layout, p_tensors = _layout_tensors(p)
    meta = {
        "format": FORMAT,
        "shape": json.dumps(list(p.shape)),
        "source_tokenizer_hash": p.source_tokenizer_hash,
        "target_tokenizer_hash": p.target_tokenizer_hash,
        "kind": p.kind,
        "normalization": p.normalization,
        "layout": layout,
    }
    tensors = {
        **p_tensors,
        "mu": p.mu.to(torch.float32).contiguous(),
        "nu": p.nu.to(torch.float32).contiguous(),
        "source_ids": p.source_ids.to(torch.int64).contiguous(),
    }
    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path


def _coo_of(path: Path, layout: str, t: dict, v: int, u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices 2 x nnz int64, values) of a CSC or dense P file."""
    if layout == "dense":
        D = t["dense"]
        if tuple(D.shape) != (v, u):
            raise PFileError(f"{path}: dense P is {tuple(D.shape)}, shape says {v} x {u}")
        idx = (D != 0).nonzero().t().contiguous()
        return idx, D[idx[0], idx[1]]
    ptr, rows = t["col_ptr"].to(torch.int64), t["row_idx"].to(torch.int64)
    if (ptr.numel() != u + 1 or int(ptr[0]) != 0 or int(ptr[-1]) != rows.numel()
            or rows.numel() != t["values"].numel() or bool((ptr[1:] < ptr[:-1]).any())):
        raise PFileError(f"{path}: col_ptr must be u + 1 = {u + 1} non-decreasing offsets from 0 to nnz")
    cols = torch.repeat_interleave(torch.arange(u), ptr[1:] - ptr[:-1])
    order = torch.argsort(rows * u + cols)  # row-major, as the COO files and the training export are
    return torch.stack([rows[order], cols[order]]), t["values"][order]


def load_p(path: str | Path) -> SparseP:
    path = Path(path)
    if not path.is_file():
        raise PFileError(f"P file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for corrupt files
        raise PFileError(f"{path}: not a readable safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise PFileError(f"{path}: not an S2T2 P file (format {meta.get('format')!r}, expected {FORMAT!r})")
    layout = meta.get("layout", "coo")
    need = {"coo": {"indices", "values"}, "csc": {"col_ptr", "row_idx", "values"}, "dense": {"dense"}}.get(layout)
    if need is None:
        raise PFileError(f"{path}: unknown P layout {layout!r} (expected coo, csc or dense)")
    missing = (need | {"mu", "nu", "source_ids"}) - set(t)
    if missing:
        raise PFileError(f"{path}: missing tensors {sorted(missing)}")
    v, u = _meta_shape(path, meta)
    if layout != "coo":
        t["indices"], t["values"] = _coo_of(path, layout, t, v, u)
    if t["mu"].numel() != v or t["nu"].numel() != u or t["source_ids"].numel() != v:
        raise PFileError(f"{path}: marginals/source ids do not match shape {v} x {u}")
    idx = t["indices"]
    if idx.ndim != 2 or idx.shape[0] != 2 or idx.shape[1] != t["values"].numel():
        raise PFileError(f"{path}: indices must be 2 x nnz matching values")
    if idx.numel() and (idx[0].max() >= v or idx[1].max() >= u or idx.min() < 0):
        raise PFileError(f"{path}: indices out of range for shape {v} x {u}")
    for k in ("source_tokenizer_hash", "target_tokenizer_hash"):
        if not isinstance(meta.get(k), str) or not meta[k]:
            raise PFileError(f"{path}: damaged metadata: {k} is missing; not a complete P file")
    kind = meta.get("kind", "sparse")
    if kind not in REGISTRY:
        raise PFileError(f"{path}: damaged metadata: kind {kind!r} is not one of {sorted(REGISTRY)}")
    check_values(path, kind, idx, t["values"], t["mu"], t["nu"])
    return SparseP(idx, t["values"], t["mu"], t["nu"], t["source_ids"], meta["source_tokenizer_hash"],
                   meta["target_tokenizer_hash"], kind, meta.get("normalization", "convex"))


def _meta_shape(path: Path, meta: dict) -> tuple[int, int]:
    try:
        v, u = json.loads(meta["shape"])
        if int(v) != v or int(u) != u or v < 1 or u < 1:
            raise ValueError
        return int(v), int(u)
    except (KeyError, TypeError, ValueError):  # JSONDecodeError is a ValueError
        raise PFileError(f"{path}: damaged metadata: shape {meta.get('shape')!r} is not [rows, columns]") from None


#: a plan's column sums end exactly at nu (the last projection); its rows stay approximate after few Dykstra
#: iterations (measured up to 0.52 in total variation on trained 512 x 512 plans), so rows get a loose bound
COL_TV_MAX, ROW_TV_MAX, MASS_TOL = 0.05, 1.0, 0.05


def check_values(path, kind: str, idx: torch.Tensor, values: torch.Tensor, mu: torch.Tensor,
                 nu: torch.Tensor) -> None:
    """P's numbers at load: finite, not all zero; for a plan (a kind whose P is a probability, translator/kinds.py:
    sparse, softmax) non-negative, with mu and nu distributions and P's marginals close to them. A P of NaN, inf or zeros is refused here, before it is scored
    or finetuned."""
    for name, x in (("values", values), ("mu", mu), ("nu", nu)):
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise PFileError(f"{path}: {bad} of {x.numel()} {name} are NaN or infinite; the P file is damaged or "
                             "came from a diverged run")
    if not bool((values != 0).any()):
        raise PFileError(f"{path}: every value of P is zero; a P file that translates nothing")
    if not REGISTRY[kind].is_probability:  # signed weights (the unconstrained translator's W = C)
        return
    vals = values.double()
    for name, x, n in (("values", vals, None), ("mu", mu, None), ("nu", nu, None)):
        if bool((x < 0).any()):
            raise PFileError(f"{path}: {int((x < 0).sum())} negative {name} in a {kind} plan (a distribution)")
    for name, x in (("mu", mu), ("nu", nu)):
        if abs(float(x.double().sum()) - 1) > MASS_TOL:
            raise PFileError(f"{path}: {name} sums to {float(x.double().sum()):.4g}, not 1")
    v, u = mu.numel(), nu.numel()
    rows = torch.zeros(v, dtype=torch.float64).index_add_(0, idx[0], vals)
    cols = torch.zeros(u, dtype=torch.float64).index_add_(0, idx[1], vals)
    col_tv, row_tv = float((cols - nu.double()).abs().sum()), float((rows - mu.double()).abs().sum())
    if col_tv > COL_TV_MAX or row_tv > ROW_TV_MAX:
        raise PFileError(f"{path}: P's marginals are far from the file's own mu and nu (column sums off by "
                         f"{col_tv:.3g}, row sums by {row_tv:.3g} in total; at most {COL_TV_MAX} and {ROW_TV_MAX}); "
                         "not a transport plan of these marginals")
