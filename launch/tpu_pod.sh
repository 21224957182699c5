#!/usr/bin/env bash
# Train on a Cloud TPU VM or pod slice: create (or reuse) the TPU VM, copy this repository to every
# worker, install it, run the same `python3 -m jrl.train --distributed ...` on every worker and
# follow worker 0's log. JAX finds the coordinator, process count and process id from the TPU VM's
# metadata. Every worker writes checkpoints, so the workdir is a gs:// path shared by all of them
# (it also outlives the VM).
#
# Usage (run from anywhere inside this repository; gcloud logged in, a default project set or
# PROJECT=...):
#   WORKDIR=gs://BUCKET/runs/demo launch/tpu_pod.sh                    # = up: v4-8, built-in demo
#   WORKDIR=gs://BUCKET/runs/q7b TPU_NAME=q7b ZONE=us-east5-a ACCELERATOR_TYPE=v5p-64 SPOT=1 \
#     MAX_RESTARTS=20 ASSETS="gs://BUCKET/models/Qwen2.5-7B-Instruct gs://BUCKET/data/gsm8k" \
#     CONFIG=configs/grpo_math.py:model=qwen2.5-7b,data=gsm8k,mesh=v5p-64 \
#     launch/tpu_pod.sh up --config.model.hf_path=/tmp/jrl_assets/Qwen2.5-7B-Instruct \
#       --config.task.train_files=/tmp/jrl_assets/gsm8k/train.parquet \
#       --config.task.eval_files=/tmp/jrl_assets/gsm8k/test.parquet
#   TPU_NAME=q7b ZONE=us-east5-a launch/tpu_pod.sh logs      # follow worker 0's log (WORKER=i)
#   TPU_NAME=q7b ZONE=us-east5-a launch/tpu_pod.sh stop      # SIGTERM: checkpoint, exit 42
#   TPU_NAME=q7b ZONE=us-east5-a launch/tpu_pod.sh delete    # the gs:// workdir stays
#   DRY_RUN=1 WORKDIR=gs://b/r launch/tpu_pod.sh             # print the commands, run nothing
#
# Subcommands (the arguments after it go to the trainer, after --config and --workdir):
#   up      (default) create or reuse the VM, setup, start, follow worker 0's log until the trainer
#           exits; with MAX_RESTARTS=N a preempted run (VM preempted, or exit 42 / 43) is started
#           again on a new VM, up to N times, and resumes from the workdir's newest checkpoint
#   create  create the TPU VM unless it exists        setup   copy the code, install, copy ASSETS
#   start   start the trainer on all workers and return (Ctrl-C in `up` or `logs` does the same:
#           the run goes on)                          logs    follow a worker's log
#   stop    SIGTERM the trainer on all workers        delete  delete the TPU VM
#   status  the VM's state and the tail of worker 0's log
#
# Settings (environment variables):
#   TPU_NAME          TPU VM name                                   (jrl-$USER)
#   ZONE              zone                                          (us-central2-b)
#   ACCELERATOR_TYPE  v4-8, v4-32, v5p-64, v5litepod-16, v6e-8, ... (v4-8)
#   RUNTIME_VERSION   TPU software version           (from the accelerator: tpu-ubuntu2204-base for
#                     v4, v2-alpha-tpuv5 for v5p, v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv6e)
#   PROJECT           Google Cloud project                          (gcloud's default)
#   SPOT=1 / PREEMPTIBLE=1   a spot / preemptible VM                (off)
#   WORKDIR           gs:// output directory, required for up / start
#   CONFIG            config file and presets     (configs/grpo_math.py:mesh=ACCELERATOR_TYPE;
#                     mesh presets exist for v4-8 and v5p-64, else set --config.mesh.shape)
#   REPO_URL, GIT_REF git clone URL (and branch / commit) to install on the workers; unset: a
#                     tarball of this checkout's git HEAD (uncommitted changes are not copied)
#   ASSETS            gs:// directories copied to ASSETS_DIR/<name> on every worker at setup (HF
#                     checkpoints, data files): nothing is downloaded at run time
#   ASSETS_DIR        where ASSETS go on the workers                (/tmp/jrl_assets)
#   MAX_RESTARTS      restarts after preemption in `up`             (0)
#   RETRY_WAIT        seconds before a restart                      (60)
#   CREATE_FLAGS      more `tpu-vm create` flags (network, service account, ...), split on spaces
#   SSH_FLAGS         more `tpu-vm ssh/scp` flags (--internal-ip, --tunnel-through-iap)
#   WORKER            the worker that `logs` follows                (0)
#   DRY_RUN=1         print every command instead of running it (local commands too)
#
# On each worker the code is in ~/jrl and the run in ~/jrl_run: train.log, pid (the trainer's),
# rc (its exit status, once it exited), stopped (written by `stop`).
set -euo pipefail

