"""jrl.models.attention: blockwise / cuDNN-mapping / splash against the materialised reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import attention

SCALE = 0.3


def _inputs(b, l, n, k, d, seed=0, dtype=jnp.float32):
    r = np.random.RandomState(seed)
    q, kk, v, ct = (r.randn(b, l, h, d) for h in (n, k, k, n))
    return tuple(jnp.asarray(x, dtype) for x in (q, kk, v)), jnp.asarray(ct, jnp.float32)


def _numpy_reference(q, k, v, scale, softcap=None, window=None):
    """Straightforward per-(row, head) attention in float64 with an explicit causal mask."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, l, n, _ = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for row in range(b):
        for h in range(n):
            kv = h // group
            scores = q[row, :, h] @ k[row, :, kv].T * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            for i in range(l):
                for j in range(l):
                    if j > i or (window is not None and j <= i - window):
                        scores[i, j] = -np.inf
            scores -= scores.max(-1, keepdims=True)
            probs = np.exp(scores)
            out[row, :, h] = probs / probs.sum(-1, keepdims=True) @ v[row, :, kv]
    return out


@functools.partial(jax.jit, static_argnames=("implementation", "softcap", "window", "block_size"))
def _value_and_grads(q, k, v, ct, *, implementation, softcap=None, window=None, block_size=512):
    def loss(q, k, v):
        out = attention.causal_attention(
            q,
            k,
            v,
            scale=SCALE,
            softcap=softcap,
            sliding_window=window,
            implementation=implementation,
            block_size=block_size,
        )
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


def _assert_close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), tol, tol)


@pytest.mark.parametrize(
    "softcap, window", [(None, None), (2.0, 4), (None, 50)], ids=["plain", "softcap_window", "wide"]
)
def test_xla_reference_matches_numpy(softcap, window):
    (q, k, v), _ = _inputs(2, 13, 4, 2, 8)
    out = attention.causal_attention(
        q, k, v, scale=SCALE, softcap=softcap, sliding_window=window, implementation="xla"
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out, _numpy_reference(q, k, v, SCALE, softcap, window), 1e-5, 1e-5)


# (batch, length, query heads, kv heads, block, window, softcap)
BLOCKWISE_CASES = {
    "gqa_ragged_blocks": (2, 37, 4, 2, 8, None, None),
    "window_lt_block": (2, 37, 4, 2, 8, 5, None),
    "window_gt_block": (1, 37, 4, 1, 8, 20, None),
    "window_ge_len": (1, 37, 4, 2, 8, 64, None),
    "softcap_window": (2, 40, 4, 2, 8, 11, 3.0),
    "block_ge_len": (2, 37, 4, 4, 64, None, 3.0),
}


@pytest.mark.parametrize("case", BLOCKWISE_CASES.values(), ids=BLOCKWISE_CASES.keys())
def test_blockwise_matches_xla_values_and_grads(case):
    b, l, n, k, block, window, softcap = case
    (q, kk, v), ct = _inputs(b, l, n, k, 16, seed=l + n)
    kw = {"softcap": softcap, "window": window, "block_size": block}
    want = _value_and_grads(q, kk, v, ct, implementation="xla", **kw)
    got = _value_and_grads(q, kk, v, ct, implementation="blockwise", **kw)
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("window", [None, 6, 40])
def test_cudnn_argument_mapping_matches_reference(window):
    """The call the "cudnn" path makes, run through jax's "xla" implementation on CPU."""
    (q, k, v), _ = _inputs(2, 29, 6, 2, 8)
    want = attention.causal_attention(
        q, k, v, scale=SCALE, sliding_window=window, implementation="xla"
    )
    got = attention._jax_dot_product_attention(q, k, v, SCALE, window, "xla")
    np.testing.assert_allclose(got, want, 1e-5, 1e-5)


def test_bfloat16_blockwise_close_to_xla():
    (q, k, v), ct = _inputs(2, 45, 4, 2, 16, dtype=jnp.bfloat16)
    for window in (None, 9):
        kw = {"softcap": 5.0, "window": window, "block_size": 16}
        want = _value_and_grads(q, k, v, ct, implementation="xla", **kw)
        got = _value_and_grads(q, k, v, ct, implementation="blockwise", **kw)
        assert got[0].dtype == jnp.bfloat16
        _assert_close(got, want, 3e-2)


