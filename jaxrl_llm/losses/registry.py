"""The one table of losses: name → kernel, the data it needs, and what it minimises.

Every part of the package that must know something about a loss reads it here — config
validation, the loader (pairs, whole groups, μ), the trainer (what to require, which metrics
mean something), the train step (micro-batching, the frozen reference model), `score`,
`curate` and `iterate` — so the taxonomy cannot drift between them. The kernels themselves
live in `policy_gradient` (TOPR), `ppo`, `stale_is`, `off_rl` and `preference`; docs/kernels.md gives each formula and its paper
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
  group advantages are computed on the full batch before the split, so it can.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial

import numpy as np

from jaxrl_llm.losses import off_rl, ppo, stale_is
from jaxrl_llm.losses import policy_gradient as pg
from jaxrl_llm.losses import preference as pref
from jaxrl_llm.losses.types import LossOutput, finite_or_raise


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """One loss: its kernel, its family (how the train step binds batch fields to it), the data
    it needs, and a one-line statement of what it minimises (its sign convention)."""

    name: str
    kernel: Callable[..., LossOutput]
    family: str  # "topr" | "ppo" | "group" | "stale_is" | "off_rl" | "fpa" | "preference"
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
    full_batch: bool = False

    def needs(self) -> tuple[str, ...]:
        """The names of the requirements that hold (for messages and docs)."""
        return tuple(f.name for f in dataclasses.fields(self)
                     if f.name.startswith("needs_") and getattr(self, f.name))


def _topr(name: str, minimises: str, needs_mu: bool) -> LossSpec:
    return LossSpec(name, partial(pg.topr_loss, **pg.TOPR_PRESETS[name]), "topr", minimises,
                    positive="baseline", needs_mu=needs_mu)


_GROUP_INPUTS = ("logp", "logmu", "mask", "rewards", "group_ids")
_PREFERENCE_INPUTS = ("logp", "ref_logp", "mask")


def _stale(name: str, minimises: str, full_batch: bool = False) -> LossSpec:
    return LossSpec(name, getattr(stale_is, f"{name}_loss"), "stale_is", minimises,
                    positive="group", needs_mu=True, inputs=_GROUP_INPUTS, needs_groups=True,
                    full_batch=full_batch)

_SPECS = (
    # TOPR family (TOPR eq. 7 and Table 1): −Σ_y w(y) R(y) log π(y), w from the truncated ratio.
    _topr("topr", "−[R>0]·R·log π − [R<0]·[π/μ]₀¹·R·log π (TOPR eq. 7, 11)", needs_mu=True),
    _topr("sft", "−[R>0]·log π over positives (TOPR Table 1, weights 1/0)", needs_mu=False),
    _topr("reinforce", "−R·log π, no ratio (naive off-policy REINFORCE)", needs_mu=False),
    _topr("opr", "−(π/μ)·R·log π, untruncated importance sampling", needs_mu=True),
    _topr("tis", "−[π/μ]₀¹·R·log π for every record (truncated IS)", needs_mu=True),
    LossSpec("ppo", ppo.ppo_loss, "ppo",
             "−min(ρA, clip(ρ, 1±ε)A), ρ = π/μ, A = R − baseline (TOPR eq. 6)", positive="baseline",
             needs_mu=True),
    LossSpec("grpo", ppo.grpo_loss, "group",
             "PPO surrogate, A = (R − mean_group)/std_group (FPA eq. 34–35)", positive="group", needs_mu=True,
             inputs=_GROUP_INPUTS, needs_groups=True),
    LossSpec("dr_grpo", ppo.dr_grpo_loss, "group",
             "PPO surrogate, A = R − mean_group, token sum / max_len (Dr.GRPO)", positive="group",
             needs_mu=True,
             inputs=_GROUP_INPUTS, needs_groups=True),
    # Stale-sample losses (losses/stale_is.py): group advantages Â, per-token ratios r = π/μ.
    _stale("cispo", "−sg(clip(r, 1−ε_low, 1+ε_high))·Â·log π, token mean (arXiv:2506.13585 eq. 4–5)"),
    _stale("gspo", "−min(sÂ, clip(s, 1±ε)Â), s = (π(y)/μ(y))^{1/|y|} (arXiv:2507.18071 eq. 5–7)"),
    _stale("icepop", "−1[α ≤ r ≤ β]·sg(r)·Â·log π, masked IS (arXiv:2510.18855)"),
    _stale("m2po", "−M·r·Â, M drops the largest (log r)² of the tokens with Â·log r > 0 until their mean ≤ τ (arXiv:2510.01161)",
           full_batch=True),
    _stale("vespo", "−sg(φ(W))·Â·log π, W = π(y)/μ(y), φ = W^k e^{λ(1−W)} (arXiv:2602.10693)"),
    LossSpec("off_rl", off_rl.off_rl_loss, "off_rl",
             "−R·π(y)^{1/|y|}, length-normalised (FPA eq. 1)", positive="correct",
             inputs=("logp", "mask", "rewards")),
    LossSpec("off_rl_kl", off_rl.off_rl_kl_loss, "off_rl",
             "off_rl + τ·KL(π_ref‖π) (FPA eq. 33)", positive="correct",
             inputs=("logp", "ref_logp", "mask", "rewards"), needs_ref=True),
    LossSpec("fpa", off_rl.fpa_loss, "fpa",
             "−sg(π̂^{1/|y|})·R·(1/|y|)·log π, π̂ ∝ π^{1+λ}/π_ref^λ (FPA eq. 3)",
             positive="correct", inputs=("logp", "logp_hat", "mask", "rewards"),
             needs_ref_model=True),
    LossSpec("dpo", pref.PREFERENCE_LOSSES["dpo"], "preference",
             "−log σ(β[(log π − log π_ref)(y⁺) − (log π − log π_ref)(y⁻)])",
             inputs=_PREFERENCE_INPUTS, needs_ref=True, needs_pairs=True,
             full_batch=True),
    LossSpec("rpo", pref.PREFERENCE_LOSSES["rpo"], "preference",
             "DPO − α·(1/|y⁺|)·log π(y⁺)", inputs=_PREFERENCE_INPUTS, needs_ref=True,
             needs_pairs=True, full_batch=True),
    LossSpec("kto", pref.PREFERENCE_LOSSES["kto"], "preference",
             "1 − σ(±β(log π − log π_ref − z₀)), z₀ the batch KL estimate",
             inputs=_PREFERENCE_INPUTS, needs_ref=True, full_batch=True),
    LossSpec("apo", pref.PREFERENCE_LOSSES["apo"], "preference",
             "(β₂·(log π − log π_ref) − (R − V̂))², V̂ the group soft value (A*-PO)",
             inputs=_PREFERENCE_INPUTS, needs_ref=True, needs_groups=True, full_batch=True),
)

LOSS_SPECS: Mapping[str, LossSpec] = {spec.name: spec for spec in _SPECS}
LOSS_NAMES: tuple[str, ...] = tuple(LOSS_SPECS)


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

    lines = ["| loss | μ (score) | π_ref | pairs | whole groups | minimises |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, s in LOSS_SPECS.items():
        ref = "model" if s.needs_ref_model else mark(s.needs_ref)
        text = s.minimises.replace("|", "\\|")
        lines.append(f"| `{name}` | {mark(s.needs_mu)} | {ref} | {mark(s.needs_pairs)} | "
                     f"{mark(s.needs_groups)} | {text} |")
    return "\n".join(lines)
