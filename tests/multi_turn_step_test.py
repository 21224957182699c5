"""Multi-turn rollouts inside the fused step (docs/multi_turn.md#in-the-step): with
rollout.multi_turn off the step is the one before multi-turn (its values); on, the training
forward attends over tool tokens (the sampler's log-probs of model tokens in later turns are the
forward's), nothing at tool positions reaches the gradients, the score sits on the last model
token, the step compiles once for any number of turns, and failing tools are answered and counted
while the run goes on.

The tiny demo config (character tokenizer, `compact` format). Its random model seldom writes a
call, so the tests make `<` and `>` likely and keep the model's outputs context-dependent
(`calling_params`): dimension 0 of every embedding is 1 and 1 + `boost` for `<` and `>`; the
layers neither read it (norm scales 0 there) nor write it, so the final hidden state keeps it and
the tied head adds to the logits of `<` and `>`; the rest of the embedding and the attention's
value and output weights are scaled up so that the context matters."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import GOLDEN, tiny_config
from helpers import faulty_tools
from jrl import logprobs
from jrl import step as step_lib
from jrl import shaping
from jrl import train_state
from jrl.run import trainer

MULTI_TURN = {
    "warmup.sft_steps": 0,
    "data.max_response_length": 20,
    "rollout.multi_turn.enable": True,
    "rollout.multi_turn.format": "compact",
    "rollout.multi_turn.max_tool_response_length": 4,
    "rollout.multi_turn.max_assistant_turns": 4,
}


def varied_reward(batch, response_ids, response_mask, *, eos_id):
    """A reward that differs between rows (the tiny task's own is 0 for a random model)."""
    return (jnp.sum(response_ids * response_mask, -1) % 3).astype(jnp.float32) / 2


def calling_params(cfg, model_cfg, tok, boost=2.0, scale=5.0, attention=10.0):
    """The initial params with `<` and `>` made likely (see the module docstring)."""
    assert not model_cfg.norm_unit_offset  # norm scales multiply: 0 hides a dimension
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    calls = jnp.array([tok.convert_tokens_to_ids(c) for c in "<>"])
    embed = (params["embed"] * scale).at[:, 0].set(1.0).at[calls, 0].set(1.0 + boost)
    layers = jax.tree.map(lambda x: x, params["layers"])
    for norm in ("input_norm", "post_attn_norm"):
        layers[norm]["scale"] = layers[norm]["scale"].at[:, 0].set(0.0)
    layers["attn"]["v_proj"] = layers["attn"]["v_proj"] * attention
    layers["attn"]["o_proj"] = (layers["attn"]["o_proj"] * attention).at[..., 0].set(0.0)
    layers["mlp"]["down_proj"] = layers["mlp"]["down_proj"].at[..., 0].set(0.0)
    return {**params, "embed": embed, "layers": layers}


# ---------------------------------------------------------------------------------------------
# Off: the step before multi-turn.

# Two steps of `reference_run` computed on the code before multi-turn rollouts were wired into the
# step (commit 04d438e, `git worktree add ... 04d438e`, this function run there on CPU): every
# metric of the second step and, per parameter leaf, its sum and sum of squares (float64). On the
# machines this was checked on, the two trees give the same bits (sha256 of the parameters and
# metrics equal); the bits differ between CPU types, so the test compares values within rtol.
REFERENCE = os.path.join(GOLDEN, "multi_turn_off_reference.json")


def reference_run(name):
    """Two fused steps of the tiny `name` config from fixed keys: ({metric: float}, [[sum, sum of
    squares] per parameter leaf])."""
    cfg = tiny_config(name, **{"warmup.sft_steps": 0})
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    ids = trainer.sampling_ids(tok, task, cfg)
    step = jax.jit(step_lib.make_step(cfg, model_cfg, varied_reward, **ids))
    for i in range(2):
        state, metrics = step(state, task.train_batch(i, step_lib.prompts_per_step(cfg)))
    leaves = [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(state.params)]
    return (
        {k: float(v) for k, v in sorted(metrics.items())},
        [[float(x.sum()), float((x * x).sum())] for x in leaves],
    )


@pytest.mark.parametrize("name", ["grpo_math", "ppo_math"])
def test_off_is_the_step_before_multi_turn(name):
    assert not tiny_config(name).rollout.multi_turn.enable
    with open(REFERENCE) as f:
        want = json.load(f)[name]
    metrics, params = reference_run(name)
    assert sorted(metrics) == sorted(want["metrics"])
    for key, value in want["metrics"].items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(params, want["params"], rtol=1e-5, atol=1e-6)


def test_the_score_sits_on_the_last_model_token():
    """Hand-worked rows: holes (tool tokens) before the end, a tool block at the end of a full
    row, a row without holes (as before: at sum(mask) - 1), an empty row (no score)."""
    mask = jnp.array([[1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0], [0] * 6])
    got = shaping.last_token_scores(jnp.array([2.0, 3.0, 4.0, 5.0]), mask)
    want = np.zeros((4, 6), np.float32)
    want[0, 4], want[1, 3], want[2, 2] = 2.0, 3.0, 4.0
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# On: the forwards, the gradients.


@pytest.fixture(scope="module")
def scored():
    """A multi-turn rollout of the tiny config (calc; every forward over the full, masked
    prompt + response: no shared-prompt forward, one micro-batch), scored by the step's second
    phase: (spec, state, experience)."""
    cfg = tiny_config(**MULTI_TURN, **{"model.shared_prompt_forward": False})
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    state = train_state.init_state(
        cfg, model_cfg, calling_params(cfg, model_cfg, tok), jax.random.key(1)
    )
    ids = trainer.sampling_ids(tok, task, cfg)
    spec = step_lib.make_spec(cfg, model_cfg, varied_reward, **ids)
    generate, advantages, _ = (
        jax.jit(f) for f in step_lib.make_phases(cfg, model_cfg, varied_reward, **ids)
    )
    exp, _ = generate(state, task.train_batch(0, step_lib.prompts_per_step(cfg)), jax.random.key(2))
    exp, _, _ = advantages(state, exp)
    return spec, state, jax.device_get(exp)


def tool_tokens(exp):
    return (exp["response_valid"] == 1) & (exp["response_mask"] == 0)


def test_the_experience_of_a_multi_turn_rollout(scored):
    """Tool tokens exist in later turns (model tokens after them); the masks nest; the reward got
    the model's final turn (its tokens after the last tool token, written out here in numpy):
    varied_reward of those, plus the tools' rewards (calc: 0)."""
    _, _, exp = scored
    tool = tool_tokens(exp)
    model_after_tool = (exp["response_mask"] == 1) & (np.cumsum(tool, -1) > 0)
    assert tool.sum() > 0 and model_after_tool.sum() > 0
    assert np.all(exp["response_valid"] >= exp["response_mask"])
    assert np.all(exp["rollout_log_prob"][tool] == 0)
    ids, model = np.asarray(exp["response_ids"]), np.asarray(exp["response_mask"])
    final = model.copy()
    for b in range(len(final)):
        tool_at = np.flatnonzero(tool[b])
        if len(tool_at):
            final[b, : tool_at[-1] + 1] = 0
    assert (final.sum(-1) < model.sum(-1)).any()  # some rows' earlier turns are not read
    want = (np.sum(ids * final, -1) % 3) / 2 + exp["tool_reward"]
    np.testing.assert_allclose(exp["scores"], want, rtol=0, atol=0)
    assert exp["num_turns"].min() >= 2 and exp["assistant_turns"].max() >= 2


def test_the_training_forward_attends_over_tool_tokens(scored):
    """The sampler's log-probs of model tokens, in every turn, equal the old log-probs of the
    step's own scoring forward (float32), and those of the shared-prompt (grouped) forward: both
    read the tool tokens as context. (Attending over response_mask alone, the model tokens after
    a tool block differed.)"""
    spec, state, exp = scored
    model = exp["response_mask"] == 1
    np.testing.assert_allclose(
        exp["old_log_prob"][model], exp["rollout_log_prob"][model], rtol=0, atol=1e-5
    )
    grouped = logprobs.response_outputs(
        spec.model_cfg,
        state.params,
        exp["input_ids"],
        exp["attention_mask"],
        exp["response_ids"],
        exp["response_valid"],
        group=spec.n,
    )["log_prob"]
    np.testing.assert_allclose(
        np.asarray(grouped)[model], exp["rollout_log_prob"][model], rtol=0, atol=1e-5
    )


def policy_grads(spec, exp):
    """`grads(params, where)`, jitted once: gradients of the update's policy loss (one mini-batch
    of every row) with the log-probs and entropies at `where` [B, R] perturbed by a term of the
    hidden state (a path of its own into every parameter)."""
    keys = ["input_ids", "attention_mask", "response_ids", "response_mask", "response_valid"]
    keys += ["advantages", "old_log_prob", "ref_log_prob"]
    mb = {k: jnp.asarray(exp[k]) for k in keys if k in exp}
    counts = step_lib.mini_batch_counts(spec, mb)
    original = logprobs.token_log_probs

    def grads(params, where):
        def perturbed(model_cfg, hidden, head, targets, *args):
            log_prob, entropy, *extra = original(model_cfg, hidden, head, targets, *args)
            noise = where * 5.0 * jnp.tanh(jnp.sum(hidden, -1))
            entropy = None if entropy is None else entropy + noise
            return (log_prob + noise, entropy, *extra)

        logprobs.token_log_probs = perturbed  # while tracing
        try:
            loss = lambda p: step_lib.actor_loss(p, mb, spec, counts, None, 1.0, jax.random.key(3))
            return jax.grad(loss, has_aux=True)(params)[0]
        finally:
            logprobs.token_log_probs = original

    return jax.jit(grads)


def test_perturbing_the_outputs_at_tool_positions_leaves_the_gradients_unchanged(scored):
    """The policy loss, KL loss and entropy read tool positions through response_mask (0): noise
    there changes no gradient; the same noise at model positions does (the check can fail)."""
    spec, state, exp = scored
    assert np.any(exp["advantages"] != 0)
    grads = policy_grads(spec, exp)
    at = lambda where: jax.device_get(grads(state.params, jnp.asarray(where, jnp.float32)))
    base = at(np.zeros_like(exp["response_mask"]))
    at_tools = at(tool_tokens(exp))
    at_model = at(exp["response_mask"] == 1)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(at_tools)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    moved = [
        np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(at_model))
    ]
    assert max(moved) > 1e-3


