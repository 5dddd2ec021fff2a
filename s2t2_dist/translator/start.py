"""The translator's start, as stage 1 builds it: the tokens' surface strings decomposed into source tokens, the FVT
prior and its source marginal (`ot.prior`), and the translator built from them. The stage and the benchmarks reach
it here, without the stage."""

from __future__ import annotations

import torch

from s2t2_dist.translator.recipe import TranslatorConfig

__all__ = ["start_translator", "surface_decomposition", "surface_prior"]


def start_translator(tc: TranslatorConfig, model_path: str, src_tok, src_ids: list[int], tgt, *,
                     lr: float | None = None, trust_remote_code: bool = False, group=None,
                     device: torch.device | str = "cpu"):
    """The translator as stage 1 starts it (the stage and bench/rehearsal.py call this). The section ``tc``
    resolved at v x u with ``lr`` (``optim.lr``; ``TranslatorConfig.resolve``: lr, alpha, floor, source marginal), the
    FVT prior (``translator.init=fvt``) with its source marginal, the translator built (``TranslatorConfig.build``)
    with C from the prior, on ``device``. Returns (translator, the prior's decomposition or None, the Resolved).
    ``translator.init_p`` is the caller's: it checks the P file against the run's tokenizers first."""
    v, u = len(src_ids), tgt.vocab_size
    resolved = tc.resolve(v, u, lr=lr)
    P0 = mu = dec = None
    if tc.fvt_start:
        uniform = (torch.full((v,), 1.0 / v, dtype=torch.float64), torch.full((u,), 1.0 / u, dtype=torch.float64))
        P0, dec, mu = surface_prior(model_path, src_tok, src_ids, tgt, *uniform, tc.init_weight,
                                    trust_remote_code=trust_remote_code, marginal=resolved.source_marginal,
                                    floor=resolved.floor)
    translator = tc.build(v, u, resolved=resolved, mu=mu, group=group, device=device)
    if P0 is not None:
        translator.init_from_dense(P0)
    return translator, dec, resolved


def surface_decomposition(src_tok, src_ids: list[int], tgt):
    """Every target token's surface string split greedily into source tokens (`ot.prior.decompose`), special
    tokens paired by role: the target's document-start token (BOS, or EOS without one) with the source's BOS, the
    target's EOS with the source's EOS, where the source list holds them. `src_tok`: a tokenizer or its path."""
    from s2t2_dist.data.tokenizers import source_surface_bytes, token_bytes
    from s2t2_dist.ot.prior import decompose

    src = source_surface_bytes(src_tok, src_ids)
    tgt_bytes = token_bytes(tgt.tokenizer)
    row = {int(i): r for r, i in enumerate(src_ids)}
    pairs = {}
    s_bos = getattr(src_tok, "bos_token_id", None)
    s_eos = getattr(src_tok, "eos_token_id", None)
    for t_id, s_id in ((tgt.eos_id, s_eos if s_eos is not None else s_bos), (tgt.start_id, s_bos),
                       (tgt.bos_id, s_bos)):
        if t_id is not None and s_id is not None and int(s_id) in row:
            pairs[int(t_id)] = row[int(s_id)]
    return decompose([tgt_bytes.get(j) for j in range(tgt.vocab_size)], src, pairs)


def surface_prior(model_path: str, src_tok, src_ids: list[int], tgt, mu, nu, weight: float, *,
                  trust_remote_code: bool = False, marginal: str = "uniform", floor: float = 0.0):
    """(P0, decomposition, mu): the FVT start P0 (v x u, float64) of `ot.prior` from both tokenizers' surface
    strings, and the source marginal it is feasible for. "uniform": the given ``mu`` and the plain blend
    (`blend_with_uniform`; the projections move it). "start": `start_plan` (a share ``1 - weight`` of every
    column on the most used pieces that the weight floor ``floor`` (units of 1/v) keeps; a column no piece builds
    is that shared part) and its own row sums, so that it is its own plan (the decomposition: `surface_decomposition`)."""
    from s2t2_dist.ot.prior import blend_with_uniform, fvt_plan, row_marginal, start_plan

    dec = surface_decomposition(model_path if src_tok is None else src_tok, src_ids, tgt)
    if marginal != "start":
        mu = mu.cpu().double()
        return blend_with_uniform(fvt_plan(dec, mu, nu.cpu()), mu, nu.cpu(), weight), dec, mu
    v = mu.numel()
    P0 = start_plan(dec, nu.cpu(), v, weight, floor / v)
    return P0, dec, row_marginal(P0)
