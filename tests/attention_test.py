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
