"""Dataset curation (TOPR §4.3 and App. D, FPA App. B.1; TOPR arXiv:2503.14286 §4.3, App. D; FPA arXiv:2509.19893 App. B.1) and group-level transforms.

Selection strategies work on three per-record arrays — `correct`, `group_ids` (and a seed) —
and return record indices, so they run on the metadata of millions of records. A record is
*positive* when `correct` (±1 rewards: R = +1). Every selection reports its `Composition`,
including the effective positive fraction of TOPR eq. 12 for the configured baseline `c`.

Group transforms (RLOO, GRPO, PKPO) replace each record's reward by its group-relative
value before training, keeping the original in `raw_reward`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from jaxrl_llm.data.pairs import make_pairs
from jaxrl_llm.data.records import Record
from jaxrl_llm.data.shards import RecordSource, write_records
from jaxrl_llm.losses import advantages, pkpo
from jaxrl_llm.losses.advantages import effective_positive_fraction

STRATEGIES = ("uniform", "target", "positives", "anna_karenina", "drop_uniform_groups", "hard", "dpo")


@dataclasses.dataclass(frozen=True)
class Composition:
    num_records: int
    positives: int
    negatives: int
    invalid: int
    num_groups: int
    positive_fraction: float
    baseline: float
    effective_positive_fraction: float  # TOPR eq. 12 with `baseline`

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def composition(correct: np.ndarray, group_ids: np.ndarray, invalid: np.ndarray | None = None,
                *, baseline: float = 0.0) -> Composition:
    correct = np.asarray(correct, bool)
    n = int(correct.size)
    pos = int(correct.sum())
    p = pos / n if n else 0.0
    return Composition(
        num_records=n, positives=pos, negatives=n - pos,
        invalid=int(np.asarray(invalid, bool).sum()) if invalid is not None else 0,
        num_groups=int(np.unique(group_ids).size), positive_fraction=p, baseline=float(baseline),
        effective_positive_fraction=float(effective_positive_fraction(p, baseline)) if n else 0.0,
    )


def _need(num: int, available: int, what: str) -> None:
    if num > available:
        raise ValueError(f"curation asks for {num} {what} but the dataset has only {available}")


def uniform(num_records: int, num: int, seed: int) -> np.ndarray:
    """N records uniformly without replacement (TOPR §4.3 and App. D, FPA App. B.1 'uniform')."""
    _need(num, num_records, "records")
    return np.sort(np.random.default_rng(seed).choice(num_records, num, replace=False))


def target_fraction(correct: np.ndarray, fraction: float, num: int | None, seed: int) -> np.ndarray:
    """A sample whose positive fraction is `fraction` ("10p" = 0.1, "50p" = 0.5).

    `num=None` takes the largest such sample the data allows.
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"target positive fraction must be in [0, 1], got {fraction}")
    pos, neg = np.flatnonzero(correct), np.flatnonzero(~np.asarray(correct, bool))
    if num is None:
        limits = [len(pos) / fraction if fraction > 0 else np.inf,
                  len(neg) / (1 - fraction) if fraction < 1 else np.inf]
        num = int(np.floor(min(limits) + 1e-9))
    n_pos = int(round(fraction * num))
    _need(n_pos, len(pos), f"positives (fraction {fraction} of {num})")
    _need(num - n_pos, len(neg), f"negatives (fraction {1 - fraction:g} of {num})")
    rng = np.random.default_rng(seed)
    chosen = np.concatenate([rng.choice(pos, n_pos, replace=False), rng.choice(neg, num - n_pos, replace=False)])
    return np.sort(chosen)


def positives_only(correct: np.ndarray) -> np.ndarray:
    """Drop negatives (STaR/ReST-style baseline, TOPR Fig. 4)."""
    return np.flatnonzero(correct)


