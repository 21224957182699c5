"""Device mesh, logical axis rules, and the shardings of the train state, batches and KV cache.

Model code names only logical axes ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp",
"layers", "expert"; see `jrl.models.transformer.logical_axes`); batches use "batch". Rules map
each logical axis onto mesh axes, flax style: a sequence of (logical name, mesh axis | tuple of
mesh axes | None) pairs (the rules, `logical_to_mesh`, `constrain` and `put` live in
`jrl.partitioning`, which the model code uses too, and are re-exported here). This module takes
logical axes (trees of PartitionSpecs), never model configs, and imports nothing from
`jrl.models`. The mesh axes (`MESH_AXES`, the default; `EXPERT_MESH_AXES` with expert
parallelism):

  * "data"   pure data parallelism: batch rows split, parameters replicated;
  * "fsdp"   batch rows split AND parameters split along "embed" (ZeRO-3 / FSDP style);
  * "expert" expert parallelism: the experts of a sparse layer split (E / ep on each device,
             tokens sent to their experts' devices: `jrl.models.moe.dispatch`); for everything
             else one more FSDP axis (batch rows split, "embed" split over fsdp x expert).
             Optional: a mesh without it has none (as if of size 1);
  * "tensor" Megatron-style tensor parallelism over heads, kv heads, MLP width and vocabulary.

Not every dimension divides its mesh axes (2 kv heads over tensor=4, an odd vocabulary): such a
dimension keeps the longest prefix of its mesh axes whose size divides it, down to none at all
(that dimension is then replicated). This is checked per array, so one awkward weight is
replicated along that dimension instead of failing the whole run. A mesh axis is used at most
once per array: a later dimension mapped to an axis already taken is replicated.

Sharded init (docs/design.md#sharding-and-initialisation): `jax.eval_shape(init)` ->
`state_shardings` -> `sharded_init(init, mesh, shardings)` (= `jax.jit(init, out_shardings=...)`),
so the full parameters never sit on one host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# The logical-axis layer lives below the model code (which uses it too); re-exported here.
from jrl.partitioning import (
    CACHE_AXES,
    DEFAULT_RULES,
    Rules,
    constrain,
    context_spec,
    fit,
    logical_to_mesh,
    mesh_axes,
    present,
    put,
)

MESH_AXES = ("data", "fsdp", "tensor")
# With expert parallelism (the mesh= presets ending in -ep): tensor innermost, then expert.
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "tensor")


def known_axes(rules: Rules = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes the rules name, in the order of `EXPERT_MESH_AXES` (then any others)."""
    named = {a for _, rule in rules for a in mesh_axes(rule)}
    return tuple(a for a in EXPERT_MESH_AXES if a in named) + tuple(
        sorted(named - set(EXPERT_MESH_AXES))
    )


