"""Logical axis names -> mesh PartitionSpecs, and host arrays -> sharded jax.Arrays.

The layer below both the model code and `jrl.sharding`: it imports nothing from jrl. Model code
names only logical axes ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers",
"expert"; see `jrl.models.transformer.logical_axes`); batches and the KV cache use "batch". Rules
map each logical axis onto mesh axes, flax style: a sequence of (logical name, mesh axis | tuple
of mesh axes | None) pairs. `jrl.sharding` builds meshes and the shardings of whole train states
on top.

The mesh axes the rules name: "data", "fsdp", "tensor" and "expert" (`OPTIONAL_MESH_AXES`: a mesh
may lack it, and then it counts as an axis of size 1, so the default 3-axis meshes need no other
rules). "expert" is expert parallelism: the experts of a sparse layer are split over it, and
everything else treats it as one more FSDP axis (rows of batches and activations, the "embed"
dimension of the other weights), as MaxText's rules do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

# Logical axis -> mesh axes. "batch" covers the leading dim of batches and of the KV cache.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", ("fsdp", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),  # the stacked decoder blocks' leading axis
    # The experts of a sparse layer (jrl.models.transformer.MoE, stacked [E, H, I]): E / ep on
    # each device of the "expert" axis (its "embed" dim then falls back to fsdp alone, a mesh axis
    # serving one dimension of an array); jrl.models.moe.dispatch sends tokens to them.
    ("expert", "expert"),
)

# Mesh axes the rules name that a mesh may lack: absent, each counts as an axis of size 1.
OPTIONAL_MESH_AXES = ("expert",)

# Logical names of a KV-cache entry [B, K, S, D] (jrl.models.transformer.init_cache).
CACHE_AXES = PartitionSpec("batch", "kv_heads", None, "head_dim")

Rules = Sequence[tuple[str, Any]]


def mesh_axes(rule) -> tuple[str, ...]:
    """A rule's target as a tuple of mesh axis names (None -> ())."""
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def logical_to_mesh(spec: PartitionSpec, rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """A logical PartitionSpec (e.g. ("embed", "mlp")) -> a mesh one (("fsdp", "tensor")).

    Every logical name must have a rule; a mesh axis already used by an earlier dimension is
    dropped from later ones (that dimension is replicated over it). No shapes are checked here;
    `fit` (and `jrl.sharding`'s shardings built with it) also fit the array's shape.
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in spec:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"logical axis {name!r} has no sharding rule; add ({name!r}, <mesh axis or None>) "
                f"to the rules (None replicates it)."
            )
        axes = tuple(a for a in mesh_axes(table[name]) if a not in used)
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def present(mesh, spec: PartitionSpec) -> PartitionSpec:
    """`spec` without the mesh axes of `OPTIONAL_MESH_AXES` that `mesh` lacks (an "expert" axis on
    a data x fsdp x tensor mesh): they count as axes of size 1."""
    out = []
    for entry in spec:
        axes = tuple(a for a in mesh_axes(entry) if a in mesh.shape or a not in OPTIONAL_MESH_AXES)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def fit(mesh: Mesh, spec: PartitionSpec, shape: Sequence[int]) -> PartitionSpec:
    """`spec` with each dimension's mesh axes cut to the longest prefix whose size divides it
    (optional mesh axes the mesh lacks dropped first: `present`)."""
    spec = present(mesh, spec)
    if len(spec) > len(shape):
        raise ValueError(
            f"sharding spec {spec} has more entries than the array's shape {tuple(shape)}; "
            "the logical axis names do not match the array."
        )
    out = []
    for dim, entry in zip(shape, spec):
        axes = mesh_axes(entry)
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(
                    f"sharding rule names mesh axis {a!r} but the mesh has axes "
                    f"{tuple(mesh.axis_names)}; map it to one of those (or None) in the rules."
                )
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def context_spec(logical: PartitionSpec, shape, rules: Rules = DEFAULT_RULES):
    """The mesh PartitionSpec of an array of `shape` with logical axes `logical` under the mesh
    in context (`jax.set_mesh`), each dim keeping only the mesh axes that divide it; None
    without a mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    return fit(mesh, logical_to_mesh(logical, rules), shape)


def context_shards(logical: str, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the mesh in context (`jax.set_mesh`) splits logical axis `logical` at most
    (the product of its rule's mesh axes); 1 without a mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    (entry,) = present(mesh, PartitionSpec(dict(rules)[logical]))
    return math.prod(mesh.shape[a] for a in mesh_axes(entry))


def constrain(x, logical: PartitionSpec, rules: Rules = DEFAULT_RULES):
    """Inside a jitted function traced under `jax.set_mesh(mesh)`: pins `x` (an array or a tree
    of same-rank arrays, e.g. the KV cache) to its logical axes' mesh sharding, each dim keeping
    only the mesh axes that divide it. Without a mesh in context it returns `x` unchanged."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(a, context_spec(logical, a.shape, rules)), x
    )


def put(tree, shardings):
    """Host arrays -> global jax.Arrays in `shardings` (a matching tree, or one sharding for all).
    Every process must pass the same values; each builds only its own devices' shards, so this
    also works across processes, where `jax.device_put` to non-addressable devices does not."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(x, sh):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda index: x[index])

    return jax.tree.map(one, tree, shardings)


__all__ = [
    "CACHE_AXES",
    "DEFAULT_RULES",
    "OPTIONAL_MESH_AXES",
    "Rules",
    "constrain",
    "context_shards",
    "context_spec",
    "fit",
    "logical_to_mesh",
    "mesh_axes",
    "present",
    "put",
]
