"""How the step's forwards run over their rows: one description per role.

A role is one of the step's forwards: "log_prob" (the old / reference log-probs and values of a
step's B rows), "actor" and "critic" (a mini-batch's forward / backward in the update). Its
`Batching` says

  * `micro`: how many micro-batches the rows are split into (verl's sizes, in rows per device:
    rollout.log_prob_micro_batch_size_per_device, actor / critic.ppo_micro_batch_size_per_device),
    so that activations stay bounded;
  * `group`: how many consecutive rows share a prompt that the forward runs once for them (n, a
    GRPO group, with model.shared_prompt_forward where it applies; else 1);
  * `buckets`: the static response lengths each micro-batch may be trimmed to
    (model.response_buckets, then R; `jrl.buckets`), or () for none.

`plan(cfg, mesh, r)` gives every role's; `in_micro_batches` maps a forward over rows as one says
(`lax.map`), `accumulate_grads` sums a loss's gradients over them (`lax.scan`). Micro-batch i
holds row blocks i, i + k, ... (`split_rows`), so each is spread over the devices like the whole
batch, and blocks of `group` rows stay together.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec

from jrl import buckets as buckets_lib
from jrl import config as config_lib
from jrl import sharding
from jrl.models import lora as lora_lib

ROLES = ("log_prob", "actor", "critic")


@dataclasses.dataclass(frozen=True)
class Batching:
    """How one role's forward runs over its rows (see the module doc)."""

    micro: int = 1  # micro-batches
    group: int = 1  # consecutive rows per shared prompt forward (1: every row its own prompt)
    buckets: tuple[int, ...] = ()  # response lengths to trim to, the last R; (): no trimming


def plan(cfg: ml_collections.ConfigDict, mesh=None, max_new_tokens: int = 0) -> dict:
    """{role: `Batching`} of a config's step over `mesh` (None: one device) with R =
    `max_new_tokens` response slots (the buckets' last length). Raises ConfigError as
    `micro_batch_counts` does."""
    counts = micro_batch_counts(cfg, mesh)
    groups = prompt_groups(cfg, counts)
    sizes = buckets_lib.bucket_sizes(cfg.model.response_buckets, max_new_tokens)
    sizes = sizes if len(sizes) > 1 else ()
    return {role: Batching(counts[role], groups[role], sizes) for role in ROLES}


def micro_batch_counts(cfg: ml_collections.ConfigDict, mesh=None) -> dict[str, int]:
    """How many micro-batches each role's rows are split into (verl's sizes, in rows per
    device): "log_prob" a step's B rows, "actor" and "critic" a mini-batch's. A size of 0 means
    one micro-batch. Raises ConfigError, naming the field and the fix, when a size does not
    divide the rows a device holds (rows over the mesh's batch axes; no mesh: one device)."""
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


def prompt_groups(cfg: ml_collections.ConfigDict, micro: dict[str, int]) -> dict[str, int]:
    """Rows per prompt that each role's forward shares (`model.shared_prompt_forward`,
    `jrl.logprobs`): n when it is on and every micro-batch of that role (`micro`) holds whole
    groups, else 1. In the update only with one mini-batch per epoch (several are drawn row by
    row, as before: in the default demo, mini-batches of whole groups learnt less) and without
    LoRA dropout (a mask per row, prompt included)."""
    n = cfg.rollout.n
    prompts = {
        "log_prob": cfg.data.train_batch_size,
        "actor": cfg.actor.ppo_mini_batch_size,
        "critic": cfg.actor.ppo_mini_batch_size,
    }
    on = cfg.model.shared_prompt_forward and n > 1
    one_mini_batch = cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
    update_ok = one_mini_batch and not lora_lib.lora_dropout_on(cfg)
    suits = {"log_prob": True, "actor": update_ok, "critic": update_ok}
    whole = lambda name: prompts[name] % micro[name] == 0
    return {name: n if on and whole(name) and suits[name] else 1 for name in micro}


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


def _take(tree, order):
    return jax.tree.map(lambda x: x[order], tree)


def in_micro_batches(fn: Callable, rows, b: Batching):
    """fn(rows) computed `b.micro` micro-batches at a time (`lax.map`), results in row order;
    with buckets, rows ordered by response length first and each micro-batch trimmed
    (`buckets.trimmed`)."""
    order = None
    if b.buckets:
        order = buckets_lib.length_order(rows, b.micro, b.group)
        rows, fn = _take(rows, order), functools.partial(buckets_lib.trimmed, fn, sizes=b.buckets)
    if b.micro == 1:
        out = fn(rows)
    else:
        out = join_rows(jax.lax.map(fn, split_rows(rows, b.micro, b.group)), b.group)
    return out if order is None else _take(out, jnp.argsort(order))


def accumulate_grads(loss_fn: Callable, params, batch, b: Batching, *args, key=None):
    """(gradient, metrics) of `loss_fn(params, batch, *args) -> (loss, metrics)` over `batch` in
    `b.micro` micro-batches: one forward / backward each (`lax.scan`), gradients summed in
    float32; with buckets, each micro-batch's loss trimmed (rows ordered by response length
    first). The loss and every metric of a micro-batch must be its share of the whole batch's
    (normalised by the whole batch: `losses.batch_counts`), so the sums equal the whole batch's;
    a metric named "..._max" is a micro-batch's maximum, and the batch's is the largest. With a
    `key` (LoRA dropout) micro-batch i gets `loss_fn(..., key=split(key, k)[i])`."""
    if b.buckets:
        batch = _take(batch, buckets_lib.length_order(batch, b.micro, b.group))
        untrimmed = loss_fn

        def loss_fn(p, mb, *a, **kw):
            return buckets_lib.trimmed(lambda cut: untrimmed(p, cut, *a, **kw), mb, b.buckets)

    k = b.micro
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
    grads, metrics = jax.lax.scan(micro, zeros, (split_rows(batch, k, b.group), keys))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return grads, {name: _reduce(name)(m, axis=0) for name, m in metrics.items()}


def _reduce(name: str):
    """How a metric of the micro-batches makes the batch's: a maximum (a name ending in
    "_max") is the largest, every other metric (a share of the batch's) their sum."""
    return jnp.max if name.endswith("_max") else jnp.sum
