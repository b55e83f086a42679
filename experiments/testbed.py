"""The testbed switch of the claim-2 and claim-4 scripts (`--testbed char | quickstart`) and
their learning-rate choice on a validation split.

`--testbed char` (default) runs the config's `full` / `smoke` section on the shared 2-layer
character-level policy (`common.warm_policy`); `--testbed quickstart` runs `full_quickstart` /
`smoke_quickstart` on the quickstart's SFT-warmed policy (`common.warm_policy_quickstart`),
with the quickstart's task options and sequence lengths (`common.quickstart_sections`).

A section with `learning_rates` picks each arm's rate on validation, as claim 8 does: the arm
runs at every rate on `select_seeds`, probed at its last step on `val_questions` validation
questions (problem seed `common.VALIDATION_SEED`, not the test questions); the rate with the
best mean validation pass@1 is the arm's, and its other seeds run at it. Which arms get their
own sweep is the script's `lr_select` key (each arm, or one reference arm per group whose
rate the group shares). A section without it trains at its one `learning_rate`.

The `--testbed` / `--seeds` arguments and the section they select are `common`'s
(`add_testbed_args`, `testbed_section`): `common.run_experiment` reads them, and this module
builds on `common`, not the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from experiments import common


def warm_policy(args: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("testbed", "char") == "quickstart":
        # smoke: `smoke_sft` SFT overrides (the common 10 steps answer nothing right, and
        # these scripts need correct samples); its own default cache, `..._smoke_sft`
        return common.warm_policy_quickstart(args.cache, smoke=args.smoke,
                                             smoke_overrides=cfg.get("smoke_sft"))
    return common.warm_policy(args.cache, smoke=args.smoke)


def sections(warm: dict[str, Any], cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The quickstart's data / train / generate sections (empty on the char testbed), with
    the section's own `max_new_tokens` where it sets one."""
    out = common.quickstart_sections(warm) if cfg.get("testbed") == "quickstart" else {}
    out.setdefault("generate", {})
    out.setdefault("data", {})
    out.setdefault("train", {})
    if "max_new_tokens" in cfg:
        out["generate"]["max_new_tokens"] = cfg["max_new_tokens"]
    return out


def learning_rates(cfg: dict[str, Any]) -> list[float | None]:
    """The rates swept, or [None] (the section's one `learning_rate`, no sweep)."""
    return list(cfg["learning_rates"]) if "learning_rates" in cfg else [None]


def lr_tag(lr: float | None) -> str:
    return "" if lr is None else f"-lr{lr:g}"


def lr_overrides(lr: float | None) -> list[str]:
    return [] if lr is None else [f"optim.learning_rate={lr!r}"]


def validation_probe(config: Any, cfg: dict[str, Any]) -> Callable[[Any], dict[str, float]] | None:
    if "val_questions" not in cfg:
        return None
    probe = common.Probe(config, num_questions=cfg["val_questions"], n=cfg["val_n"],
                         split="validation", problem_seed=common.VALIDATION_SEED)

    def val(model: Any) -> dict[str, float]:
        row = probe(model)
        return {"val_pass_at_1": row["pass_at_1"], "val_pass_at_1_se": row["pass_at_1_se"]}

    return val


def choose_lr(cfg: dict[str, Any], val_pass: Callable[[float | None, int], float]
              ) -> tuple[float | None, dict[str, float]]:
    """The rate with the best mean validation pass@1 over `select_seeds` (`val_pass(lr,
    seed)` trains that run); ties go to the first rate listed. No sweep: (None, {})."""
    rates = learning_rates(cfg)
    if rates == [None]:
        return None, {}
    val = {lr: float(np.mean([val_pass(lr, s) for s in cfg["select_seeds"]])) for lr in rates}
    best = max(rates, key=lambda lr: val[lr])
    return best, {f"{lr:g}": v for lr, v in val.items()}


def cached_rows(run_dir: Path, key: dict[str, Any]) -> list[dict[str, float]] | None:
    """The probe rows a finished earlier run saved with the same `key`, else None."""
    path = run_dir / "probe_rows.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return saved["rows"] if saved.get("key") == key else None


def save_rows(run_dir: Path, key: dict[str, Any], rows: list[dict[str, float]]) -> None:
    (run_dir / "probe_rows.json").write_text(json.dumps({"key": key, "rows": rows}))
