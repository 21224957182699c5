"""The shared-prompt forward (`model.shared_prompt_forward`): running each group's prompt once
and its n responses over the prompt's keys and values gives the full forward's log-probs,
values and gradients; scoring and the update are
those of the full forward; `prompt_group` turns it off where it does not apply. (The fused step
with it on against the lean step, where it is off: lean_step_test.)"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import batching, logprobs
from jrl import step as step_lib
from jrl import train_state
from jrl.models import transformer as tfm

from conftest import tiny_config
from helpers import tiny_decoders
from helpers.steps import assert_same_update, built_phases

# Llama-like with a value head; Gemma-like: sliding-window layers (window 3 < prompt +
# response), attention and final softcaps, qk norm
LLAMA = tiny_decoders.CFG
GEMMA = dataclasses.replace(tiny_decoders.GEMMA_CFG, value_head=True)


def _groups(seed=0, g=3, n=2, p=5, r=6, vocab=37):
    """g left-padded prompts of different lengths, each repeated for its n rows (`jnp.repeat`
    order, as the rollout lays them out), and n right-padded responses per prompt."""
    rng = np.random.default_rng(seed)
    pmask = np.ones((g, p), np.int32)
    pmask[1, :2] = 0
    pmask[2, :4] = 0  # a one-token prompt
    prompt = rng.integers(1, vocab, (g, p)).astype(np.int32) * pmask
    rmask = (np.arange(r)[None] < rng.integers(1, r + 1, (g * n, 1))).astype(np.int32)
    resp = rng.integers(1, vocab, (g * n, r)).astype(np.int32) * rmask
    rows = lambda x: np.repeat(x, n, axis=0)
    return tuple(jnp.asarray(x) for x in (rows(prompt), rows(pmask), resp, rmask))


@pytest.mark.parametrize("cfg", [LLAMA, GEMMA], ids=["llama", "gemma"])
def test_grouped_forward_gives_the_full_forwards_outputs_and_gradients(cfg):
    n = 2
    batch = _groups(n=n, vocab=cfg.vocab_size)
    mask = np.asarray(batch[3], bool)
    params = tiny_decoders.random_params(cfg)

    @functools.partial(jax.jit, static_argnums=1)  # one compile each, not op by op
    def outputs(params, group):
        out = logprobs.response_outputs(cfg, params, *batch, 0.8, with_entropy=True, group=group)
        return out, jnp.sum(out["log_prob"] * batch[3]) + jnp.sum(out["values"] * batch[3])

    assert logprobs.grouped_forward_suits(cfg, 11)
    grads = jax.jit(jax.grad(lambda q, group: outputs(q, group)[1]), static_argnums=1)
    grad = lambda group: grads(params, group)
    want, got = outputs(params, 1)[0], outputs(params, n)[0]
    for k in ("log_prob", "entropy", "values"):  # at the response's real tokens
        np.testing.assert_allclose(np.asarray(got[k])[mask], np.asarray(want[k])[mask], atol=2e-5)
    assert np.abs(np.asarray(want["log_prob"])[mask]).min() > 1e-3  # not trivially equal
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), grad(n), grad(1))
    # A prompt's gradient is the sum over its rows: break one row's prompt and it shows.
    other = (batch[0].at[1, -1].set(batch[0][1, -1] % (cfg.vocab_size - 1) + 1), *batch[1:])
    moved = jax.jit(lambda q: logprobs.response_outputs(cfg, q, *other, 0.8, group=1))(params)
    moved = moved["log_prob"]
    assert np.abs(np.asarray(moved - want["log_prob"])[1][mask[1]]).max() > 1e-4


def test_prompt_groups_is_n_only_where_every_micro_batch_holds_whole_groups():
    # the tiny preset: 4 prompts x n 4; one mini-batch of all 4 prompts
    cfg = tiny_config(**{"actor.ppo_mini_batch_size": 4})
    n = cfg.rollout.n
    assert n > 1
    micro = {"log_prob": 1, "actor": 1, "critic": 1}
    assert batching.prompt_groups(cfg, micro) == {k: n for k in micro}
    split = {"log_prob": 1, "actor": 8, "critic": 4}  # actor: half a group per micro-batch
    assert batching.prompt_groups(cfg, split) == {"log_prob": n, "actor": 1, "critic": n}
    two = tiny_config(**{"actor.ppo_mini_batch_size": 2})  # two mini-batches: rows drawn at random
    assert batching.prompt_groups(two, micro) == {"log_prob": n, "actor": 1, "critic": 1}
    off = tiny_config(**{"model.shared_prompt_forward": False})
    assert batching.prompt_groups(off, micro) == {k: 1 for k in micro}
    single = tiny_config(**{"rollout.n": 1})
    assert batching.prompt_groups(single, micro) == {k: 1 for k in micro}
    dropout = tiny_config(**{"actor.ppo_mini_batch_size": 4, "lora.rank": 4, "lora.dropout": 0.1})
    assert batching.prompt_groups(dropout, micro) == {"log_prob": n, "actor": 1, "critic": 1}


def test_grouped_forward_is_off_with_remat_or_blockwise_attention():
    assert not logprobs.grouped_forward_suits(dataclasses.replace(LLAMA, remat="block"), 11)
    blockwise = dataclasses.replace(LLAMA, attention="blockwise", attention_block_size=4)
    assert not logprobs.grouped_forward_suits(blockwise, 11)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_update_with_the_shared_prompt_forward_equals_the_full_forwards(estimator):
    """Scoring and the update (2 epochs of one mini-batch in 4 micro-batches): same experience,
    metrics and parameters with the shared-prompt forward on and off (then rows in random order)."""
    changes = {
        "algorithm.adv_estimator": estimator,
        "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size_per_device": 4,  # one group of 4 rows
        "critic.ppo_micro_batch_size_per_device": 4,
        "rollout.log_prob_micro_batch_size_per_device": 8,
        "actor.ppo_epochs": 2,  # not on-policy: the old log-prob forward runs
    }
    on_cfg = tiny_config(**changes)
    off_cfg = tiny_config(**changes, **{"model.shared_prompt_forward": False})
    task, model_cfg, (generate, score, update) = built_phases(on_cfg)
    _, _, (_, off_score, off_update) = built_phases(off_cfg)
    ids = {"eos_id": 0, "pad_id": 0, "max_new_tokens": 1}
    assert step_lib.make_spec(on_cfg, model_cfg, None, **ids).batching["actor"].group > 1
    key = jax.random.key(0)
    state = train_state.init_state(on_cfg, model_cfg, tfm.init_params(model_cfg, key), key)
    exp, _ = jax.jit(generate)(state, task.train_batch(0, on_cfg.data.train_batch_size), key)
    scored, _, _ = jax.jit(score)(state, exp)
    off_scored, _, _ = jax.jit(off_score)(state, exp)
    mask = np.asarray(scored["response_mask"], bool)
    for k in ("old_log_prob", "ref_log_prob", "values"):
        if k in scored:
            np.testing.assert_allclose(
                np.asarray(scored[k])[mask], np.asarray(off_scored[k])[mask], atol=1e-5
            )
    assert_same_update(state, scored, key, off_update, update)
