"""The launch scripts (launch/*.sh, launch/slurm_gpu.sbatch), offline: bash syntax, the commands
they print with DRY_RUN=1, their one-line errors, and their restart logic against fake gcloud /
srun / scontrol / python executables. Nothing here needs gcloud, SLURM or a GPU."""

import os
import pathlib
import signal
import subprocess
import time

import pytest

import conftest

REPO = pathlib.Path(conftest.REPO)
LAUNCH = REPO / "launch"
SCRIPTS = ["tpu_pod.sh", "gpu_host.sh", "multinode_gpu.sh", "slurm_gpu.sbatch"]


def run(script, *args, env=None, tmp_path, timeout=60):
    """Runs launch/<script> with bash in the repository root, with a clean environment plus
    `env`; returns the CompletedProcess (stdout and stderr as text)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    base = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "USER": "tester",
        "TMPDIR": str(tmp_path),
    }
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def commands(proc) -> list[str]:
    """The commands a DRY_RUN printed ('+ ...' lines), without the '+ '."""
    return [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]


def one(lines: list[str], *parts: str) -> str:
    """The only line that contains every part."""
    found = [line for line in lines if all(p in line for p in parts)]
    assert len(found) == 1, (parts, lines)
    return found[0]


def executable(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(0o755)
    return path


def assert_one_line_error(proc, *parts: str):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for part in parts:
        assert part in lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


# ---------------------------------------------------------------------------------------- TPU pod

POD_ENV = {
    "DRY_RUN": "1",
    "TPU_NAME": "pod1",
    "ZONE": "us-east5-a",
    "ACCELERATOR_TYPE": "v5p-64",
    "PROJECT": "proj",
    "SPOT": "1",
    "WORKDIR": "gs://bucket/runs/q7b",
    "CONFIG": "configs/grpo_math.py:model=qwen2.5-7b,data=gsm8k,mesh=v5p-64",
    "ASSETS": "gs://bucket/models/Qwen2.5-7B",
}


def test_tpu_pod_dry_run_prints_create_install_and_run_on_all_workers(tmp_path):
    proc = run("tpu_pod.sh", "up", "--config.total_steps=10", env=POD_ENV, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cmds = commands(proc)
    assert all(c.startswith(("gcloud ", "git ")) for c in cmds), cmds
    one(cmds, "tpu-vm describe pod1")
    create = one(cmds, "tpu-vm create pod1")
    for part in ["--zone=us-east5-a", "--project=proj", "--accelerator-type=v5p-64", "--spot"]:
        assert part in create
    assert "--version=v2-alpha-tpuv5" in create  # the runtime follows the accelerator
    one(cmds, "git -C", "archive", "HEAD")
    one(cmds, "tpu-vm scp", "--worker=all")
    one(cmds, "tpu-vm ssh pod1", "--worker=all", "pip install", "-e", ".[tpu,gcs]")
    one(cmds, "--worker=all", "gcloud storage cp -r gs://bucket/models/Qwen2.5-7B /tmp/jrl_assets")
    start = one(cmds, "--worker=all", "-m jrl.train")
    for part in [
        "--distributed",
        "--config=configs/grpo_math.py:model=qwen2.5-7b,data=gsm8k,mesh=v5p-64",
        "--workdir=gs://bucket/runs/q7b",
        "--config.total_steps=10",
        "nohup",
    ]:
        assert part in start
    one(cmds, "tpu-vm ssh pod1", "--worker=0", "tail")  # the log of worker 0 is followed


def test_tpu_pod_defaults_and_git_clone(tmp_path):
    env = {"DRY_RUN": "1", "WORKDIR": "gs://b/r", "REPO_URL": "https://example.com/jrl.git"}
    cmds = commands(run("tpu_pod.sh", env=env, tmp_path=tmp_path))
    create = one(cmds, "tpu-vm create jrl-tester")
    assert "--accelerator-type=v4-8" in create and "--version=tpu-ubuntu2204-base" in create
    assert "--spot" not in create and "--preemptible" not in create
    one(cmds, "--worker=all", "git clone --quiet https://example.com/jrl.git")
    assert not [c for c in cmds if "tpu-vm scp" in c]
    one(cmds, "--worker=all", "--config=configs/grpo_math.py:mesh=v4-8")


@pytest.mark.parametrize(
    "sub,parts",
    [
        ("logs", ["--worker=0", "tail"]),
        ("stop", ["--worker=all", "kill -TERM"]),
        ("delete", ["tpu-vm delete pod1", "--quiet"]),
        ("status", ["tpu-vm describe pod1"]),
    ],
)
def test_tpu_pod_subcommands(tmp_path, sub, parts):
    proc = run("tpu_pod.sh", sub, env={"DRY_RUN": "1", "TPU_NAME": "pod1"}, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    one(commands(proc), *parts)


@pytest.mark.parametrize("workdir", ["/tmp/run", "runs/x", ""])
def test_tpu_pod_needs_a_gs_workdir(tmp_path, workdir):
    proc = run("tpu_pod.sh", "up", env={**POD_ENV, "WORKDIR": workdir}, tmp_path=tmp_path)
    assert_one_line_error(proc, "WORKDIR", "gs://")
    assert not proc.stdout  # nothing was run (or printed)


def test_tpu_pod_unknown_subcommand(tmp_path):
    assert_one_line_error(run("tpu_pod.sh", "go", tmp_path=tmp_path), "unknown subcommand")


def test_tpu_pod_restarts_on_a_new_vm_after_preemption(tmp_path):
    """The whole `up` loop against a fake gcloud that runs the workers' commands here: the first
    run is preempted (the trainer exits 42 and the VM goes away), the VM is recreated, the same
    command runs again and finishes."""
    fake = tmp_path / "fake"
    fake.mkdir()
    executable(
        fake / "gcloud",
        """echo "$*" >> "$FAKE/calls"
