"""The train state: parameters, optimizer state, step and RNG, sharded on a mesh.

`TrainState` is a flax struct pytree. The model is held in NNX's functional form
(`nnx.split(model, nnx.Param, ...)`): `graphdef` (static structure) plus `params` (trainable)
and `model_state` (every other variable, e.g. buffers), so the train step is a pure function
that re-merges them (`nnx.merge`). With `optim.master_weights_fp32` the `params` held here are
float32 master weights and the step casts them to the model's own parameter dtypes
(`param_dtypes`, e.g. bf16) for the forward pass; gradients and optimizer state stay float32.

FPA (and the preference losses with `train.ref_logprobs: model`) keep a frozen copy of the
initial policy, `ref_params`, in the model's own dtype, sharded exactly like `params`.

With `model.lora` (models/lora.py) only the adapters (`nnx.LoRAParam`) are `params`: they
alone get gradients and optimizer state. The frozen base weights sit in `model_state`,
sharded by the same rules as trainable parameters. The reference policy is the same model
with its adapters off: `ref_params` is a zero adapter tree (B = 0 makes every update
vanish exactly), so the base weights are never copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.models.lora import LoraSpec, add_lora
from jaxrl_llm.parallel.rules import optimizer_shardings, state_shardings
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.weights.loading import load_model


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: nnx.State  # trainable parameters (fp32 master weights when configured)
    opt_state: optax.OptState
    model_state: nnx.State  # the model's non-trainable variables
    ref_params: nnx.State | None  # frozen reference policy (FPA / ref_logprobs: model)
    rng: jax.Array  # uint32[2] PRNG key, advanced every step
    graphdef: Any = struct.field(pytree_node=False)
    param_dtypes: tuple[str, ...] = struct.field(pytree_node=False)  # per params leaf

    def model_params(self) -> nnx.State:
        """`params` cast to the model's own dtypes (what the forward pass uses)."""
        return cast_to_dtypes(self.params, self.param_dtypes)

    def model(self) -> nnx.Module:
        """The policy as an NNX module (for sampling, export and tests; not in the step)."""
        return nnx.merge(self.graphdef, self.model_params(), self.model_state)


def lora_spec(config: ExperimentConfig) -> Any:
    """The `models.lora.LoraSpec` of `model.lora`, or None (full fine-tuning)."""
    lora = config.model.lora
    if lora is None:
        return None

    return LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets))


def _adapters_of(model: nnx.Module) -> Any:
    """The model's `LoraSpec`, or None (also for models without a `DecoderConfig`)."""
    return getattr(getattr(model, "config", None), "lora", None)


def with_adapters(config: ExperimentConfig, model: nnx.Module) -> nnx.Module:
    """`model` with the adapters `model.lora` asks for: attached in place (fresh, B = 0) to a
    model without any; a model that has them already (a previous iteration's) must match."""
    spec = lora_spec(config)
    have = _adapters_of(model)
    if have == spec:
        return model
    if have is None:
        return add_lora(model, spec, seed=config.seed)
    raise ConfigError(f"model.lora={config.model.lora} but the given model has adapters {have}")


def needs_reference_model(config: ExperimentConfig) -> bool:
    """FPA needs the reference hidden states; other losses need π_ref only when the config
    asks the step to compute reference log-probs."""
    spec = config.loss.spec
    return spec.needs_ref_model or (spec.needs_ref and config.train.ref_logprobs == "model")


def cast_to_dtypes(tree: nnx.State, dtypes: tuple[str, ...]) -> nnx.State:
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(dtypes):
        raise ValueError(f"{len(leaves)} parameters but {len(dtypes)} recorded dtypes")
    return jax.tree.unflatten(
        treedef, [_astype(x, jnp.dtype(d)) for x, d in zip(leaves, dtypes)]
    )


