"""Checkpoints: exact round trips, retention, async saves, corrupt checkpoints, preemption."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jrl.run import checkpoint as ckpt_lib
from conftest import REPO

# A failed orbax read leaves an asyncio callback that complains once its event loop has closed,
# whichever test the garbage collector happens to run in; it is harmless.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@flax.struct.dataclass
class State:
    """Shaped like jrl.step.TrainState (a reference field that may be None, a typed key)."""

    step: jax.Array
    params: Any
    opt_state: Any
    ref_params: Any
    kl_coef: jax.Array
    key: jax.Array


def make_state(seed=0, width=8, with_ref=False):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "embed": jax.random.normal(k1, (4, width)),
        "layers_0": {"w": jax.random.normal(k2, (width, width)).astype(jnp.bfloat16)},
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-trivial moments and count
    ref = jax.tree.map(lambda x: x * 2, params) if with_ref else None
    return State(jnp.int32(seed), params, opt_state, ref, jnp.float32(0.5), jax.random.key(seed))


def assert_same(a, b):
    """Same pytree structure, dtypes and values (typed keys compared through their data)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def checkpointer(workdir, **kw):
    kw = {"every_steps": 1, "max_to_keep": 0, **kw}
    return ckpt_lib.Checkpointer(str(workdir), **kw)


def test_round_trip_is_exact(tmp_path):
    state = make_state(seed=3)
    with checkpointer(tmp_path) as ck:
        assert ck.save(7, state, {"next_batch": 7, "config": {"lr": 0.1}})
    with checkpointer(tmp_path) as ck:
        restored, extra, step = ck.restore_latest(jax.eval_shape(lambda: make_state()))
    assert step == 7 and extra == {"next_batch": 7, "config": {"lr": 0.1}}
    assert restored.ref_params is None
    assert jax.dtypes.issubdtype(restored.key.dtype, jax.dtypes.prng_key)
    assert_same(restored, state)
    # The restored key draws the same numbers as the original.
    np.testing.assert_array_equal(
        jax.random.uniform(restored.key, (3,)), jax.random.uniform(state.key, (3,))
    )


def test_empty_workdir_restores_nothing(tmp_path):
    with checkpointer(tmp_path) as ck:
        assert ck.restore_latest(make_state()) is None


def test_reference_is_saved_once_not_in_each_checkpoint(tmp_path):
    state = make_state(seed=1, with_ref=True)
    with checkpointer(tmp_path) as ck:
        ck.save(1, state, {})
        ck.save(2, state.replace(step=jnp.int32(2)), {})
        ck.wait()
        for step in (1, 2):
            saved = ck._manager.item_metadata(step)["state"].tree
            assert "ref_params" not in saved and "params" in saved
    assert (tmp_path / "reference" / "0" / "params").is_dir()
    target = jax.eval_shape(lambda: make_state(with_ref=True))
    with checkpointer(tmp_path) as ck:
        restored, _, step = ck.restore_latest(target)
        assert step == 2
        assert_same(restored, state.replace(step=jnp.int32(2)))
        assert_same(ck.restore_reference(target.ref_params), state.ref_params)


def test_stale_reference_of_a_run_without_checkpoints_is_replaced(tmp_path):
    with checkpointer(tmp_path) as ck:  # a run that died before its first checkpoint
        ck.save_reference(make_state(seed=1, with_ref=True).ref_params)
    state = make_state(seed=2, with_ref=True)
    with checkpointer(tmp_path) as ck:
        ck.save(1, state, {})
    with checkpointer(tmp_path) as ck:
        restored, _, _ = ck.restore_latest(jax.eval_shape(lambda: make_state(with_ref=True)))
    assert_same(restored.ref_params, state.ref_params)


def test_real_train_state_round_trip(tmp_path):
    from jrl import config as config_lib
    from jrl import train_state
    from jrl.models import transformer

    cfg = config_lib.base_config()
    cfg.actor.use_kl_loss = True  # a reference policy in the state
    model_cfg = transformer.ModelConfig(
        vocab_size=16,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=16,
    )
    params = make_state(seed=5).params  # small stand-in params: the model's init is slow on CPU
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    assert state.ref_params is not None
    with checkpointer(tmp_path) as ck:
        ck.save(5, state, {"next_batch": 5})
    init = lambda: train_state.init_state(cfg, model_cfg, params, jax.random.key(9))
    with checkpointer(tmp_path) as ck:
        restored, extra, step = ck.restore_latest(jax.eval_shape(init))
    assert (step, extra) == (5, {"next_batch": 5})
    assert_same(restored, state)


