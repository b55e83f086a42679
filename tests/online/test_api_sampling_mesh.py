"""`load_policy(config=...)` and `policy.sample` as a new user runs them on 8 CPU devices
(tests/conftest.py), the way issue 54 found the sampler replicated: with `mesh: {data: 8}` the
sampler now decodes in 8 slot groups (each device holds 1/8 of the KV cache), with
`mesh: {data: 2, fsdp: 2, tensor: 2}` in 4 slot groups × tensor 2, and both sample the tokens
the one-device policy samples."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.api import load_policy
from jaxrl_llm.config.train import MeshConfig
from jaxrl_llm.parallel.mesh import make_mesh
from jaxrl_llm.sampling.build import build_sampler
from tests.online.helpers import tiny

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [3, 4], [15, 16, 17]]


def policy(tmp_path, mesh: dict, devices=None):
    tree = tiny(tmp_path / "run")
    del tree["online"]  # an experiment config: the API's own schema has no online: section
    tree["model"]["num_kv_heads"] = 2  # tensor 2 divides them
    tree["mesh"] = mesh
    tree["generate"]["temperature"] = 0.0
    if devices is None:
        return load_policy(config=tree)
    return load_policy(config=tree, mesh=make_mesh(MeshConfig(**mesh), devices=devices))


def test_policy_sampling_uses_every_device_of_the_mesh(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs the 8 fake devices of tests/conftest.py")
    one = policy(tmp_path / "one", {"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    reference = one.sample(PROMPTS, seed=2, n=2)
    for mesh, groups, tensor in (({"data": 8, "fsdp": 1, "tensor": 1}, 8, 1),
                                 ({"data": 2, "fsdp": 2, "tensor": 2}, 4, 2)):
        p = policy(tmp_path / f"{groups}", mesh)
        sampler = build_sampler(p.model, p.tokenizer, PROMPTS, batch_size=4, n=2,
                                max_new_tokens=4, key="generate.batch_size",
                                **p.config.generate.sampler_options())
        layout = sampler.decode_layout
        assert (layout.groups, layout.tensor) == (groups, tensor)
        got = p.sample(PROMPTS, seed=2, n=2)
        for a, b in zip(got.token_ids, reference.token_ids, strict=True):
            np.testing.assert_array_equal(a, b)
