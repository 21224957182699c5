"""Multi-turn rollout: masks and offsets of tool blocks, log-probs against a full forward over
model and tool tokens, single-turn parity with `rollout.generate`, one compile for any number
of turns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import multi_turn, rollout, sharding
from jrl.models import transformer as tfm
from conftest import sample, tiny_model
from helpers.scripted_host import CALL, EOS, K, PAD, PMASK, PROMPTS, ScriptedHost, turn_result

CFG = tiny_model(11)
P = PROMPTS.shape[1]


@pytest.fixture(scope="module")
def params():
    # Small random weights: close to uniform over 11 tokens, so stop ids come up often.
    return tfm.init_params(CFG, jax.random.key(1))


class RuleHost:
    """A tool that answers every CALL with a block of 1 + (turns % 4) tokens (9, 10, 9, 10 ...)
    and ends a row at EOS or at its `max_turns`-th model turn; records every appended block
    as (row, start slot, tokens)."""

    block_size, stop_ids, stat_names = K, (EOS, CALL), ("calls",)

    def __init__(self, max_turns):
        self.max_turns, self.appended, self.calls = max_turns, [], 0

    def __call__(self, ids, length, turn_start, waiting, turns):
        b = ids.shape[0]
        self.calls += 1
        blocks, finished = {}, np.zeros(b, bool)
        for row in np.flatnonzero(waiting):
            last = ids[row, length[row] - 1]
            if last == EOS or turns[row] >= self.max_turns:
                finished[row] = True
                continue
            blocks[row] = [9, 10, 9, 10][: 1 + turns[row] % 4]
            self.appended.append((row, int(length[row]), blocks[row]))
        stats = waiting.astype(np.float32)[:, None]
        return turn_result(b, blocks, finished, np.zeros(b, np.float32), stats)


def run(params, host, key, r, temperature=1.0, force_ids=None):
    ids = dict(max_new_tokens=r, eos_id=EOS, pad_id=PAD)
    options = dict(host=host, temperature=temperature, force_ids=force_ids)
    return sample(multi_turn.generate, CFG, params, PROMPTS, PMASK, key, **ids, **options)


def full_forward_logprobs(params, ids_BR, valid_BR, temperature):
    """log pi(y_t | prompt, y_<t) from one full forward over prompt + response, attending to
    every valid response token (model and tool alike), positions numbered straight through."""
    ids = jnp.concatenate([jnp.asarray(PROMPTS), jnp.asarray(ids_BR)], 1)
    mask = jnp.concatenate([jnp.asarray(PMASK), jnp.asarray(valid_BR)], 1)
    logits = np.asarray(tfm.forward(CFG, params, ids, mask), np.float64)[:, P - 1 : -1]
    logits = logits / temperature
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.asarray(ids_BR)[..., None], -1)[..., 0]
    return picked - logz


def test_scripted_policy_masks_tool_tokens_and_keeps_offsets(params):
    r = 12
    m, t, _ = "m", "t", None
    # (token, kind) per response slot of each row; "t" slots are filled by the host's blocks.
    layout = [
        # a call, a 3-token tool block, an answer ending at EOS (length 7)
        [(5, m), (CALL, m), (9, t), (10, t), (9, t), (6, m), (EOS, m)],
        # a call answered by 1 token; a call answered by nothing (the turn goes on); a call
        # answered by 4 tokens; EOS (length 11)
        [(CALL, m), (10, t), (4, m), (CALL, m), (5, m), (CALL, m)] + [(9, t)] * 4 + [(EOS, m)],
        # 9 model tokens, then a 4-token block of which 3 fit: the budget ends the row
        [(4, m)] * 8 + [(CALL, m), (9, t), (10, t), (9, t)],
        # a call whose block ends the episode (finished with a block)
        [(5, m), (CALL, m), (10, t), (10, t)],
    ]
    script = {
        0: [([9, 10, 9], False), ([], True)],
        1: [([10], False), ([], False), ([9, 9, 9, 9], False), ([], True)],
        2: [([9, 10, 9, 10], False)],
        3: [([10, 10], True)],
    }
    force = np.full((4, r), -1, np.int32)
    for row, slots in enumerate(layout):
        for i, (tok, kind) in enumerate(slots):
            if kind == m:
                force[row, i] = tok
    host = ScriptedHost(script)
    out = run(params, host, jax.random.key(0), r, 0.8, force_ids=jnp.asarray(force))
    ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
    valid, logps = np.asarray(out.valid), np.asarray(out.log_probs)
    for row, slots in enumerate(layout):
        n = len(slots)
        np.testing.assert_array_equal(ids[row, :n], [tok for tok, _ in slots])
        assert np.all(ids[row, n:] == PAD)
        np.testing.assert_array_equal(mask[row], [kind == m for _, kind in slots] + [0] * (r - n))
        np.testing.assert_array_equal(valid[row], np.arange(r) < n)
    assert np.all(logps[mask == 0] == 0.0)
    assert np.all(logps[mask == 1] < 0.0)
    assert all(not items for items in host.script.values())  # every scripted call was made
    np.testing.assert_array_equal(out.assistant_turns, [2, 3, 1, 1])
    np.testing.assert_array_equal(out.num_turns, [4, 6, 3, 3])  # verl's: + blocks + 1
    np.testing.assert_allclose(out.tool_reward, [1.0, 2.0, 0.5, 0.5])
    # stats summed over calls: (calls, block tokens offered)
    np.testing.assert_allclose(out.stats, [[2, 3], [4, 5], [1, 4], [1, 2]])
    # What the host saw at row 1's calls: the response so far, where the turn began, the turns.
    seen = [c for c in host.calls if c["waiting"][1]]
    np.testing.assert_array_equal([c["length"][1] for c in seen], [1, 4, 6, 11])
    np.testing.assert_array_equal([c["start"][1] for c in seen], [0, 2, 2, 10])
    np.testing.assert_array_equal([c["turns"][1] for c in seen], [1, 2, 2, 3])
    np.testing.assert_array_equal(seen[2]["ids"][1, :6], [CALL, 10, 4, CALL, 5, CALL])
    # Positions run on through the tool tokens and the cache holds them: the forced tokens'
    # log-probs are the full forward's over model and tool tokens.
    ref = full_forward_logprobs(params, ids, valid, 0.8)
    np.testing.assert_allclose(logps[mask == 1], ref[mask == 1], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def rule_gen(params):
    """One jitted multi-turn rollout over a RuleHost whose `max_turns` the tests change."""
    host = RuleHost(max_turns=3)
    traces = []

    def gen(key):
        traces.append(1)
        return run(params, host, key, 16, 0.7)

    return jax.jit(gen), host, traces


def test_log_probs_of_later_turns_equal_full_forward(rule_gen, params):
    gen, host, _ = rule_gen
    host.max_turns, host.appended = 3, []
    later_turn_tokens = 0
    for seed in range(3):
        host.appended = []
        out = gen(jax.random.key(seed))
        ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
        valid, logps = np.asarray(out.valid), np.asarray(out.log_probs)
        # response_mask is 0 exactly on the appended blocks' slots (and padding)
        tool = np.zeros_like(mask, bool)
        for row, start, block in host.appended:
            n = min(len(block), 16 - start)
            np.testing.assert_array_equal(ids[row, start : start + n], block[:n])
            tool[row, start : start + n] = True
        np.testing.assert_array_equal(mask, valid.astype(bool) & ~tool)
        assert np.all(logps[~mask.astype(bool)] == 0.0)
        ref = full_forward_logprobs(params, ids, valid, 0.7)
        np.testing.assert_allclose(logps[mask == 1], ref[mask == 1], atol=1e-5, rtol=0)
        for row, start, block in host.appended:
            later_turn_tokens += int(np.sum(mask[row, start:]))
    assert later_turn_tokens >= 5  # model tokens after tool blocks were checked


class NeverAppends:
    """Every stop (EOS only) finishes the row; nothing is ever appended."""

    block_size, stop_ids, stat_names = K, (EOS,), ()

    def __init__(self):
        self.calls = 0

    def __call__(self, ids, length, turn_start, waiting, turns):
        self.calls += 1
        b = ids.shape[0]
        return turn_result(b, {}, waiting.copy(), np.zeros(b, np.float32), np.zeros((b, 0)))


def test_host_that_never_appends_gives_the_single_turn_rollout_bit_for_bit(params):
    host = NeverAppends()
    kw = dict(max_new_tokens=8, eos_id=EOS, pad_id=PAD, temperature=0.9, top_k=8, top_p=0.95)
    many = jax.jit(
        lambda key: sample(multi_turn.generate, CFG, params, PROMPTS, PMASK, key, host=host, **kw)
    )
    one = jax.jit(lambda key: sample(rollout.generate, CFG, params, PROMPTS, PMASK, key, **kw))
    early = 0
    for seed in range(4):
        a, b = many(jax.random.key(seed)), one(jax.random.key(seed))
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.response_mask, b.response_mask)
        np.testing.assert_array_equal(a.log_probs, b.log_probs)
        np.testing.assert_array_equal(a.valid, b.response_mask)
        np.testing.assert_array_equal(a.assistant_turns, 1)
        np.testing.assert_array_equal(a.num_turns, 2)
        early += int(np.sum(np.asarray(b.response_mask).sum(-1) < 8))
    assert early > 0 and host.calls > 0  # some rows ended at EOS, so the host was called


def test_one_compile_for_any_number_of_turns(rule_gen):
    gen, host, traces = rule_gen
    turns = []
    for max_turns in (1, 2, 4):
        host.max_turns = max_turns
        turns.append(int(np.max(gen(jax.random.key(7)).assistant_turns)))
    assert len(set(turns)) >= 2, turns  # the calls really had different numbers of turns
    assert max(turns) <= 4 and turns[0] == 1
    assert len(traces) == 1


def test_sharded_rows_give_the_same_rollout(rule_gen, params):
    """Under a (data, fsdp, tensor) mesh, the host sees whole rows and the rollout is the
    unsharded one's."""
    gen, host, _ = rule_gen
    host.max_turns = 3
    want = gen(jax.random.key(5))
    mesh = sharding.make_mesh(shape=(2, 2, 2))
    other = RuleHost(max_turns=3)
    with jax.set_mesh(mesh):
        p = jax.device_put(params, sharding.param_shardings(mesh, params, tfm.logical_axes(CFG)))
        run_sharded = jax.jit(lambda p, key: run(p, other, key, 16, 0.7))
        got = jax.block_until_ready(run_sharded(p, jax.random.key(5)))  # the host's calls done
    assert other.calls > 0 and int(np.max(got.assistant_turns)) >= 2
    for name in multi_turn.MultiTurnRollout._fields:
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        if name == "log_probs":
            np.testing.assert_allclose(a, b, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)


def test_bad_host_answers_and_settings_are_named():
    class Bad(NeverAppends):
        def __call__(self, ids, length, turn_start, waiting, turns):
            out = super().__call__(ids, length, turn_start, waiting, turns)
            return out._replace(block_ids=out.block_ids[:, :2])

    call, _ = multi_turn._host_call(Bad(), 4, K, 0)
    z = np.zeros(4, np.int32)
    with pytest.raises(ValueError, match=r"block_ids has shape \(4, 2\), expected \(4, 4\)"):
        call(np.zeros((4, 6), np.int32), z, z, z.astype(bool), z)
    no_eos = type("NoEos", (NeverAppends,), {"stop_ids": (CALL,)})()
    with pytest.raises(ValueError, match="lack eos_id 2"):
        run(None, no_eos, jax.random.key(0), 6)
