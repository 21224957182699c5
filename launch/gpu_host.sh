#!/usr/bin/env bash
# Train on one host with all its GPUs: one process, JAX sees every local GPU and the step is
# sharded over them by the config's mesh (mesh=gpu8: one host with 8 GPUs).
#
# Usage (from the repository root, after `pip install -e '.[cuda]'`):
#   launch/gpu_host.sh                                             # built-in demo on 8 GPUs
#   WORKDIR=runs/q05 CONFIG=configs/grpo_math.py:model=qwen2.5-0.5b,data=gsm8k,mesh=gpu8 \
#     launch/gpu_host.sh --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct \
#       --config.task.train_files=/data/gsm8k/train.parquet \
#       --config.task.eval_files=/data/gsm8k/test.parquet
#   MAX_RESTARTS=50 WORKDIR=runs/q05 launch/gpu_host.sh ...      # rerun after a preemption (42)
#   CUDA_VISIBLE_DEVICES=0,1,2,3 CONFIG=configs/grpo_math.py launch/gpu_host.sh   # 4 of the GPUs
#   DRY_RUN=1 launch/gpu_host.sh                                   # print the command, run nothing
# The arguments go to the trainer after --config and --workdir (later flags win).
#
# Settings (environment variables):
#   CONFIG        config file and presets           (configs/grpo_math.py:mesh=gpu8)
#   WORKDIR       output directory, local or gs://   (runs/<config name>/<time>, fixed for reruns)
#   PYTHON        the Python that has jrl installed  (python)
#   MAX_RESTARTS  reruns after exit 42 (preempted: SIGTERM, checkpoint written, or a SIGTERM while
#                 it started); each rerun resumes from the workdir's newest checkpoint; other
#                 statuses (2 bad input, 3 NaN guard, 4 write error, 5 reward error) end it  (0)
#   XLA_PYTHON_CLIENT_MEM_FRACTION  share of GPU memory JAX takes at start  (0.90)
#   XLA_FLAGS     extra XLA flags; --xla_gpu_enable_latency_hiding_scheduler=true is added
#   JAX_COMPILATION_CACHE_DIR       persistent compilation cache: reruns skip compiling
#                                   (~/.cache/jrl/jax)
#   DRY_RUN=1     print the environment and the command instead of running them
#
# SIGTERM or Ctrl-C (SIGINT) to this script is passed to the trainer as SIGTERM: it finishes the
# step, writes a checkpoint and exits 42; no rerun follows. A second one stops it at once (43).
# launch/multinode_gpu.sh runs this script on every node with the coordinator flags.
set -euo pipefail

CONFIG="${CONFIG:-configs/grpo_math.py:mesh=gpu8}"
config_name="$(basename "${CONFIG%%:*}" .py)"
WORKDIR="${WORKDIR:-runs/$config_name/$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
DRY_RUN="${DRY_RUN:-0}"

log() { echo "[gpu_host] $*" >&2; }
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "error: MAX_RESTARTS=$MAX_RESTARTS is not a whole number" >&2
  exit 1
fi

# GPU settings; each keeps a value already set.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}" # JAX default: 0.75
if [[ "${XLA_FLAGS:-}" != *xla_gpu_enable_latency_hiding_scheduler* ]]; then
  # Overlap collectives (all-gathers, reductions) with compute across the GPUs.
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_latency_hiding_scheduler=true"
fi
cache_home="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$cache_home/jrl/jax}"

cmd=("$PYTHON" -m jrl.train --config="$CONFIG" --workdir="$WORKDIR" "$@")

# quote WORD...: the words as one shell command line (plain words stay plain, others in '...').
quote() {
  local out=() w
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+=("$w")
    else
      out+=("'${w//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

if [[ "$DRY_RUN" == 1 ]]; then
  for var in XLA_PYTHON_CLIENT_MEM_FRACTION XLA_FLAGS JAX_COMPILATION_CACHE_DIR; do
    echo "+ export $var=$(quote "${!var}")"
  done
  echo "+ $(quote "${cmd[@]}")"
  exit 0
fi

stopping=0
child=
# Forward SIGTERM / SIGINT to the trainer as SIGTERM (a background child ignores SIGINT).
on_signal() {
  stopping=1
  [[ -n "$child" ]] && kill -TERM "$child" 2>/dev/null || true
}
trap on_signal TERM INT

log "workdir: $WORKDIR"
restarts=0
while :; do
  "${cmd[@]}" &
  child=$!
  rc=0
  wait "$child" || rc=$?
  while kill -0 "$child" 2>/dev/null; do # a signal interrupted `wait`: the trainer is checkpointing
    rc=0
    wait "$child" || rc=$?
  done
  child=
  if [[ "$rc" != 42 || "$stopping" == 1 ]] || ((restarts >= MAX_RESTARTS)); then
    if [[ "$rc" == 42 ]]; then
      log "exit 42: the same command resumes from the newest checkpoint in $WORKDIR"
    fi
    exit "$rc"
  fi
  restarts=$((restarts + 1))
  log "exit 42 (preempted): rerun $restarts of $MAX_RESTARTS, resuming from $WORKDIR"
done