# ---------------------------------------------------------------------------------------------
# On: the fused step over several steps, with a tool that fails.


def test_one_compile_any_turns_and_failing_tools_are_answered_and_counted():
    """Three steps of the fused step with a tool whose calls answer, raise and sleep past the
    limit in turn: one compile, turns per row differ between steps, every call that slept is a
    time-out in the metrics, every call that raised an error (with the malformed calls), the
    update is finite."""
    cfg = tiny_config(
        **MULTI_TURN,
        **{
            "rollout.multi_turn.tools": "helpers.faulty_tools:flaky",
            "rollout.multi_turn.tool_timeout": 0.25,
        },
    )
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    state = train_state.init_state(
        cfg, model_cfg, calling_params(cfg, model_cfg, tok), jax.random.key(1)
    )
    step = jax.jit(
        step_lib.make_step(cfg, model_cfg, varied_reward, **trainer.sampling_ids(tok, task, cfg))
    )
    faulty_tools.reset()
    seen = []
    for i in range(3):
        state, metrics = step(state, task.train_batch(i, step_lib.prompts_per_step(cfg)))
        seen.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    assert step._cache_size() == 1
    assert len({m["num_turns/mean"] for m in seen}) > 1, [m["num_turns/mean"] for m in seen]
    counts = faulty_tools.COUNTS
    assert counts["raised"] > 0 and counts["slept"] > 0
    assert sum(m["tool_calls/timeouts"] for m in seen) == counts["slept"]
    assert sum(m["tool_calls/errors"] for m in seen) >= counts["raised"]
    rows = cfg.data.train_batch_size * cfg.rollout.n
    calls = sum(m["tool_call_counts/mean"] * rows for m in seen)
    assert calls >= counts["calls"]  # the tool's calls, and the malformed ones it never got
    for m in seen:
        assert m["training/step_skipped"] == 0 and np.isfinite(m["actor/pg_loss"])
        assert 0 < m["tool_calls/response_token_share"] < 1
        assert m["timing_s/tool_host"] > 0
    assert any(m["actor/grad_norm"] > 0 for m in seen)


