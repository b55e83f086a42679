"""The train step: one pure function `train_step(state, batch) -> (state, metrics)`, jitted
once with explicit in/out shardings on the ("data", "fsdp", "tensor") mesh and donating the
state (docs/architecture.md § Contracts).

One step:
1. Split the batch into `train.batch_size / train.micro_batch_size` micro-batches (contiguous
   rows, each spread over all batch shards) and scan over them, accumulating the gradient of
   each micro-batch's loss `total` and the sums of `total` and `weight`; the gradient and the
   loss are divided by Σ weight once at the end, which is exactly the full-batch loss
   `Σ total / Σ weight` (the `LossOutput` contract; never a mean of means). Packed batches
   (`records_per_row` k > 1) split the same way: per-record arrays are [B·k] with row i's
   records at i·k..i·k+k−1, so the contiguous reshape keeps each row with its records.
2. The policy runs as `nnx.merge(graphdef, params, model_state)`; with fp32 master weights
   the params are cast to the model's dtypes first (bf16 compute), so gradients are fp32.
3. FPA (and `train.ref_logprobs: model`) run the frozen reference model under
   `stop_gradient`, with its parameters sharded like the policy's.
   A mixture of experts (models/moe.py) adds its router losses to each micro-batch's loss,
   `router_aux_loss_coef` · load-balancing + `router_z_loss_coef` · z-loss, as a term of
   `total` weighted by the micro-batch's `weight` (so `Σ total / Σ weight` is the loss plus
   their weight-averaged sum), and logs both as `loss/router_aux_loss`, `loss/router_z_loss`.
   With routing replay (`model.routing_replay: sampler`, `Batch.routing`) the policy's forward
   routes each completion token to the experts it was sampled with (docs/moe.md); the frozen
   reference routes by its own routers.
4. Non-finite batch field, loss or gradient: the update is skipped (params, optimizer state and step
   unchanged bit for bit: a `jnp.where` selection of the old arrays, not a zero update, which
   would turn −0.0 into +0.0; optax's `apply_if_finite` also changes the optimizer state's
   structure and accepts NaN updates after a limit) and `metrics["update_skipped"] = 1`; we
   never train on NaN. `metrics["nonfinite_first"]` names the first non-finite quantity
   (`train/nonfinite.py`), which the trainer reports when it gives up.
5. A loss that reports `update_scale` (VCPO's √(ESS/N), from its whole-batch pre-pass
   `train/score_norms.py`, which also gives the micro-batches its advantages) has the
   optimizer's update multiplied by it: a learning-rate factor for this step.
6. `train.grad_norm_by_sign` (FPA arXiv:2509.19893 Fig. 2's positive/negative split): the same
   micro-batch scan also takes the gradients of the loss restricted to positive and to
   negative records (`record_mask` zeroed on the others, see `positive_records`), both
   divided by the full batch's Σ weight. Every loss it allows is a `record_mask`-weighted sum
   of per-record terms with advantages fixed before masking, so g⁺ + g⁻ = g exactly and
   `grad_norm_positive`/`grad_norm_negative` are ‖g⁺‖, ‖g⁻‖.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.config import ConfigError, ExperimentConfig
from jaxrl_llm.data.batch import Batch, array_fields, token_record_mask
from jaxrl_llm.losses.registry import LOSS_SPECS
from jaxrl_llm.losses.types import LossOutput
from jaxrl_llm.losses.variance_controlled import UPDATE_SCALE
from jaxrl_llm.models.layer_scan import LayerGradAccumulator
from jaxrl_llm.parallel.context import check_order
from jaxrl_llm.parallel.mesh import batch_axes, batch_shards, context_shards
from jaxrl_llm.parallel.rules import batch_sharding_tree
from jaxrl_llm.train.forward import forward, forward_moe, kernel_unembedding, sequence_axis
from jaxrl_llm.train.loss_fn import batch_advantages, compute_loss, needs_full_batch
from jaxrl_llm.train.monitors import MONITORS, batch_monitors, finish
from jaxrl_llm.train.nonfinite import NONFINITE_KEY, first_nonfinite
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.score_norms import vcpo_prepass
from jaxrl_llm.train.state import TrainState, cast_to_dtypes, needs_reference_model

Metrics = dict[str, jax.Array]


def num_micro_batches(config: ExperimentConfig, batch_size: int, mesh: Mesh) -> int:
    """How many micro-batches a batch of `batch_size` rows is split into (config-checked)."""
    micro = config.train.micro_batch_size or batch_size
    if batch_size % micro:
        raise ConfigError(
            f"train.micro_batch_size={micro} must divide the batch's {batch_size} rows"
        )
    n = batch_size // micro
    if n > 1 and needs_full_batch(config):
        raise ConfigError(
            f"loss.name={config.loss.name} couples rows across the batch (pairs / batch mean / "
            "M2PO's token mask) "
            "and cannot be split into micro-batches: unset train.micro_batch_size"
        )
    if n > 1 and micro % batch_shards(mesh):
        raise ConfigError(
            f"train.micro_batch_size={micro} must be a multiple of the mesh's "
            f"{'×'.join(batch_axes(mesh))} = "
            f"{batch_shards(mesh)} so every device gets rows of every micro-batch"
        )
    return n


def _split_micro(batch: Batch, n: int, mesh: Mesh) -> Batch:
    """[B, ...] → [n, B/n, ...] (contiguous rows), each micro-batch sharded over all batch
    shards (one reshuffle of the small integer/float batch per step). Per-record arrays
    [B·k] become [n, B·k/n]: micro-batch m holds exactly the records of its rows."""
    def split(x: jax.Array) -> jax.Array:
        y = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        tokens = (sequence_axis(mesh),) if x.ndim == 2 else ()
        return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, batch_axes(mesh),
                                                                         *tokens)))

    fields = {
        name: split(getattr(batch, name))
        for name in array_fields(batch) if name != "pair_index"
    }
    fields["pair_index"] = jnp.zeros((n, 0, 2), jnp.int32)
    return batch.replace(**fields)


# Which records count as positive for `train.grad_norm_by_sign` (`LossSpec.positive`).
_POSITIVE_RULES = {"baseline": "reward - loss.baseline >= 0", "group": "group advantage >= 0",
                   "correct": "batch.correct"}
SIGN_DEFINITIONS = {name: _POSITIVE_RULES[spec.positive] for name, spec in LOSS_SPECS.items()
                    if spec.positive is not None}


def check_sign_split(config: ExperimentConfig) -> None:
    """`train.grad_norm_by_sign` needs a loss that is a sum over records (not pairs)."""
    if config.train.grad_norm_by_sign and config.loss.name not in SIGN_DEFINITIONS:
        raise ConfigError(
            f"train.grad_norm_by_sign is not defined for loss.name={config.loss.name}: its "
            "loss couples records (pairs / batch mean); allowed: "
            + ", ".join(sorted(SIGN_DEFINITIONS))
        )


def positive_records(config: ExperimentConfig, batch: Batch, adv: jax.Array | None) -> jax.Array:
    """[B] bool: the records on the positive side of the split (`LossSpec.positive`).

    TOPR family and PPO use the kernel's own rule `A = R − baseline ≥ 0` (TOPR eq. 7); the
    GRPO family the full-batch group advantage `Â ≥ 0`; Off-RL/FPA, which have no baseline,
    the verifier's `correct` flag (FPA's correct/incorrect split)."""
    rule = config.loss.spec.positive
    if rule == "group":
        return adv >= 0
    if rule == "baseline":
        return batch.rewards - jnp.float32(config.loss.baseline) >= 0
    return batch.correct.astype(bool)


def accumulates_in_layer_scan(config: ExperimentConfig) -> bool:
    """Whether micro-batch gradients are added into the accumulator inside the layer scan's
    backward pass (`models/layer_scan.py`): scanned layers under `remat: full` (its backward
    recomputes each layer from the layer's input, as `remat: full` does), full fine-tuning,
    one gradient tree (`train.accumulate_in_layer_scan`)."""
    m = config.model
    return (config.train.accumulate_in_layer_scan and m.scan_layers and m.remat == "full"
            and m.lora is None and not config.train.grad_norm_by_sign)


def _is_layer_path(path: tuple[Any, ...]) -> bool:
    return bool(path) and getattr(path[0], "key", None) == "layers"


def _layers_are_float32(params: Any) -> bool:
    """Float32 layer weights (masters), as the in-scan accumulator's cotangents are; with
    `optim.master_weights_fp32: false` and bf16 weights the plain scan runs."""
    leaves = [a for path, a in jax.tree_util.tree_leaves_with_path(params) if _is_layer_path(path)]
    return bool(leaves) and all(a.dtype == jnp.float32 for a in leaves)


def _has_router(params: Any) -> bool:
    """A mixture of experts' params (its layers have routers): the in-scan accumulator's
    scan carries no router losses, so it trains with the plain scan."""
    return any(any(getattr(k, "key", None) == "router" for k in path)
               for path, _ in jax.tree_util.tree_leaves_with_path(params))


def _where_layers(layers_from: Any, rest_from: Any) -> Any:
    """A params-shaped tree: the layer weights' leaves from `layers_from`, the others from
    `rest_from`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a, b: a if _is_layer_path(path) else b, layers_from, rest_from)


