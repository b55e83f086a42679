"""Does a record set give the configured loss anything to learn? Checked by `curate` (a
warning) and `train` (a refusal unless `train.allow_no_signal`) before anything trains.

Per loss, by its positive rule (`LossSpec.positive`, losses/registry.py), on the rewards the
loss will see (after curate's group transform):

- "baseline" (TOPR family, PPO): a record is pushed up when A = R − loss.baseline > 0 (TOPR
  eq. 7). With none, the negatives' term only pushes probability down, and the mass goes to
  whatever the model did not sample, such as malformed answers (sft: no gradient at all);
- "group" (GRPO, Dr.GRPO, CISPO, GSPO, IcePop, M2PO, VESPO): the advantage is relative to the
  group (FPA eq. 34–35), so a group whose rewards are all equal gives advantage 0 to every
  record. With every group all-equal the gradient is 0;
- "correct" (Off-RL, FPA): −R·π^{1/|y|} raises only the records with R > 0 (FPA eq. 1);
  with none it only pushes down;
- None (DPO/RPO/KTO/A*-PO): coupled records; the composition is reported, never refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_llm.core.errors import ConfigError
from jaxrl_llm.data.shards import RecordSource
from jaxrl_llm.losses.registry import loss_spec

ALLOW_KEY = "train.allow_no_signal"


@dataclasses.dataclass(frozen=True)
class Signal:
    """What a record set holds for one loss."""

    num_records: int
    positives: int  # correct records (the verifier's flag)
    raised: int  # records the loss pushes up under its positive rule
    num_groups: int
    equal_groups: int  # groups whose records all have the same reward
    rule: str | None  # the loss's positive rule (LossSpec.positive)


def measure(rewards: np.ndarray, correct: np.ndarray, group_ids: np.ndarray, *,
            rule: str | None, baseline: float = 0.0) -> Signal:
    """Count positives, the records `rule` raises and the groups with all-equal rewards."""
    rewards = np.asarray(rewards, np.float64)
    correct, group_ids = np.asarray(correct, bool), np.asarray(group_ids)
    if rule == "baseline":
        raised = int((rewards - baseline > 0).sum())
    elif rule == "correct":
        raised = int((rewards > 0).sum())
    else:  # "group": the records of groups with unequal rewards (counted below)
        raised = 0
    if rewards.size:
        _, inverse = np.unique(group_ids, return_inverse=True)
        lo = np.full(inverse.max() + 1, np.inf)
        hi = np.full(inverse.max() + 1, -np.inf)
        np.minimum.at(lo, inverse, rewards)
        np.maximum.at(hi, inverse, rewards)
        equal = lo == hi
        if rule == "group":
            raised = int((~equal[inverse]).sum())
    else:
        equal = np.zeros(0, bool)
    return Signal(num_records=int(rewards.size), positives=int(correct.sum()), raised=raised,
                  num_groups=int(equal.size), equal_groups=int(equal.sum()), rule=rule)


def no_signal(signal: Signal) -> bool:
    """True when the loss's rule finds nothing to raise (see the module docstring)."""
    return signal.rule is not None and signal.num_records > 0 and signal.raised == 0


def _percent(part: int, whole: int) -> str:
    return f"{part} of {whole} ({100 * part / whole:.0f} %)" if whole else f"{part} of 0"


def describe(signal: Signal, loss: str, baseline: float, where: str) -> str:
    """The composition, and what it does to `loss` (one paragraph)."""
    s = signal
    head = (f"{where}: {_percent(s.positives, s.num_records)} records are positive (correct) "
            f"and {_percent(s.equal_groups, s.num_groups)} groups have all-equal rewards")
    if s.rule == "baseline":
        effect = (f"loss.name={loss} raises only records with R − loss.baseline > 0 "
                  f"(baseline {baseline:g}): {s.raised} here"
                  + ("; with none it only pushes probability down (TOPR eq. 7), which moves "
                     "it onto what was not sampled, malformed answers included"
                     if not s.raised else ""))
    elif s.rule == "group":
        effect = (f"loss.name={loss} uses group-relative advantages: an all-equal group gives "
                  f"each of its records advantage 0, so it learns from {s.raised} records "
                  f"in {s.num_groups - s.equal_groups} groups")
    elif s.rule == "correct":
        effect = (f"loss.name={loss} raises only records with R > 0: {s.raised} here"
                  + ("; with none it only pushes probability down" if not s.raised else ""))
    else:
        effect = f"loss.name={loss} compares records with each other (pairs, batch means)"
    return f"{head}. {effect}"