def _grad_temp_bytes(implementation, b=1, n=2, l=2048, d=16, block=256):
    def loss(q, k, v):
        out = attention.causal_attention(
            q, k, v, scale=SCALE, implementation=implementation, block_size=block
        )
        return jnp.sum(out)

    shape = jax.ShapeDtypeStruct((b, l, n, d), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_backward_holds_no_whole_score_matrix():
    one_score_matrix = 1 * 2 * 2048 * 2048 * 4  # float32 [B, N, L, L]
    blockwise, xla = _grad_temp_bytes("blockwise"), _grad_temp_bytes("xla")
    print(f"grad temp bytes: blockwise {blockwise}, xla {xla}, [B,N,L,L] f32 {one_score_matrix}")
    assert blockwise < one_score_matrix < xla


def test_auto_selection():
    pick = functools.partial(attention.resolve_implementation, "auto", head_dim=64, block_size=512)
    cpu = functools.partial(pick, dtype=jnp.float32, backend="cpu")
    assert cpu(seq_len=512) == "xla" and cpu(seq_len=513) == "blockwise"
    gpu = functools.partial(pick, seq_len=20_000, backend="gpu")
    assert gpu(dtype=jnp.bfloat16) == "cudnn" and gpu(dtype=jnp.float16, seq_len=64) == "cudnn"
    assert gpu(dtype=jnp.bfloat16, softcap=50.0) == "blockwise"
    assert gpu(dtype=jnp.float32) == "blockwise"
    assert (
        attention.resolve_implementation(
            "auto", seq_len=64, head_dim=60, dtype=jnp.bfloat16, backend="gpu"
        )
        == "xla"
    )  # head dim not a multiple of 8
    tpu = pick(seq_len=4096, dtype=jnp.bfloat16, backend="tpu")
    assert tpu == "splash"
    assert (
        attention.resolve_implementation("blockwise", seq_len=8, head_dim=8, dtype=jnp.float32)
        == "blockwise"
    )
    # and on this (CPU) backend, the dispatch itself
    (q, k, v), _ = _inputs(1, 40, 2, 1, 8)
    want = attention.causal_attention(q, k, v, scale=SCALE, implementation="xla")
    for block in (64, 16):  # auto -> xla, auto -> blockwise
        got = attention.causal_attention(q, k, v, scale=SCALE, block_size=block)
        np.testing.assert_allclose(got, want, 1e-5, 1e-5)


def test_invalid_arguments_raise():
    (q, k, v), _ = _inputs(1, 8, 2, 1, 8)
    with pytest.raises(ValueError, match="blockwise"):
        attention.causal_attention(q, k, v, scale=SCALE, implementation="flash")
    with pytest.raises(ValueError, match="sliding_window"):
        attention.causal_attention(q, k, v, scale=SCALE, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        attention.causal_attention(q, k, v, scale=SCALE, softcap=5.0, implementation="cudnn")


@pytest.mark.parametrize("softcap, window", [(None, None), (3.0, 37)], ids=["causal", "local"])
def test_splash_interpret_matches_xla_values_and_grads(softcap, window):
    """Off TPU "splash" runs the Pallas kernel in interpret mode: L=300, padded to 384 = 3 x 128."""
    (q, k, v), ct = _inputs(2, 300, 4, 2, 16)
    kw = {"softcap": softcap, "window": window, "block_size": 128}
    want = _value_and_grads(q, k, v, ct, implementation="xla", **kw)
    got = _value_and_grads(q, k, v, ct, implementation="splash", **kw)
    _assert_close(got, want, 1e-5)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 2, 4)])
def test_splash_runs_per_shard_under_a_mesh(mesh_shape):
    """Under a mesh the kernel runs on each device's rows (and heads, where the tensor axis
    divides both head counts: over 2 it does, over 4 the 2 kv heads do not), matching the
    unsharded reference in values and gradients."""
    from jrl import sharding

    mesh = sharding.make_mesh(shape=mesh_shape)
    (q, k, v), ct = _inputs(4, 130, 4, 2, 8)
    want = _value_and_grads(q, k, v, ct, implementation="xla", window=40)
    with jax.set_mesh(mesh):
        got = _value_and_grads(q, k, v, ct, implementation="splash", window=40, block_size=128)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# Decode attention: L new queries per row at ragged cache slots against the materialised
