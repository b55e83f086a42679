"""Sampler-vs-trainer mismatch of the score pass, as verl/TRL rollout correction report it.

The score pass recomputes the sampler's per-token log-probs with the trainer's numerics; any
difference (kernels, dtypes, batch shapes) makes π/μ ≠ 1 where it should be 1. `Mismatch`
accumulates per-process sufficient statistics that combine exactly over processes;
`compared_logprobs` decides which of the sampler's arrays is comparable to which of the
trainer's (the same temperature, the same — untruncated or truncated — distribution).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxrl_llm.data.records import Record
from jaxrl_llm.data.sampler_info import effective_temperature, manifest_sampler_info

# -- mismatch metrics ----------------------------------------------------------------------

# Per-process sufficient statistics of the sampler-vs-trainer comparison, combined over
# processes column by column: "sum" columns add, "max" columns take the maximum, and the
# sequence log-weights' (max, Σw, Σw²) — w = exp(log-weight − max) — are rescaled onto the
# global max (`Mismatch.combine`).
_SUM_STATS = ("tokens", "abs_dlogp", "abs_dp", "k3", "chi2", "x", "y", "xx", "yy", "xy",
              "sequences", "flagged", "dropped")
_MAX_STATS = ("max_abs_dp", "max_abs_seq")
_WEIGHT_STATS = ("top", "w1", "w2")
MISMATCH_STATS = _SUM_STATS + _MAX_STATS + _WEIGHT_STATS
NUM_MISMATCH_STATS = len(MISMATCH_STATS)


@dataclasses.dataclass
class Mismatch:
    """Running sampler-vs-trainer statistics, as verl/TRL rollout correction reports them.

    Per token, with q = the sampler's probability of the sampled token and p = the trainer's
    (the same distribution recomputed), r = p/q: mean |log p − log q|, mean and max |p − q|,
    the k3 estimate of KL(q ‖ p) = E_q[(r − 1) − log r], χ²(p ‖ q) = E_q[r²] − 1, and the
    Pearson correlation of log q and log p. Per sequence, with W = Π_t r_t: χ² = E[W²] − 1,
    the normalised effective sample size (ΣW)² / (N·ΣW²), the max |Σ log p − Σ log q|, and
    the sequences flagged / dropped by the `bound` (`generate.max_mismatch`).
    """

    sums: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(_SUM_STATS, 0.0))
    maxima: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(_MAX_STATS, 0.0))
    seq_log_weights: list[float] = dataclasses.field(default_factory=list)

    def add(self, trainer: np.ndarray, sampler: np.ndarray) -> float:
        """Add one sequence's per-token log-probs; returns Σ log p − Σ log q."""
        y, x = trainer.astype(np.float64), sampler.astype(np.float64)
        d = y - x  # log r
        dp = np.abs(np.exp(y) - np.exp(x))
        seq = float(d.sum())
        s = self.sums
        for key, value in (("tokens", d.size), ("abs_dlogp", np.abs(d).sum()), ("abs_dp", dp.sum()),
                           ("k3", (np.expm1(d) - d).sum()), ("chi2", np.expm1(2 * d).sum()),
                           ("x", x.sum()), ("y", y.sum()), ("xx", (x * x).sum()), ("yy", (y * y).sum()),
                           ("xy", (x * y).sum()), ("sequences", 1)):
            s[key] += float(value)
        self.maxima["max_abs_dp"] = max(self.maxima["max_abs_dp"], float(dp.max(initial=0.0)))
        self.maxima["max_abs_seq"] = max(self.maxima["max_abs_seq"], abs(seq))
        self.seq_log_weights.append(seq)
        return seq

    def count(self, key: str) -> None:
        """One more sequence `key` ("flagged" or "dropped")."""
        self.sums[key] += 1.0

    def stats(self) -> np.ndarray:
        """float64 [NUM_MISMATCH_STATS]: this process's sufficient statistics."""
        lw = np.asarray(self.seq_log_weights, np.float64)
        top = float(lw.max()) if lw.size else -np.inf
        w = np.exp(lw - top) if lw.size else lw
        return np.asarray([*(self.sums[k] for k in _SUM_STATS), *(self.maxima[k] for k in _MAX_STATS),
                           top, w.sum(), (w**2).sum()], np.float64)

    @staticmethod
    def combine(stats: np.ndarray) -> dict[str, float]:
        """The metrics of the union of the records behind each row of `stats` [P, NUM_STATS]."""
        stats = np.atleast_2d(np.asarray(stats, np.float64))
        col = {name: stats[:, i] for i, name in enumerate(MISMATCH_STATS)}
        s = {k: float(col[k].sum()) for k in _SUM_STATS}
        out = {"mismatch/flagged_sequences": s["flagged"], "mismatch/dropped_sequences": s["dropped"]}
        n_tok, n_seq = s["tokens"], s["sequences"]
        if not n_tok:
            return out
        has = col["sequences"] > 0
        top = float(col["top"][has].max())
        scale = np.exp(col["top"][has] - top)  # each process's weights onto the global max
        w1, w2 = float((col["w1"][has] * scale).sum()), float((col["w2"][has] * scale**2).sum())
        log_m2 = 2 * top + math.log(w2 / n_seq)  # log E[W²]
        out.update({
            "mismatch/mean_abs_logprob_diff": s["abs_dlogp"] / n_tok,
            "mismatch/mean_abs_prob_diff": s["abs_dp"] / n_tok,
            "mismatch/max_abs_prob_diff": float(col["max_abs_dp"].max()),
            "mismatch/kl_sampler_trainer": s["k3"] / n_tok,
            "mismatch/chi2_token": s["chi2"] / n_tok,
            "mismatch/chi2_seq": math.expm1(log_m2) if log_m2 < 700 else math.inf,
            "mismatch/ess_fraction": w1**2 / w2 / n_seq,
            "mismatch/max_abs_seq_logprob_diff": float(col["max_abs_seq"].max()),
            "mismatch/num_sequences": n_seq,
            "mismatch/num_tokens": n_tok,
        })
        vx, vy = s["xx"] - s["x"] ** 2 / n_tok, s["yy"] - s["y"] ** 2 / n_tok
        if vx > 0 and vy > 0:  # undefined for constant log-probs
            out["mismatch/pearson_logprob"] = (s["xy"] - s["x"] * s["y"] / n_tok) / math.sqrt(vx * vy)
        return out

    def metrics(self) -> dict[str, float]:
        return self.combine(self.stats()[None])