def make_loss_and_grad(config: ExperimentConfig, mesh: Mesh, state: TrainState):
    """`(params, state, batch) -> (grads, total, weight, metrics, sign_grads)` summed over
    micro-batches (gradients of Σ total, not yet divided). `sign_grads` is None, or with
    `train.grad_norm_by_sign` the pair (g⁺, g⁻) of gradients of the positive and negative
    records' Σ total (g⁺ + g⁻ = grads). Exposed for tests and the benchmark."""
    check_sign_split(config)
    use_ref = needs_reference_model(config)
    by_sign = config.train.grad_norm_by_sign
    grad_shardings = jax.tree.map(lambda x: x.sharding, state.params)

    def micro_step(params, st: TrainState, mb: Batch, adv, layer_grads: Any = None):
        """(gradient trees, LossOutput): (g,) or, when split by sign, (g, g⁺, g⁻). With
        `layer_grads` (the accumulator's layer weights, a pure dict) the layer weights' entry
        of g is `layer_grads` plus their gradient (`models/layer_scan.py`)."""
        ref_hidden = ref_unembed = None
        if use_ref:
            ref_params = jax.lax.stop_gradient(st.ref_params)
            ref_hidden, ref_unembed, _ = forward(st.graphdef, ref_params, st.model_state,
                                                 mb.inputs, mb.positions, mb.segment_ids, mesh,
                                                 gather_unembed=False)
            ref_unembed, _ = kernel_unembedding(ref_unembed, mesh)
            ref_hidden = jax.lax.stop_gradient(ref_hidden)
            ref_unembed = jax.lax.stop_gradient(ref_unembed)

        def grad_of(b: Batch):
            def loss_of(p):
                model_params = cast_to_dtypes(p, st.param_dtypes)
                accumulator = None
                if layer_grads is not None:
                    dtypes = jax.tree.map(lambda a: a.dtype,
                                          nnx.to_pure_dict(model_params["layers"]))
                    accumulator = LayerGradAccumulator(layer_grads, dtypes)
                    # the layers get their float32 masters and cast one layer at a time
                    model_params = _where_layers(p, model_params)
                hidden, unembed, softcap, router = forward_moe(
                    st.graphdef, model_params, st.model_state, b.inputs, b.positions,
                    b.segment_ids, mesh, gather_unembed=False, grad_accumulator=accumulator,
                    routing=b.routing,  # routing replay: the sampler's experts (π only)
                )
                unembed, rows = kernel_unembedding(unembed, mesh)
                out: LossOutput = compute_loss(
                    config, b, hidden, unembed, ref_hidden=ref_hidden,
                    ref_unembed=ref_unembed, softcap=softcap, advantages=adv,
                    row_sharding=rows,
                )
                if router is not None:  # a term of Σ total / Σ weight (module docstring)
                    penalty, router_metrics = router
                    out = out._replace(
                        total=out.total + penalty * jax.lax.stop_gradient(out.weight),
                        metrics={**out.metrics, **router_metrics})
                return out.total, out

            (_, out), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            return jax.lax.with_sharding_constraint(grads, grad_shardings), out

        grads, out = grad_of(mb)
        if not by_sign:
            return (grads,), out
        # Same loss code on the same rows, only `record_mask` restricted to one side.
        pos = positive_records(config, mb, adv).astype(mb.record_mask.dtype)
        g_pos, _ = grad_of(mb.replace(record_mask=mb.record_mask * pos))
        g_neg, _ = grad_of(mb.replace(record_mask=mb.record_mask * (1.0 - pos)))
        return (grads, g_pos, g_neg), out

    def split_result(parts):
        return parts[0], (tuple(parts[1:]) if by_sign else None)

    def loss_and_grad(params, st: TrainState, batch: Batch):
        # the model's causal masks assume the mesh's token order: a batch in another is
        # refused while tracing (the order is static), never trained on wrong masks
        check_order(batch, context_shards(mesh))
        n = num_micro_batches(config, batch.batch_size, mesh)
        adv = batch_advantages(config, batch)
        pre: dict[str, jax.Array] = {}  # whole-batch metrics of a pre-pass (VCPO's ESS, step scale)
        if config.loss.spec.needs_score_norms:
            adv, pre = vcpo_prepass(config, mesh, st, params, batch, forward)
        if n == 1:
            parts, out = micro_step(params, st, batch, adv)
            grads, sign_grads = split_result(parts)
            return grads, out.total, out.weight, {**out.metrics, **pre}, sign_grads
        micro = _split_micro(batch, n, mesh)
        adv_micro = None if adv is None else adv.reshape(n, -1)
        in_scan = (accumulates_in_layer_scan(config) and _layers_are_float32(params)
                   and not _has_router(params))

        def body(carry, xs):
            g_acc, total, weight = carry
            mb, a = xs
            if in_scan:
                (g,), out = micro_step(params, st, mb, a,
                                       layer_grads=nnx.to_pure_dict(g_acc[0]["layers"]))
                # the layer weights' entries of g already hold the accumulator
                g_acc = (jax.tree_util.tree_map_with_path(
                    lambda path, acc, gi: gi if _is_layer_path(path) else acc + gi, g_acc[0], g),)
            else:
                parts, out = micro_step(params, st, mb, a)
                g_acc = jax.tree.map(jnp.add, g_acc, parts)
            # Kernel metrics are per micro-batch means: weight them by the micro-batch weight.
            weighted = {k: v * out.weight for k, v in out.metrics.items()}
            return (g_acc, total + out.total, weight + out.weight), (weighted, out.weight)

        zeros = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), grad_shardings
        )
        num_parts = 3 if by_sign else 1
        init = (tuple(zeros for _ in range(num_parts)), jnp.zeros((), jnp.float32),
                jnp.zeros((), jnp.float32))
        (parts, total, weight), (weighted, weights) = jax.lax.scan(
            body, init, (micro, adv_micro)
        )
        denom = jnp.maximum(jnp.sum(weights), 1e-12)
        metrics = {k: jnp.sum(v) / denom for k, v in weighted.items()}
        grads, sign_grads = split_result(parts)
        return grads, total, weight, {**metrics, **pre}, sign_grads

    return loss_and_grad


