#!/usr/bin/env bash
# Generate an offline dataset with vLLM on one GPU host (docs/architecture.md § The flow: generate on GPUs,
# train anywhere; records go to a local path or gs:// through etils.epath).
#
#   pip install -e '.[vllm]'            # once, on the GPU host (vLLM brings its own torch)
#   launch/vllm_host.sh configs/generate_topr_gsm8k.yaml [key.sub=value ...]
#
# The model is config `model.path` (an HF directory; exported checkpoints of a previous
# iteration work too: `jaxrl-llm export`). Tensor parallelism: generate.tensor_parallel_size.
# Sampling follows the config (TOPR: T=1, top-p 1, top-k 500, 512 tokens, n=16 GSM8K / 32 MATH;
# FPA: T=0.7, n=8). vLLM's per-token log-probs are stored as behavior_logprobs
# (generate.vllm_logprobs_mode=processed_logprobs) next to the manifest's truncation settings.
#
# Afterwards, the config's other stages on the training hosts (its "# Stages" header block;
# `python -m jaxrl_llm.chain --skip generate CONFIG` prints them): score (μ with the trainer's
# numerics), curate, train, export, evaluate. `jaxrl-llm data stats OUT` shows the records'
# composition, invalid rate and lengths.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [key.sub=value ...]" >&2
  exit 2
fi
CONFIG="$1"; shift

MODEL="$(python - "$CONFIG" <<'PY'
import sys, yaml
print((yaml.safe_load(open(sys.argv[1])) or {}).get("model", {}).get("path") or "")
PY
)"
if [[ -z "$MODEL" ]]; then
  echo "$CONFIG: model.path (an HF model directory) is required for vLLM" >&2
  exit 2
fi

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec python -m jaxrl_llm.generate.vllm --model "$MODEL" --config "$CONFIG" "$@"
