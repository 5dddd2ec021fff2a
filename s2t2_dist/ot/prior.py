"""Starting plans for C from the surface strings of the tokens (pure math on bytes; no I/O, no torch.distributed).

FVT ("fast vocabulary transfer", the zero-shot baseline of ZeTT / tokenkit): each target token's bytes are written
as source tokens by greedy longest match, and its embedding is the mean of theirs. As a plan: column j of
``P_fvt`` puts ``nu_j * count_i / n_pieces`` on each source row i of its decomposition, so ``W = P / nu`` (the
"convex" weights) is exactly the FVT average. A target token whose bytes no source token covers (or a special
token without a counterpart) gets the uniform column ``nu_j * mu``.

The start of training is ``P0 = lam * P_fvt + (1 - lam) * mu nu^T``: lam = 1 is FVT itself, lam = 0 the paper's
uniform start. Columns of P0 sum exactly to nu; rows do not sum to mu (the sparse Sinkhorn projects them).

Under the start's own source marginal (the sparse kind's ``source_marginal: start``) the start is
:func:`shared_start` instead: the ``1 - lam`` part (the "shared part", a mean of the most used pieces) goes only to
the rows that the weight floor keeps, :func:`shared_rows`, renormalised there, so every built column keeps exactly
``1 - lam`` of its weight in that part at any v. The plain blend leaves it to the floor, which drops
``(1 - lam) mu_i`` below ``floor / v``: at v = 512 most of it (the shared part falls to ~0.18 of a column at lam 0.5),
at v = 49,152 none (0.49 over every row mu uses; docs/translator.md, "init_weight").
:func:`start_plan` composes it from a decomposition; there a target token that no piece builds starts as the shared
part alone, not as FVT's uniform column, so the start's marginal holds no mass on rows that nothing uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["Decomposition", "decompose", "fvt_plan", "blend_with_uniform", "row_marginal", "shared_rows",
           "shared_start", "start_plan"]


@dataclass
class Decomposition:
    #: per target token: the source ROWS (indices into the source list) of its pieces, in order
    pieces: list[list[int]]
    #: bytes of all (non-special) target tokens, and how many of them some source piece covers
    total_bytes: int
    covered_bytes: int
    #: target tokens with no piece at all (uniform column)
    empty: int
    #: target tokens that are one source token exactly (the same string in both vocabularies)
    identical: int

    @property
    def coverage(self) -> float:
        return self.covered_bytes / self.total_bytes if self.total_bytes else 0.0


def decompose(target: Sequence[bytes | None], source: Sequence[bytes | None],
              special_pairs: dict[int, int] | None = None) -> Decomposition:
    """Greedy longest-match decomposition of every target token's bytes into source tokens.

    ``target[j]`` / ``source[i]``: the bytes each token stands for (None: a special token). ``special_pairs``:
    target id -> source row for tokens matched by role (BOS to BOS...), used whatever their bytes. A byte that no
    source token starts with is skipped (counted as uncovered)."""
    special_pairs = dict(special_pairs or {})
    index: dict[bytes, int] = {}
    for i, b in enumerate(source):
        if b:  # the first (lowest-row) source token of a string wins, as a tokenizer's own id would
            index.setdefault(bytes(b), i)
    max_len = max((len(b) for b in index), default=0)
    pieces: list[list[int]] = []
    total = covered = empty = identical = 0
    for j, t in enumerate(target):
        if j in special_pairs:
            pieces.append([int(special_pairs[j])])
            continue
        if not t:
            pieces.append([])
            empty += 1
            continue
        t = bytes(t)
        total += len(t)
        out: list[int] = []
        k = 0
        while k < len(t):
            for n in range(min(max_len, len(t) - k), 0, -1):
                i = index.get(t[k: k + n])
                if i is not None:
                    out.append(i)
                    covered += n
                    k += n
                    break
            else:
                k += 1  # no source token starts with this byte
        if not out:
            empty += 1
        elif len(out) == 1 and source[out[0]] == t:
            identical += 1
        pieces.append(out)
    return Decomposition(pieces, total, covered, empty, identical)


def fvt_plan(dec: Decomposition, mu: Tensor, nu: Tensor) -> Tensor:
    """The FVT plan (v x u, float64) of a decomposition: column j is ``nu_j`` spread evenly over its pieces (a
    piece used twice counts twice), or ``nu_j * mu`` when it has none."""
    mu, nu = mu.double().reshape(-1), nu.double().reshape(-1)
    v, u = mu.numel(), nu.numel()
    if len(dec.pieces) != u:
        raise ValueError(f"decomposition of {len(dec.pieces)} target tokens for u={u}")
    P = torch.zeros(v, u, dtype=torch.float64)
    for j, rows in enumerate(dec.pieces):
        if not rows:
            P[:, j] = mu * nu[j]
            continue
        r = torch.tensor(rows, dtype=torch.long)
        if int(r.max()) >= v or int(r.min()) < 0:
            raise ValueError(f"target {j}: source row out of range 0..{v - 1}")
        P[:, j].index_add_(0, r, torch.full((r.numel(),), float(nu[j]) / r.numel(), dtype=torch.float64))
    return P


def blend_with_uniform(P: Tensor, mu: Tensor, nu: Tensor, lam: float) -> Tensor:
    """``lam * P + (1 - lam) * mu nu^T`` (float64): a start between the prior (lam = 1) and the uniform plan."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"blend weight must be in [0, 1], got {lam}")
    U = mu.double().reshape(-1, 1) * nu.double().reshape(1, -1)
    return lam * P.double() + (1.0 - lam) * U