def train_step_fn(
    config: ExperimentConfig, mesh: Mesh, state: TrainState
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """The un-jitted pure step (see module docstring)."""
    tx, schedule = make_optimizer(config.optim, config.train.steps)
    loss_and_grad = make_loss_and_grad(config, mesh, state)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        batch.check_shapes()
        grads, total, weight, kernel_metrics, sign_grads = loss_and_grad(
            state.params, state, batch
        )
        inv_weight = 1.0 / jnp.maximum(weight, 1e-12)

        def normalise(tree):
            return jax.tree.map(lambda g: (g * inv_weight).astype(jnp.float32), tree)

        grads = normalise(grads)
        loss = total * inv_weight
        grad_norm = optax.tree.norm(grads)
        # Any non-finite batch field, loss, gradient leaf or gradient norm skips the update.
        first_bad = first_nonfinite(batch, loss, grads, grad_norm)
        finite = first_bad < 0
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        scale = kernel_metrics.get(UPDATE_SCALE)  # a loss's step-size factor (VCPO's √(ESS/N))
        if scale is not None:  # on the whole update: exactly a learning-rate factor
            updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
        new_params = optax.apply_updates(state.params, updates)

        def keep_if_finite(new, old):
            return jnp.where(finite, new, old)

        new_state = state.replace(
            step=state.step + finite.astype(jnp.int32),
            params=jax.tree.map(keep_if_finite, new_params, state.params),
            opt_state=jax.tree.map(keep_if_finite, new_opt, state.opt_state),
            rng=jax.random.split(state.rng)[0],
        )
        completion_tokens = jnp.sum(batch.loss_mask * token_record_mask(batch))
        metrics: Metrics = {
            **batch_monitors(batch.rewards, batch.record_mask, completion_tokens),
            "loss": loss,
            "loss_weight": weight,
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(new_state.params),
            "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
            "update_skipped": 1.0 - finite.astype(jnp.float32),
            NONFINITE_KEY: first_bad,
            "completion_tokens": completion_tokens,
            **{(k if k in MONITORS else f"loss/{k}"): jnp.asarray(v, jnp.float32)
               for k, v in finish(dict(kernel_metrics)).items()},
        }
        if sign_grads is not None:
            # Both sides over the full batch's weight, so the two gradients sum to `grads`.
            g_pos, g_neg = sign_grads
            metrics["grad_norm_positive"] = optax.tree.norm(normalise(g_pos))
            metrics["grad_norm_negative"] = optax.tree.norm(normalise(g_neg))
        return new_state, metrics

    return train_step


class TrainStep:
    """The jitted train step behind the token-order check (`parallel.context.check_order`):
    jit's own complaint about a batch in another order would be a pytree-structure mismatch
    with its in_shardings that names no fix. Called like the jitted function; `lower` too."""

    def __init__(self, jitted: Any, context: int) -> None:
        self.jitted, self.context = jitted, context

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        check_order(batch, self.context)
        return self.jitted(state, batch)

    def lower(self, state: Any, batch: Any) -> Any:
        check_order(batch, self.context)
        return self.jitted.lower(state, batch)


def make_train_step(
    config: ExperimentConfig, mesh: Mesh, state: TrainState, *, donate: bool = True
) -> TrainStep:
    """`train_step(state, batch) -> (state, metrics)` jitted with explicit shardings.

    `state` (concrete from `create_train_state`, or abstract from `abstract_train_state`)
    fixes the state shardings. The batch must be a global `Batch` whose row dimension is
    sharded over ("data", "fsdp") and `pair_index` replicated — `parallel.distributed.
    global_batch(local_batch, mesh)` builds it from each host's rows — in the mesh's token
    order (`Batch.context_order`, which `global_batch` sets; another order raises
    `parallel.context.BatchOrderError`). The input state is donated (its buffers are
    reused): do not touch it after the call.
    """
    step = train_step_fn(config, mesh, state)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(mesh, P())
    return TrainStep(jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding_tree(mesh)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,) if donate else (),
    ), context_shards(mesh))
