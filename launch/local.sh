#!/usr/bin/env bash
# Run a jaxrl-llm command on this machine (CPU, or all local GPUs/TPU chips as one mesh).
#
# Usage:
#   launch/local.sh CONFIG.yaml [key=value ...]            # jaxrl-llm train on this host
#   COMMAND=plan launch/local.sh CONFIG.yaml               # any other command
#   CPU_DEVICES=8 launch/local.sh CONFIG.yaml mesh.fsdp=8  # 8 fake CPU devices (test meshes)
#
# Environment: VENV (default .venv, skipped if absent), COMMAND (default train),
# CPU_DEVICES (force JAX onto N host CPU devices).
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
config=$1
shift

venv=${VENV:-.venv}
if [[ -f "$venv/bin/activate" ]]; then
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
fi
if [[ -n "${CPU_DEVICES:-}" ]]; then
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${CPU_DEVICES}"
fi
exec jaxrl-llm "${COMMAND:-train}" --config "$config" "$@"