def anna_karenina(correct: np.ndarray, group_ids: np.ndarray, num: int | None, seed: int) -> np.ndarray:
    """Per problem keep only its first positive; fill up to `num` with random negatives.

    `num=None` keeps every negative (TOPR App. D).
    """
    correct, group_ids = np.asarray(correct, bool), np.asarray(group_ids)
    pos_idx = np.flatnonzero(correct)
    _, first = np.unique(group_ids[pos_idx], return_index=True)  # storage order within a group
    firsts = pos_idx[first]
    neg = np.flatnonzero(~correct)
    n_neg = len(neg) if num is None else num - len(firsts)
    if n_neg < 0:
        raise ValueError(f"anna_karenina: {len(firsts)} first positives already exceed num={num}")
    _need(n_neg, len(neg), "negatives to fill the Anna Karenina set")
    negs = np.random.default_rng(seed).choice(neg, n_neg, replace=False)
    return np.sort(np.concatenate([firsts, negs]))


def drop_uniform_groups(correct: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Remove prompts whose samples are all correct or all incorrect (FPA, after DAPO)."""
    correct, group_ids = np.asarray(correct, bool), np.asarray(group_ids)
    uniq, inverse = np.unique(group_ids, return_inverse=True)
    pos = np.bincount(inverse, weights=correct, minlength=len(uniq))
    size = np.bincount(inverse, minlength=len(uniq))
    mixed = (pos > 0) & (pos < size)
    return np.flatnonzero(mixed[inverse])


def _largest_remainder(total: int, weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Integer quotas ∝ weights summing to `total`, each ≤ its cap (Hamilton's method).

    Groups whose ideal share exceeds their cap get the cap and the rest is re-shared; the
    ideal shares are floored and the leftover units go to the largest fractional parts
    (ties: lower group index first).
    """
    weights, caps = np.asarray(weights, float), np.asarray(caps, np.int64)
    quotas = np.zeros(len(weights), np.int64)
    active = (weights > 0) & (caps > 0)
    remaining = total
    while True:
        ideal = np.where(active, remaining * weights / weights[active].sum(), 0.0) if active.any() else np.zeros(len(weights))
        over = active & (ideal > caps)
        if not over.any():
            break
        quotas[over] = caps[over]
        remaining -= int(caps[over].sum())
        active &= ~over
    base = np.floor(ideal + 1e-9).astype(np.int64)
    quotas[active] = base[active]
    left = remaining - int(base[active].sum())
    frac = np.where(active, ideal - base, -1.0)
    for g in np.argsort(-frac, kind="stable")[:left]:
        quotas[g] += 1
    return quotas


def hard_emphasis(correct: np.ndarray, group_ids: np.ndarray, num: int, seed: int,
                  *, power: float = 1.0) -> np.ndarray:
    """More samples from questions with few positives (TOPR App. D).

    Group g with positive rate p_g gets a quota ∝ (1 − p_g + 1/n_g)^power records (capped
    at its size; the 1/n_g keeps all-correct groups represented); records inside a group
    are drawn uniformly.
    """
    correct, group_ids = np.asarray(correct, bool), np.asarray(group_ids)
    _need(num, len(correct), "records")
    uniq, inverse = np.unique(group_ids, return_inverse=True)
    size = np.bincount(inverse, minlength=len(uniq))
    p = np.bincount(inverse, weights=correct, minlength=len(uniq)) / size
    weights = (1.0 - p + 1.0 / size) ** power
    quotas = _largest_remainder(num, weights, size)
    rng = np.random.default_rng(seed)
    chosen = [rng.choice(np.flatnonzero(inverse == g), q, replace=False) for g, q in enumerate(quotas) if q]
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)


def dpo_pairs(correct: np.ndarray, group_ids: np.ndarray, *, seed: int = 0,
              max_pairs_per_prompt: int = 16) -> np.ndarray:
    """(chosen, rejected) record indices: every correct × incorrect pair of a prompt, capped
    at 16 per prompt (docs/kernels.md § Preference losses choice; `data.pairs.make_pairs` over the whole dataset)."""
    return make_pairs(np.asarray(group_ids, np.int64), np.asarray(correct, bool),
                      max_pairs_per_prompt=max_pairs_per_prompt, seed=seed)


