"""The one table of losses: name → kernel, the data it needs, what it minimises, and its options.

Every part of the package that must know something about a loss reads it here — config
validation, the loader (pairs, whole groups, μ), the trainer (what to require, which metrics
mean something), the train step (micro-batching, the frozen reference model), `score`,
`curate` and `iterate` — so the taxonomy cannot drift between them. The kernels themselves
live in `policy_gradient` (TOPR, AsymRE), `ppo`, `stale_is`, `trust_region` (DPPO, TRM),
`optimal_advantage` (OAPL), `variance_controlled` (VCPO), `off_rl` and `preference`;
docs/kernels.md gives each formula and its paper
(TOPR arXiv:2503.14286, FPA arXiv:2509.19893).

Requirements, per loss:

- `needs_mu`: the kernel weights records by the importance ratio π/μ, so records need μ's
  per-token log-probs (`jaxrl-llm score`, or the sampler's with `loss.mu_source: sampler`).
- `needs_ref`: the kernel reads log π_ref(y): from the records (`ref_logprobs`, written by the
  score pass) or from the frozen reference model in the step (`train.ref_logprobs: model`).
- `needs_ref_model`: the kernel needs the reference model's hidden states (FPA's extrapolated
  policy), so the frozen reference always runs in the step.
- `needs_pairs`: the batch holds (chosen, rejected) pairs as rows (2i, 2i+1) (`curate` with
  `data.curation: dpo`); rows cannot be packed.
- `needs_groups`: the kernel computes statistics over a prompt's group inside the batch, so
  batches must hold whole groups.
- `full_batch`: rows are coupled across the batch inside the kernel (pairs, KTO's batch-mean
  z₀, A*-PO's group values, M2PO's second-moment mask over all tokens), so the step cannot split the batch into micro-batches. (GRPO's
  group advantages are computed on the full batch before the split, so it can; so are those
  of a loss with `advantages`, its kernel module's function the step calls on the full batch.)
- `needs_score_norms`: the kernel's baseline reads each record's `‖∇_θ log π(y)‖²` (VCPO's
  OPOB), so the step runs a backward pass per record first (train/score_norms.py) and the
  records cannot be packed.

Options, per loss (`LossSpec.options`, `losses.options.Option`): the `loss.<key>` keys the
loss reads, each with its type, default, bounds, description and the kernel keyword it binds
to, plus an optional rule over several of them (`LossSpec.check`). The config builds its
`loss:` fields from `OPTIONS` and refuses, through `option_problem`, an option of another loss
set away from its default; the train step passes `LossSpec.kernel_options` to the kernel. So
a new loss is its kernel module plus one entry below, and a new option of a loss is one
`Option` in its entry. The table imports no JAX: a kernel's module is imported on first use of
`LossSpec.kernel`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Literal

from jaxrl_llm.losses.options import (
    AGGREGATION,
    ASYMRE_OPTIONS,
    BETA,
    CLIP_OPTIONS,
    DPPO_OPTIONS,
    LENGTH_NORM,
    OAPL_OPTIONS,
    RATIO_LEVEL,
    STD_DDOF,
    TOPR_OPTIONS,
    TRM_OPTIONS,
    VCPO_OPTIONS,
    Option,
    OptionsCheck,
    dppo_check,
    no_ratio_check,
    ppo_check,
    topr_check,
    vcpo_check,
)

if TYPE_CHECKING:
    from jaxrl_llm.losses.types import LossOutput


def _module(name: str) -> Any:
    """A kernel module of this package, imported when a kernel is first used (so reading
    the table, e.g. to validate a config, imports no JAX)."""
    return importlib.import_module(f"jaxrl_llm.losses.{name}")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """One loss: its kernel, its family (how the train step binds batch fields to it), the data
    it needs, a one-line statement of what it minimises (its sign convention), and its
    `loss.<key>` options (`losses.options.Option`: type, default, bounds, kernel keyword)."""

    name: str
    load: Callable[[], Callable[..., LossOutput]]  # imports and returns the kernel
    # "topr" | "ppo" | "group" | "stale_is" | "async" | "asymre" | "off_rl" | "fpa" | "preference"
    family: str
    minimises: str
    # Which records count as positive (`train.grad_norm_by_sign`): "baseline" (R − baseline
    # ≥ 0, TOPR eq. 7), "group" (group advantage ≥ 0), "correct" (the verifier's flag, FPA's
    # split), or None for losses that couple records (pairs, batch means).
    positive: str | None = None
    # The kernel's required array arguments (names as in its signature) when called directly.
    inputs: tuple[str, ...] = ("logp", "logmu", "mask", "rewards")
    needs_mu: bool = False
    needs_ref: bool = False
    needs_ref_model: bool = False
    needs_pairs: bool = False
    needs_groups: bool = False
    needs_score_norms: bool = False
    full_batch: bool = False
    options: tuple[Option, ...] = ()
    check: OptionsCheck | None = None  # a rule over several of its options (e.g. α < β)
    # Imports and returns the function the train step calls on the full batch for the per-record
    # advantages, `fn(rewards, group_ids, record_mask, **kernel_options) -> [B]` (whole groups
    # before the micro-batch split); None: the step computes none, or GRPO's by family.
    advantages: Callable[[], Callable[..., Any]] | None = None

    @cached_property
    def kernel(self) -> Callable[..., LossOutput]:
        """The kernel function (its module imported on first use)."""
        return self.load()

    def needs(self) -> tuple[str, ...]:
        """The names of the requirements that hold (for messages and docs)."""
        return tuple(f.name for f in dataclasses.fields(self)
                     if f.name.startswith("needs_") and getattr(self, f.name))

    def kernel_options(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """This loss's options in `values` (by config key) as its kernel's keywords; a None
        value is left out, so the kernel's default (or the TOPR preset's bound) applies."""
        return {o.kwarg: values[o.key] for o in self.options
                if o.kwarg is not None and values[o.key] is not None}


def _topr(name: str, minimises: str, needs_mu: bool) -> LossSpec:
    def load() -> Callable[..., LossOutput]:
        pg = _module("policy_gradient")
        return partial(pg.topr_loss, **pg.TOPR_PRESETS[name])

    return LossSpec(name, load, "topr", minimises, positive="baseline", needs_mu=needs_mu,
                    options=TOPR_OPTIONS, check=topr_check if needs_mu else no_ratio_check(name))


_GROUP_INPUTS = ("logp", "logmu", "mask", "rewards", "group_ids")
_PREFERENCE_INPUTS = ("logp", "ref_logp", "mask")


def _stale(name: str, minimises: str, options: tuple[Option, ...], *,
           check: OptionsCheck | None = None, full_batch: bool = False) -> LossSpec:
    return LossSpec(name, lambda: getattr(_module("stale_is"), f"{name}_loss"), "stale_is",
                    minimises, positive="group", needs_mu=True, inputs=_GROUP_INPUTS,
                    needs_groups=True, full_batch=full_batch, options=(*options, STD_DDOF),
                    check=check)


def _async(name: str, module: str, minimises: str, options: tuple[Option, ...], *,
           advantages: str | None, check: OptionsCheck | None = None,
           inputs: tuple[str, ...] = _GROUP_INPUTS, **needs: bool) -> LossSpec:
    """The async-RL objectives of 2025–26 (docs/kernels.md § Async-RL objectives): μ and whole
    groups; `advantages` names the module's full-batch advantage function."""
    fn = None if advantages is None else (lambda: getattr(_module(module), advantages))
    return LossSpec(name, lambda: getattr(_module(module), f"{name}_loss"), "async", minimises,
                    positive="group", needs_mu=True, inputs=inputs, needs_groups=True,
                    options=options, check=check, advantages=fn, **needs)


