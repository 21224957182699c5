"""Mixture-of-experts maths (Qwen3-MoE, Mixtral): top-k softmax routing, dropless dispatch of
tokens to SwiGLU experts by grouped matmuls, and the router's load-balancing loss.

The Flax module holding the parameters is `jrl.models.transformer.MoE` (next to the dense
`MLP`, whose helpers it shares: a module here importing them would close an import cycle); it
calls the functions below. Shapes: T tokens (the rows of a batch flattened), H hidden, E experts,
I an expert's width, k experts per token (`num_experts_per_tok`).

Routing (`route`), as Hugging Face's `Qwen3MoeTopKRouter` / `MixtralTopKRouter` compute it: the
router's logits [T, E] (a linear map of the hidden state, in the compute dtype), softmax over the
experts in float32, the k largest probabilities and their experts; with `normalize` (Qwen3-MoE's
`norm_topk_prob`, always on for Mixtral) the k weights are divided by their sum. Routing replay:
given experts [T, k] chosen elsewhere (a rollout's), the block uses them instead of its own top
k, weighted by the router's probabilities at those experts, renormalised the same way; it still
reports its own top k (`Routing.experts`), so a caller can record them or count mismatches.

Dispatch (`experts_forward`) is dropless, as Hugging Face computes it (no capacity, no token
dropped, padding tokens included: they take their own rows and change no other token's output):
the T x k (token, expert) pairs are sorted by expert, each pair's hidden state gathered into its
row, and the three projections run as grouped matmuls over the E contiguous groups (one group
per expert, sizes counted from the routing); the outputs go back to their pairs' order and each
token sums its k outputs times its weights. No dense one-hot product over all experts is formed
by this code. The grouped matmul (`MATMULS`, `ModelConfig.moe_matmul`):
  * "ragged": `jax.lax.ragged_dot`. jax 0.10.2 emits XLA's ragged-dot instruction on TPU and GPU
    (its speed there not measured for jrl yet) but lowers it on CPU to one dot over an [E, T x
    k, H] masked copy of the rows: E times the work;
  * "tiled": the sorted rows in tiles of `TILE` rows, one [TILE, K] x [K, N] product for each
    (tile, group) pair that overlap, at most tiles + E - 1 of them, in a `lax.map` whose step is
    rematerialised (the backward keeps no expert's weights per step); rows of other groups are
    zeroed, so each row is one product as with ragged_dot. Work: (T x k + E x TILE) rows
    (skipping the steps past the last group with a `lax.cond` made the backward 4x slower);
  * "capacity" and "chunks": not a grouped matmul but the whole SwiGLU MLP of the experts
    (`expert_mlp`) in batches of C-row items, each batch one batched product over its items.
    "capacity": batch p takes positions p C .. p C + C - 1 of every expert's group (C =
    `capacity_rows`, twice the mean group's size as a power of two, 8 to `TILE`), so no
    expert's weights are taken out, but every batch is E x C rows and there are ceil(largest
    group / C) of them: E x the largest group in all (all tokens on one expert: E times the
    rows). "chunks": each group cut into chunks of C rows (C = `chunk_rows`, the mean group's
    size as a power of two, rounded down); the first chunk of every group is one batch in
    expert order (weights used in place), the other chunks go E / 2 a batch, each with its
    expert's weights taken out (a copy): about T x k + E x C rows in all, however unequal the
    groups. The batches run in a `while_loop` while any is left. The
    gradient is its own (`jax.custom_vjp`): the same batches, each product differentiated,
    nothing kept per batch;
  * "auto" (the default): "chunks" on CPU, "ragged" elsewhere.
On a 2-core CPU (H 256, I 512, 8 experts, top 2, float32, against a dense MLP of width 1024;
two scratch benchmarks, each timing its variants alternately in one process, 2026-11-29): the
MLP of a decode step's 128 tokens took 1.4-1.5 ms dense, 7.7 ms "tiled", 2.8 ms "capacity";
forward and backward of 1,136 tokens (an update micro-batch) 19.4-19.9 ms dense, 67.9 ms
"tiled", 36.5 ms "capacity" (C = 128; 35.9 ms with C = 64). In W2-MoE's update the routing is
far from even: a thunk profile (scripts/thunk_profile.py) counted 7.5 "capacity" batches of
C = 128 per layer and micro-batch, so its largest group held about 900 of the 2,272 pairs (a
micro-batch is two groups of 8 samples of one prompt each); there "chunks" made the update 0.52x
as long as "capacity", the rollout 0.91x (docs/performance.md, "Mixture of experts").

Expert parallelism (`dispatch`, which the block calls): where the mesh in context has an
"expert" axis (jrl/partitioning.py) of size ep > 1 dividing E, each device holds E / ep experts
and the tokens of an expert group travel a ring of its devices, each running its own experts on
them, inside `jax.shard_map`; elsewhere `experts_forward` runs over all the tokens as it is (the
same program as without the axis).
Earlier, on a 2-core CPU shared with other jobs, T x k = 4096 rows, H 256, I 512: the three
projections' forward and backward took 1.0 s ("ragged") / 0.20 s ("tiled") with 8 experts, 3.3
s / 0.28 s with 32, and a dense MLP of the same active width (k x I) 0.1 s.

The load-balancing loss (`load_balancing_loss`) is Hugging Face's `load_balancing_loss_func`
(Switch Transformer's): over the real tokens of every sparse layer together, f_e the fraction of
(token, slot) assignments of the router's own top k that go to expert e and P_e the mean router
probability of e; loss = E * sum_e f_e P_e (f_e sums to k over e, so a uniform router gives k).
Counts and probabilities are summed per layer (`routing_stats`), then normalised once by the
real tokens of all layers, as HF's accumulates them. It reads the router's own top k even under
routing replay: HF recomputes it from the logits, and so does Megatron's router under verl's
replay patch (`compute_routing_scores_for_aux_loss(logits, ...)` in
verl/utils/megatron/router_replay_patch.py). Gradients reach the router through P only.

Who adds it to a loss: Hugging Face's `*MoeForCausalLM.forward` adds `router_aux_loss_coef *
aux_loss` to the language-model loss only when `output_router_logits` is set (false in the
released Qwen3-MoE and Mixtral configs) and labels are given; `ModelConfig` keeps both fields.
verl, checked at volcengine/verl b178a3cd (2026-01-29), adds none by default: its FSDP actor
(verl/workers/actor/dp_actor.py) calls the HF model without labels or `output_router_logits`
and builds its losses from the logits alone, and its Megatron configs for Qwen2-MoE, Qwen3-MoE
and Mixtral (verl/models/mcore/config_converter.py) pass `moe_aux_loss_coeff =
router_aux_loss_coef` but `moe_router_load_balancing_type="none"` ("turn off aux_loss as it
hurts perf in RL"), which a run re-enables through `override_transformer_config`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jrl import partitioning
from jrl.registry import Registry

TILE = 128  # rows per tile of the "tiled" grouped matmul


class Routing(NamedTuple):
    """What a sparse layer reports of its routing; a model stacks it over its sparse layers
    (leading [S] axis). Shapes here are one layer's: experts [B, L, k], the rest [E] / []."""

    experts: jax.Array  # int32: each token's own top-k experts, best first (what to record)
    load: jax.Array  # float32 [E]: real tokens routed to each expert by the own top k
    probs: jax.Array  # float32 [E]: the router's probabilities summed over the real tokens
    tokens: jax.Array  # float32 []: real tokens (the valid mask's sum)