def row_marginal(P: Tensor) -> Tensor:
    """The source marginal under which the plan ``P`` is feasible: its row sums, normalised (float64). A source
    token that ``P`` never uses gets mass 0 (an all-zero row of every plan with this marginal)."""
    r = P.double().sum(1)
    if float(r.sum()) <= 0 or bool((r < 0).any()):
        raise ValueError("row_marginal: P must be non-negative with positive total mass")
    return r / r.sum()


def shared_rows(mu: Tensor, share: float, floor_w: float) -> Tensor:
    """The source rows of the shared part (bool, v): the largest set of the most used rows (by ``mu``, ties taken
    or left whole) on which ``share * mu_i / mu(rows) >= floor_w`` for every row, i.e. the rows whose weight in the
    shared part stays at or above the floor (``floor_w``: the floor as a weight, ``floor / v``). Empty when even
    the most used row falls below it (``share`` 0, or a flat ``mu`` with ``share < 1``...)."""
    mu = mu.double().reshape(-1)
    m, order = mu.sort(descending=True)
    # mass of all rows with mu >= m_k, whole tie groups together (so a tie is never split by row order)
    vals, inv = torch.unique(m, sorted=True, return_inverse=True)
    above = torch.zeros_like(vals).index_add_(0, inv, m).flip(0).cumsum(0).flip(0)[inv]
    # share * m_k - floor_w * above_k falls with k, so the rows that pass are a prefix of the sorted order
    ok = (share * m >= floor_w * above) & (m > 0)
    keep = torch.zeros(mu.numel(), dtype=torch.bool)
    keep[order[ok]] = True
    return keep


def shared_start(P: Tensor, mu: Tensor, nu: Tensor, lam: float, floor_w: float,
                 unbuilt: Tensor | None = None) -> Tensor:
    """``lam * P + (1 - lam) * s nu^T`` (float64), ``s`` = ``mu`` on :func:`shared_rows` (``1 - lam``,
    ``floor_w``) renormalised to 1: each column gives exactly ``1 - lam`` of its mass to the shared part, whatever
    v is, on rows the floor keeps. ``floor_w`` 0 keeps every row of ``mu`` (the plain blend). No row passes: ``P``
    itself (what the floor makes of the blend then). ``unbuilt`` (bool, u): these columns are ``nu_j s`` alone
    (with no shared row, ``s`` is ``mu`` renormalised)."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"blend weight must be in [0, 1], got {lam}")
    mu = mu.double().reshape(-1)
    keep = shared_rows(mu, 1.0 - lam, floor_w)
    shared = bool(keep.any())
    s = torch.where(keep, mu, torch.zeros_like(mu)) if shared else mu
    s = s / s.sum()
    out = blend_with_uniform(P, s, nu, lam) if shared else P.double().clone()
    if unbuilt is not None:
        out[:, unbuilt] = s.unsqueeze(1) * nu.double().reshape(-1)[unbuilt]
    return out


def start_plan(dec: Decomposition, nu: Tensor, v: int, lam: float, floor_w: float) -> Tensor:
    """The sparse kind's start under its own source marginal (float64, v x u; the marginal is its
    :func:`row_marginal`): :func:`shared_start` of the FVT plan over the marginal of the pieces the built columns
    use, and every column that no piece builds set to that shared part (``nu_j s``; with no shared part, the
    pieces' marginal). FVT's uniform column there would put ``nu_j / v`` on every source row: at v = 49,152 that
    is mass on ~48,700 rows that no column uses, which every row step of the projections then has to place and
    the last column step drops (3.6% of the marginal with SmolLM2's English, 23 unbuilt columns). With no built
    column at all: FVT's plan (uniform columns) blended as :func:`shared_start` does."""
    nu = nu.double().reshape(-1)
    F = fvt_plan(dec, torch.full((v,), 1.0 / v, dtype=torch.float64), nu)
    built = torch.tensor([bool(p) for p in dec.pieces], dtype=torch.bool)
    if not bool(built.any()):
        return shared_start(F, row_marginal(F), nu, lam, floor_w)
    return shared_start(F, row_marginal(F[:, built]), nu, lam, floor_w, unbuilt=~built)