# reference (`attend_head_major` over the whole cache with a [B, L, S] mask).
# (rows, queries per row, query heads, kv heads, slots, block, window, softcap)
DECODE_CASES = {
    "gqa_ragged_fills": (3, 1, 4, 2, 37, 8, None, None),
    "window_lt_block": (3, 1, 4, 2, 37, 8, 5, None),
    "softcap_window_gt_block": (3, 1, 4, 1, 40, 8, 13, 3.0),
    "four_queries_a_row": (3, 4, 6, 2, 29, 8, None, None),
    "block_ge_slots": (3, 2, 4, 4, 20, 64, 7, 2.0),
    "one_pass": (3, 2, 4, 2, 20, 128, None, None),  # at most a quarter block: one pass
    "one_pass_window_softcap": (3, 1, 4, 2, 24, 96, 5, 2.0),
}


def _decode_inputs(rows, l, n, k, s, seed, window=None):
    r = np.random.RandomState(seed)
    d = 8
    q = jnp.asarray(r.randn(rows, l, k, n // k, d), jnp.float32)
    kk, v = (jnp.asarray(r.randn(rows, k, s, d), jnp.float32) for _ in range(2))
    # ragged fills, the last query short of the end; with a window, past the first blocks
    low = 2 if window is None else s // 2 - 2
    starts = np.array([low, s // 2 + 3, 2 * s // 3 - l][:rows], np.int32)
    pad = np.array([0, 2, 1][:rows])  # left padding of a 4-slot prompt
    valid = np.ones((rows, s), bool)
    for row, p in enumerate(pad):
        valid[row, :p] = False
    return q, kk, v, jnp.asarray(valid), jnp.asarray(starts)


def _decode_reference(q, k, v, valid, starts, scale, softcap, window):
    l, s = q.shape[1], k.shape[2]
    q_slot = starts[:, None] + np.arange(l)[None]  # [B, L]
    slots = np.arange(s)
    mask = valid[:, None, :] & (slots <= q_slot[..., None])
    if window is not None:
        mask = mask & (slots > q_slot[..., None] - window)
    bias = attention.mask_bias(jnp.asarray(mask))[:, None, None]
    return attention.attend_head_major(q, k, v, bias, scale, softcap)


@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_attention_matches_the_materialised_reference(case):
    """Traced bounds (the decode loop's) and static ones (the decode report's) give the
    reference's values; the blocks past the last query's slot, and before the earliest
    query's window, are never read: NaN there changes nothing."""
    rows, l, n, kh, s, block, window, softcap = case
    q, k, v, valid, starts = _decode_inputs(rows, l, n, kh, s, seed=s + l, window=window)
    want = _decode_reference(q, k, v, valid, starts, SCALE, softcap, window)
    kw = dict(scale=SCALE, softcap=softcap, window=window, block_size=block)
    end, first = int(starts.max()) + l, int(starts.min())
    # what the blocks cover: from the window's first slot (or 0), whole blocks, then quarter
    # blocks to `end` (the last one may reach past it; one past S is read from S - its size);
    # a cache of at most a quarter block is read whole, in one pass
    big = min(block, s)
    small = max(big // 4, 1)
    lo = 0 if window is None else max(first - window + 1, 0)
    rest = lo + (end - lo) // big * big
    read_to = rest + -(-(end - rest) // small) * small
    unread = (np.arange(s) < lo) | (np.arange(s) >= read_to)
    if read_to > s:  # the last block is read from S - small
        unread &= np.arange(s) < s - small
    one_pass = s <= block // 4
    if one_pass:
        unread[:] = False
    assert unread.any() or one_pass  # the cases leave slots unread
    k_nan, v_nan = (jnp.where(jnp.asarray(unread)[:, None], jnp.nan, x) for x in (k, v))
    q_slot = starts[:, None] + jnp.arange(l)[None]

    @jax.jit
    def traced(q, k, v, valid, q_slot, end, first):
        return attention.decode_attention(q, k, v, valid, q_slot, end, first_slot=first, **kw)

    got = traced(q, k_nan, v_nan, valid, q_slot, jnp.int32(end), jnp.int32(first))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    static = attention.decode_attention(q, k_nan, v_nan, valid, q_slot, end, first_slot=first, **kw)
    np.testing.assert_allclose(static, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_in_bfloat16_close_to_the_reference_in_float32():
    """bf16 inputs: within bf16 rounding of the float32 reference (scores and sums in float32)."""
    q, k, v, valid, starts = _decode_inputs(3, 1, 4, 2, 37, seed=0, window=9)
    want = _decode_reference(q, k, v, valid, starts, SCALE, 3.0, 9)
    bf = lambda x: x.astype(jnp.bfloat16)
    got = attention.decode_attention(
        bf(q),
        bf(k),
        bf(v),
        valid,
        starts[:, None],
        int(starts.max()) + 1,
        first_slot=int(starts.min()),
        scale=SCALE,
        softcap=3.0,
        window=9,
        block_size=8,
    )
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(
    "window, softcap, block",
    [(None, None, 4), (6, 2.0, 4), (None, None, 64)],
    ids=["gqa", "window_softcap", "one_block"],
)
def test_decode_attention_reads_a_shared_prompt_once_per_group(window, softcap, block):
    """Two prompts of 8 slots (left padding 3 and 1), 3 rows each (B = 6) with ragged response
    fills, the prompt's keys / values given once per group (`prompt`): the reference's values
    over the rows' whole caches, whose prompt slots hold NaN (so they are never read)."""
    r = np.random.RandomState(1)
    groups, n, p, s, kh, g, d = 2, 3, 8, 29, 2, 3, 8
    b = groups * n
    q = jnp.asarray(r.randn(b, 1, kh, g, d), jnp.float32)
    k_p, v_p = (jnp.asarray(r.randn(groups, kh, p, d), jnp.float32) for _ in range(2))
    k_resp, v_resp = (jnp.asarray(r.randn(b, kh, s, d), jnp.float32) for _ in range(2))
    valid_p = np.arange(p)[None] >= np.array([[3], [1]])
    valid = np.concatenate([np.repeat(valid_p, n, 0), np.ones((b, s - p), bool)], 1)
    starts = jnp.asarray([p, p + 5, p + 13, p + 2, p + 9, p + 17], jnp.int32)  # ragged
    rows = lambda x: jnp.repeat(x, n, 0)
    k_full = jnp.concatenate([rows(k_p), k_resp[:, :, p:]], 2)
    v_full = jnp.concatenate([rows(v_p), v_resp[:, :, p:]], 2)
    want = _decode_reference(q, k_full, v_full, valid, starts, SCALE, softcap, window)
    nan_prompt = lambda x: x.at[:, :, :p].set(jnp.nan)
    kw = dict(scale=SCALE, softcap=softcap, window=window, block_size=block)
    end, first = int(starts.max()) + 1, int(starts.min())

    @jax.jit
    def traced(q, k, v, end, first):
        prompt = (k_p, v_p, jnp.asarray(valid_p))
        return attention.decode_attention(
            q, k, v, jnp.asarray(valid), starts[:, None], end, first_slot=first, prompt=prompt, **kw
        )

    got = traced(q, nan_prompt(k_full), nan_prompt(v_full), jnp.int32(end), jnp.int32(first))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    # The same as layer 1 of a stack of 3 layers' caches (`layer`, the scan over layers of
    # `model.scan_cached_layers`), the other layers NaN: only layer 1's blocks are read.
    stack = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])

    @jax.jit
    def stacked(q, k, v, end, first, layer):
        prompt = (stack(k_p), stack(v_p), jnp.asarray(valid_p))
        return attention.decode_attention(
            q,
            k,
            v,
            jnp.asarray(valid),
            starts[:, None],
            end,
            first_slot=first,
            prompt=prompt,
            layer=layer,
            **kw,
        )

    k_stack, v_stack = (stack(nan_prompt(x)) for x in (k_full, v_full))
    got = stacked(q, k_stack, v_stack, jnp.int32(end), jnp.int32(first), jnp.int32(1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [8, 128], ids=["blocks", "one_pass"])
def test_decode_attention_gives_zero_to_a_query_that_sees_no_key(block):
    """Row 1 has no valid slot: its output is 0 (not the mean of the values); the other rows
    keep the reference's values."""
    q, k, v, valid, starts = _decode_inputs(3, 1, 4, 2, 24, seed=3)
    valid = valid.at[1].set(False)
    want = np.array(_decode_reference(q, k, v, valid, starts, SCALE, None, None))
    want[1] = 0.0
    got = attention.decode_attention(
        q, k, v, valid, starts[:, None], int(starts.max()) + 1, scale=SCALE, block_size=block
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