def _preference(name: str, minimises: str, options: tuple[Option, ...], **needs: bool) -> LossSpec:
    return LossSpec(name, lambda: _module("preference").PREFERENCE_LOSSES[name], "preference",
                    minimises, inputs=_PREFERENCE_INPUTS, needs_ref=True, full_batch=True,
                    options=options, **needs)


def _icepop_check(values: Mapping[str, Any]) -> str | None:
    if values["icepop_alpha"] >= values["icepop_beta"]:
        return (f"loss.icepop_alpha={values['icepop_alpha']} must be < loss.icepop_beta="
                f"{values['icepop_beta']}: IcePop keeps the ratios in [α, β] "
                "(arXiv:2510.18855: 0.5, 5)")
    return None


_SPECS = (
    # TOPR family (TOPR eq. 7 and Table 1): −Σ_y w(y) R(y) log π(y), w from the truncated ratio.
    _topr("topr", "−[R>0]·R·log π − [R<0]·[π/μ]₀¹·R·log π (TOPR eq. 7, 11)", needs_mu=True),
    _topr("sft", "−[R>0]·log π over positives (TOPR Table 1, weights 1/0)", needs_mu=False),
    _topr("reinforce", "−R·log π, no ratio (naive off-policy REINFORCE)", needs_mu=False),
    _topr("opr", "−(π/μ)·R·log π, untruncated importance sampling", needs_mu=True),
    _topr("tis", "−[π/μ]₀¹·R·log π for every record (truncated IS)", needs_mu=True),
    LossSpec("ppo", lambda: _module("ppo").ppo_loss, "ppo",
             "−min(ρA, clip(ρ, 1±ε)A), ρ = π/μ, A = R − baseline (TOPR eq. 6)", positive="baseline",
             needs_mu=True, options=(*CLIP_OPTIONS, RATIO_LEVEL, AGGREGATION),
             check=ppo_check),
    LossSpec("grpo", lambda: _module("ppo").grpo_loss, "group",
             "PPO surrogate, A = (R − mean_group)/std_group (FPA eq. 34–35)", positive="group", needs_mu=True,
             inputs=_GROUP_INPUTS, needs_groups=True,
             options=(*CLIP_OPTIONS, AGGREGATION, STD_DDOF)),
    LossSpec("dr_grpo", lambda: _module("ppo").dr_grpo_loss, "group",
             "PPO surrogate, A = R − mean_group, token sum / max_len (Dr.GRPO)", positive="group",
             needs_mu=True, inputs=_GROUP_INPUTS, needs_groups=True, options=CLIP_OPTIONS),
    # Stale-sample losses (losses/stale_is.py): group advantages Â, per-token ratios r = π/μ.
    _stale("cispo", "−sg(clip(r, 1−ε_low, 1+ε_high))·Â·log π, token mean (arXiv:2506.13585 eq. 4–5)", (
        Option("cispo_eps_low", float | None, None, "lower clip ε_low^IS of the IS weight "
               "(1 − ε_low); null = no lower bound (arXiv:2506.13585)", "eps_low", ge=0, le=1),
        Option("cispo_eps_high", float, 0.28, "upper clip ε_high^IS of the stop-gradient IS "
               "weight (1 + ε_high)", "eps_high", ge=0),
    )),
    _stale("gspo", "−min(sÂ, clip(s, 1±ε)Â), s = (π(y)/μ(y))^{1/|y|} (arXiv:2507.18071 eq. 5–7)", (
        Option("gspo_eps_low", float, 3e-4, "lower clip of the sequence ratio s (1 − ε), 3e-4 "
               "in arXiv:2507.18071", "eps_low", ge=0, le=1),
        Option("gspo_eps_high", float, 4e-4, "upper clip of the sequence ratio s (1 + ε), 4e-4 "
               "in arXiv:2507.18071", "eps_high", ge=0),
    )),
    _stale("icepop", "−1[α ≤ r ≤ β]·sg(r)·Â·log π, masked IS (arXiv:2510.18855)", (
        Option("icepop_alpha", float, 0.5, "tokens with ratio π/μ below α get no gradient "
               "(arXiv:2510.18855: 0.5)", "alpha", ge=0),
        Option("icepop_beta", float, 5.0, "tokens with ratio π/μ above β get no gradient "
               "(arXiv:2510.18855: 5)", "beta", gt=0),
        Option("icepop_level", Literal["token", "sequence"], "token", "mask per token (ratio "
               "π_t/μ_t) or per record (ratio π(y)/μ(y), TRL's sequence_mask)", "level"),
        Option("icepop_aggregation", Literal["token-mean", "seq-mean-token-mean"], "token-mean",
               "token-mean over the batch's tokens (verl/TRL default, kept for existing runs) or "
               "seq-mean-token-mean, the paper's GRPO 1/G Σ_i 1/|o_i| Σ_t (arXiv:2510.18855)",
               "aggregation"),
    ), check=_icepop_check),
    _stale("m2po", "−M·r·Â, M drops the largest (log r)² of the tokens with Â·log r > 0 until their mean ≤ τ (arXiv:2510.01161)", (
        Option("m2po_tau", float, 0.04, "second-moment budget τ_M2 of mean (log π/μ)² over the "
               "kept tokens that m2po_mask covers (arXiv:2510.01161)", "tau", gt=0),
        Option("m2po_mask", Literal["trust_region", "all_tokens"], "trust_region",
               "tokens the mask covers: trust_region (the paper's Algorithm 1: Â>0 & r>1 or Â<0 & "
               "r<1, the others always kept) or all_tokens (AReaL's Oct-2025 variant)",
               "mask_tokens"),
    ), full_batch=True),
    _stale("vespo", "−sg(φ(W))·Â·log π, W = π(y)/μ(y), φ = W^k e^{λ(1−W)} (arXiv:2602.10693)", (
        Option("vespo_k_pos", float, 2.0, "shape k of φ(W) = W^k e^{λ(1−W)} for records with "
               "advantage ≥ 0 (arXiv:2602.10693)", "k_pos", ge=0),
        Option("vespo_lambda_pos", float, 3.0, "rate λ of φ(W) for records with advantage ≥ 0",
               "lambda_pos", gt=0),
        Option("vespo_k_neg", float, 3.0, "shape k of φ(W) for records with advantage < 0",
               "k_neg", ge=0),
        Option("vespo_lambda_neg", float, 2.0, "rate λ of φ(W) for records with advantage < 0",
               "lambda_neg", gt=0),
    )),
    LossSpec("off_rl", lambda: _module("off_rl").off_rl_loss, "off_rl",
             "−R·π(y)^{1/|y|}, length-normalised (FPA eq. 1)", positive="correct",
             inputs=("logp", "mask", "rewards")),
    LossSpec("off_rl_kl", lambda: _module("off_rl").off_rl_kl_loss, "off_rl",
             "off_rl + τ·KL(π_ref‖π) (FPA eq. 33)", positive="correct",
             inputs=("logp", "ref_logp", "mask", "rewards"), needs_ref=True, options=(
                 Option("kl_tau", float, 0.04, "weight τ of KL(π_ref‖π) (FPA eq. 33)", "tau",
                        ge=0, strict=False),
                 # read by the binding: the exact KL needs the reference model's hidden states
                 Option("kl_exact", bool, False, "exact per-token KL(π_ref‖π_θ) over the "
                        "vocabulary (needs train.ref_logprobs: model) instead of the sample "
                        "estimate logπ_ref(y) − logπ_θ(y) (docs/kernels.md § TOPR family, PPO, "
                        "GRPO, Off-RL, FPA, KL)", None, strict=False),
             )),
    LossSpec("fpa", lambda: _module("off_rl").fpa_loss, "fpa",
             "−sg(π̂^{1/|y|})·R·(1/|y|)·log π, π̂ ∝ π^{1+λ}/π_ref^λ (FPA eq. 3)",
             positive="correct", inputs=("logp", "logp_hat", "mask", "rewards"),
             needs_ref_model=True, options=(
                 # read by the binding: λ builds the extrapolated log-probs the kernel receives
                 Option("fpa_lambda", float, 1.0, "extrapolation λ of softmax((1+λ)h_θ − "
                        "λh_ref) (FPA eq. 3)", None, ge=0, strict=False),
                 Option("fpa_on", Literal["both", "negatives", "positives"], "both",
                        "which records get the extrapolated weight", "fpa_on", strict=False),
             )),
    # Async-RL objectives (trust_region.py, optimal_advantage.py, variance_controlled.py).
    _async("dppo", "trust_region", "−M·(π/μ)·Â per token, M masks |π(a) − μ(a)| > δ (Binary TV/KL)"
           " moving away (arXiv:2602.04879 eq. 11–14)", (*DPPO_OPTIONS, AGGREGATION, STD_DDOF),
           advantages="dppo_advantages", check=dppo_check),
    _async("trm", "trust_region", "−M·Â·Σ_t π_t/μ_t, M = 1[max_t ½log²(π_t/μ_t) ≤ δ] per sequence"
           " (arXiv:2512.23075 eq. 22)", (*TRM_OPTIONS, AGGREGATION, STD_DDOF),
           advantages="trm_advantages"),
    _async("oapl", "optimal_advantage", "(β₂·log(π/π_lag)(y) − (R − V̂*))², π_lag = μ, V̂* the "
           "group soft value (arXiv:2602.19362)", OAPL_OPTIONS, advantages="oapl_advantages"),
    _async("vcpo", "variance_controlled", "−[π/μ]^C·(R − b*)/σ·log π, b* = OPOB, step × "
           "√(ESS/N) (arXiv:2602.17616)", (*VCPO_OPTIONS, AGGREGATION, STD_DDOF),
           advantages=None, check=vcpo_check, needs_score_norms=True,
           # a direct call computes the OPOB from them (the step passes advantages instead)
           inputs=(*_GROUP_INPUTS, "score_sq_norms")),
    LossSpec("asymre", lambda: _module("policy_gradient").asymre_loss, "asymre",
             "−(R − mean_group R − δV)·log π, no ratio (arXiv:2506.20520)", positive="group",
             inputs=("logp", "mask", "rewards", "group_ids"), needs_groups=True,
             options=(*ASYMRE_OPTIONS, LENGTH_NORM, AGGREGATION), check=topr_check,
             advantages=lambda: _module("policy_gradient").asymre_advantages),
    _preference("dpo", "−log σ(β[(log π − log π_ref)(y⁺) − (log π − log π_ref)(y⁻)])",
                (BETA,), needs_pairs=True),
    _preference("rpo", "DPO − α·(1/|y⁺|)·log π(y⁺)", (
        BETA, Option("rpo_alpha", float, 1.0, "weight α of the chosen answers' NLL term", "alpha",
                     strict=False),
    ), needs_pairs=True),
    _preference("kto", "1 − σ(±β(log π − log π_ref − z₀)), z₀ the batch KL estimate", (BETA,)),
    _preference("apo", "(β₂·(log π − log π_ref) − (R − V̂))², V̂ the group soft value (A*-PO)", (
        Option("apo_beta1", float, 0.5, "β₁ of the soft value V̂", "beta1", gt=0, strict=False),
        Option("apo_beta2", float, 1e-3, "β₂ of the regression target", "beta2", gt=0,
               strict=False),
    ), needs_groups=True),
)

