"""The policy's forward pass as the train step and the score pass run it: hidden states,
the unembedding laid out for the chunked log-prob kernel, and a mixture of experts' router
losses (`forward_moe`), with the sharding constraints that keep the log-prob matmul from
replicating logits over the batch (docs/plan.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.losses.vocab_chunks import RowSharding
from jaxrl_llm.models.attention import attention_mesh
from jaxrl_llm.models.layer_scan import LayerGradAccumulator
from jaxrl_llm.models.moe import MoeAux, router_losses
from jaxrl_llm.parallel.mesh import CONTEXT_AXIS, batch_axes, context_shards
from jaxrl_llm.parallel.rules import logical_to_mesh_spec


def _vocab_axis(mesh: Mesh, vocab: int) -> str | None:
    return "tensor" if vocab % mesh.shape["tensor"] == 0 else None


def unembed_row_sharding(mesh: Mesh | None, unembed_shape: tuple[int, ...]) -> RowSharding | None:
    """FSDP layout of the log-prob kernel's table (rows [V, d], d split over "fsdp" — and
    "context" when the rules put it there — one vocabulary chunk gathered at a time), or None
    where the whole-table gather of `forward` applies instead: no mesh, no FSDP split of d,
    or vocab split over "tensor"."""
    if mesh is None or mesh.shape["fsdp"] == 1 or unembed_shape[0] % mesh.shape["fsdp"]:
        return None
    if mesh.shape["tensor"] > 1 and _vocab_axis(mesh, unembed_shape[1]) is not None:
        return None
    axes = logical_to_mesh_spec(("embed",), unembed_shape[:1], mesh)[0]
    return RowSharding(mesh, axes)


def gather_unembedding(unembed: jax.Array, mesh: Mesh) -> jax.Array:
    """The unembedding [d, V] all-gathered over "fsdp" (vocab stays split over "tensor")."""
    spec = P(None, _vocab_axis(mesh, unembed.shape[1]))
    return jax.lax.with_sharding_constraint(unembed, NamedSharding(mesh, spec))


def kernel_unembedding(unembed: jax.Array, mesh: Mesh | None):
    """(unembedding, RowSharding or None) for the log-prob kernel: kept FSDP-split when
    `unembed_row_sharding` allows it, else gathered whole as `forward` does by default."""
    rows = unembed_row_sharding(mesh, unembed.shape)
    if rows is None and mesh is not None:
        unembed = gather_unembedding(unembed, mesh)
    return unembed, rows


def forward(graphdef: Any, params: nnx.State, model_state: nnx.State, inputs: jax.Array,
            positions: jax.Array, segment_ids: jax.Array, mesh: Mesh | None = None,
            *, gather_unembed: bool = True, grad_accumulator: LayerGradAccumulator | None = None,
            routing: jax.Array | None = None):
    """(hidden [B,T,d], unembedding [d,V], final-logit softcap): `forward_moe` without the
    mixture of experts' router losses."""
    return forward_moe(graphdef, params, model_state, inputs, positions, segment_ids, mesh,
                       gather_unembed=gather_unembed, grad_accumulator=grad_accumulator,
                       routing=routing)[:3]


def forward_moe(graphdef: Any, params: nnx.State, model_state: nnx.State, inputs: jax.Array,
                positions: jax.Array, segment_ids: jax.Array, mesh: Mesh | None = None,
                *, gather_unembed: bool = True,
                grad_accumulator: LayerGradAccumulator | None = None,
                routing: jax.Array | None = None):
    """(hidden [B,T,d], unembedding [d,V], final-logit softcap, router losses) of the model on
    token rows `inputs [B,T]` with their `positions` and `segment_ids` (a `Batch`'s fields of
    those names). Router losses: None for a dense model, else (penalty, metrics) of
    `moe.router_losses`. `routing` [B,T,L,k] (`Batch.routing`, routing replay): the experts
    each token goes to (-1: its own top-k), gates from the current routers (docs/moe.md).

    With a mesh, hidden states are pinned to batch sharding and (`gather_unembed`) the
    unembedding is all-gathered over "fsdp" (vocab stays split over "tensor"): otherwise
    GSPMD may contract the FSDP-sharded d dimension of the log-prob matmul by resharding the
    activations, which replicates every logit chunk over the batch (measured: 21.6 GiB of
    temporaries per v5e chip for Llama-3-8B at 1 row per chip, vs MiB with the constraint).
    The train step passes `gather_unembed=False` and gives the log-prob kernel an
    `unembed_row_sharding` instead, which gathers one vocabulary chunk at a time.
    """
    model = nnx.merge(graphdef, params, model_state)
    with attention_mesh(mesh):  # fused attention kernels run per shard of this mesh
        # passed only when set: models other than `Decoder` (test models) do not take it
        extra = {} if grad_accumulator is None else {"grad_accumulator": grad_accumulator}
        # the train step checked the batch's order (`check_order`); the scorer orders its own
        if context_shards(mesh) > 1:
            extra["context_order"] = context_shards(mesh)
        moe = getattr(getattr(model, "config", None), "is_moe", False)
        if moe:
            extra["return_moe"] = True
        if routing is not None:  # [B, T, L, k] -> the decoder's [L, B, T, k]
            extra["routing"] = jnp.transpose(routing, (2, 0, 1, 3))
        hidden = model(inputs, positions=positions, segment_ids=segment_ids, **extra)
    losses = None
    if moe:
        hidden, aux = hidden
        losses = router_losses(aux, model.config) if isinstance(aux, MoeAux) else None
    softcap = getattr(model, "final_logit_softcap", None)
    # In the compute dtype, as the layers cast theirs: float32 weights with bf16 compute.
    unembed = model.unembedding().astype(hidden.dtype)
    if mesh is not None:
        hidden = jax.lax.with_sharding_constraint(
            hidden, NamedSharding(mesh, P(batch_axes(mesh), sequence_axis(mesh), None))
        )
        if gather_unembed:
            unembed = gather_unembedding(unembed, mesh)
    return hidden, unembed, softcap, losses


def sequence_axis(mesh: Mesh) -> str | None:
    """The mesh axis a row's tokens are split over: "context", or None without one."""
    return CONTEXT_AXIS if context_shards(mesh) > 1 else None
