"""Multi-turn rollouts in the fused step with the `hermes` format (docs/multi_turn.md): malformed
and refused tool calls are answered with an error block and counted while the run goes on, and
the multi-turn rollout under ReMax (its greedy baseline), DAPO (dynamic sampling), LoRA and a
mesh of host devices.

The model is the scripted one of tests/helpers/hermes_script.py: every assistant turn is
`<tool_call> BODY </tool_call> <|im_end|>` with BODY sampled among `BODIES` (greedy: `good`), and
each row makes `TURNS` assistant turns. A `Recorder` around the host keeps every pause's inputs
and results: the tests check the blocks and the step's metrics against hand-written answers."""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from helpers.hermes_script import (
    BODIES,
    HERMES,
    R,
    TURNS,
    Recorder,
    ids_of,
    scripted_model,
    scripted_reward,
)
from helpers.tools_fixtures import TOOL_BLOCK, qwen_style_tokenizer
from jrl import sharding
from jrl import step as step_lib
from jrl import train_state
from jrl.run import trainer
from jrl.tools.host import make_tool_host

# The tool message each body gets, written out by hand (calc's answer, the host's refusals).
ANSWERS = {
    "good": "408",
    "bad_json": "error: invalid JSON in tool call: Expecting ',' delimiter at char 53",
    "unknown": "error: unknown tool 'nope'; the tools are calc",
    "wrong_args": "error: calc is missing argument(s) expression",
}


@pytest.fixture(scope="module")
def tok():
    return qwen_style_tokenizer(extra_tokens=list(BODIES.values()))


def body_of(tok, turn_ids):
    """The name of the body in a turn's tokens."""
    names = [n for n, t in zip(BODIES, ids_of(tok, *BODIES.values())) if t in turn_ids]
    assert len(names) == 1, tok.decode(turn_ids)
    return names[0]


def rollouts(tok, pauses, rows):
    """The rollouts of `rows` rows among the recorded pauses, in order, each checked: the block of
    every waiting row is the hand-written tool message of its call, and the last turn's call is
    not run. Each rollout: [(response ids, the names of the calls run)] per row."""
    out, done, names = [], {}, [[] for _ in range(rows)]
    for (ids, length, start, waiting, turns), result in pauses:
        if len(length) != rows:
            continue
        for i in np.flatnonzero(waiting):
            turn = ids[i, start[i] : length[i]].tolist()
            assert turn[0] == tok.convert_tokens_to_ids("<tool_call>") and len(turn) == 4
            if turns[i] == TURNS:  # the last turn: not run, the row ends
                assert result.finished[i] and result.block_len[i] == 0
                done[i] = ids[i, : length[i]].tolist()
                continue
            name = body_of(tok, turn)
            block = tok.decode(result.block_ids[i, : result.block_len[i]].tolist())
            assert block == TOOL_BLOCK.format(ANSWERS[name]) and not result.finished[i]
            names[i].append(name)
        if len(done) == rows:
            out.append([(done[i], names[i]) for i in range(rows)])
            done, names = {}, [[] for _ in range(rows)]
    assert not done, "a rollout left rows unfinished"
    return out


def refused(names) -> int:
    return sum(name != "good" for name in names)


def score(response) -> float:
    """scripted_reward of what the reward reads of a response, in numpy: the model's final turn,
    its last assistant turn (every row ends at the pause of that 4-token turn, its call not run)
    after the last tool block."""
    return float(np.sum(response[-4:]) % 3) / 2


def make(tok, on_mesh: bool = False, **changes):
    """(config, recorder, jitted fused step, initial state, mesh or None) of the tiny config with
    HERMES and `changes`; `on_mesh`: over a (data 2, fsdp 2) mesh of 4 host devices."""
    cfg = tiny_config(**HERMES, **changes)
    model_cfg, params = scripted_model(cfg, tok)
    host = Recorder(make_tool_host(cfg, tok, max_response_length=R))
    ids = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, max_new_tokens=R, tool_host=host)
    init = lambda: train_state.init_state(cfg, model_cfg, params, jax.random.key(1))  # noqa: E731
    if on_mesh:
        mesh = sharding.make_mesh(shape=(2, 2, 1), devices=jax.devices()[:4])
        jitted = trainer.jit_step(cfg, model_cfg, scripted_reward, ids, mesh, init)
        state = jax.jit(init, out_shardings=jitted.state_sh)()
        return cfg, host, jitted.step_fn, state, mesh
    step = jax.jit(step_lib.make_step(cfg, model_cfg, scripted_reward, **ids))
    return cfg, host, step, init(), None