# -- which arrays are compared ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What the sampler's log-probs of a record set are compared with.

    `raw`: the trainer array (`"mu_logprobs"` at the scoring temperature, `"ref_logprobs"` at
    T = 1) at the temperature of the sampler's `raw_logprobs`, or None (no such temperature
    scored). `behavior`: whether `behavior_logprobs` (processed: at the sampling temperature,
    after top-k/top-p) are compared with `mu_logprobs` — only when the scoring temperature is
    the sampling temperature; with truncation on the difference includes the truncation.
    """

    raw: str | None
    behavior: bool

    def pair(self, record: Record, mu: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(trainer, sampler) log-probs of `record`'s model tokens to compare, or None: an
        episode's environment tokens (`action_mask` 0) were never sampled, so neither side
        has a log-prob there to compare."""
        if record.raw_logprobs is not None and self.raw is not None:
            trainer, sampler = (mu if self.raw == "mu_logprobs" else ref), record.raw_logprobs
        elif record.behavior_logprobs is not None and self.behavior:
            trainer, sampler = mu, record.behavior_logprobs
        else:
            return None
        model = record.model_tokens()
        return trainer[model], sampler[model]

    def to_json(self) -> dict[str, Any]:
        return {"raw_logprobs": self.raw, "behavior_logprobs": "mu_logprobs" if self.behavior else None}


def compared_logprobs(manifest: Any, temperature: float, ref_temperature: float) -> Comparison:
    """The `Comparison` for records of `manifest` scored at `temperature` (μ) and
    `ref_temperature` (π_ref)."""
    info = manifest_sampler_info(manifest)
    raw_t = info["raw_logprobs_temperature"]
    raw = None
    if raw_t is not None and math.isclose(raw_t, temperature, rel_tol=1e-6):
        raw = "mu_logprobs"
    elif raw_t is not None and math.isclose(raw_t, ref_temperature, rel_tol=1e-6):
        raw = "ref_logprobs"
    t = manifest.sampling.temperature
    behavior = t > 0 and math.isclose(effective_temperature(t), temperature, rel_tol=1e-6)
    return Comparison(raw, behavior)