def parse_target(strategy: str) -> float | None:
    """'10p' -> 0.1, '50p' -> 0.5; None when `strategy` is not of that form."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)p", strategy)
    return float(m.group(1)) / 100 if m else None


def select(strategy: str, correct: np.ndarray, group_ids: np.ndarray, *, num: int | None = None,
           seed: int = 0, target: float | None = None, power: float = 1.0) -> np.ndarray:
    """Dispatch by name: one of STRATEGIES or 'Np' (target positive fraction N%)."""
    correct = np.asarray(correct, bool)
    frac = parse_target(strategy)
    if frac is not None:
        strategy, target = "target", frac
    if strategy == "uniform":
        return uniform(len(correct), len(correct) if num is None else num, seed)
    if strategy == "target":
        if target is None:
            raise ValueError("curation 'target' needs data.target_positive_fraction (or use '10p')")
        return target_fraction(correct, target, num, seed)
    if strategy == "positives":
        return positives_only(correct)
    if strategy == "anna_karenina":
        return anna_karenina(correct, group_ids, num, seed)
    if strategy == "drop_uniform_groups":
        return drop_uniform_groups(correct, group_ids)
    if strategy == "dpo":
        return dpo_pairs(correct, group_ids, seed=seed).reshape(-1)
    if strategy == "hard":
        return hard_emphasis(correct, group_ids, len(correct) if num is None else num, seed, power=power)
    raise ValueError(f"unknown curation {strategy!r}; expected one of {STRATEGIES} or 'Np' (e.g. '10p')")


# -- group-level reward transforms (applied before training) ------------------------------

TRANSFORMS = ("none", "rloo", "grpo", "dr_grpo", "pkpo")


def _grouped(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rewards as [G, n_max] with a mask, plus each record's (row, col) flat position."""
    uniq, inverse = np.unique(group_ids, return_inverse=True)
    size = np.bincount(inverse, minlength=len(uniq))
    col = np.zeros(len(rewards), np.int64)
    seen = np.zeros(len(uniq), np.int64)
    for i, g in enumerate(inverse):
        col[i] = seen[g]
        seen[g] += 1
    grid = np.zeros((len(uniq), int(size.max())), np.float32)
    mask = np.zeros_like(grid, bool)
    grid[inverse, col] = rewards
    mask[inverse, col] = True
    return grid, mask, inverse * grid.shape[1] + col


def transform_rewards(rewards: Sequence[float], group_ids: Sequence[int], kind: str, *,
                      k: int | None = None, singleton_baseline: float | None = None) -> np.ndarray:
    """Group-relative rewards: RLOO (RLOO, Ahmadian et al. arXiv:2402.14740), GRPO / Dr.GRPO (FPA eq. 34), PKPO sloo_minus_one (PKPO arXiv:2505.15201 eq. 33)."""
    r = np.asarray(rewards, np.float32)
    g = np.asarray(group_ids)
    if kind == "none":
        return r
    if kind == "rloo":
        return np.asarray(advantages.rloo_advantages(r, g, singleton_baseline=singleton_baseline))
    if kind == "grpo":
        return np.asarray(advantages.grpo_advantages(r, g))
    if kind == "dr_grpo":
        return np.asarray(advantages.dr_grpo_advantages(r, g))
    if kind == "pkpo":
        if k is None:
            raise ValueError("group transform 'pkpo' needs k (curate --pkpo-k)")
        grid, mask, flat = _grouped(r, g)
        return np.asarray(pkpo.sloo_minus_one(grid, k, mask)).reshape(-1)[flat]
    raise ValueError(f"unknown group transform {kind!r}; expected one of {TRANSFORMS}")