def route(logits_TE, k: int, normalize: bool, experts_TK=None):
    """(experts [T, k] int32, weights [T, k] float32, probs [T, E] float32, own top-k [T, k]).

    probs = softmax(logits) in float32; own = the k most probable experts, best first (ties: the
    lower index); experts = `experts_TK` when given (routing replay), else own; weights = probs
    at experts, divided by their sum with `normalize`."""
    probs = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    top_p, own = jax.lax.top_k(probs, k)
    if experts_TK is None:
        experts, weights = own, top_p
    else:
        experts = experts_TK.astype(jnp.int32)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights, probs, own.astype(jnp.int32)


def _ragged(x_MK, w_GKN, group_sizes_G, out_dtype):
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G, preferred_element_type=out_dtype)


def _tiled(x_MK, w_GKN, group_sizes_G, out_dtype):
    m, n, groups = x_MK.shape[0], w_GKN.shape[2], w_GKN.shape[0]
    tile = min(TILE, m)
    tiles = -(-m // tile)
    x = jnp.pad(x_MK, ((0, tiles * tile - m), (0, 0)))
    ends = jnp.cumsum(group_sizes_G)
    starts = ends - group_sizes_G
    first = starts // tile  # each group's first tile, and how many it overlaps
    count = jnp.where(group_sizes_G > 0, (ends - 1) // tile - first + 1, 0)
    done = jnp.cumsum(count)  # items of the groups up to g
    item = jnp.arange(tiles + groups - 1)  # (tile, group) pairs: at most this many
    group = jnp.minimum(jnp.searchsorted(done, item, side="right"), groups - 1)
    live = item < done[-1]
    tile_of = jnp.where(live, first[group] + item - (done[group] - count[group]), 0)
    lo, hi = jnp.where(live, starts[group], 0), jnp.where(live, ends[group], 0)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def product(args):
        t, g, lo, hi = args
        rows = jax.lax.dynamic_slice_in_dim(x, t * tile, tile)
        slot = t * tile + jnp.arange(tile)
        rows = jnp.where(((slot >= lo) & (slot < hi))[:, None], rows, jnp.zeros((), x.dtype))
        return jnp.matmul(rows, w_GKN[g], preferred_element_type=out_dtype)

    out = jax.lax.map(product, (tile_of, group, lo, hi))  # [items, tile, N]
    out = jnp.zeros((tiles, tile, n), out.dtype).at[tile_of].add(out)
    return out.reshape(tiles * tile, n)[:m]


def capacity_rows(m: int, groups: int) -> int:
    """Rows per expert in one pass of "capacity" (`expert_mlp`) for m rows in `groups` groups:
    twice the mean group's size rounded up to a power of two, 8 to `TILE`."""
    mean = -(-m // max(groups, 1))
    return min(TILE, max(8, 1 << (2 * mean - 1).bit_length()))


def chunk_rows(m: int, groups: int) -> int:
    """Rows per chunk of "chunks" (`expert_mlp`) for m rows in `groups` groups: the mean group's
    size rounded down to a power of two, 8 to `TILE` (so the groups' padding to whole chunks,
    at most one chunk each, adds at most about m rows)."""
    mean = max(m // max(groups, 1), 1)
    return min(TILE, max(8, 1 << (mean.bit_length() - 1)))


def _batches(kind: str, c: int, starts_E, sizes_E):
    """(first, how many batches, batch(b)) of `expert_mlp`: `first` is positions 0 .. C - 1 of
    every group (the first pass of "capacity", the first chunks of "chunks"); it and each
    batch(b) give (experts [N] int32 or None, rows [N, C], in_group [N, C]): N items, each C
    consecutive rows of one expert's group (row indices, and whether each is in the group),
    with the item's expert (None: item e is expert e's, all E of them in order, whose weights
    are used in place)."""
    n = sizes_E.shape[0]

    def positions(p):  # positions p C .. p C + C - 1 of every group
        position = p * c + jnp.arange(c)
        return None, starts_E[:, None] + position, position < sizes_E[:, None]

    if kind == "capacity":  # then pass b + 1 while some group has rows left
        return positions(0), (jnp.max(sizes_E) + c - 1) // c - 1, lambda b: positions(b + 1)
    # "chunks": each group cut into chunks of C rows (the last one short); after the first ones,
    # N = E / 2 chunks a batch, with their experts' weights taken out
    more = jnp.maximum((sizes_E + c - 1) // c - 1, 0)  # each group's chunks after its first
    ends = jnp.cumsum(more)
    per_batch = max(n // 2, 1)

    def batch(b):
        item = b * per_batch + jnp.arange(per_batch)
        expert = jnp.minimum(jnp.searchsorted(ends, item, side="right"), n - 1).astype(jnp.int32)
        chunk = item - ends[expert] + more[expert] + 1  # the first chunk is `first`'s
        position = chunk[:, None] * c + jnp.arange(c)
        live = (item < ends[-1])[:, None] & (position < sizes_E[expert][:, None])
        return expert, starts_E[expert][:, None] + position, live

    return positions(0), (ends[-1] + per_batch - 1) // per_batch, batch


def _swiglu(act, dtype, decode, x_NCH, gate, up, down):
    """The experts' MLP on each item's [C, H] rows at once (a batched product over the N items,
    item i with weights gate[i], up[i], down[i]); products in float32 when `decode`."""
    acc = jnp.float32 if decode else dtype
    mm = lambda spec, a, w: jnp.einsum(spec, a, w, preferred_element_type=acc).astype(dtype)
    h = act(mm("nch,nhi->nci", x_NCH, gate)) * mm("nch,nhi->nci", x_NCH, up)
    return mm("nci,nih->nch", h, down)


def _gather_pass(x_MH, idx_NC, in_group_NC):
    m = x_MH.shape[0]
    rows = jnp.take(x_MH, jnp.minimum(idx_NC, m - 1), axis=0)
    return jnp.where(in_group_NC[..., None], rows, jnp.zeros((), x_MH.dtype))


def _add_pass(y_MH, idx_NC, in_group_NC, out_NCH):
    return y_MH.at[jnp.where(in_group_NC, idx_NC, y_MH.shape[0])].add(out_NCH, mode="drop")


def _items_weights(experts_N, weights):
    """The weights of a batch's items: the stacked [E, ..] arrays as they are (experts None),
    else each item's expert's taken out."""
    return weights if experts_N is None else tuple(jnp.take(w, experts_N, axis=0) for w in weights)


def _zeros_like(a, *like):
    """Zeros shaped as `a`, varying over the mesh axes any of `a`, `like` vary over (a loop's
    carry inside `dispatch`'s shard_map must have its body's type from the start)."""
    z = jnp.zeros_like(a)
    for b in like:
        z = z + jnp.zeros_like(b.reshape(-1)[:1], a.dtype).reshape((1,) * a.ndim)
    return z


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def expert_mlp(kind, act, c, dtype, decode, x_MH, gate, up, down, starts_E, sizes_E):
    """The experts' SwiGLU MLP of rows x [M, H] sorted into E consecutive groups (group e: the
    sizes[e] rows from starts[e]) with each group's weights: [M, H] in `dtype` (rows past the
    groups: 0), in batches of C-row items run as one batched product each (`_batches`):
      * "capacity": batch p holds positions p C .. p C + C - 1 of every group, ceil(max size /
        C) batches; no expert's weights are taken out, but every batch computes E x C rows,
        E x (the largest group) in all;
      * "chunks": the groups cut into chunks of C rows; every group's first chunk in one batch
        with the weights in place, the rest E / 2 a batch, each with its expert's weights
        taken out; about M + E x C rows in all, however unequal the groups.
    The first batch runs, then the rest in a `while_loop` while any is left. Its
    gradient is its own: the same batches, each one's product differentiated (`jax.vjp`), the
    rows' gradients added to theirs and the weights' summed into their experts'."""
    fn = functools.partial(_swiglu, act, dtype, decode)
    first, batches, batch = _batches(kind, c, starts_E, sizes_E)

    def apply(y, experts, idx, in_group):
        w = _items_weights(experts, (gate, up, down))
        return _add_pass(y, idx, in_group, fn(_gather_pass(x_MH, idx, in_group), *w))

    y = _zeros_like(jnp.zeros((x_MH.shape[0], down.shape[2]), dtype), x_MH, gate, down, sizes_E)
    y = apply(y, *first)
    one = lambda state: (state[0] + 1, apply(state[1], *batch(state[0])))
    return jax.lax.while_loop(lambda state: state[0] < batches, one, (0, y))[1]


def _expert_mlp_fwd(kind, act, c, dtype, decode, x_MH, gate, up, down, starts_E, sizes_E):
    y = expert_mlp(kind, act, c, dtype, decode, x_MH, gate, up, down, starts_E, sizes_E)
    return y, (x_MH, gate, up, down, starts_E, sizes_E)


def _expert_mlp_bwd(kind, act, c, dtype, decode, residuals, dy_MH):
    x_MH, gate, up, down, starts_E, sizes_E = residuals
    fn = functools.partial(_swiglu, act, dtype, decode)
    first, batches, batch = _batches(kind, c, starts_E, sizes_E)

    def apply(grads, experts, idx, in_group):
        dx, *dw = grads
        w = _items_weights(experts, (gate, up, down))
        _, vjp = jax.vjp(fn, _gather_pass(x_MH, idx, in_group), *w)
        d_rows, *d_items = vjp(_gather_pass(dy_MH.astype(dtype), idx, in_group))
        if experts is None:
            dw = [a + g.astype(a.dtype) for a, g in zip(dw, d_items)]
        else:
            dw = [a.at[experts].add(g.astype(a.dtype)) for a, g in zip(dw, d_items)]
        return _add_pass(dx, idx, in_group, d_rows.astype(dx.dtype)), *dw

    like = (x_MH, dy_MH, gate, down, sizes_E)
    grads = tuple(_zeros_like(a.astype(jnp.float32), *like) for a in (x_MH, gate, up, down))
    grads = apply(grads, *first)
    one = lambda state: (state[0] + 1, *apply(state[1:], *batch(state[0])))
    _, dx, *dw = jax.lax.while_loop(lambda state: state[0] < batches, one, (0, *grads))
    no_grad = tuple(np.zeros(a.shape, jax.dtypes.float0) for a in (starts_E, sizes_E))
    cast = lambda g, a: g.astype(a.dtype)
    return (cast(dx, x_MH), *(cast(g, w) for g, w in zip(dw, (gate, up, down))), *no_grad)


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


# Grouped matmuls by name (`ModelConfig.moe_matmul`; "auto": see `resolve_matmul`).
MATMULS = Registry(
    "grouped matmul (model.moe_matmul)",
    {"auto": None, "ragged": _ragged, "tiled": _tiled, "capacity": None, "chunks": None},
)


def resolve_matmul(name: str, backend: str | None = None) -> str:
    """The grouped matmul `name` runs: itself, or for "auto" "chunks" on CPU, else "ragged"."""
    MATMULS.get(name)
    if name != "auto":
        return name
    return "chunks" if (backend or jax.default_backend()) == "cpu" else "ragged"


def grouped_matmul(
    x_MK, w_GKN, group_sizes_G, dtype, decode: bool = False, implementation: str = "auto"
):
    """Rows of x [M, K] in consecutive groups (group g: the next group_sizes[g] rows) times
    their group's matrix w[g] [K, N]: [M, N] in `dtype` (rows past the groups' total are 0).
    With `decode` the product accumulates in float32 and is rounded once, as
    `transformer.product` does for the rollout. `implementation`: a key of MATMULS."""
    fn = MATMULS.get(resolve_matmul(implementation))
    x, w = jnp.asarray(x_MK, dtype), jnp.asarray(w_GKN, dtype)
    return fn(x, w, group_sizes_G, jnp.float32 if decode else dtype).astype(dtype)


def experts_forward(
    x_TH,
    experts_TK,
    weights_TK,
    gate_EHI,
    up_EHI,
    down_EIH,
    act,
    dtype,
    decode: bool = False,
    implementation: str = "auto",
    first_expert=None,
):
    """sum_j weights[t, j] * down(act(x_t gate[e]) * (x_t up[e])), e = experts[t, j]: [T, H] in
    `dtype`, each (token, expert) pair computed once (dropless), by expert-sorted grouped
    matmuls (`grouped_matmul` with `implementation`).

    `first_expert` (an int, traced; expert parallelism, `dispatch`): the weights hold experts
    first_expert .. first_expert + E_local - 1 of the model's, and the pairs of other experts
    add nothing (sorted after the last group, their rows are no group's)."""
    t, k = experts_TK.shape
    num_experts = gate_EHI.shape[0]
    flat = experts_TK.reshape(-1)  # pair p = t * k + j
    if first_expert is not None:  # local expert index; the other experts' pairs sort last
        flat = flat - first_expert
        flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    rows = jnp.take(x_TH.astype(dtype), order // k, axis=0)  # [T*k, H]
    kind = resolve_matmul(implementation)
    if kind in ("capacity", "chunks"):
        c = (capacity_rows if kind == "capacity" else chunk_rows)(t * k, num_experts)
        starts = jnp.cumsum(sizes) - sizes
        weights = (gate_EHI.astype(dtype), up_EHI.astype(dtype), down_EIH.astype(dtype))
        out = expert_mlp(kind, act, c, jnp.dtype(dtype), decode, rows, *weights, starts, sizes)
    else:
        mm = lambda a, w: grouped_matmul(a, w, sizes, dtype, decode, implementation)
        h = act(mm(rows, gate_EHI)) * mm(rows, up_EHI)
        out = mm(h, down_EIH)  # [T*k, H], sorted
    if first_expert is not None:  # rows past the groups: 0 whatever the grouped matmul leaves
        live = jnp.arange(t * k) < jnp.sum(sizes)
        out = jnp.where(live[:, None], out, jnp.zeros((), out.dtype))
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back to pair order
    weighted = out.reshape(t, k, -1) * weights_TK.astype(dtype)[..., None]
    return jnp.sum(weighted, axis=1)


class ExpertPlan(NamedTuple):
    """How `dispatch` splits a sparse layer over the mesh in context: the mesh axes (tuples of
    names) of the experts, of the rows and of an expert's width."""

    experts: tuple  # E is split over these (expert parallelism: E / ep experts per device)
    rows: tuple  # B (and so the tokens) is split over these
    width: tuple  # I ("mlp") is split over these (tensor parallelism)


def expert_plan(x_shape, gate_shape) -> ExpertPlan | None:
    """The `ExpertPlan` of x [B, L, H] and experts gate [E, H, I] under the mesh in context:
    each dimension's mesh axes as `jrl.partitioning` fits them (E over "expert", B over "batch",
    I over "mlp"). None without a mesh, or when no mesh axis of size > 1 splits the experts:
    then `dispatch` runs `experts_forward` as it is."""
    spec = partitioning.context_spec(P("expert", "embed", "mlp"), gate_shape)
    if spec is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    experts = partitioning.mesh_axes(spec[0])
    if math.prod(mesh.shape[a] for a in experts) == 1:
        return None
    rows = partitioning.mesh_axes(partitioning.context_spec(P("batch"), x_shape[:1])[0])
    return ExpertPlan(experts, rows, partitioning.mesh_axes(spec[2]))


def dispatch(x_BLH, experts_BLK, weights_BLK, projections, act, dtype, decode=False, impl="auto"):
    """`experts_forward` of x [B, L, H] (each token's experts and weights [B, L, k]) and
    `projections` (gate [E, H, I], up [E, H, I], down [E, I, H]), with `impl` its grouped matmul:
    [B, L, H].

    Without a mesh in context, or where its "expert" axis is absent, of size 1 or does not
    divide E, it is `experts_forward` over the B x L tokens, exactly (one sort of all the pairs).

    Expert parallelism, where the mesh splits the experts E / ep per device (`expert_plan`),
    inside `jax.shard_map`: the rows are split over the expert axis as over fsdp, and the ep
    devices of an expert group (the same data and fsdp coordinates) pass their tokens around a
    ring (`ppermute`), each with a float32 sum of its outputs. At each of the ep hops a device
    runs its own E / ep experts on the pairs of the tokens it holds (`experts_forward` with
    `first_expert`: those pairs sorted first, the others left out; the sort is over one
    device's tokens, never across data shards) and adds their weighted outputs to the tokens'
    sum; after the ep-th hop every sum is back on its tokens' device. Over the tensor axis,
    when it splits the experts' width, the sums are added (`psum`). Dropless with static
    shapes, and a hop's buffers are one device's T_local x k pairs, as without expert
    parallelism: an all-to-all or all-gather dispatch that drops nothing must hold all ep x
    T_local x k pairs of the group at once (all of them may choose this device's experts). What
    crosses the expert axis per hop is the tokens [T_local, H] and their sums: in all, as much
    as an all-gather of the group's tokens and a reduce-scatter of the sums, and with k >= ep
    no more than an all-to-all of the pairs. Each hop's compute is recomputed in the backward
    (`jax.checkpoint`): the backward keeps only what travels. When B does not split over the
    expert axis (fewer rows than devices), a group's devices hold the same tokens: one hop,
    and the sum over the group is a `psum`. The hops are unrolled (ep is small).
    """
    h, k = x_BLH.shape[-1], experts_BLK.shape[-1]
    options = (act, dtype, decode, impl)
    plan = expert_plan(x_BLH.shape, projections[0].shape)
    if plan is None:
        per_pair = (x_BLH.reshape(-1, h), experts_BLK.reshape(-1, k), weights_BLK.reshape(-1, k))
        return experts_forward(*per_pair, *projections, *options).reshape(x_BLH.shape)
    ring = tuple(a for a in plan.experts if a in plan.rows)
    summed = tuple(dict.fromkeys(a for a in plan.experts + plan.width if a not in plan.rows))
    batch_only = tuple(a for a in plan.rows if a not in plan.experts + plan.width)
    spec = lambda axes: axes if len(axes) != 1 else axes[0]
    rows_spec = P(spec(plan.rows) or None, None, None)
    in_weights = P(spec(plan.experts), None, spec(plan.width) or None)
    out_weights = P(spec(plan.experts), spec(plan.width) or None, None)

    def local(x, experts, weights, gate, up, down):
        # Tokens and weights varying over every mesh axis of the computation from here: the
        # gradients' sums over the axes each was the same on are then taken once, here, not in
        # each grouped matmul's loop and branch (a collective inside a cond whose branch differs
        # by device hangs). `summed`, the axes the experts and their width split and the rows
        # do not, ends it.
        vary = lambda arrays, axes: [jax.lax.pcast(a, axes, to="varying") for a in arrays]
        if summed:
            x, experts, weights = vary((x, experts, weights), summed)
        if batch_only:
            gate, up, down = vary((gate, up, down), batch_only)
        first = jax.lax.axis_index(plan.experts) * gate.shape[0]
        own = lambda x, e, w: experts_forward(x, e, w, gate, up, down, *options, first).astype(
            jnp.float32
        )
        carry = (x.reshape(-1, h), experts.reshape(-1, k), weights.reshape(-1, k))
        if not ring:
            y = own(*carry)
        else:
            n = math.prod(jax.lax.axis_size(a) for a in ring)
            perm = [(i, (i + 1) % n) for i in range(n)]
            send = lambda a: jax.lax.ppermute(a, ring, perm)

            # Unrolled (n is small): XLA:CPU may start a loop's collectives and another
            # collective outside it in different orders on different devices (a deadlock).
            hop = jax.checkpoint(lambda acc, *tokens: acc + own(*tokens), prevent_cse=False)
            # zeros of the sums' type (their varying mesh axes: the tokens' and the experts')
            acc = jnp.zeros_like(carry[0] * gate[0, 0, 0] * down[0, 0, 0], dtype=jnp.float32)
            for i in range(n):  # the n-th send brings every sum back to its tokens' device
                acc = send(hop(acc, *carry))
                if i < n - 1:  # the next hop after this one: one hop's buffers at a time
                    acc, carry = jax.lax.optimization_barrier((acc, send(carry)))
            y = acc
        if summed:
            y = jax.lax.psum(y, summed)
        return y.astype(dtype).reshape(x.shape)

    return jax.shard_map(
        local,
        in_specs=(rows_spec, rows_spec, rows_spec, in_weights, in_weights, out_weights),
        out_specs=rows_spec,
    )(x_BLH.astype(dtype), experts_BLK, weights_BLK, *(w.astype(dtype) for w in projections))


def routing_stats(experts_TK, probs_TE, valid_T=None):
    """(load [E], probs [E], tokens []) of one layer over its valid tokens (all when `valid_T`
    is None): assignments of the own top k per expert, router probabilities summed, tokens."""
    t, k = experts_TK.shape
    num_experts = probs_TE.shape[-1]
    valid = jnp.ones((t,), jnp.float32) if valid_T is None else valid_T.astype(jnp.float32)
    load = (
        jnp.zeros((num_experts,), jnp.float32).at[experts_TK.reshape(-1)].add(jnp.repeat(valid, k))
    )
    return load, jnp.sum(probs_TE * valid[:, None], axis=0), jnp.sum(valid)


def load_balancing_loss(routing: Routing):
    """Hugging Face's `load_balancing_loss_func` of a model's sparse layers (`Routing` with a
    leading [S] axis, or one layer's): E * sum_e (load_e / N) (probs_e / N), load and probs
    summed over the layers, N their real tokens. 0 when there are none."""
    load = jnp.reshape(routing.load, (-1, routing.load.shape[-1])).sum(0)
    probs = jnp.reshape(routing.probs, (-1, routing.probs.shape[-1])).sum(0)
    n = jnp.maximum(jnp.sum(routing.tokens), 1.0)
    return load.shape[0] * jnp.sum((load / n) * (probs / n))