def test_the_greedy_eval_counts_tool_calls_per_answer():
    """`make_eval` with a tool host reports calls per answer: the tool blocks in the greedy
    answers (runs of tool tokens: valid, not the model's), counted here from the rollout's masks
    instead of the host's stats; 0 errors from `calc` on what it parses, and none of it without
    tools."""
    cfg = tiny_config(**MULTI_TURN)
    built = trainer.build(cfg)
    tok, task, model_cfg = built.tokenizer, built.task, built.model_cfg
    params = calling_params(cfg, model_cfg, tok)
    ids = trainer.sampling_ids(tok, task, cfg)
    batch = task.eval_batch()
    metrics = jax.jit(trainer.make_eval(model_cfg, varied_reward, **ids))(params, batch)
    out, valid, _ = jax.jit(
        lambda p, b: step_lib.sample_and_score(
            model_cfg, varied_reward, p, b, jax.random.key(0), greedy=True, **ids
        )
    )(params, batch)
    tool = (np.asarray(valid) > 0) & (np.asarray(out.response_mask) == 0)
    blocks = (tool[:, 1:] & ~tool[:, :-1]).sum(1) + tool[:, 0]  # starts of tool-token runs
    assert blocks.sum() > 0
    assert float(metrics["val/tool_calls"]) == pytest.approx(blocks.mean())
    assert float(metrics["val/tool_errors"]) >= 0
    one_turn = {**ids, "tool_host": None}
    plain = jax.jit(trainer.make_eval(model_cfg, varied_reward, **one_turn))(params, batch)
    assert "val/tool_calls" not in plain
