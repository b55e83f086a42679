#!/usr/bin/env bash
# The online pipeline across two Cloud TPU slices sharing only a gs:// directory: rollout
# workers on a sampler slice, the trainer on a trainer slice (docs/online.md § Pipeline).
#
# Usage:
#   launch/tpu_pipeline.sh [--dry-run] run  TRAINER SAMPLER ZONE CONFIG.yaml gs://BUCKET/DIR [k=v ...]
#   launch/tpu_pipeline.sh [--dry-run] stop TRAINER SAMPLER ZONE
#   e.g. SAMPLER_HOSTS=2 launch/tpu_pipeline.sh --dry-run run trainer-pod sampler-pod \
#          us-west4-a configs/online_pipeline_pod.yaml gs://my-bucket/exchange
#
# Create and install each slice first with launch/tpu_pod.sh (create / install NAME ZONE).
# `run` starts, at once: `jaxrl-llm online --config CONFIG --role trainer` on every worker of
# TRAINER (one multi-host JAX job: jax.distributed detects the pod), and on host K of SAMPLER
# (K = 0 … SAMPLER_HOSTS-1) `jaxrl-llm online --config CONFIG --role worker --worker K`, each
# a single-host JAX process (TPU_HOST_BOUNDS=1,1,1 keeps a pod host's libtpu to its own chips;
# SAMPLER_ENV replaces those variables). Both sides get the same `online.exchange=DIR`,
# `online.workers=SAMPLER_HOSTS` and `online.sampler_devices=0`, then the overrides. It waits
# for all of them: the first side that fails stops the others' ssh sessions (then `stop` ends
# what still runs on the hosts); any side restarts with the same command. --dry-run prints
# every command (gcloud included) instead of running it. Environment: SAMPLER_HOSTS (default:
# counted with gcloud describe; required with --dry-run), PROJECT, REPO_DIR (~/jaxrl_llm),
# VENV (~/venv), SAMPLER_ENV.
set -euo pipefail

usage() {
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

dry_run=0
if [[ ${1:-} == --dry-run ]]; then
  dry_run=1
  shift
fi
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  usage 0
fi
[[ $# -ge 4 ]] || usage
action=$1
trainer=$2
sampler=$3
zone=$4
shift 4

project_flag=()
if [[ -n "${PROJECT:-}" ]]; then
  project_flag=(--project "$PROJECT")
fi
repo_dir=${REPO_DIR:-'~/jaxrl_llm'}
venv=${VENV:-'~/venv'}
sampler_env=${SAMPLER_ENV:-TPU_HOST_BOUNDS=1,1,1 TPU_WORKER_HOSTNAMES=localhost TPU_WORKER_ID=0}

# ssh_argv SLICE WORKER COMMAND: the gcloud command that runs COMMAND on WORKER (or all).
ssh_argv() {
  argv=(gcloud compute tpus tpu-vm ssh "$1" --zone "$zone" "${project_flag[@]}"
        "--worker=$2" --command "$3")
}

# shellcheck source=launch/sides.sh
. "$(dirname "$0")/sides.sh"

sampler_hosts() {
  if [[ -n "${SAMPLER_HOSTS:-}" ]]; then
    echo "$SAMPLER_HOSTS"
  elif ((dry_run)); then
    echo "--dry-run needs SAMPLER_HOSTS=N (the number of hosts of $sampler)" >&2
    exit 2
  else
    gcloud compute tpus tpu-vm describe "$sampler" --zone "$zone" "${project_flag[@]}" \
      --format=json | python3 -c 'import json, sys; print(len(json.load(sys.stdin)["networkEndpoints"]))'
  fi
}

case "$action" in
  run)
    [[ $# -ge 2 ]] || usage
    config=$1
    exchange=$2
    shift 2
    if [[ $exchange != gs://* ]]; then
      echo "the exchange directory must be gs://BUCKET/DIR (two slices share no disk); got $exchange" >&2
      exit 2
    fi
    python3 -m jaxrl_llm.chain --check "$config"
    workers=$(sampler_hosts)
    if ! [[ $workers =~ ^[1-9][0-9]*$ ]]; then
      echo "SAMPLER_HOSTS=$workers: expected a positive number of sampler hosts" >&2
      exit 2
    fi
    shared=(online.exchange="$exchange" online.workers="$workers" online.sampler_devices=0 "$@")
    line=$(quoted jaxrl-llm online --config "$config" --role trainer "${shared[@]}")
    ssh_argv "$trainer" all ". $venv/bin/activate && cd $repo_dir && $line"
    show_or_start trainer "${argv[@]}"
    host_env=""
    if ((workers > 1)); then
      host_env="$sampler_env "
    fi
    for ((k = 0; k < workers; k++)); do
      line=$(quoted jaxrl-llm online --config "$config" --role worker --worker "$k" "${shared[@]}")
      ssh_argv "$sampler" "$k" ". $venv/bin/activate && cd $repo_dir && ${host_env}$line"
      show_or_start "worker $k" "${argv[@]}"
    done
    ((dry_run)) && exit 0
    wait_sides || {
      status=$?
      echo "stopped; run '$0 stop $trainer $sampler $zone' to end what still runs on the hosts" >&2
      exit "$status"
    }
    ;;
  stop)
    # The online processes this launcher started (their command lines), on both slices.
    ssh_argv "$trainer" all "pkill -f '[j]axrl-llm online --config .* --role trainer' || true"
    show_or_start trainer "${argv[@]}"
    ssh_argv "$sampler" all "pkill -f '[j]axrl-llm online --config .* --role worker' || true"
    show_or_start sampler "${argv[@]}"
    ((dry_run)) || wait_sides
    ;;
  *)
    echo "unknown action: $action" >&2
    usage
    ;;
esac
