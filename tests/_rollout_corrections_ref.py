"""An independent numpy reference of the rollout corrections (`jaxrl_vlm/rl/corrections.py`) and their diagnostics.

Written from the definitions (verl's `docs/algo/rollout_corr.md`, slime's MIS helper, the IcePop and SkyRL papers),
in float64, looping over each packed sequence's loss-mask tokens one sequence at a time: it shares no code with the
jnp segment sums it checks.
"""

from __future__ import annotations

import numpy as np

BOUND = 20.0  # |log ratio| bound before exp, token and sequence alike


def reference(name: str, train: np.ndarray, rollout: np.ndarray, mask: np.ndarray, ids: np.ndarray, low: float,
              high: float) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """(weights [B, T], keep [B, T], diagnostics without the `rollout_corr/` prefix) of correction `name`."""
    m = mask > 0
    weights, keep = np.zeros(mask.shape), np.zeros(mask.shape)
    with np.errstate(invalid="ignore"):
        d = np.clip(np.where(m, train - rollout, 0.0), -BOUND, BOUND)
    r = np.exp(d)
    for s in np.unique(ids[m]):
        sel = m & (ids == s)
        total = np.clip(d[sel].sum(), -BOUND, BOUND)
        seq_ratio, geo = np.exp(total), np.exp(d[sel].mean())
        tok = r[sel]
        in_band = (tok >= low) & (tok <= high)
        if name in ("none", "custom"):
            w, k = np.ones_like(tok), np.ones_like(tok)
        elif name == "token_tis":
            w, k = np.clip(tok, low, high), np.ones_like(tok)
        elif name == "sequence_tis":
            w, k = np.full_like(tok, min(max(seq_ratio, low), high)), np.ones_like(tok)
        elif name == "token_mis":
            k = in_band.astype(float)
            w = tok * k
        elif name == "sequence_mis":
            k = np.full_like(tok, float(low <= seq_ratio <= high))
            w = seq_ratio * k
        elif name == "icepop":
            w, k = np.where(in_band, tok, 0.0), np.ones_like(tok)
        elif name == "geo_mask":
            k = np.full_like(tok, float(low <= geo <= high))
            w = k.copy()
        else:
            raise KeyError(name)
        weights[sel], keep[sel] = w, k
    dropped = m & ((keep == 0) | (weights == 0)) if name != "custom" else m & (keep == 0)
    kept = m & ~dropped
    seqs = np.unique(ids[m])
    if not m.any():  # a micro-batch of padding: every mean has weight 0 and reads 0
        return weights, keep, dict.fromkeys(["k3", "chi2", "masked_token_frac", "masked_seq_frac"]
                                            + ([] if name == "custom" else ["weight_mean"]), 0.0)
    metrics = {
        "k3": float((r - 1.0 - d)[m].mean()),  # float64: no cancellation to worry about
        "chi2": float((r**2 - 1.0)[m].mean()),
        "masked_token_frac": float(dropped[m].mean()),
        "masked_seq_frac": float(np.mean([dropped[ids == s].any() for s in seqs])),
    }
    if name != "custom":
        metrics["weight_mean"] = float(weights[kept].mean()) if kept.any() else 0.0
    return weights, keep, metrics