def run(cfg, step, state, mesh, index=0):
    """One step on the task's batch `index`: (state, metrics on the host)."""
    batch = trainer.build(cfg).task.train_batch(index, step_lib.prompts_per_step(cfg))
    with jax.set_mesh(mesh) if mesh is not None else _nothing():
        state, metrics = step(state, batch)
    return state, {k: float(v) for k, v in jax.device_get(metrics).items()}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *_):
        return False


# ---------------------------------------------------------------------------------------------


def test_malformed_calls_are_answered_and_counted_under_remax_with_lora(tok):
    """Two ReMax steps with LoRA adapters (on o_proj and down_proj: what the scripted model's
    output reads), one compile. Each step: every call with bad JSON, an unknown tool or wrong
    arguments is answered with its error block (checked token for token in `rollouts`), the row
    goes on to its next turn, and `tool_calls/errors` counts those calls; the greedy baseline is
    itself a multi-turn rollout (`good` in each turn) whose score is the hand-written greedy
    response's, and the mean advantage is the samples' mean score minus it (every row has 3 x 4
    model tokens: the token mean is the row mean). The frozen base is untouched, the adapters
    train."""
    cfg, host, step, state, mesh = make(
        tok,
        **{
            "algorithm.adv_estimator": "remax",
            "lora.rank": 4,
            "lora.target_modules": "o_proj,down_proj",
        },
    )
    base_before = jax.device_get(state.ref_params)
    adapters_before = jax.device_get(state.params)
    b_p, n = cfg.data.train_batch_size, cfg.rollout.n
    turn = "<tool_call>" + BODIES["good"] + "</tool_call><|im_end|>"
    by_hand = tok.encode((turn + TOOL_BLOCK.format("408")) * 2 + turn, add_special_tokens=False)
    kinds = set()
    for i in range(2):
        host.pauses.clear()
        state, metrics = run(cfg, step, state, mesh, index=i)
        (samples,) = rollouts(tok, host.pauses, b_p * n)
        (greedy,) = rollouts(tok, host.pauses, b_p)
        assert metrics["tool_calls/errors"] == sum(refused(names) for _, names in samples) > 0
        assert metrics["tool_call_counts/min"] == TURNS - 1  # every row called twice ...
        assert metrics["num_turns/min"] == 1 + TURNS + TURNS - 1  # ... and ended at the limit
        assert all(response == by_hand and names == ["good"] * 2 for response, names in greedy)
        scores = np.array([score(response) for response, _ in samples])
        assert metrics["critic/score/mean"] == pytest.approx(scores.mean())
        assert metrics["critic/advantages/mean"] == pytest.approx(scores.mean() - score(by_hand))
        assert metrics["training/step_skipped"] == 0 and metrics["actor/grad_norm"] > 0
        kinds |= {name for _, names in samples for name in names}
    assert kinds == set(BODIES)
    assert step._cache_size() == 1
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(state.ref_params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    moved = [
        np.max(np.abs(a - np.asarray(b)))
        for a, b in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(state.params))
    ]
    assert max(moved) > 0


def test_dynamic_sampling_over_multi_turn_rollouts_on_a_mesh(tok):
    """DAPO's dynamic sampling (groups whose scores differ, up to 2 rounds of prompts) on a
    (data 2, fsdp 2) mesh of host devices: every round is a checked multi-turn rollout, the
    step's rounds are the rollouts the host saw, and the errors counted are those of the groups
    kept (signal groups of every round in order, then the first round's others)."""
    cfg, host, step, state, mesh = make(
        tok,
        on_mesh=True,
        **{
            "algorithm.filter_groups.enable": True,
            "algorithm.filter_groups.metric": "score",
            "algorithm.filter_groups.max_num_gen_batches": 2,
        },
    )
    state, metrics = run(cfg, step, state, mesh)
    b_p, n = cfg.data.train_batch_size, cfg.rollout.n
    rounds = rollouts(tok, host.pauses, b_p * n)
    assert metrics["training/num_gen_batches"] == len(rounds)
    signal, others = [], []
    for k, rollout in enumerate(rounds):
        for g in range(b_p):
            group = rollout[g * n : (g + 1) * n]
            scores = [score(response) for response, _ in group]
            errors = sum(refused(names) for _, names in group)
            if max(scores) > min(scores):
                signal.append(errors)
            elif k == 0:
                others.append(errors)
    kept = (signal + others)[:b_p]
    assert metrics["training/filled_groups_ratio"] == min(len(signal), b_p) / b_p
    assert metrics["tool_calls/errors"] == sum(kept)
    assert metrics["training/step_skipped"] == 0 and np.isfinite(metrics["actor/pg_loss"])
