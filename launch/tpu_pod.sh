#!/usr/bin/env bash
# Run a jaxrl-llm command on every worker of a Cloud TPU VM pod slice.
#
# Usage:
#   launch/tpu_pod.sh create  NAME ZONE ACCELERATOR [RUNTIME]   # e.g. v5litepod-256
#   launch/tpu_pod.sh install NAME ZONE [GIT_URL_OR_PATH]       # pip install -e .[tpu] on all
#   launch/tpu_pod.sh run     NAME ZONE -- jaxrl-llm train --config configs/X.yaml [k=v ...]
#   launch/tpu_pod.sh chain   NAME ZONE configs/X.yaml [k=v ...]      # the config's stages
#   launch/tpu_pod.sh delete  NAME ZONE
#
# `run` executes the same command on every worker at once (gcloud ... ssh --worker=all): JAX's
# multi-controller SPMD needs exactly that. Inside the command, jaxrl_llm.parallel.
# distributed.initialize() auto-detects the pod (no coordinator arguments needed), then one
# mesh spans all chips. `chain` runs the "# Stages" block of the config's header (checked
# here first), stage by stage on every worker, except `generate`: sample on the vLLM GPU host
# (launch/vllm_host.sh CONFIG) before. STAGES=score,train keeps only those stages.
# Check memory first, from any machine: jaxrl-llm plan --config X.
# Environment: PROJECT (gcloud project, optional), REPO_DIR (checkout dir on the workers,
# default ~/jaxrl_llm), VENV (default ~/venv).
set -euo pipefail

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  usage 0
fi
[[ $# -ge 3 ]] || usage
action=$1
name=$2
zone=$3
shift 3

project_flag=()
if [[ -n "${PROJECT:-}" ]]; then
  project_flag=(--project "$PROJECT")
fi
repo_dir=${REPO_DIR:-'~/jaxrl_llm'}
venv=${VENV:-'~/venv'}

on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project_flag[@]}" \
    --worker=all --command "$1"
}

case "$action" in
  create)
    [[ $# -ge 1 ]] || usage
    accelerator=$1
    runtime=${2:-v2-alpha-tpuv5-lite}
    gcloud compute tpus tpu-vm create "$name" --zone "$zone" "${project_flag[@]}" \
      --accelerator-type "$accelerator" --version "$runtime"
    ;;
  install)
    source_spec=${1:-https://github.com/jaxrl-llm/jaxrl_llm.git}
    on_all_workers "set -e
      python3 -m venv $venv
      . $venv/bin/activate
      pip install -q --upgrade pip
      if [ ! -d $repo_dir ]; then git clone -q $source_spec $repo_dir; fi
      cd $repo_dir && pip install -q -e '.[tpu]'
      python -c 'import jax; print(jax.process_index(), jax.local_device_count())'"
    ;;
  run)
    [[ ${1:-} == "--" ]] && shift
    [[ $# -ge 1 ]] || usage
    printf -v command '%q ' "$@"
    # Every worker runs the same command; stdout of all workers is interleaved here.
    on_all_workers ". $venv/bin/activate && cd $repo_dir && $command"
    ;;
  chain)
    [[ $# -ge 1 ]] || usage
    python3 -m jaxrl_llm.chain --check "$1"
    mapfile -t lines < <(python3 -m jaxrl_llm.chain --skip generate --only "${STAGES:-}" "$@")
    for line in "${lines[@]}"; do
      echo "+ $line (all workers)" >&2
      on_all_workers ". $venv/bin/activate && cd $repo_dir && $line"
    done
    ;;
  delete)
    gcloud compute tpus tpu-vm delete "$name" --zone "$zone" "${project_flag[@]}" --quiet
    ;;
  *)
    echo "unknown action: $action" >&2
    usage
    ;;
esac
