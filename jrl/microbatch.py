"""Micro-batches: a forward or a forward / backward over many rows, run a few rows at a time so
that activations stay bounded (verl's micro-batch sizes, in rows per device).

`micro_batch_counts(cfg, mesh)` turns the config's sizes into counts; `in_micro_batches` maps a
function over micro-batches (`lax.map`); `accumulate_grads` sums a loss's gradients over them
(`lax.scan`). Micro-batch i holds row blocks i, i + k, ... (`split_rows`), so each is spread over
the devices like the whole batch, and blocks of `group` rows (a GRPO group sharing its prompt)
stay together.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec

from jrl import config as config_lib
from jrl import sharding


def micro_batch_counts(cfg: ml_collections.ConfigDict, mesh=None) -> dict[str, int]:
    """How many micro-batches each forward / backward is split into (verl's sizes, in rows per
    device): "log_prob" (old / reference log-probs and values of a step's B rows,
    rollout.log_prob_micro_batch_size_per_device), "actor" and "critic" (a mini-batch's rows,
    actor / critic.ppo_micro_batch_size_per_device). A size of 0 means one micro-batch. Raises
    ConfigError, naming the field and the fix, when a size does not divide the rows a device
    holds (rows over the mesh's batch axes; no mesh: one device)."""
    n = cfg.rollout.n
    sizes = {
        "log_prob": ("rollout.log_prob_micro_batch_size_per_device", cfg.data.train_batch_size * n),
        "actor": ("actor.ppo_micro_batch_size_per_device", cfg.actor.ppo_mini_batch_size * n),
        "critic": ("critic.ppo_micro_batch_size_per_device", cfg.actor.ppo_mini_batch_size * n),
    }
    counts = {}
    for name, (field, rows) in sizes.items():
        size = cfg[field.split(".")[0]][field.split(".")[1]]
        per_device = (
            rows if mesh is None else sharding.batch_sharding(mesh, rows).shard_shape((rows,))[0]
        )
        if size < 0 or (size and per_device % size):
            raise config_lib.ConfigError(
                f"{field}={size} does not divide the {per_device} rows each device holds "
                f"({rows} rows over {rows // per_device} device(s)); use a divisor of "
                f"{per_device}, or 0 for one micro-batch."
            )
        counts[name] = per_device // size if size else 1
    return counts


def split_rows(tree, k: int, group: int = 1):
    """[rows, ...] -> [k, rows / k, ...] in blocks of `group` consecutive rows: micro-batch i
    holds blocks i, i + k, i + 2k, ..., so each is spread over the devices like the whole batch
    (pinned there under a mesh) and keeps a group's rows together."""

    def split(x):
        blocks = x.reshape(x.shape[0] // (k * group), k, group, *x.shape[1:]).swapaxes(0, 1)
        return blocks.reshape(k, -1, *x.shape[1:])

    return sharding.constrain(jax.tree.map(split, tree), PartitionSpec(None, "batch"))


def join_rows(tree, group: int = 1):
    """The inverse of `split_rows`."""

    def join(x):
        k = x.shape[0]
        blocks = x.reshape(k, -1, group, *x.shape[2:]).swapaxes(0, 1)
        return blocks.reshape(-1, *x.shape[2:])

    return jax.tree.map(join, tree)


def in_micro_batches(fn: Callable, rows, k: int, group: int = 1):
    """fn(rows) computed k micro-batches at a time (`lax.map`), results in row order."""
    if k == 1:
        return fn(rows)
    return join_rows(jax.lax.map(fn, split_rows(rows, k, group)), group)


def accumulate_grads(loss_fn: Callable, params, batch, k: int, *args, key=None, group: int = 1):
    """(gradient, metrics) of `loss_fn(params, batch, *args) -> (loss, metrics)` over `batch` in k
    micro-batches: one forward / backward each (`lax.scan`), gradients summed in float32. The loss
    and every metric of a micro-batch must be its share of the whole batch's (normalised by the
    whole batch: `losses.batch_counts`), so the sums equal the whole batch's. With a `key` (LoRA
    dropout) micro-batch i gets `loss_fn(..., key=split(key, k)[i])`. `group`: see `split_rows`."""
    grad_fn = jax.grad(loss_fn, has_aux=True)
    keys = None if key is None else jax.random.split(key, k)
    with_key = lambda kk: {} if kk is None else {"key": kk}
    if k == 1:
        return grad_fn(params, batch, *args, **with_key(None if keys is None else keys[0]))

    def micro(acc, xs):
        mb, kk = xs
        grads, metrics = grad_fn(params, mb, *args, **with_key(kk))
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    grads, metrics = jax.lax.scan(micro, zeros, (split_rows(batch, k, group), keys))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return grads, jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)
