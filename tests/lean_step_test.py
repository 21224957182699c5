"""The memory-lean step computes what the plain one does: micro-batches (update and scoring)
give the whole mini-batch's update, and the fused step with chunked log-probs, rematerialised
blocks, blockwise attention and micro-batches all on gives the metrics and parameters of the step
with all of them off (each alone: logprobs_test, microbatch_test). Plus the micro-batch size
check at the command line, the on-policy shortcut and `python -m jrl.bench --memory`."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import step as step_lib

from jrl import train_state
from jrl.run import trainer
from jrl.models import transformer as tfm
from conftest import COMPILE_FLAGS, REPO, assert_same_run, run_steps, tiny_config
from helpers.steps import assert_same_update, built_phases


# One CPU device, with the tests' compile settings (tests/conftest.py).
ONE_DEVICE = f"--xla_force_host_platform_device_count=1 {COMPILE_FLAGS}"


# (changes to the tiny config): policy losses x aggregation modes, a KL loss, and critics.
UPDATE_CASES = {
    "vanilla-token-mean-kl": {"actor.use_kl_loss": True, "actor.entropy_coeff": 0.01},
    "gspo": {"actor.policy_loss": "gspo"},
    "geo_mean": {"actor.policy_loss": "geo_mean"},
    "cispo-seq-mean-token-sum": {
        "actor.policy_loss": "cispo",
        "actor.loss_agg_mode": "seq-mean-token-sum",
    },
    "gae-critic-seq-mean-token-mean": {
        "algorithm.adv_estimator": "gae",
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "critic.loss_agg_mode": "seq-mean-token-mean",
    },
    "gae-shared-backbone": {"algorithm.adv_estimator": "gae", "critic.share_backbone": True},
}


@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_micro_batches_give_the_update_of_the_whole_mini_batch(case):
    """One optimizer update per mini-batch of 8 rows, in 4 micro-batches of 2 or in one: the same
    parameters, critic and metrics. Scoring in micro-batches gives the same experience."""
    changes = {**UPDATE_CASES[case], "actor.ppo_mini_batch_size": 2, "data.train_batch_size": 4}
    plain_cfg = tiny_config(**changes)
    micro_cfg = tiny_config(
        **changes,
        **{
            "actor.ppo_micro_batch_size_per_device": 2,
            "critic.ppo_micro_batch_size_per_device": 4,
            "rollout.log_prob_micro_batch_size_per_device": 4,
        },
    )
    task, model_cfg, (generate, score, update) = built_phases(plain_cfg)
    _, _, (_, micro_score, micro_update) = built_phases(micro_cfg)
    key = jax.random.key(0)
    state = train_state.init_state(plain_cfg, model_cfg, tfm.init_params(model_cfg, key), key)
    batch = task.train_batch(0, 4)
    exp, _ = jax.jit(generate)(state, batch, key)
    scored, _, _ = jax.jit(score)(state, exp)
    micro_scored, _, _ = jax.jit(micro_score)(state, exp)
    for k in ("old_log_prob", "advantages", "returns", "values", "ref_log_prob"):
        if k in scored:
            np.testing.assert_allclose(micro_scored[k], scored[k], rtol=1e-5, atol=1e-6)
    assert_same_update(state, scored, key, update, micro_update)


def test_fused_step_with_everything_on_equals_everything_off():
    """Two steps of the tiny config: chunked log-probs, block remat, blockwise attention and
    micro-batches (update and scoring) change no metric and no parameter."""
    lean = {
        "model.logits_chunk_size": 3,
        "model.remat": "block",
        "model.attention": "blockwise",
        "model.attention_block_size": 4,
        "actor.ppo_micro_batch_size_per_device": 2,
        "rollout.log_prob_micro_batch_size_per_device": 4,
    }
    results = []
    for cfg in (tiny_config(), tiny_config(**lean)):
        state, metrics = run_steps(cfg, 2)
        results.append((jax.device_get(state.params), metrics))
    (want_params, want_metrics), (got_params, got_metrics) = results
    for want, got in zip(want_metrics, got_metrics):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_params, want_params
    )


def test_cli_rejects_a_micro_batch_size_before_compiling(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jrl.train",
            "--config=configs/grpo_math.py:tiny",
            f"--workdir={tmp_path / 'w'}",
            "--config.actor.ppo_micro_batch_size_per_device=3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [l for l in run.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "ppo_micro_batch_size_per_device=3" in lines[0]
    assert not (tmp_path / "w").exists()


def test_bench_memory_reports_one_json_line():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jrl.bench",
            "--memory",
            "--json",
            "--config=configs/grpo_math.py:tiny",
            "--config.actor.ppo_micro_batch_size_per_device=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XLA_FLAGS": ONE_DEVICE},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for k in ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "peak_bytes"):
        assert isinstance(report[k], int) and report[k] >= 0, k
    assert report["peak_bytes"] == (
        report["argument_bytes"]
        + report["output_bytes"]
        - report["alias_bytes"]
        + report["temp_bytes"]
    )
    assert (report["rows"], report["prompt_length"], report["response_length"]) == (16, 7, 4)
    # The train state is an argument: float32 params + Adam's two moments, at least.
    assert report["argument_bytes"] >= 3 * 4 * report["params"]


def test_on_policy_update_skips_the_old_log_prob_forward_and_changes_nothing(monkeypatch):
    """One epoch over one mini-batch: the update's own forward gives the old log-probs (no
    scoring forward of the policy); two steps give the parameters and metrics of the step that
    scores them separately."""
    from jrl import rewards

    # Scores that differ within a group, so the advantages (and the old log-probs' role in the
    # ratio) are not zero.
    parity = lambda batch, ids, mask, eos_id: (jnp.sum(ids, -1) % 3).astype(jnp.float32)
    monkeypatch.setitem(rewards.REWARDS, "parity", parity)
    cfg = tiny_config(**{"actor.ppo_mini_batch_size": 4, "actor.entropy_coeff": 0.01})
    cfg.task.reward = "parity"
    assert step_lib.on_policy_update(cfg)
    assert not step_lib.on_policy_update(tiny_config())  # two mini-batches per step
    results = []
    for shortcut in (True, False):
        monkeypatch.setattr(step_lib, "on_policy_update", lambda c, s=shortcut: s)
        built = trainer.build(cfg)
        tok, task = built.tokenizer, built.task
        reward_fn, model_cfg = built.reward_fn, built.model_cfg
        phases = step_lib.make_phases(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task))
        key = jax.random.key(0)
        state = train_state.init_state(cfg, model_cfg, tfm.init_params(model_cfg, key), key)
        exp, _ = jax.jit(phases[0])(state, task.train_batch(0, 4), key)
        scored, _, _ = jax.jit(phases[1])(state, exp)
        assert ("old_log_prob" in scored) != shortcut
        step = jax.jit(
            step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task))
        )
        metrics = []
        for i in range(2):
            state, m = step(state, task.train_batch(i, 4))
            metrics.append(jax.device_get(m))
        results.append((jax.device_get(state.params), metrics))
    want_metrics = results[1][1]
    assert abs(float(want_metrics[0]["critic/advantages/max"])) > 0.1
    assert_same_run(results[0], results[1], rtol=1e-4)


def test_bench_workload_micro_batch_and_its_override():
    """W2's update runs in micro-batches of 16 of its 128 rows (one optimizer update); the
    override (`--micro_batch`) replaces it, 0 meaning all rows at once; W1 has none."""
    from jrl.run import benchmark

    w2 = benchmark.workload_config("W2")
    assert w2.data.train_batch_size * w2.rollout.n == 128
    assert w2.actor.ppo_mini_batch_size == w2.data.train_batch_size  # one update per step
    assert w2.actor.ppo_micro_batch_size_per_device == 16
    assert benchmark.workload_config("W2", 0).actor.ppo_micro_batch_size_per_device == 0
    assert benchmark.workload_config("W2", 32).actor.ppo_micro_batch_size_per_device == 32
    assert benchmark.workload_config("W1").actor.ppo_micro_batch_size_per_device == 0
