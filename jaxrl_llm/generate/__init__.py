"""Generation backends (JAX KV-cache sampler, vLLM) and the score pass (SPEC §0).

    generate_records      generate.jax_backend   sample, score with the task, write records
    completions_from_request_outputs  generate.vllm  (python -m jaxrl_llm.generate.vllm)
    score_records         generate.score         μ per-token log-probs on the training mesh
                                                 (multi-host), mismatch metrics
    gold_records          generate.completions   gold solutions as SFT records
"""
