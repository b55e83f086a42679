#!/usr/bin/env bash
# Run a config on this machine (CPU, or all local GPUs/TPU chips as one mesh).
#
# Usage:
#   launch/local.sh CONFIG.yaml [key=value ...]            # the config's whole stage chain
#   STAGES=score,train launch/local.sh CONFIG.yaml         # only these stages, in chain order
#   COMMAND=plan launch/local.sh CONFIG.yaml               # one jaxrl-llm command instead
#   CPU_DEVICES=8 launch/local.sh CONFIG.yaml mesh.fsdp=8  # 8 fake CPU devices (test meshes)
#
# The chain is the "# Stages" block of the config's header (python -m jaxrl_llm.chain CONFIG
# prints it; it is checked first, so a missing key fails before any stage runs). Overrides
# are appended to every stage that reads the config. Environment: VENV (default .venv,
# skipped if absent), STAGES, COMMAND, CPU_DEVICES (force JAX onto N host CPU devices).
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
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
if [[ -n "${COMMAND:-}" ]]; then
  exec jaxrl-llm "$COMMAND" --config "$config" "$@"
fi

python -m jaxrl_llm.chain --check "$config"
mapfile -t commands < <(python -m jaxrl_llm.chain --only "${STAGES:-}" "$config" "$@")
for command in "${commands[@]}"; do
  echo "+ $command" >&2
  bash -c "$command"
done
