"""Pieces of the mesh tests (sharding_test, expert_parallel_test): the shapes of an array's
shards, and a reward that differs within groups so a step's update is real."""

import jax.numpy as jnp


def shard_shapes(x):
    """The set of shapes of `x`'s addressable shards."""
    return {tuple(s.data.shape) for s in x.addressable_shards}


def varied_reward(batch, response_ids, response_mask, *, eos_id):
    """Share of response tokens divisible by 3: differs within groups, so advantages and gradients
    are real (the untrained policy scores 0 on arithmetic, leaving gradients of rounding noise)."""
    hits = jnp.sum((response_ids % 3 == 0) * response_mask, -1)
    return hits / jnp.maximum(jnp.sum(response_mask, -1), 1)