case "$4" in
  describe) [ -s "$FAKE/state" ] && cat "$FAKE/state" ;;
  create) echo READY > "$FAKE/state" ;;
  delete) rm -f "$FAKE/state" ;;
  scp) cp "$5" "$HOME/${6#*:}" ;;
  ssh)
    [ "$(cat "$FAKE/state")" = READY ] || exit 255  # a preempted VM answers no ssh
    for a in "$@"; do case "$a" in --command=*) """
        """cd "$HOME" && bash -c "${a#--command=}" ;; esac; done
    ;;
esac
""",
    )
    executable(
        fake / "python3",
        """[ "$2" = jrl.train ] || exit 0  # pip
echo "$*" >> "$FAKE/train_calls"
if [ "$(wc -l < "$FAKE/train_calls")" = 1 ]; then echo PREEMPTED > "$FAKE/state"; exit 42; fi
echo "step 10 done"
""",
    )
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "FAKE": str(fake),
        "TPU_NAME": "pod1",
        "WORKDIR": "gs://bucket/run",
        "MAX_RESTARTS": "2",
        "RETRY_WAIT": "0",
    }
    proc = run("tpu_pod.sh", "up", "--config.seed=1", env=env, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    calls = (fake / "calls").read_text().splitlines()
    assert sum(" create pod1" in c for c in calls) == 2
    assert sum(" delete pod1" in c for c in calls) == 1
    train_calls = (fake / "train_calls").read_text().splitlines()
    assert len(train_calls) == 2 and train_calls[0] == train_calls[1]
    assert train_calls[0] == (
        "-m jrl.train --distributed --config=configs/grpo_math.py:mesh=v4-8 "
        "--workdir=gs://bucket/run --config.seed=1"
    )
    assert "step 10 done" in proc.stdout  # worker 0's log was streamed
    assert (tmp_path / "home" / "jrl" / "jrl" / "train.py").exists()  # the code was unpacked


# ---------------------------------------------------------------------------------- one GPU host


def test_gpu_host_dry_run(tmp_path):
    env = {"DRY_RUN": "1", "WORKDIR": "/runs/a", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    proc = run(
        "gpu_host.sh",
        "--config.rollout.n=16",
        "--config.mesh.shape=(1,8,1)",
        env=env,
        tmp_path=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    cmds = commands(proc)
    assert "export XLA_PYTHON_CLIENT_MEM_FRACTION=0.90" in cmds
    flags = one(cmds, "export XLA_FLAGS=")
    assert "--xla_dump_to=/tmp/d" in flags and "latency_hiding_scheduler=true" in flags
    assert cmds[-1] == (
        "python -m jrl.train --config=configs/grpo_math.py:mesh=gpu8 --workdir=/runs/a "
        "--config.rollout.n=16 '--config.mesh.shape=(1,8,1)'"
    )
    assert "--distributed" not in cmds[-1]  # one process: no jax.distributed


def test_gpu_host_default_workdir_is_fixed_per_invocation(tmp_path):
    proc = run(
        "gpu_host.sh", env={"DRY_RUN": "1", "CONFIG": "configs/ppo_math.py"}, tmp_path=tmp_path
    )
    assert " --config=configs/ppo_math.py --workdir=runs/ppo_math/" in commands(proc)[-1]


def fake_trainer(tmp_path, body: str) -> dict:
    """An environment whose PYTHON is a fake trainer: it appends its arguments to `calls`, then
    runs `body` (bash)."""
    python = executable(tmp_path / "python", f'echo "$*" >> "{tmp_path}/calls"\n{body}')
    return {"PYTHON": str(python), "WORKDIR": str(tmp_path / "run")}


def test_gpu_host_reruns_after_exit_42(tmp_path):
    env = fake_trainer(tmp_path, f'[ "$(wc -l < {tmp_path}/calls)" -ge 3 ] || exit 42')
    proc = run(
        "gpu_host.sh", "--config.seed=3", env={**env, "MAX_RESTARTS": "5"}, tmp_path=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 3 and len(set(calls)) == 1 and calls[0].endswith("--config.seed=3")


def test_gpu_host_without_restarts_exits_42(tmp_path):
    proc = run("gpu_host.sh", env=fake_trainer(tmp_path, "exit 42"), tmp_path=tmp_path)
    assert proc.returncode == 42
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_gpu_host_passes_sigterm_on_and_does_not_rerun(tmp_path):
    started = tmp_path / "started"
    body = f"trap 'exit 42' TERM\ntouch {started}\nwhile :; do sleep 0.05; done"
    env = {**fake_trainer(tmp_path, body), "MAX_RESTARTS": "5"}
    env.update(PATH=os.environ["PATH"], HOME=str(tmp_path))
    proc = subprocess.Popen(["bash", str(LAUNCH / "gpu_host.sh")], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 20
        while not started.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 42
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


# ----------------------------------------------------------------------- plain multi-node GPU

NODE_ENV = {
    "NUM_NODES": "4",
    "NODE_RANK": "2",
    "COORDINATOR": "10.0.0.1:8476",
    "WORKDIR": "/shared/r",
}


def test_multinode_dry_run_passes_the_coordinator_flags(tmp_path):
    proc = run(
        "multinode_gpu.sh", "--config.seed=1", env={**NODE_ENV, "DRY_RUN": "1"}, tmp_path=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    train = commands(proc)[-1]
    assert train.startswith(
        "python -m jrl.train --config=configs/grpo_math.py --workdir=/shared/r "
    )
    for part in [
        "--coordinator_address=10.0.0.1:8476",
        "--num_processes=4",
        "--process_id=2",
        "--config.seed=1",
    ]:
        assert f" {part}" in train


@pytest.mark.parametrize("missing", ["NUM_NODES", "NODE_RANK", "COORDINATOR", "WORKDIR"])
def test_multinode_names_a_missing_setting(tmp_path, missing):
    env = {k: v for k, v in NODE_ENV.items() if k != missing}
    proc = run("multinode_gpu.sh", env={**env, "DRY_RUN": "1"}, tmp_path=tmp_path)
    assert_one_line_error(proc, f"{missing} is not set")
    assert not proc.stdout


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"NODE_RANK": "4"}, "NODE_RANK=4 is not in 0 .. 3"),
        ({"NUM_NODES": "two"}, "NUM_NODES=two"),
        ({"COORDINATOR": "10.0.0.1"}, "host:port"),
    ],
)
def test_multinode_rejects_bad_values(tmp_path, bad, message):
    proc = run("multinode_gpu.sh", env={**NODE_ENV, **bad, "DRY_RUN": "1"}, tmp_path=tmp_path)
    assert_one_line_error(proc, message)


# ---------------------------------------------------------------------------------------- SLURM


def test_slurm_dry_run(tmp_path):
    env = {"DRY_RUN": "1", "WORKDIR": "/shared/r", "SLURM_GPUS_ON_NODE": "4"}
    proc = run("slurm_gpu.sbatch", "--config.seed=2", env=env, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cmds = commands(proc)
    assert "export JAX_LOCAL_DEVICE_IDS=0,1,2,3" in cmds  # all the node's GPUs, not GPU <localid>
    assert cmds[-1] == (
        "srun --ntasks-per-node=1 python -m jrl.train --distributed "
        "--config=configs/grpo_math.py --workdir=/shared/r --config.seed=2"
    )


def test_slurm_header_requeues_and_signals_before_the_time_limit():
    header = (LAUNCH / "slurm_gpu.sbatch").read_text()
    for line in ["#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --signal=TERM@"]:
        assert line in header


def test_slurm_errors(tmp_path):
    assert_one_line_error(
        run("slurm_gpu.sbatch", env={"DRY_RUN": "1"}, tmp_path=tmp_path), "WORKDIR"
    )
    proc = run("slurm_gpu.sbatch", env={"WORKDIR": "/shared/r"}, tmp_path=tmp_path)
    assert_one_line_error(proc, "sbatch")  # not inside a job


@pytest.mark.parametrize("restart_count,requeued", [("0", True), ("20", False)])
def test_slurm_requeues_after_exit_42(tmp_path, restart_count, requeued):
    fake = tmp_path / "fake"
    fake.mkdir()
    executable(fake / "srun", f'echo "$*" >> {fake}/srun.log\nexit 42')
    executable(fake / "scontrol", f'echo "$*" >> {fake}/scontrol.log')
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "WORKDIR": "/shared/r",
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": restart_count,
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    proc = run("slurm_gpu.sbatch", env=env, tmp_path=tmp_path)
    assert proc.returncode == 42, proc.stderr
    assert "--distributed" in (fake / "srun.log").read_text()
    scontrol = fake / "scontrol.log"
    assert (scontrol.read_text() == "requeue 77\n") if requeued else not scontrol.exists()