def how_to_get_positives() -> str:
    return ("Get positives first: more samples per prompt (generate.n), more prompts "
            "(data.num_prompts), an easier task or a few-shot prompt (README § Your own model "
            "and data)")


def read_signal(directory: str, *, rule: str | None, baseline: float,
                chunk: int = 4096) -> Signal:
    """`measure` over every record of `directory`."""
    source = RecordSource(directory)
    rewards, correct, groups = [], [], []
    for start in range(0, len(source), chunk):
        for r in source.__getitems__(list(range(start, min(start + chunk, len(source))))):
            rewards.append(r.reward)
            correct.append(r.correct)
            groups.append(r.group_id)
    return measure(np.asarray(rewards), np.asarray(correct), np.asarray(groups), rule=rule,
                   baseline=baseline)


def check_signal(config: Any, directory: str, *, refuse: bool) -> str | None:
    """The warning to print when `directory` gives `config`'s loss no learning signal, or no
    positive record / no group with unequal rewards at all (None: nothing to say). With
    `refuse` and no signal for the loss, a `ConfigError` naming `train.allow_no_signal`
    instead, unless the config sets it."""
    loss, baseline = config.loss.name, float(config.loss.baseline)
    signal = read_signal(directory, rule=loss_spec(loss).positive, baseline=baseline)
    if signal.num_records == 0:
        return None
    degenerate = signal.positives == 0 or signal.equal_groups == signal.num_groups
    if not (degenerate or no_signal(signal)):
        return None
    text = describe(signal, loss, baseline, directory)
    if no_signal(signal):
        if refuse and not config.train.allow_no_signal:
            raise ConfigError(f"{text}. Training would not teach the task; refused. "
                              f"{how_to_get_positives()}; or set {ALLOW_KEY}=true to train "
                              "anyway")
        allowed = config.train.allow_no_signal
        text += (f". {ALLOW_KEY}=true: training anyway" if allowed else
                 f". `jaxrl-llm train` will refuse these records unless {ALLOW_KEY}=true. "
                 f"{how_to_get_positives()}")
    return f"warning: {text}"


# Consecutive updates without a learning signal before an online run or `Policy.step` says so.
NO_SIGNAL_STREAK = 3


class SignalWatch:
    """The learning signal of each update's batch, as online rounds and `Policy.step` train:
    `note(records)` measures it (module docstring) and returns the step's metrics
    (`signal/raised`, `signal/none`); `warning` is set once `NO_SIGNAL_STREAK` updates in a row
    had nothing to learn (again after each signal), unless `train.allow_no_signal` says
    that is intended. `jaxrl-llm train` refuses such records outright; a run that samples its
    own can get positives later, so it trains on and says so."""

    def __init__(self, config: Any) -> None:
        self.loss, self.baseline = config.loss.name, float(config.loss.baseline)
        self.rule = loss_spec(self.loss).positive
        self.allowed = bool(config.train.allow_no_signal)
        self.streak = 0
        self.warning: str | None = None

    def note(self, records: Any) -> dict[str, float]:
        signal = measure(np.asarray([r.reward for r in records], np.float64),
                         np.asarray([r.correct for r in records], bool),
                         np.asarray([r.group_id for r in records]), rule=self.rule,
                         baseline=self.baseline)
        none = no_signal(signal)
        self.streak = self.streak + 1 if none else 0
        self.warning = None
        if self.streak == NO_SIGNAL_STREAK and not self.allowed:
            where = f"{self.streak} updates in a row had nothing to learn; the latest batch"
            self.warning = (f"warning: {describe(signal, self.loss, self.baseline, where)}. "
                            "Updates like these do not teach the task. "
                            f"{how_to_get_positives()}; or set {ALLOW_KEY}=true to silence "
                            "this")
        return {"signal/raised": float(signal.raised), "signal/none": float(none)}
