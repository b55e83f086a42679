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
    "and grpo, for the TOPR family length_norm's per-record normalisation "
    "(seq-mean-token-mean / -sum)", "aggregation")


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