def apply_transform(records: Sequence[Record], kind: str, **kwargs) -> list[Record]:
    """Records with `reward` replaced by the group transform, the original kept in `raw_reward`."""
    if kind == "none":
        return list(records)
    raw = [r.raw_reward if r.raw_reward is not None else r.reward for r in records]
    new = transform_rewards(raw, [r.group_id for r in records], kind, **kwargs)
    return [r.replace(reward=float(v), raw_reward=float(o)) for r, v, o in zip(records, new, raw)]


def empty_selection(strategy: str, in_dir: str, correct: np.ndarray, group_ids: np.ndarray) -> str:
    """Why `strategy` selected nothing from `in_dir`, with the counts that decide it."""
    correct, group_ids = np.asarray(correct, bool), np.asarray(group_ids)
    n, pos = int(correct.size), int(correct.sum())
    _, inverse = np.unique(group_ids, return_inverse=True)
    per_group = np.bincount(inverse, weights=correct) if n else np.zeros(0)
    size = np.bincount(inverse) if n else np.zeros(0)
    mixed = int(((per_group > 0) & (per_group < size)).sum())
    counts = (f"{n} records, {pos} positives (correct), {n - pos} negatives, {mixed} mixed "
              f"groups (a correct and an incorrect answer to one prompt) of {len(size)}")
    needs = {"dpo": "pairs need a mixed group", "positives": "it keeps the positives",
             "drop_uniform_groups": "it keeps the mixed groups"}.get(strategy, "")
    return (f"curation {strategy!r} selected no records from {in_dir} ({counts})"
            f"{'; ' + needs if needs else ''}; nothing written. Sample more (generate.n, "
            "data.num_prompts) or from a stronger policy, or choose another data.curation")


def curate_directory(
    in_dir: str, out_dir: str, *, strategy: str, num: int | None = None, seed: int = 0,
    target: float | None = None, power: float = 1.0, transform: str = "none",
    pkpo_k: int | None = None, baseline: float = 0.0, overwrite: bool = False,
) -> Composition:
    """Select records of `in_dir` by `strategy`, apply the group transform, write `out_dir`.

    The group transform runs on the selected set (groups as they will be trained on). The
    composition (with baseline `c`) is stored in the output manifest under `extra.curation`.
    Strategy "dpo" writes each (chosen, rejected) pair as two consecutive records sharing a
    fresh group id (the prompt's is kept in `metadata["prompt_group"]`): load them with
    `LoaderOptions(pairs=True)`, which fills `Batch.pair_index`.
    """
    source = RecordSource(in_dir)
    records = list(source)
    correct = np.asarray([r.correct for r in records], bool)
    groups = np.asarray([r.group_id for r in records])
    chosen = select(strategy, correct, groups, num=num, seed=seed, target=target, power=power)
    if len(chosen) == 0:  # never write an empty training set
        raise ValueError(empty_selection(strategy, in_dir, correct, groups))
    selected = apply_transform([records[i] for i in chosen], transform, k=pkpo_k)
    if strategy == "dpo":
        # Rows (2p, 2p+1) are pair p; its own group id lets the loader rebuild `pair_index`.
        selected = [r.replace(group_id=i // 2, metadata={**r.metadata, "prompt_group": r.group_id})
                    for i, r in enumerate(selected)]
    comp = composition(correct[chosen], groups[chosen], np.asarray([r.invalid for r in selected], bool),
                       baseline=baseline)
    m = source.manifest
    write_records(out_dir, selected, overwrite=overwrite, vocab_size=m.vocab_size, tokenizer=m.tokenizer,
                  model=m.model, task=m.task, reward_fn=m.reward_fn, sampling=m.sampling,
                  scored_by=m.scored_by,
                  extra={**m.extra, "curation": {"strategy": strategy, "source": str(in_dir), "seed": seed,
                                                 "transform": transform, "pkpo_k": pkpo_k, **comp.to_dict()}})
    return comp
