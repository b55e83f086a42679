"""Generation backends (JAX KV-cache sampler, vLLM) and the score pass (SPEC §0).

    generate_records      generate.jax_backend   sample, score with the task, write records
    completions_from_request_outputs  generate.vllm  (python -m jaxrl_llm.generate.vllm)
    score_records         generate.score         μ (sampling T) and π_ref (T = 1) per-token
                                                 log-probs on the training mesh (multi-host)
    Mismatch              generate.mismatch      sampler-vs-trainer report (|Δp|, k3, χ², ESS)
    gold_records          generate.completions   gold solutions as SFT records
"""