def make_mesh(
    axes: Sequence[str] = MESH_AXES,
    shape: Sequence[int] = (-1, 1, 1),
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh of `devices` (default: all, every process) with named `axes` of sizes `shape`.

    One size may be -1: it takes the devices the others leave. Axes are `AxisType.Auto`, so jit
    with in/out shardings propagates shardings through the step as usual.
    """
    axes, shape = tuple(axes), [int(s) for s in shape]
    devices = list(jax.devices() if devices is None else devices)
    unknown = [a for a in axes if a not in known_axes()]
    if unknown:
        raise ValueError(
            f"mesh.axes {axes}: no sharding rule maps anything onto {unknown[0]!r}; the mesh "
            f"axes are {', '.join(known_axes())}."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"mesh.axes {axes} names an axis twice; name each at most once.")
    if len(axes) != len(shape):
        raise ValueError(
            f"mesh.axes {axes} and mesh.shape {tuple(shape)} differ in length; "
            "give one size per axis."
        )
    if shape.count(-1) > 1:
        raise ValueError(
            f"mesh.shape {tuple(shape)} has more than one -1; at most one size is auto."
        )
    if any(s < 1 and s != -1 for s in shape):
        raise ValueError(f"mesh.shape {tuple(shape)} has a size below 1; use positive sizes or -1.")
    n = len(devices)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if n % known:
            raise ValueError(
                f"mesh.shape {tuple(shape)} over axes {axes}: the fixed sizes multiply to {known}, "
                f"which does not divide the {n} devices; choose sizes whose product divides {n}."
            )
        shape[shape.index(-1)] = n // known
    if math.prod(shape) != n:
        raise ValueError(
            f"mesh.shape {tuple(shape)} over axes {axes} needs {math.prod(shape)} devices but "
            f"{n} are available; make the sizes multiply to {n} (-1 = the rest)."
        )
    return jax.make_mesh(
        tuple(shape), axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices
    )


def named_sharding(mesh: Mesh, logical: PartitionSpec, shape, rules: Rules = DEFAULT_RULES):
    """NamedSharding of one array of `shape` from its logical axis names (divisibility-checked)."""
    return NamedSharding(mesh, fit(mesh, logical_to_mesh(logical, rules), shape))


def param_shardings(mesh: Mesh, abstract_params, logical_specs, rules: Rules = DEFAULT_RULES):
    """NamedShardings shaped like `abstract_params` (arrays or `jax.ShapeDtypeStruct`s), from the
    logical PartitionSpecs of `logical_specs` (`transformer.logical_axes(cfg)`)."""
    return jax.tree.map(
        lambda spec, x: named_sharding(mesh, spec, x.shape, rules),
        logical_specs,
        abstract_params,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


def mirror_shardings(mesh: Mesh, abstract_tree, abstract_params, params_sh):
    """Shardings of an optimizer state: a leaf whose tree path ends with a parameter's path and
    has that parameter's shape (Adam's mu / nu, ...) gets the parameter's sharding; every other
    leaf (step counts, norms, schedule states) is replicated."""
    table = {
        tuple(path): (x.shape, sh)
        for (path, x), sh in zip(
            jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(params_sh)
        )
    }
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path, x):
        for i in range(len(path)):
            shape, sh = table.get(tuple(path[i:]), (None, None))
            if sh is not None and shape == x.shape:
                return sh
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_tree)


def state_shardings(
    mesh: Mesh,
    abstract_state,
    policy_axes,
    critic_axes=None,
    rules: Rules = DEFAULT_RULES,
    reference_axes=None,
):
    """Shardings of a whole `jrl.train_state.TrainState` (`abstract_state = jax.eval_shape(init)`).

    Policy and reference params by the policy's logical axes, critic params by the critic's,
    optimizer states mirroring their params (`mirror_shardings`); everything else (step, KL
    coefficient, PRNG key, fields added later) replicated. `policy_axes` / `critic_axes` are
    `jrl.models.transformer.logical_axes` of the model configs of `jrl.train_state.model_configs`;
    `reference_axes` those of the reference params when they are another tree (LoRA's frozen
    base; `jrl.models.lora.state_axes` gives all three for a LoRA state).
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    out = jax.tree.map(lambda _: replicated, abstract_state)
    params = param_shardings(mesh, abstract_state.params, policy_axes, rules)
    out = out.replace(
        params=params,
        opt_state=mirror_shardings(mesh, abstract_state.opt_state, abstract_state.params, params),
    )
    if abstract_state.ref_params is not None:
        ref = params
        if reference_axes is not None:
            ref = param_shardings(mesh, abstract_state.ref_params, reference_axes, rules)
        out = out.replace(ref_params=ref)
    if abstract_state.critic_params is not None:
        if critic_axes is None:
            raise ValueError(
                "the state has critic params but critic_axes is None; pass the logical axes of "
                "the critic's model (jrl.train_state.model_configs(cfg, model_cfg)[1])."
            )
        critic = param_shardings(mesh, abstract_state.critic_params, critic_axes, rules)
        out = out.replace(
            critic_params=critic,
            critic_opt_state=mirror_shardings(
                mesh, abstract_state.critic_opt_state, abstract_state.critic_params, critic
            ),
        )
    return out


