"""The trainer on one device, on 8 devices in two mesh layouts, and as two jax.distributed
processes of 4 devices each: the same metrics and parameters, within float32 tolerances; a
SIGTERM to one process stops both after the same step.

The runs train on a GSM8K-style file with a Python reward (`tests/helpers/scale_rewards.py`, through
`jax.pure_callback`), so the host-side reward path is checked on every layout too."""

import json
import signal
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jrl.run import checkpoint as checkpoint_lib
from jrl.run import trainer
from jrl import train_state
from jrl.models import transformer
from conftest import GOLDEN, REPO, tiny_config

DATA = os.path.join(GOLDEN, "scale_gsm8k.jsonl")
# The tiny model with 8 prompts per step (so 8 devices can split them), no warm-up (parameters
# are created straight into their shards) and a reward that differs within groups.
OVERRIDES = {
    "total_steps": 3,
    "model.num_layers": 1,
    "warmup.sft_steps": 0,
    "data.train_batch_size": 8,
    "actor.ppo_mini_batch_size": 4,
    "task.name": "gsm8k",
    "task.train_files": DATA,
    "task.eval_files": DATA,
    "data.max_prompt_length": 128,
    "data.max_response_length": 8,
    "task.reward": "tests.helpers.scale_rewards:vowel_share",
}
# data x fsdp x tensor: every axis split at once, and the widest tensor split (the rows are split
# over data in the first; a pure data split's parameter layout is checked in tests/sharding_test.py)
MESHES = [(2, 2, 2), (1, 2, 4)]


def config(**extra):
    return tiny_config(**OVERRIDES, **extra)


def flags(workdir, **extra):
    values = {**OVERRIDES, **extra}
    return [
        "--config=configs/grpo_math.py:tiny",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in values.items()),
    ]


