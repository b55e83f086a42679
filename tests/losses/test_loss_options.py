"""Each loss owns its `loss.<key>` options (losses/registry.py, losses/options.py): the config's
fields, the ownership errors and the kernel keywords all come from the registry entries."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_llm.config import ConfigError, LossConfig, config_from_dict, load_config
from jaxrl_llm.losses import ppo
from jaxrl_llm.losses import preference as pref
from jaxrl_llm.losses.registry import LOSS_SPECS, OPTIONS, loss_spec, owners

ROOT = Path(__file__).resolve().parents[2]

# Kernels that forward their keywords through a wrapper: the function that finally takes them.
_FORWARDED = {"dr_grpo": ppo.grpo_loss, "dpo": pref.dpo_loss, "rpo": pref.rpo_loss,
              "kto": pref.kto_loss, "apo": pref.apo_loss}


def _parameters(name: str) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(_FORWARDED.get(name, LOSS_SPECS[name].kernel)).parameters)


@pytest.mark.parametrize("name", list(LOSS_SPECS))
def test_every_option_binds_to_a_keyword_of_its_kernel_with_the_same_default(name):
    params = _parameters(name)
    for option in LOSS_SPECS[name].options:
        if option.kwarg is None:  # read by the train step's binding, not the kernel
            continue
        assert option.kwarg in params, (name, option.key, option.kwarg)
        kernel_default = params[option.kwarg].default
        if option.default is not None and kernel_default is not inspect.Parameter.empty:
            assert kernel_default == option.default, (name, option.key)


def test_kernel_options_rename_to_kernel_keywords_and_leave_out_unset_values():
    lc = load_config(None, ["loss.name=m2po", "loss.m2po_tau=0.05"]).loss
    assert loss_spec("m2po").kernel_options(dict(lc)) == {"tau": 0.05, "mask_tokens": "trust_region",
                                                          "std_ddof": 0}
    lc = load_config(None, ["loss.name=icepop", "loss.icepop_level=sequence"]).loss
    assert lc.spec.kernel_options(dict(lc)) == {"alpha": 0.5, "beta": 5.0, "level": "sequence",
                                                "aggregation": "token-mean", "std_ddof": 0}
    # a null TOPR bound keeps the preset's (bound into the kernel); a set one is passed
    lc = load_config(None, ["loss.name=tis", "loss.b_neg=2.0"]).loss
    assert lc.spec.kernel_options(dict(lc)) == {"b_neg": 2.0, "length_norm": True,
                                                "ratio_level": "sequence"}
    # ppo without an aggregation: the kernel's own token-mean applies
    lc = load_config(None, ["loss.name=ppo"]).loss
    assert "aggregation" not in lc.spec.kernel_options(dict(lc))


def test_the_config_has_one_field_per_declared_option_with_its_default_and_bounds():
    fields = LossConfig.model_fields
    assert set(OPTIONS) <= set(fields)
    assert set(fields) - set(OPTIONS) == {"name", "baseline", "logprob_chunk_size", "mu_source"}
    assert fields["m2po_tau"].default == 0.04
    assert [m.gt for m in fields["m2po_tau"].metadata] == [0]
    assert fields["m2po_tau"].description.startswith("m2po: ")
    assert owners("std_ddof") == ("grpo", "cispo", "gspo", "icepop", "m2po", "vespo", "dppo",
                                  "trm", "vcpo")


@pytest.mark.parametrize(("loss", "key", "owner"), [
    ({"name": "grpo", "m2po_tau": 0.1}, "m2po_tau", "m2po"),
    ({"name": "icepop", "m2po_tau": 0.1}, "m2po_tau", "m2po"),
    ({"name": "cispo", "icepop_level": "sequence"}, "icepop_level", "icepop"),
    ({"name": "topr", "clip_eps_low": 0.1}, "clip_eps_low", "ppo / grpo / dr_grpo"),
    ({"name": "dr_grpo", "std_ddof": 1}, "std_ddof",
     "grpo / cispo / gspo / icepop / m2po / vespo / dppo / trm / vcpo"),
    ({"name": "off_rl", "aggregation": "token-mean"}, "aggregation",
     "topr / sft / reinforce / opr / tis / ppo / grpo / dppo / trm / vcpo / asymre"),
])
def test_an_option_of_another_loss_names_the_key_its_owners_and_the_chosen_loss(loss, key, owner):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"loss": loss})
    text = str(err.value)
    assert f"loss.{key} has no effect with loss.name={loss['name']}" in text, text
    assert f"it is an option of loss.name={owner};" in text, text


@pytest.mark.parametrize("loss", [
    # one `loss:` section across a sweep of losses (experiments/topr_offline.py)
    {"name": "topr", "clip_eps": 0.3, "beta": 0.2},
    {"name": "grpo", "fpa_lambda": 1.5, "kl_tau": 0.1},  # tests/parallel/helpers.py's base
])
def test_the_non_strict_options_other_losses_ignore_as_before(loss):
    assert config_from_dict({"loss": loss}).loss.name == loss["name"]


def test_an_option_left_at_its_default_is_unset_for_other_losses():
    # a run's saved config.yaml holds every key: the defaults of other losses' options pass
    tree = LossConfig().model_dump()
    tree["name"] = "m2po"
    assert config_from_dict({"loss": tree}).loss.m2po_tau == 0.04


def test_importing_the_config_and_registry_imports_no_jax():
    code = ("import sys, jaxrl_llm.config, jaxrl_llm.losses.registry; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