def test_every_steps_and_max_to_keep(tmp_path):
    with checkpointer(tmp_path, every_steps=2, max_to_keep=2) as ck:
        saved = [s for s in range(1, 8) if ck.maybe_save(s, make_state(seed=s), {"s": s})]
        assert saved == [2, 4, 6]
        assert ck.save(7, make_state(seed=7), {"s": 7}, force=True)
        assert not ck.save(7, make_state(seed=7), {"s": 7})  # already saved: not again
        ck.wait()
        assert ck.all_steps() == [6, 7]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [
        "6",
        "7",
    ]


def test_async_save_keeps_the_values_of_save_time(tmp_path):
    state = make_state(seed=4)
    expected = jax.tree.map(lambda x: x.copy(), state)
    with checkpointer(tmp_path, async_save=True) as ck:
        ck.save(1, state, {})
        # The next step donates the state's buffers while the files are still being written
        # (on CPU orbax's host copy aliases them, and JAX then declines the donation).
        bump = jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)
        bump(state.params)
        ck.wait()
        restored, _, _ = ck.restore_latest(jax.eval_shape(lambda: make_state()))
    assert_same(restored, expected)


def test_sharded_target_keeps_its_shardings(tmp_path):
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    row = NamedSharding(mesh, P("x", None))
    col = NamedSharding(mesh, P(None, "x"))
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), row), "key": jax.random.key(2)}
    with checkpointer(tmp_path) as ck:
        ck.save(1, state, {})
    target = {
        "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=col),
        "key": jax.eval_shape(lambda: jax.random.key(0)),
    }
    with checkpointer(tmp_path) as ck:
        restored, _, _ = ck.restore_latest(target)
    assert restored["w"].sharding == col
    np.testing.assert_array_equal(restored["w"], np.arange(64.0).reshape(8, 8))
    assert_same(restored["key"], state["key"])


def _truncate_arrays(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)


def _delete_manifest(step_dir):
    (step_dir / "state" / "manifest.ocdbt").unlink()


def _delete_extra(step_dir):
    (step_dir / "extra" / "metadata").unlink()


