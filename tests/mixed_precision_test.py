"""bfloat16 compute over float32 master weights (`model.dtype="bfloat16"`,
`model.param_dtype="float32"`): the weights, optimizer state and updates stay float32 while the
matmuls run in bfloat16."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jrl import step as step_lib

from jrl import train_state
from jrl.run import trainer
from jrl.models import transformer
from conftest import tiny_config, tiny_model

F32 = tiny_model(32, intermediate_size=64)
BF16 = dataclasses.replace(F32, dtype="bfloat16")


def test_bfloat16_forward_is_close_to_float32_and_grads_are_float32():
    params = transformer.init_params(BF16, jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 32)
    exact = transformer.forward(F32, params, ids)
    mixed = transformer.forward(BF16, params, ids)
    assert mixed.dtype == jnp.float32  # logits come back in float32
    gap = float(jnp.max(jnp.abs(mixed - exact)))
    # bfloat16 keeps 8 significant bits: a relative rounding of 2**-8 ~ 4e-3 per operation, so the
    # logits (of size ~1) differ by ~1e-2, never by 0 (the matmuls did run in bfloat16) and far
    # less than the logits' own spread.
    assert 1e-4 < gap < 0.1, gap
    assert float(jnp.std(exact)) > 10 * gap

    def loss(p, cfg):
        return jnp.mean(jax.nn.logsumexp(transformer.forward(cfg, p, ids), -1))

    g16, g32 = jax.grad(loss)(params, BF16), jax.grad(loss)(params, F32)
    for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0.1, atol=0.02 * float(jnp.max(jnp.abs(b))) + 1e-6)


def test_fused_step_in_bfloat16_keeps_float32_state():
    cfg = tiny_config()
    cfg.warmup.sft_steps = 0
    cfg.model.dtype, cfg.model.param_dtype = "bfloat16", "float32"
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    assert model_cfg.dtype == "bfloat16"
    params = trainer.initial_params(cfg, model_cfg, jax.random.key(0))
    state = train_state.init_state(cfg, model_cfg, params, jax.random.key(1))
    step = jax.jit(
        step_lib.make_step(cfg, model_cfg, reward_fn, **trainer.sampling_ids(tok, task)),
        donate_argnums=0,
    )
    for i in range(2):
        state, metrics = step(state, task.train_batch(i, step_lib.prompts_per_step(cfg)))
    dtypes = {x.dtype for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim}
    assert dtypes == {jnp.dtype(jnp.float32)}
    metrics = jax.device_get(metrics)
    assert all(math.isfinite(float(v)) for v in metrics.values())
