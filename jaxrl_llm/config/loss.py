"""The `loss:` section: its own keys plus every option a registry entry declares (losses/registry.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    create_model,
    field_validator,
    model_validator,
)

from jaxrl_llm.config.base import Section
from jaxrl_llm.losses.options import Option
from jaxrl_llm.losses.registry import OPTIONS, LossSpec, loss_spec, option_problem, owners


class _LossSection(Section):
    """Which loss kernel and its options (losses/, docs/kernels.md).

    Each loss's options are declared in its registry entry (`losses.registry`: type, default,
    bounds, the kernel keyword) and set flat as `loss.<key>`; `LossConfig` below adds them as
    fields. Setting a strict option (`Option.strict`, most are) of another loss than `name`
    is an error."""

    # A name of `losses.registry.LOSS_SPECS` (checked below against that one table).
    name: str = "topr"
    # subtracted from each reward (TOPR eq. 12: baselines as dataset composition); read by
    # the TOPR family and ppo, by curate, and by train.grad_norm_by_sign's split
    baseline: float = 0.0
    # vocabulary columns per chunk of the log-prob kernel (peak memory vs speed, docs/kernels.md)
    logprob_chunk_size: int = Field(4096, gt=0)
    # μ for π/μ: trainer = the score pass's mu_logprobs, sampler = the sampler's own log-probs
    mu_source: Literal["trainer", "sampler"] = "trainer"

    @field_validator("name")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        loss_spec(name)  # ValueError listing the choices
        return name

    @model_validator(mode="after")
    def _options_read_by_the_loss(self) -> _LossSection:
        """An option the chosen loss does not read is an error, never silently ignored; then
        the loss's own checks of its values (`registry.option_problem`)."""
        problem = option_problem(self.spec, dict(self))
        if problem:
            raise ValueError(problem)
        if self.baseline != 0 and self.spec.positive != "baseline":
            raise ValueError(
                f"loss.baseline={self.baseline} has no effect with loss.name={self.name}: "
                "only the TOPR family and ppo subtract it from the rewards (TOPR eq. 12); "
                f"{self.name}'s advantages come from its "
                + {"group": "groups", "correct": "verifier's split"}.get(
                    str(self.spec.positive), "record pairs or batch")
                + ": unset loss.baseline")
        return self

    @property
    def spec(self) -> LossSpec:
        """The registry entry of `name` (checked when the section was validated): what the
        rest of the package reads about the chosen loss, instead of looking it up by name.
        Not stored on the model, so copies and equality see only the config's values."""
        return loss_spec(self.name)


def _option_field(option: Option) -> tuple[Any, Any]:
    """A registry option as a pydantic field; its description names the losses reading it."""
    return option.type, Field(option.default, description=f"{', '.join(owners(option.key))}: "
                              f"{option.doc}", **option.bounds())


# The `loss:` section: the fields above plus every registry option (`registry.OPTIONS`).
LossConfig = create_model(  # type: ignore[call-overload]
    "LossConfig", __base__=_LossSection, __module__=__name__, __doc__=_LossSection.__doc__,
    **{key: _option_field(option) for key, option in OPTIONS.items()},
)