def launch(args, devices: int, **popen):
    """`python -m jrl.train ARGS` in a fresh process that sees `devices` CPU devices (the other
    XLA flags as in this process: the same code as the in-process runs)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    others = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*others, f"--xla_force_host_platform_device_count={devices}"])
    cmd = [sys.executable, "-m", "jrl.train", *args]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(cmd, cwd=REPO, env=env, text=True, **pipes)


def finish(proc):
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]


def rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_params(workdir):
    """The last checkpoint's policy parameters, restored onto one device (whatever mesh wrote
    them)."""
    cfg = config()
    model_cfg = trainer.build(cfg).model_cfg
    abstract = jax.eval_shape(
        lambda: train_state.init_state(
            cfg, model_cfg, transformer.init_params(model_cfg, jax.random.key(0)), jax.random.key(1)
        )
    )
    one = SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), abstract)
    with checkpoint_lib.Checkpointer(str(workdir), every_steps=0, max_to_keep=0) as ckpt:
        state, _, step = ckpt.restore_latest(target)
    assert step == 3
    return jax.device_get(state.params)


def assert_same_rows(want, got):
    """float32 tolerances, rtol 1e-5 / atol 1e-6 per metric: the meshes split the same sums into
    different partial sums, so the last bits differ (observed gaps are ~1e-7); the sampled tokens
    (score, lengths, token counts) must be identical."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):
        for name in ("critic/score/mean", "response_length/mean", "perf/total_num_tokens"):
            assert a.get(name) == b.get(name), (a["step"], name)
        for name in set(a) & set(b):
            if name.startswith(("timing_s", "perf/throughput")):
                continue
            np.testing.assert_allclose(
                b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=f"step {a['step']}: {name}"
            )


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The reference: a fresh process that sees a single CPU device (mesh 1 x 1 x 1)."""
    workdir = tmp_path_factory.mktemp("one_device")
    finish(launch(flags(workdir), devices=1))
    return workdir


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    """In this process (8 devices): one run per mesh; records the shard shapes of the
    parameters when each checkpoint is saved."""
    mp = pytest.MonkeyPatch()
    shards = {}
    save = checkpoint_lib.Checkpointer.save

    def spy(self, step, state, extra=None, **kw):
        layer = state.params["layers"]
        shards[self.directory] = {
            name: {tuple(s.data.shape) for s in x.addressable_shards}
            for name, x in [
                ("embed", state.params["embed"]),
                ("gate", layer["mlp"]["gate_proj"]),
                ("q", layer["attn"]["q_proj"]),
                ("adam_mu_embed", state.opt_state[1][0].mu["embed"]),
            ]
        }
        return save(self, step, state, extra, **kw)

    mp.setattr(checkpoint_lib.Checkpointer, "save", spy)
    out = {}
    try:
        for shape in MESHES:
            workdir = tmp_path_factory.mktemp("mesh_" + "x".join(map(str, shape)))
            trainer.run(config(**{"mesh.shape": shape}), str(workdir))
            ckpt_dir = os.path.join(str(workdir), checkpoint_lib.CHECKPOINTS_DIR)
            out[shape] = (workdir, next(v for k, v in shards.items() if str(k) == ckpt_dir))
    finally:
        mp.undo()
    return out


# Shard shapes (hidden 32, MLP 64, vocab 88, 4 heads of 8, 1 layer): embed [88, 32] is
# (tensor, fsdp), gate [1, 32, 64] (-, fsdp, tensor), q [1, 32, 4, 8] (-, fsdp, tensor, -).
EXPECTED_SHARDS = {
    (2, 2, 2): {"embed": (44, 16), "gate": (1, 16, 32), "q": (1, 16, 2, 8)},
    (1, 2, 4): {"embed": (22, 16), "gate": (1, 16, 16), "q": (1, 16, 1, 8)},
}


@pytest.mark.parametrize("shape", MESHES)
def test_meshes_match_one_device(one_device, meshes, shape):
    workdir, shards = meshes[shape]
    want = EXPECTED_SHARDS[shape]
    assert shards == {**{k: {v} for k, v in want.items()}, "adam_mu_embed": {want["embed"]}}
    ref_rows, got_rows = rows(one_device), rows(workdir)
    assert [r["step"] for r in ref_rows] == [0, 1, 2, 3]
    assert ref_rows[1]["actor/grad_norm"] > 0.1  # real updates, not rounding noise
    assert_same_rows(ref_rows, got_rows)
    # float32 parameters after 3 Adam steps: atol 1e-6 (observed gaps ~1e-8).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(b, a, rtol=0, atol=1e-6),
        final_params(one_device),
        final_params(workdir),
    )


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process_and_stop_together(meshes, tmp_path):
    """Two jax.distributed processes with 4 CPU devices each (gloo collectives), one 2x2x2 mesh
    over both: the metrics of the single-process 8-device 2x2x2 run (the learning rate is
    constant, so a longer run shares its first steps). Preemption reaches the hosts of a pod at
    different times: after step 2, a SIGTERM to process 1 only stops both processes after the
    same step, with one checkpoint of that step, exit 42."""
    port = free_port()
    args = flags(tmp_path, total_steps=200, **{"mesh.shape": (2, 2, 2)})
    procs = [
        launch(
            [*args, f"--coordinator_address=localhost:{port}", "--num_processes=2"]
            + [f"--process_id={i}"],
            devices=4,
            stdout=subprocess.DEVNULL,  # nobody reads the logs while waiting: no full pipes
            stderr=open(tmp_path / f"log{i}", "w"),
        )
        for i in range(2)
    ]
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # step 2 done
        assert all(p.poll() is None for p in procs), (tmp_path / "log0").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    for i, p in enumerate(procs):
        p.wait(timeout=300)
        assert p.returncode == 42, (tmp_path / f"log{i}").read_text()[-3000:]
    got = rows(tmp_path)  # written by process 0 only
    last = got[-1]["step"]
    assert 2 <= last < 200
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [str(last)]
    want = rows(meshes[(2, 2, 2)][0])
    n = min(len(got), len(want))
    assert n >= 3  # steps 0 (eval), 1 and 2
    assert_same_rows(want[:n], got[:n])
