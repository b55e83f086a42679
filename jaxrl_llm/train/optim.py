"""optax optimizers, learning-rate schedules and clipping from the `optim:` config section.

- Adafactor: TOPR's choice (TOPR arXiv:2503.14286 §4.3); optax's T5X-style defaults (factored second moment,
  update clipping at RMS 1, parameter-scale multiplication off so `learning_rate` is the step).
- AdamW: FPA's (FPA arXiv:2509.19893 App. B), decoupled weight decay; `mu_dtype: bfloat16`
  stores the first moment in bf16 (half its memory, at bf16's precision), float32 by default.
- SGD: for tests and ablations.

Schedules: `constant`, `warmup_constant` (linear 0 → lr over `warmup_steps`, then flat) and
`warmup_cosine` (linear warm-up then cosine decay to `end_lr_ratio · lr` at `decay_steps`,
default `train.steps`). Global-norm clipping (`clip_norm`: 1.0 in TOPR, 10 in FPA) runs first.
"""

from __future__ import annotations

import optax

from jaxrl_llm.config import ConfigError, OptimConfig


def make_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate as a function of the optimizer step count."""
    lr = config.learning_rate
    warmup = config.warmup_steps
    if config.schedule == "constant":
        return optax.constant_schedule(lr)
    if config.schedule == "warmup_constant":
        if warmup == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
        )
    decay = config.decay_steps or total_steps
    if decay <= warmup:
        raise ConfigError(
            f"optim.schedule=warmup_cosine needs optim.decay_steps (or train.steps) = {decay} "
            f"> optim.warmup_steps = {warmup}"
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=decay,
        end_value=lr * config.end_lr_ratio,
    )


def make_optimizer(
    config: OptimConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(transformation, schedule). The transformation expects fp32 (master) gradients."""
    schedule = make_schedule(config, total_steps)
    wd = config.weight_decay
    if config.mu_dtype != "float32" and config.name != "adamw":
        raise ConfigError(
            f"optim.mu_dtype={config.mu_dtype} applies to AdamW's first moment only; "
            f"optim.name={config.name}: leave optim.mu_dtype at float32"
        )
    if config.name == "adamw":
        # mu_dtype: the moment is stored in it; optax computes its update in float32.
        core = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=wd,
                           mu_dtype=config.mu_dtype)
    elif config.name == "adafactor":
        core = optax.adafactor(
            learning_rate=schedule,
            multiply_by_parameter_scale=False,
            weight_decay_rate=wd or None,
        )
    else:
        core = optax.chain(
            optax.add_decayed_weights(wd) if wd else optax.identity(), optax.sgd(schedule)
        )
    parts = []
    if config.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(config.clip_norm))
    parts.append(core)
    return optax.chain(*parts), schedule