TPU_NAME="${TPU_NAME:-jrl-${USER:-user}}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-8}"
case "$ACCELERATOR_TYPE" in
  v4-*) default_runtime=tpu-ubuntu2204-base ;;
  v5p-*) default_runtime=v2-alpha-tpuv5 ;;
  v5litepod-* | v5e-*) default_runtime=v2-alpha-tpuv5-lite ;;
  v6e-*) default_runtime=v2-alpha-tpuv6e ;;
  *) default_runtime=tpu-ubuntu2204-base ;;
esac
RUNTIME_VERSION="${RUNTIME_VERSION:-$default_runtime}"
PROJECT="${PROJECT:-}"
SPOT="${SPOT:-0}"
PREEMPTIBLE="${PREEMPTIBLE:-0}"
WORKDIR="${WORKDIR:-}"
CONFIG="${CONFIG:-configs/grpo_math.py:mesh=$ACCELERATOR_TYPE}"
REPO_URL="${REPO_URL:-}"
GIT_REF="${GIT_REF:-}"
ASSETS="${ASSETS:-}"
ASSETS_DIR="${ASSETS_DIR:-/tmp/jrl_assets}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
RETRY_WAIT="${RETRY_WAIT:-60}"
CREATE_FLAGS="${CREATE_FLAGS:-}"
SSH_FLAGS="${SSH_FLAGS:-}"
WORKER="${WORKER:-0}"
DRY_RUN="${DRY_RUN:-0}"

# Paths on the workers, expanded there (single quotes: $HOME is the worker's).
# shellcheck disable=SC2016
CODE='$HOME/jrl' RUN='$HOME/jrl_run'

die() {
  echo "error: $*" >&2
  exit 1
}
log() { echo "[tpu_pod] $*" >&2; }

# quote WORD...: the words as one shell command line (plain words stay plain, others in '...').
quote() {
  local out=() w
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+=("$w")
    elif [[ "$w" =~ ^(--[A-Za-z0-9_.-]+=)(.*)$ ]]; then # --flag='value'
      w="${BASH_REMATCH[2]}"
      out+=("${BASH_REMATCH[1]}'${w//\'/\'\\\'\'}'")
    else
      out+=("'${w//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

# run CMD...: run it, or print it when DRY_RUN=1 (to fd 3 = stdout, even inside $(...)).
exec 3>&1
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "+ $(quote "$@")" >&3
  else
    "$@"
  fi
}

# The flags every gcloud tpu-vm command takes.
gcloud_flags=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && gcloud_flags+=(--project="$PROJECT")
read -r -a ssh_flags <<<"$SSH_FLAGS"
read -r -a create_flags <<<"$CREATE_FLAGS"

# tpu_ssh WORKER COMMAND...: run shell commands, one after the other, on one worker or on all of
# them ("all").
tpu_ssh() {
  local worker="$1" line
  shift
  printf -v line '%s; ' "$@"
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${gcloud_flags[@]}" "${ssh_flags[@]}" \
    --worker="$worker" --command="${line%; }"
}

# The VM's state (READY, CREATING, PREEMPTED, ...), empty when it does not exist.
vm_state() {
  if [[ "$DRY_RUN" == 1 ]]; then
    run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${gcloud_flags[@]}" --format='value(state)'
    return 0 # a dry run assumes there is no VM yet
  fi
  gcloud compute tpus tpu-vm describe "$TPU_NAME" "${gcloud_flags[@]}" --format='value(state)' \
    2>/dev/null || true
}

require_workdir() {
  local why="every TPU worker writes checkpoints there and it must outlive the VM"
  local example="e.g. WORKDIR=gs://my-bucket/runs/grpo"
  [[ -n "$WORKDIR" ]] || die "WORKDIR is not set; set a gs:// path ($why), $example"
  [[ "$WORKDIR" == gs://* ]] || die "WORKDIR=$WORKDIR is not a gs:// path ($why), $example"
}

create_vm() {
  local spot=()
  [[ "$SPOT" == 1 && "$PREEMPTIBLE" == 1 ]] && die "set SPOT=1 or PREEMPTIBLE=1, not both"
  [[ "$SPOT" == 1 ]] && spot=(--spot)
  [[ "$PREEMPTIBLE" == 1 ]] && spot=(--preemptible)
  log "creating TPU VM $TPU_NAME ($ACCELERATOR_TYPE, $RUNTIME_VERSION) in $ZONE"
  run gcloud compute tpus tpu-vm create "$TPU_NAME" "${gcloud_flags[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${spot[@]}" \
    "${create_flags[@]}"
}

delete_vm() {
  log "deleting TPU VM $TPU_NAME"
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${gcloud_flags[@]}" --quiet
}

# A READY VM: reused when it is, created when there is none, recreated when it was preempted.
ensure_vm() {
  local state waited=0
  while :; do
    state="$(vm_state)"
    case "$state" in
      READY)
        log "reusing TPU VM $TPU_NAME (READY)"
        return 0
        ;;
      "")
        create_vm
        return
        ;;
      PREEMPTED | TERMINATED)
        log "TPU VM $TPU_NAME is $state"
        delete_vm || return 1
        create_vm
        return
        ;;
      STOPPED)
        run gcloud compute tpus tpu-vm start "$TPU_NAME" "${gcloud_flags[@]}"
        return
        ;;
      *) # CREATING, STARTING, RESTARTING, REPAIRING, STOPPING, DELETING, ...
        ((waited < 1800)) || {
          echo "error: TPU VM $TPU_NAME stays $state" >&2
          return 1
        }
        log "TPU VM $TPU_NAME is $state; waiting"
        sleep 30
        waited=$((waited + 30))
        ;;
    esac
  done
}

