"""Generation backends (JAX KV-cache sampler, vLLM): completions -> reward-scored records.

    generate_records      generate.jax_backend   sample, score with the task, write records
    completions_from_request_outputs  generate.vllm  (`jaxrl-llm vllm generate`)
    gold_records          generate.completions   gold solutions as SFT records

The score pass (μ and π_ref per-token log-probs with the trainer's numerics, docs/architecture.md
§ Why μ is re-scored) lives in `train.score`: it runs the train step's own `forward`.
"""