def _overwrite_64_bytes(step_dir, item="state"):
    """Bytes changed on disk, the sizes kept: orbax alone reads such a file without a word."""
    files = [p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d"]
    big = max(files, key=lambda p: p.stat().st_size)
    with open(big, "r+b") as f:
        f.seek(big.stat().st_size // 2 - 32)
        f.write(np.random.default_rng(0).bytes(64))


def _drop_checksums(step_dir):
    (step_dir / ckpt_lib.CHECKSUMS_FILE).unlink()


@pytest.mark.parametrize(
    "corrupt",
    [_truncate_arrays, _delete_manifest, _delete_extra, _overwrite_64_bytes, _drop_checksums],
)
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, corrupt):
    with checkpointer(tmp_path) as ck:
        for s in (1, 2, 3):
            ck.save(s, make_state(seed=s), {"s": s})
    newest = tmp_path / "checkpoints" / "3"
    corrupt(newest)
    with caplog.at_level(logging.WARNING), checkpointer(tmp_path) as ck:
        restored, extra, step = ck.restore_latest(jax.eval_shape(lambda: make_state()))
        assert (step, extra) == (2, {"s": 2})
        assert_same(restored, make_state(seed=2))
        # Set aside, not deleted, so that the resumed run can save step 3 again.
        assert not newest.exists() and (tmp_path / "checkpoints" / "3.invalid").is_dir()
        assert ck.save(3, restored, {"s": 3})
    assert any(
        "unreadable checkpoint" in r.getMessage() and str(newest) in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize("async_save", [True, False])
def test_each_checkpoint_lists_its_files_checksums(tmp_path, async_save):
    """Written in orbax's commit (the tmp directory held no checksums before): every file of the
    state / extra / meta items, with its size and CRC-32 as zlib computes it from the file."""
    import json
    import zlib

    with checkpointer(tmp_path, async_save=async_save) as ck:
        ck.save(1, make_state(with_ref=True), {"s": 1})
    for step_dir in (tmp_path / "checkpoints" / "1", tmp_path / "reference" / "0"):
        listed = json.loads((step_dir / ckpt_lib.CHECKSUMS_FILE).read_text())["files"]
        files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent != step_dir]
        assert sorted(listed) == sorted(str(p.relative_to(step_dir)) for p in files)
        assert {p.split("/")[0] for p in listed} >= {"meta"}
        for p in files:
            want = listed[str(p.relative_to(step_dir))]
            assert want == {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
        assert ckpt_lib.damage(step_dir) is None


def test_a_damaged_reference_is_one_line(tmp_path):
    with checkpointer(tmp_path) as ck:
        ck.save(1, make_state(with_ref=True), {})
    _overwrite_64_bytes(tmp_path / "reference" / "0", item="params")
    with checkpointer(tmp_path) as ck, pytest.raises(ckpt_lib.CheckpointError) as e:
        ck.restore_latest(jax.eval_shape(lambda: make_state(with_ref=True)))
    assert "\n" not in str(e.value) and "reference params" in str(e.value)
    assert "CRC-32 mismatch" in str(e.value) and "--fresh" in str(e.value)


def test_unfinished_save_is_skipped_with_a_warning(tmp_path, caplog):
    with checkpointer(tmp_path) as ck:
        for s in (1, 2):
            ck.save(s, make_state(seed=s), {"s": s})
    # What a kill during the save of step 2 leaves: orbax's tmp directory, never renamed.
    tmp = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp"
    (tmp_path / "checkpoints" / "2").rename(tmp)
    with caplog.at_level(logging.WARNING), checkpointer(tmp_path) as ck:
        _, extra, step = ck.restore_latest(jax.eval_shape(lambda: make_state()))
    assert (step, extra) == (1, {"s": 1})
    assert tmp.is_dir()  # nothing deleted
    assert any(
        "incomplete checkpoint" in r.getMessage() and str(tmp) in r.getMessage()
        for r in caplog.records
    )


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    with checkpointer(tmp_path) as ck:
        ck.save(1, make_state(), {})
    _truncate_arrays(tmp_path / "checkpoints" / "1")
    with checkpointer(tmp_path) as ck, pytest.raises(ckpt_lib.CheckpointError, match="reads back"):
        ck.restore_latest(jax.eval_shape(lambda: make_state()))
    assert (tmp_path / "checkpoints" / "1").is_dir()


def test_shape_mismatch_names_the_parameter_and_the_fix(tmp_path):
    with checkpointer(tmp_path) as ck:
        ck.save(1, make_state(width=8), {})
    with checkpointer(tmp_path) as ck, pytest.raises(ckpt_lib.CheckpointError) as e:
        ck.restore_latest(jax.eval_shape(lambda: make_state(width=16)))
    msg = str(e.value)
    assert "\n" not in msg
    assert "params/embed is (4, 8) float32 in the checkpoint but (4, 16) float32 here" in msg
    assert "--workdir" in msg and str(tmp_path / "checkpoints" / "1") in msg
    assert (tmp_path / "checkpoints" / "1").is_dir()  # a mismatch is not corruption


def test_a_checkpoint_with_per_layer_params_names_the_way_out(tmp_path):
    """Checkpoints written before the decoder layers were stacked (params/layers_0/...)."""
    with checkpointer(tmp_path) as ck:
        ck.save(1, make_state(), {})

    def stacked():
        state = make_state()
        params = {"embed": state.params["embed"], "layers": state.params["layers_0"]}
        return state.replace(params=params, opt_state=jax.eval_shape(lambda: state.opt_state))

    with checkpointer(tmp_path) as ck, pytest.raises(ckpt_lib.CheckpointError) as e:
        ck.restore_latest(jax.eval_shape(stacked))
    msg = str(e.value)
    assert "\n" not in msg and "params/layers_0/" in msg
    assert "python -m jrl.export" in msg and "--config.model.hf_path" in msg


def test_missing_reference_is_an_error(tmp_path):
    with checkpointer(tmp_path) as ck:
        ck.save(1, make_state(), {})  # written without a reference
    with checkpointer(tmp_path) as ck, pytest.raises(ckpt_lib.CheckpointError, match="reference"):
        ck.restore_latest(jax.eval_shape(lambda: make_state(with_ref=True)))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_guard_sets_flag_and_restores_handlers(sig):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with ckpt_lib.PreemptionGuard() as guard:
        assert signal.getsignal(sig) == guard._handle
        assert not guard.should_stop(0)
        os.kill(os.getpid(), sig)  # handled: the process survives, no KeyboardInterrupt
        deadline = time.monotonic() + 5  # the guard's watcher thread records it
        while not guard.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard.requested and guard.signal_name == sig.name and guard.should_stop(1)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert isinstance(ckpt_lib.Preempted(3), SystemExit)
    assert ckpt_lib.Preempted(3).code == ckpt_lib.PREEMPTED_EXIT_CODE


_STARTING = """
import os, sys, time
sys.path.insert(0, {repo!r})
from jrl.run import checkpoint as ckpt_lib

with ckpt_lib.PreemptionGuard(at_once=True) as guard:
    guard.on_exit.append(lambda: print("released", flush=True))
    with guard.writing():
        print("writing", flush=True)
        with open({path!r}, "w") as f:
            for i in range(10):
                f.write(f"line {{i}}\\n")
                f.flush()
                time.sleep(0.1)
    time.sleep(60)  # the start-up's long compile
"""


def test_a_signal_while_starting_exits_42_once_the_write_in_progress_ends(tmp_path):
    path = tmp_path / "config.json"
    script = _STARTING.format(repo=str(REPO), path=str(path))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # in the middle of the 1 s write
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == ckpt_lib.PREEMPTED_EXIT_CODE, err
    assert time.monotonic() - t < 20  # not after the 60 s "compile"
    assert path.read_text() == "".join(f"line {i}\n" for i in range(10))  # written whole
    assert out.strip() == "released" and "SIGTERM while starting: exiting now" in err


def test_the_first_signal_after_defer_is_a_request():
    with ckpt_lib.PreemptionGuard(at_once=True) as guard:
        called = []
        guard.on_request.append(lambda: called.append(1))
        guard.defer()
        os.kill(os.getpid(), signal.SIGTERM)  # handled: no exit
        deadline = time.monotonic() + 5
        while not called and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard.requested and called == [1]


# A training loop in a child process: one "step" takes a while; the parent signals it.
_LOOP = """
import os, signal, sys, time
import jax, jax.numpy as jnp
sys.path.insert(0, {repo!r})
from jrl.run import checkpoint as ckpt_lib

ck = ckpt_lib.Checkpointer({workdir!r}, every_steps=1000, max_to_keep=3)
state = {{"w": jnp.zeros((256, 256)), "step": jnp.int32(0), "key": jax.random.key(0)}}
ck.save(1, state, {{"next_batch": 1}})
ck.wait()
{before_loop}
def the_step(seconds):
    # The step's work, like a long XLA call: the main thread runs no Python code until it ends,
    # and signals go to the process's other threads (blocked in this one).
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM, signal.SIGINT}})
    time.sleep(seconds)
    signal.pthread_sigmask(signal.SIG_SETMASK, old)

with ckpt_lib.PreemptionGuard() as guard:
    print("ready", flush=True)
    for step in range(2, 10_000):
        the_step({step_seconds})
        state = {{"w": state["w"] + 1, "step": jnp.int32(step), "key": state["key"]}}
        ck.maybe_save(step, state, {{"next_batch": step}})
        if guard.should_stop(step):
            ck.save(step, state, {{"next_batch": step}}, force=True)
            ck.wait()
            ck.close()
            print("saved", step, flush=True)
            raise ckpt_lib.Preempted(step)
"""


def _start(tmp_path, before_loop="", step_seconds=0.2):
    script = _LOOP.format(
        repo=str(REPO),
        workdir=str(tmp_path),
        before_loop=textwrap.dedent(before_loop),
        step_seconds=step_seconds,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read())
    return proc


def _target():
    return {
        "w": jax.ShapeDtypeStruct((256, 256), jnp.float32),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "key": jax.eval_shape(lambda: jax.random.key(0)),
    }


def test_sigterm_finishes_the_step_saves_and_exits_42(tmp_path):
    proc = _start(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == ckpt_lib.PREEMPTED_EXIT_CODE, err
    saved_step = int(out.split()[-1])
    with checkpointer(tmp_path) as ck:
        state, extra, step = ck.restore_latest(_target())
    assert step == saved_step and extra == {"next_batch": saved_step}
    assert int(state["step"]) == saved_step
    np.testing.assert_array_equal(state["w"], np.full((256, 256), saved_step - 1, np.float32))


def test_second_signal_exits_at_once_and_keeps_committed_checkpoints(tmp_path, caplog):
    # The child starts saving step 2 and is killed before orbax commits it: the commit (the
    # rename of the tmp directory) is held back, so the kill lands at the worst moment, with all
    # of step 2's files written but not committed.
    # The child reports "ready" only once the save has reached the commit: before that, a kill
    # could land before orbax had created the tmp directory at all.
    before_loop = """
    import asyncio, threading
    from orbax.checkpoint._src.path import async_path
    real_rename = async_path.rename
    at_commit = threading.Event()
    async def slow_rename(*a, **k):
        at_commit.set()
        await asyncio.sleep(60)
        return await real_rename(*a, **k)
    async_path.rename = slow_rename
    ck.save(2, {"w": jnp.ones((256, 256)), "step": jnp.int32(2), "key": state["key"]}, {})
    assert at_commit.wait(60), "the save of step 2 never reached its commit"
    """
    proc = _start(tmp_path, before_loop=before_loop, step_seconds=60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for line in proc.stderr:  # signals sent back to back may merge: wait for the first's handler
        if "Received SIGTERM" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == ckpt_lib.FORCED_EXIT_CODE, err
    # Both signals acted in the middle of the 60 s step, not after it.
    assert time.monotonic() - t0 < 30
    tmp = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp"
    assert tmp.is_dir() and not (tmp_path / "checkpoints" / "2").exists()
    with caplog.at_level(logging.WARNING), checkpointer(tmp_path) as ck:
        state, extra, step = ck.restore_latest(_target())
    assert (step, extra) == (1, {"next_batch": 1})
    np.testing.assert_array_equal(state["w"], np.zeros((256, 256), np.float32))
    assert any(str(tmp) in r.getMessage() for r in caplog.records)