LOSS_SPECS: Mapping[str, LossSpec] = {spec.name: spec for spec in _SPECS}
LOSS_NAMES: tuple[str, ...] = tuple(LOSS_SPECS)


def _all_options() -> dict[str, Option]:
    """Every declared option by key, in table order; one key is one declaration."""
    found: dict[str, Option] = {}
    for spec in _SPECS:
        for option in spec.options:
            if found.setdefault(option.key, option) != option:
                raise ValueError(f"loss {spec.name!r} declares loss.{option.key} unlike another "
                                 "loss does: share one Option (losses/options.py)")
    return found


# The `loss.<key>` options of all losses (the config builds its `loss:` fields from them).
OPTIONS: Mapping[str, Option] = _all_options()


def owners(key: str) -> tuple[str, ...]:
    """The losses whose entries declare option `key`."""
    return tuple(n for n, s in LOSS_SPECS.items() if any(o.key == key for o in s.options))


def option_problem(spec: LossSpec, values: Mapping[str, Any]) -> str | None:
    """Why the option `values` (by key) cannot train `spec`'s loss, or None.

    A strict option (`Option.strict`) of another loss set away from its default has no
    effect, so it is an error (naming the key, the losses that read it and the chosen one);
    then each of `spec`'s options' own check, then the entry's rule over several options.
    (Bounds are the config's: pydantic checks them field by field.)
    """
    own = {o.key for o in spec.options}
    for key, option in OPTIONS.items():
        if option.strict and key not in own and values[key] != option.default:
            return (f"loss.{key} has no effect with loss.name={spec.name}: it is an option of "
                    f"loss.name={' / '.join(owners(key))}; remove the key")
    for option in spec.options:
        why = option.check(values[option.key]) if option.check else None
        if why:
            return f"loss.{option.key}={values[option.key]}: {why}"
    return spec.check(values) if spec.check else None