# Copy the code to every worker, install it with the tpu and gcs extras (libtpu, gcsfs for gs:// metrics), copy ASSETS.
setup() {
  local fetch root tarball asset dest
  if [[ -n "$REPO_URL" ]]; then
    fetch="rm -rf $CODE && git clone --quiet $(quote "$REPO_URL") $CODE"
    [[ -n "$GIT_REF" ]] && fetch+=" && git -C $CODE checkout --quiet $(quote "$GIT_REF")"
  else
    root="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)" || return 1
    if [[ -n "$(git -C "$root" status --porcelain --untracked-files=no)" ]]; then
      log "note: uncommitted changes are not copied (the workers get git HEAD)"
    fi
    tarball="${TMPDIR:-/tmp}/jrl-$TPU_NAME.tar.gz"
    run git -C "$root" archive --format=tar.gz -o "$tarball" HEAD || return 1
    run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:jrl.tar.gz" "${gcloud_flags[@]}" \
      "${ssh_flags[@]}" --worker=all || return 1
    fetch="rm -rf $CODE && mkdir -p $CODE && tar -xzf \$HOME/jrl.tar.gz -C $CODE"
  fi
  log "installing on all workers"
  tpu_ssh all "set -e" "$fetch" "cd $CODE" \
    "python3 -m pip install --quiet --upgrade pip" \
    "python3 -m pip install --quiet -e '.[tpu,gcs]'" || return 1
  for asset in $ASSETS; do
    [[ "$asset" == gs://* ]] || die "ASSETS entry $asset is not a gs:// path"
    dest="$ASSETS_DIR/$(basename "$asset")"
    log "copying $asset to $dest on all workers (unless it is there)"
    tpu_ssh all "set -e" "mkdir -p $(quote "$ASSETS_DIR")" \
      "[ -e $(quote "$dest") ] || gcloud storage cp -r $(quote "$asset") $(quote "$ASSETS_DIR")" ||
      return 1
  done
}

# Remote test: a trainer started by `start` is still running on this worker.
RUNNING="[ -s $RUN/pid ] && [ ! -e $RUN/rc ] && kill -0 \$(cat $RUN/pid) 2>/dev/null"

# Start the trainer on every worker in the background (nohup: it survives the ssh session).
start() {
  local train wrapper
  train="$(quote python3 -m jrl.train --distributed --config="$CONFIG" --workdir="$WORKDIR" "$@")"
  # The wrapper records the trainer's pid (for stop) and, once it exits, its status (for up).
  wrapper="$train & echo \$! > $RUN/pid; wait \$!; echo \$? > $RUN/rc"
  log "starting on all workers: $train"
  tpu_ssh all "mkdir -p $RUN" \
    "if $RUNNING; then echo \"error: a run is going on \$(hostname)\" >&2; exit 1; fi" \
    "rm -f $RUN/pid $RUN/rc $RUN/stopped" \
    "cd $CODE && nohup bash -c $(quote "$wrapper") > $RUN/train.log 2>&1 < /dev/null &"
}

# follow WORKER: stream the worker's log until its trainer exits (Ctrl-C leaves the run going).
follow() {
  tpu_ssh "$1" "for i in \$(seq 60); do [ -s $RUN/pid ] && break; sleep 1; done" \
    "tail -n +1 -F $RUN/train.log --pid=\$(cat $RUN/pid)"
}

# Follow worker 0 until the trainer exits; set RC to its exit status, to "stopped" after `stop`,
# or to "preempted" when the VM went away.
wait_for_run() {
  local out state
  if [[ "$DRY_RUN" == 1 ]]; then
    follow 0
    RC=0 # a dry run assumes the trainer finished
    return 0
  fi
  while :; do
    follow 0 || true
    out="$(tpu_ssh 0 "for i in \$(seq 30); do [ -s $RUN/rc ] && break; sleep 1; done" \
      "if [ -e $RUN/stopped ]; then echo stopped; else cat $RUN/rc; fi" 2>/dev/null |
      tail -n 1)" || true
    if [[ "$out" =~ ^([0-9]+|stopped)$ ]]; then
      RC="$out"
      return 0
    fi
    state="$(vm_state)"
    if [[ "$state" != READY ]]; then
      log "TPU VM $TPU_NAME is ${state:-gone}"
      RC=preempted
      return 0
    fi
    log "lost the log of worker 0 but the VM is READY; following again in 30s"
    sleep 30
  done
}

cmd_up() {
  local restarts=0
  require_workdir
  while :; do
    RC=failed
    if ensure_vm && setup && start "$@"; then
      log "following worker 0; Ctrl-C stops following, not the run (then: $0 logs | stop)"
      wait_for_run
    fi
    case "$RC" in
      0)
        log "done: $WORKDIR"
        return 0
        ;;
      stopped)
        log "stopped by launch/tpu_pod.sh stop; the same command resumes from the newest checkpoint"
        return 42
        ;;
      42 | 43 | preempted) ;; # preempted: restart if allowed
      failed) # creating, setting up or starting failed (the VM may have been preempted meanwhile)
        ((MAX_RESTARTS > 0)) || return 1
        ;;
      *)
        log "the trainer exited with status $RC (see the log above); not restarting"
        return "$RC"
        ;;
    esac
    if ((restarts >= MAX_RESTARTS)); then
      log "run ended: $RC; the same command resumes from the newest checkpoint in $WORKDIR"
      [[ "$RC" =~ ^[0-9]+$ ]] && return "$RC"
      [[ "$RC" == preempted ]] && return 42
      return 1
    fi
    restarts=$((restarts + 1))
    log "run ended: $RC; restart $restarts of $MAX_RESTARTS in ${RETRY_WAIT}s"
    sleep "$RETRY_WAIT"
  done
}

cmd="${1:-up}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  up) cmd_up "$@" ;;
  create)
    if [[ -n "$(vm_state)" ]]; then log "TPU VM $TPU_NAME exists; reusing it"; else create_vm; fi
    ;;
  setup) setup ;;
  start)
    require_workdir
    start "$@"
    ;;
  logs) follow "$WORKER" ;;
  stop)
    log "SIGTERM to the trainer on all workers: it finishes the step, checkpoints and exits 42"
    tpu_ssh all "touch $RUN/stopped" "kill -TERM \$(cat $RUN/pid)"
    ;;
  delete) delete_vm ;;
  status)
    run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${gcloud_flags[@]}" \
      --format='value(state,acceleratorType)'
    tpu_ssh 0 "if $RUNNING; then echo running; else echo exited: \$(cat $RUN/rc 2>/dev/null); fi" \
      "tail -n 20 $RUN/train.log 2>/dev/null || echo 'no run'"
    ;;
  -h | --help | help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *) die "unknown subcommand '$cmd'; one of: up create setup start logs stop delete status" ;;
esac