def batch_sharding(mesh: Mesh, batch_size: int | None = None, rules: Rules = DEFAULT_RULES):
    """Sharding of [B, ...] arrays (a whole batch dict): rows over the "batch" rule's mesh axes
    (data, fsdp, expert), the other dims replicated. With `batch_size`, only the mesh axes
    dividing it."""
    spec = present(mesh, logical_to_mesh(PartitionSpec("batch"), rules))
    if batch_size is not None:
        spec = fit(mesh, spec, (batch_size,))
    return NamedSharding(mesh, spec)


def cache_sharding(mesh: Mesh, shape: Sequence[int] | None = None, rules: Rules = DEFAULT_RULES):
    """Sharding of a KV-cache entry [B, K, S, D]: rows over data, fsdp (and expert), kv heads
    over tensor. One sharding serves the whole cache (every layer's "k" and "v"); with `shape`,
    each dim keeps only the mesh axes that divide it."""
    spec = present(mesh, logical_to_mesh(CACHE_AXES, rules))
    if shape is not None:
        spec = fit(mesh, spec, shape)
    return NamedSharding(mesh, spec)


def process_rows(sharding: NamedSharding, batch_size: int) -> slice:
    """The rows of a [batch_size, ...] batch placed with `sharding` that this process's devices
    hold: each host reads, tokenizes and sends only these (`global_batch`). One process: all."""
    spans = {
        (idx[0].start or 0, batch_size if idx[0].stop is None else idx[0].stop)
        for idx in sharding.addressable_devices_indices_map((batch_size,)).values()
    }
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    covered = set().union(*(range(a, b) for a, b in spans))
    if covered != set(range(lo, hi)):
        raise ValueError(
            f"this process holds rows {sorted(spans)} of the batch, not one contiguous range; "
            "order the mesh so each process's devices are adjacent along the batch axes."
        )
    return slice(lo, hi)


def global_batch(local: dict, sharding: NamedSharding, batch_size: int) -> dict:
    """One global jax.Array per field from this process's rows (`process_rows`) of each field,
    so no host holds (or reads) the whole batch."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:]))
        for k, v in local.items()
    }


def sharded_init(
    init_fn: Callable, mesh: Mesh, shardings, donate_argnums: int | Sequence[int] = ()
) -> Callable:
    """`init_fn` compiled to write its outputs straight into `shardings` (each device computes
    only its shards; no host holds the full result). Call it like `init_fn`.

    `donate_argnums`: the positional arguments whose buffers the result may reuse (`jax.jit`'s
    donation); they are deleted by the call. Building a train state from initial params, donate
    the params (`donate_argnums=0`): otherwise the caller's params, the state's policy and its
    reference copy are all alive at once at the peak. Default: nothing is donated.
    """
    jitted = jax.jit(init_fn, out_shardings=shardings, donate_argnums=donate_argnums)

    def init(*args, **kwargs):
        with jax.set_mesh(mesh):
            return jitted(*args, **kwargs)

    return init


def describe(shardings) -> dict[str, str]:
    """{"path": "PartitionSpec(...)"} of a sharding tree: for logs and debugging."""
    return {
        jax.tree_util.keystr(path): str(sh.spec)
        for path, sh in jax.tree_util.tree_leaves_with_path(shardings)
    }


__all__ = [
    "CACHE_AXES",
    "DEFAULT_RULES",
    "EXPERT_MESH_AXES",
    "MESH_AXES",
    "batch_sharding",
    "cache_sharding",
    "constrain",
    "context_spec",
    "describe",
    "global_batch",
    "known_axes",
    "logical_to_mesh",
    "make_mesh",
    "mirror_shardings",
    "named_sharding",
    "param_shardings",
    "present",
    "process_rows",
    "put",
    "sharded_init",
    "state_shardings",
]
