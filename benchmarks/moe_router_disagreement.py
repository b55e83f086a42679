"""Router disagreement between the sampler and the trainer, per layer, on a tiny random
Qwen3-MoE (docs/moe.md § Router disagreement, measured).

The JAX continuous sampler records the experts every fed completion token went to in every
layer (`generate(return_routing=True)`); the trainer's forward (cache-free, the path of the
train step and the score pass, float32 on CPU) routes the same tokens again. A (token, layer)
disagrees when the two top-k expert sets differ. Settings:

- `float32`: sampler and trainer in float32 on the same weights;
- `bfloat16`: the sampler's copy of the weights and its compute in bfloat16 (the sampling
  dtype on TPU and GPU), the trainer in float32; the router itself runs in float32 in both
  (models/moe.py), so what differs is the bf16 hidden state it reads;
- `staleness_s` (s = 1, 2, 4): records sampled (float32) by the policy before s TOPR updates
  (each on a fresh batch of rollouts, through `Policy.step`: the train step itself), their
  routing recomputed by the policy after them: what a trainer without routing replay routes
  when it trains on s-updates-old records.

Counted over completion tokens that are inputs (every completion token but the last), summed
over `--seeds` (each its own random weights and prompts). Writes JSON: per setting the
fraction of (token, layer) pairs that disagree in each layer, their mean, and the fraction of
tokens whose experts differ in at least one layer.

    python benchmarks/moe_router_disagreement.py [--seeds 3] [--prompts 16] [--n 4]
        [--learning-rate 3e-4] [--out benchmarks/results/moe_router_disagreement.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.api import load_policy
from jaxrl_llm.models.decoder import Decoder
from jaxrl_llm.sampling.continuous import ContinuousSampler
from jaxrl_llm.sampling.sampler import SamplingParams
from jaxrl_llm.train.router_disagreement import RouterDisagreement, model_routing

MODEL = {"source": "random", "family": "qwen3_moe", "vocab_size": 128, "hidden_size": 64,
         "intermediate_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "max_position_embeddings": 256,
         "routing_replay": "sampler"}
MAX_LEN = 160  # arithmetic prompts with the char tokenizer: ~100 tokens, + 40 new
STALENESS = (1, 2, 4)


def experiment(seed: int, prompts: int, n: int, learning_rate: float) -> dict:
    return {"seed": seed, "model": MODEL,
            "loss": {"name": "topr", "baseline": -0.3},
            "optim": {"learning_rate": learning_rate, "clip_norm": 1.0},
            "train": {"batch_size": prompts * n, "max_seq_len": MAX_LEN},
            "generate": {"n": n, "temperature": 1.0, "max_new_tokens": 40},
            "data": {"task": "arithmetic", "num_prompts": prompts,
                     "task_options": {"min_ops": 1, "max_ops": 2, "max_operand": 9}}}


def bf16_copy(model: Decoder) -> Decoder:
    """The same weights in bfloat16, computing in bfloat16 (the router stays float32)."""
    config = dataclasses.replace(model.config, param_dtype="bfloat16",
                                 compute_dtype="bfloat16")
    graphdef = nnx.graphdef(Decoder(config, rngs=nnx.Rngs(0)))
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model)))


def one_seed(seed: int, args: argparse.Namespace, counts: dict[str, RouterDisagreement]) -> None:
    policy = load_policy(config=experiment(seed, args.prompts, args.n, args.learning_rate))
    problems = policy.task.load(num=args.prompts * (1 + max(STALENESS)), seed=seed)
    first = problems[:args.prompts]
    records = policy.rollout(first, seed=seed)
    rows = [(r.prompt_ids, r.completion_ids) for r in records]
    for r, again in zip(records, model_routing(policy.model, rows, MAX_LEN), strict=True):
        counts["float32"].add(r.routing, again)
    # bfloat16 sampler, float32 trainer: the same prompts, the same weights
    ids = [r.prompt_ids.tolist() for r in records[::args.n]]
    sampler = ContinuousSampler(bf16_copy(policy.model), slots=args.prompts * args.n,
                                pad_token_id=0)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=args.n,
                            stop_token_ids=(policy.tokenizer.eos_token_id,))
    out = sampler.generate(ids, params, jax.random.key(seed), return_routing=True)
    rows = [(np.asarray(ids[out.prompt_index[i]]), out.tokens[i, :out.lengths[i]])
            for i in range(out.tokens.shape[0])]
    for i, again in enumerate(model_routing(policy.model, rows, MAX_LEN)):
        counts["bfloat16"].add(out.routing[i, :out.lengths[i] - 1], again)
    # staleness: TOPR updates on fresh rollouts, then the first records routed again
    for update in range(1, max(STALENESS) + 1):
        batch = problems[update * args.prompts:(update + 1) * args.prompts]
        fresh = policy.rollout(batch, seed=seed + 1000 * update)
        # on-policy at T = 1, untruncated: μ is the sampler's own log-probs
        policy.step([r.replace(mu_logprobs=r.behavior_logprobs) for r in fresh])
        if update in STALENESS:
            rows = [(r.prompt_ids, r.completion_ids) for r in records]
            for r, again in zip(records, model_routing(policy.model, rows, MAX_LEN), strict=True):
                counts[f"staleness_{update}"].add(r.routing, again)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--out", default="benchmarks/results/moe_router_disagreement.json")
    args = parser.parse_args()
    layers = MODEL["num_layers"]
    names = ["float32", "bfloat16", *(f"staleness_{s}" for s in STALENESS)]
    counts = {name: RouterDisagreement(layers) for name in names}
    start = time.time()
    for seed in range(args.seeds):
        one_seed(seed, args, counts)
        print(f"seed {seed}: " + ", ".join(f"{k} {c.to_json()['mean']:.4f}"
                                           for k, c in counts.items()), flush=True)
    result = {"model": MODEL, "seeds": args.seeds, "prompts": args.prompts, "n": args.n,
              "learning_rate": args.learning_rate,
              "loss": "topr (baseline -0.3, mu: the sampler's log-probs)",
              "seconds": round(time.time() - start, 1), "load_average": os.getloadavg()[0],
              "jax": jax.__version__, **{k: c.to_json() for k, c in counts.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in names}, indent=2))


if __name__ == "__main__":
    main()