def _astype(x: Any, dtype: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x if x.dtype == dtype else x.astype(dtype)


def master_dtypes(params: nnx.State, fp32: bool) -> tuple[str, ...]:
    """dtype of each master weight: float32 for floating leaves when `fp32`, else unchanged."""
    out = []
    for x in jax.tree.leaves(params):
        dt = jnp.dtype(x.dtype)
        out.append("float32" if fp32 and jnp.issubdtype(dt, jnp.floating) else dt.name)
    return tuple(out)


def build_model(config: ExperimentConfig, *, weights: bool = True,
                mesh: Mesh | None = None) -> nnx.Module:
    """The policy named by `config.model`, loaded by the weights loader
    `weights.loading.load_model` (with `mesh`: every parameter already in its sharding) with
    `model.lora`'s adapters; train's only way to a model (commands open theirs in `opener`).
    `weights=False` builds a randomly initialised model of the same architecture (for
    `nnx.eval_shape` / `plan`)."""
    model = load_model(config.model, seed=config.seed, mesh=mesh, weights=weights).model
    return with_adapters(config, model)


def split_model(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State]:
    """(graphdef, trainable params, everything else): the adapters alone are trainable when
    the model has them, the base weights then go with the rest (frozen)."""
    trainable = nnx.LoRAParam if _adapters_of(model) is not None else nnx.Param
    graphdef, params, rest = nnx.split(model, trainable, ...)
    return graphdef, params, rest


def reference_params(config: ExperimentConfig, params: nnx.State) -> nnx.State | None:
    """The reference policy's `params` (None when the loss needs none): with LoRA the
    adapters switched off (zeros), else a copy of the initial policy (`params` given in the
    model's own dtypes)."""
    if not needs_reference_model(config):
        return None
    if config.model.lora is not None:
        return jax.tree.map(jnp.zeros_like, params)
    return jax.tree.map(jnp.copy, params)


def _put(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


def state_shardings_for(state: TrainState, mesh: Mesh) -> TrainState:
    """NamedShardings of every leaf of a (concrete or abstract) TrainState, from the rules."""
    p_shard = state_shardings(state.params, mesh)
    return state.replace(
        step=NamedSharding(mesh, jax.sharding.PartitionSpec()),
        params=p_shard,
        opt_state=optimizer_shardings(state.opt_state, state.params, p_shard),
        model_state=state_shardings(state.model_state, mesh),  # frozen LoRA base: sharded
        ref_params=None if state.ref_params is None else state_shardings(state.ref_params, mesh),
        rng=NamedSharding(mesh, jax.sharding.PartitionSpec()),
    )


def _unsharded_state(
    config: ExperimentConfig, model: nnx.Module, init_opt: Callable[[Any], Any]
) -> TrainState:
    graphdef, params, rest = split_model(model)
    dtypes = tuple(jnp.dtype(x.dtype).name for x in jax.tree.leaves(params))
    master = cast_to_dtypes(params, master_dtypes(params, config.optim.master_weights_fp32))
    ref = reference_params(config, params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=master,
        opt_state=init_opt(master),
        model_state=rest,
        ref_params=ref,
        rng=jax.random.PRNGKey(config.seed),
        graphdef=graphdef,
        param_dtypes=dtypes,
    )


def create_train_state(
    config: ExperimentConfig, mesh: Mesh, model: nnx.Module | None = None
) -> TrainState:
    """A concrete TrainState placed on `mesh` by the sharding rules.

    `model=None` loads the policy from `config.model` straight into its shardings (random
    init inside a jitted initialiser; pretrained weights shard by shard from the files), so
    no device ever holds the whole model; a given `model` is placed by the same rules. The
    fp32 master weights and the optimizer state are made by jitted functions with
    out-shardings, shard by shard. The reference model (when needed) is a frozen copy of the
    initial policy in its own dtype.
    """
    tx, _ = make_optimizer(config.optim, config.train.steps)
    model = build_model(config, mesh=mesh) if model is None else with_adapters(config, model)
    graphdef, params, rest = split_model(model)
    dtypes = tuple(jnp.dtype(x.dtype).name for x in jax.tree.leaves(params))
    masters = master_dtypes(params, config.optim.master_weights_fp32)
    p_shard = state_shardings(params, mesh)
    params = _put(params, p_shard)  # a no-op for a model loaded onto this mesh
    master = jax.jit(lambda p: cast_to_dtypes(p, masters), out_shardings=p_shard)(params)
    opt_shard = optimizer_shardings(jax.eval_shape(tx.init, master), master, p_shard)
    scalar = NamedSharding(mesh, jax.sharding.PartitionSpec())
    ref = reference_params(config, params)
    return TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), scalar),
        params=master,
        opt_state=jax.jit(tx.init, out_shardings=opt_shard)(master),
        model_state=_put(rest, state_shardings(rest, mesh)),
        # A real copy: the step donates the state, and one buffer cannot be donated twice.
        ref_params=None if ref is None else _put(ref, p_shard),
        rng=jax.device_put(jax.random.PRNGKey(config.seed), scalar),
        graphdef=graphdef,
        param_dtypes=dtypes,
    )


def abstract_train_state(
    config: ExperimentConfig, mesh: Mesh,
    model_factory: Callable[[], nnx.Module] | None = None,
) -> TrainState:
    """The TrainState as `jax.ShapeDtypeStruct`s carrying their NamedShardings; no weights are
    created (`nnx.eval_shape`), so an 8B model costs nothing. Used by `plan` and for restoring
    checkpoints onto a mesh."""
    tx, _ = make_optimizer(config.optim, config.train.steps)
    factory = model_factory or (lambda: build_model(config, weights=False))  # reads no weights

    def make() -> TrainState:
        model = factory()
        return _unsharded_state(config, model, tx.init)

    # Model and optimizer state in one eval_shape (an optimizer made from an
    # already-abstract model under an Auto mesh fails).
    with nnx.use_eager_sharding(False):
        shapes = nnx.eval_shape(make)
    shardings = state_shardings_for(shapes, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def count_params(params: nnx.State) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
