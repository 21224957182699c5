"""The step tests' shared pieces (lean_step_test, shared_prompt_test): a config's step phases, and
two update phases compared on the same scored batch."""

import jax
import jax.numpy as jnp
import numpy as np

from jrl import step as step_lib
from jrl.run import trainer


def built_phases(cfg, mesh=None):
    """(task, model config, (generate, score, update)) of `cfg`: the step's phases, each to jit
    on its own (`step.make_phases`)."""
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    phases = step_lib.make_phases(
        cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task), mesh=mesh
    )
    return task, model_cfg, phases


def assert_same_update(state, scored, key, want_update, got_update):
    """Two update phases give `scored` (with random advantages and returns: a fresh model rarely
    earns a reward) the same metrics and parameters, and do move the parameters."""
    rng = np.random.default_rng(0)
    mask = np.asarray(scored["response_mask"], np.float32)
    for k in ("advantages", "returns"):
        scored[k] = jnp.asarray(rng.standard_normal(mask.shape).astype(np.float32) * mask)
    want_state, want_m = jax.jit(want_update)(state, scored, key)
    got_state, got_m = jax.jit(got_update)(state, scored, key)
    assert set(got_m) == set(want_m)
    for k in want_m:
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # Adam's first step moves a weight by ~lr * g / (|g| + eps): for a gradient entry near eps the
    # summation order (of micro-batches, of a prompt's rows) shifts it by a few 1e-6 (lr 1e-3); a
    # lost or doubled micro-batch would move weights by ~lr.
    for name in ("params", "critic_params"):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
            getattr(got_state, name),
            getattr(want_state, name),
        )
    moved = jax.tree.leaves(
        jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), want_state.params, state.params)
    )
    assert max(moved) > 1e-4  # the update did change the parameters
