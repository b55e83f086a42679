"""The `loss.<key>` options a loss declares in its registry entry (`losses.registry`).

An `Option` is one flat config key: its type, default, one-line description, value bounds,
and the kernel keyword it binds to. The config layer builds the `loss:` section's fields from
these declarations (so the keys, their checks and docs/configuration.md come from here), and
the train step passes a loss's options to its kernel by their `kwarg`. Options read by several
losses (the TOPR family's bounds, PPO's clip) are declared once below and listed in each
entry that reads them; an option read by one loss is declared inside that loss's entry.

Standard library only: the config imports these declarations, and validating a config must
not import JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

# A rule over several options of one loss (e.g. IcePop's α < β): the message for bad values,
# None when they are fine. It reads the config's values by key.
OptionsCheck = Callable[[Mapping[str, Any]], str | None]


@dataclasses.dataclass(frozen=True)
class Option:
    """One `loss.<key>` option of the losses whose entries list it."""

    key: str  # the flat config key users write: loss.<key>
    type: Any  # what the config validates: float, float | None, bool, Literal[...]
    default: Any  # also the value that counts as "not set" for the losses that do not read it
    doc: str  # the description in docs/configuration.md (the owning losses are prefixed)
    # The kernel keyword the value is passed as; None: the train step's binding reads it
    # (train/loss_fn.py), not the kernel. A None value is never passed: the kernel's own
    # default (or the TOPR preset's bound) applies.
    kwarg: str | None
    gt: float | None = None  # bounds, checked by the config like pydantic's Field(gt=...)
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    # A value within the bounds that is still wrong: the reason, or None when fine.
    check: Callable[[Any], str | None] | None = None
    # Set away from its default with a loss that does not read it: an error (True), or
    # ignored (False: kept for the keys one `loss:` section sets across a sweep of losses,
    # e.g. experiments/topr_offline.py gives every loss ppo's clip_eps and dpo's beta).
    strict: bool = True

    def bounds(self) -> dict[str, float]:
        """The set bounds by name (`gt`, `ge`, `lt`, `le`)."""
        return {k: v for k in ("gt", "ge", "lt", "le") if (v := getattr(self, k)) is not None}


AggregationName = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]

# --------------------------------------------------------------- TOPR family (TOPR Table 1)


def _bound(key: str, what: str) -> Option:
    return Option(key, float | None, None, f"{what} (null: the preset's, TOPR Table 1)", key,
                  strict=False)


TOPR_BOUNDS = (
    _bound("a_pos", "lower truncation bound of the positive records' ratio weight"),
    _bound("b_pos", "upper bound of the positive records' ratio weight"),
    _bound("a_neg", "lower bound of the negative records' ratio weight"),
    _bound("b_neg", "upper bound of the negative records' ratio weight"),
)
LENGTH_NORM = Option("length_norm", bool, True, "divide each record's token sum by its length",
                     "length_norm", strict=False)
RATIO_LEVEL = Option(
    "ratio_level", Literal["sequence", "token", "geometric"], "sequence",
    '"sequence" π(y)/μ(y) (TOPR\'s), "token" π_t/μ_t, or "geometric" — the length-normalised '
    "(π(y)/μ(y))^{1/|y|} (TOPR family only; ppo takes sequence or token)", "ratio_level")
AGGREGATION = Option(
    "aggregation", AggregationName | None, None,
    "the reduction, in verl's names; null = the loss's own: token-mean for ppo (token ratios) "
    "and grpo, for the TOPR family and asymre length_norm's per-record normalisation "
    "(seq-mean-token-mean / -sum), seq-mean-token-sum for dppo, trm and vcpo (their papers' "
    "sum over a sequence's tokens, mean over sequences)", "aggregation")


def topr_check(values: Mapping[str, Any]) -> str | None:
    """length_norm=false and an aggregation both choose the TOPR normalisation."""
    if values["aggregation"] is not None and not values["length_norm"]:
        return (f"loss.length_norm=false and loss.aggregation={values['aggregation']} both "
                "choose the TOPR normalisation; length_norm=false is "
                "aggregation=seq-mean-token-sum: set only loss.aggregation")
    return None


def no_ratio_check(name: str) -> OptionsCheck:
    """`topr_check`, and for a TOPR preset that reads no μ (sft, reinforce: weights 1/0 or 1,
    no ratio) a refusal of the ratio bounds: a set bound would weigh its records by π/μ, with
    μ never scored for it (zero-filled)."""
    def check(values: Mapping[str, Any]) -> str | None:
        bound = next((o.key for o in TOPR_BOUNDS if values[o.key] is not None), None)
        if bound is not None:
            return (f"loss.{bound}={values[bound]} with loss.name={name}: {name} reads no μ "
                    "(its records are never scored for it), so a ratio bound would weigh them "
                    "by π/μ over a μ of zeros. The ratio bounds belong to the losses that read "
                    "μ (loss.name=topr, tis, opr): use one of those, or unset the bound")
        return topr_check(values)
    return check


TOPR_OPTIONS = (*TOPR_BOUNDS, LENGTH_NORM, RATIO_LEVEL, AGGREGATION)

# ----------------------------------------------------------------------- PPO / GRPO clipping


def _dual_clip(c: float | None) -> str | None:
    if c is not None and not c > 1.0:
        return ("dual clip needs c > 1 (dual-clip PPO, arXiv:1912.09729: c ≤ 1 would cap "
                "negative-advantage losses at or below the unclipped value); e.g. 3.0, or null")
    return None


CLIP_OPTIONS = (
    Option("clip_eps", float, 0.2, "ratio clip ε (1 ± ε)", "clip_eps", gt=0, strict=False),
    Option("clip_eps_low", float | None, None,
           "lower clip bound (DAPO clip-higher, arXiv:2503.14476); null means clip_eps",
           "clip_eps_low", ge=0, le=1),
    Option("clip_eps_high", float | None, None,
           "upper clip bound (DAPO clip-higher); null means clip_eps", "clip_eps_high", ge=0),
    Option("dual_clip_c", float | None, None,
           "dual clip (arXiv:1912.09729): loss ≤ −c·A for A < 0; c > 1; null = off",
           "dual_clip_c", check=_dual_clip),
)
STD_DDOF = Option("std_ddof", Literal[0, 1], 0,
                  "the group std of the advantages: 0 population, 1 sample std (verl / TRL)",
                  "std_ddof")


def ppo_check(values: Mapping[str, Any]) -> str | None:
    """PPO takes sequence or token ratios, and reduces tokens (aggregation) only with the
    token ratio."""
    level = values["ratio_level"]
    if level == "geometric":
        return ("loss.ratio_level=geometric has no effect with loss.name=ppo: geometric ratios "
                "are for the TOPR family; ppo takes ratio_level sequence or token")
    if values["aggregation"] is not None and level != "token":
        return (f"loss.aggregation has no effect with loss.name=ppo and loss.ratio_level={level}:"
                " a sequence ratio weighs whole records; set loss.ratio_level=token or remove "
                "loss.aggregation")
    return None


# ------------------------------------------------------------------------ preference losses

BETA = Option("beta", float, 0.1, "β of the implicit reward", "beta", gt=0, strict=False)


# ------------------------------------------------------------- async-RL objectives (2025–26)
# DPPO arXiv:2602.04879, TRM arXiv:2512.23075, OAPL arXiv:2602.19362, VCPO arXiv:2602.17616,
# AsymRE arXiv:2506.20520 (losses/trust_region.py, optimal_advantage.py,
# variance_controlled.py, policy_gradient.py; docs/kernels.md § Async-RL objectives).


def _no_effect(values: Mapping[str, Any], key: str, default: Any, because: str) -> str | None:
    if values[key] != default:
        return f"loss.{key}={values[key]} has no effect: {because}; remove the key"
    return None


DPPO_OPTIONS = (
    Option("dppo_divergence", Literal["tv", "kl"], "tv", "the Binary divergence between μ and π "
           "at the sampled token: tv |μ − π| (eq. 13) or kl of the two Bernoullis (eq. 14)",
           "divergence"),
    Option("dppo_delta", float | None, None, "threshold δ of the mask (eq. 12), for advantages "
           "> 0 and, unless dppo_delta_low, < 0; null: 0.15 for tv, 0.05 for kl (the paper's)",
           "delta", gt=0),
    Option("dppo_delta_low", float | None, None, "a separate δ for advantages < 0 (the "
           "authors' verl code and prime-rl take two); null: dppo_delta", "delta_low", gt=0),
    Option("dppo_ratio_cap", float | None, None, "gradient weight min(π/μ, C) (the paper's "
           "appendix: C = 5 in its scaling runs); null: no cap (eq. 11)", "ratio_cap", gt=0),
    Option("dppo_kl_tau", float, 0.0, "weight of prime-rl's per-token (log π/μ)² term (its "
           "default loss: 1e-3); 0: the paper's objective", "kl_tau", ge=0),
    Option("dppo_std_scale", bool, False, "divide the group-centred advantage by the group "
           "std (GRPO's); false: R − mean_group (the paper's)", "scale_by_std"),
)


def dppo_check(values: Mapping[str, Any]) -> str | None:
    if not values["dppo_std_scale"]:
        return _no_effect(values, "std_ddof", 0, "loss.dppo_std_scale=false takes no std")
    return None


TRM_OPTIONS = (
    Option("trm_delta", float, 0.05, "threshold δ of the sequence mask max_t ½(log π_t/μ_t)² "
           "≤ δ (the paper's TRM-Max: 0.05)", "delta", gt=0),
    Option("trm_delta_avg", float | None, None, "also require mean_t (ρ_t − 1 − log ρ_t) ≤ δ_avg"
           " (the paper's TRM-Avg: 0.001); null: max criterion only", "delta_avg", gt=0),
)
OAPL_OPTIONS = (
    Option("oapl_beta", float, 1e-3, "β₂ of the regression β₂·log(π/π_lag) ≈ r − V̂*", "beta",
           gt=0),
    Option("oapl_value_beta", float, 1.0, "β₁ of the group soft value V̂* = β₁ log mean "
           "exp(r/β₁)", "value_beta", gt=0),
)
VCPO_OPTIONS = (
    Option("vcpo_is_cap", float | None, 8.0, "truncation of the sequence weight π(y)/μ(y) in "
           "the gradient (the authors' runs: 8); null: untruncated", "is_cap", gt=0),
    Option("vcpo_baseline", Literal["opob", "group_mean"], "opob", "opob: Σw²‖∇log π‖²R / "
           "Σw²‖∇log π‖² per group (needs a backward pass per record); group_mean: ablation",
           "baseline"),
    Option("vcpo_std_scale", bool, True, "divide R − b by the group's reward std (the "
           "authors' runs)", "scale_by_std"),
    Option("vcpo_ess_rule", Literal["sqrt", "linear", "off"], "sqrt", "step scale from ρ = "
           "ESS/N: √min(1, ρ/ρ_base) (the paper's, for AdamW-style optimizers), min(1, "
           "ρ/ρ_base), or off", "ess_rule"),
    Option("vcpo_ess_base", float, 1.0, "ρ_base of the step scale (the authors' runs: 1)",
           "ess_base", gt=0, le=1),
)


def vcpo_check(values: Mapping[str, Any]) -> str | None:
    if values["vcpo_ess_rule"] == "off":
        why = _no_effect(values, "vcpo_ess_base", 1.0, "loss.vcpo_ess_rule=off scales no step")
        if why:
            return why
    if not values["vcpo_std_scale"]:
        return _no_effect(values, "std_ddof", 0, "loss.vcpo_std_scale=false takes no std")
    return None


ASYMRE_OPTIONS = (
    Option("asymre_delta_v", float, -0.1, "δV of the baseline V = mean_group(R) + δV; ≤ 0 "
           "(V ≤ V^μ, the paper's improvement condition; Trinity-RFT's default −0.1)",
           "delta_v", le=0),
)