def loss_spec(name: str) -> LossSpec:
    """The `LossSpec` of `name`; a ValueError listing the choices for an unknown name."""
    try:
        return LOSS_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; choose one of {list(LOSS_NAMES)}") from None


def names_where(requirement: str) -> tuple[str, ...]:
    """The loss names whose `requirement` (a `LossSpec` boolean field) holds."""
    return tuple(n for n, s in LOSS_SPECS.items() if getattr(s, requirement))


def check_loss_inputs(name: str, **arrays: object) -> None:
    """Caller-facing guard (outside jit) before a loss `name` is trained on.

    Raises a ValueError naming the loss and the argument when a required array of
    `loss_spec(name).inputs` is missing, or when any given floating array holds NaN/inf — on
    unmasked entries only when `mask` / `record_mask` are given (padding may hold anything).
    """
    import numpy as np  # here, not at the top: the table itself is read without array libraries

    from jaxrl_llm.losses.types import finite_or_raise  # here: types imports JAX

    missing = [k for k in loss_spec(name).inputs if arrays.get(k) is None]
    if missing:
        raise ValueError(f"loss {name!r} needs argument(s) {missing}")
    mask = arrays.get("mask")
    record_mask = arrays.get("record_mask")
    checked = {}
    for key, value in arrays.items():
        if value is None or key in ("mask", "record_mask"):
            continue
        arr = np.asarray(value)
        if not np.issubdtype(arr.dtype, np.floating):
            checked[key] = arr
            continue
        keep = np.ones(arr.shape, bool)
        if mask is not None and arr.shape == np.shape(mask):
            keep &= np.asarray(mask) > 0
        if record_mask is not None and arr.shape[:1] == np.shape(record_mask):
            rm = np.asarray(record_mask) > 0
            keep &= rm.reshape(rm.shape + (1,) * (arr.ndim - 1))
        checked[key] = np.where(keep, arr, 0.0)
    try:
        finite_or_raise(**checked)
    except ValueError as err:
        raise ValueError(f"loss {name!r}: {err}") from None


def markdown_table() -> str:
    """The registry as the Markdown table the README shows (a test keeps the two equal)."""
    def mark(flag: bool) -> str:
        return "✓" if flag else ""

    lines = ["| loss | μ (score) | π_ref | pairs | whole groups | minimises | options (`loss.`) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in LOSS_SPECS.items():
        ref = "model" if s.needs_ref_model else mark(s.needs_ref)
        text = s.minimises.replace("|", "\\|")
        options = ", ".join(f"`{o.key}`" for o in s.options)
        lines.append(f"| `{name}` | {mark(s.needs_mu)} | {ref} | {mark(s.needs_pairs)} | "
                     f"{mark(s.needs_groups)} | {text} | {options} |")
    return "\n".join(lines)
