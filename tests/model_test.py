"""The decoder: causal masking, padding invariance, KV-cache decode == full forward, logical axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import transformer as tfm

CFG = tfm.ModelConfig(
    vocab_size=23,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    rope_theta=500.0,
    qkv_bias=True,
    tie_word_embeddings=False,
    value_head=True,
)


@pytest.fixture(scope="module")
def params():
    return tfm.init_params(CFG, jax.random.key(0))


def _full(params, ids, mask):
    return tfm.apply_full(CFG, params, jnp.asarray(ids), jnp.asarray(mask))


def test_causal_future_tokens_do_not_change_past_logits(params):
    ids = np.array([[3, 4, 5, 6, 7, 8]])
    other = ids.copy()
    other[0, 4:] = [9, 10]
    mask = np.ones_like(ids)
    a, va = _full(params, ids, mask)
    b, vb = _full(params, other, mask)
    np.testing.assert_allclose(a[0, :4], b[0, :4], atol=1e-6)
    np.testing.assert_allclose(va[0, :4], vb[0, :4], atol=1e-6)
    assert np.abs(np.asarray(a[0, 4:] - b[0, 4:])).max() > 1e-4  # and the future ones do change


def test_left_padding_does_not_change_logits(params):
    ids = np.array([[3, 4, 5, 6]])
    padded = np.array([[0, 0, 3, 4, 5, 6]])
    a, _ = _full(params, ids, np.ones_like(ids))
    b, _ = _full(params, padded, (padded > 0).astype(np.int32))
    np.testing.assert_allclose(a[0], b[0, 2:], atol=1e-5)


def test_kv_cache_decode_equals_full_forward(params):
    """Prefill a left-padded batch, decode token by token; every step's logits equal the full pass."""
    model = tfm.Transformer(CFG)
    prompt = np.array([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5]], np.int32)
    pmask = (prompt > 0).astype(np.int32)
    cont = np.array([[7, 8, 9, 10], [11, 12, 13, 14]], np.int32)
    b, p = prompt.shape
    r = cont.shape[1]
    s = p + r
    key_valid = np.zeros((b, s), bool)
    key_valid[:, :p] = pmask
    slots = np.arange(s)
    cache = tfm.init_cache(CFG, b, s)
    mask = key_valid[:, None, :] & (slots[None, None, :] <= np.arange(p)[None, :, None])
    pos = tfm.positions_from_mask(jnp.asarray(pmask))
    logits, _, cache = model.apply({"params": params}, prompt, pos, mask, cache, 0)
    step_logits = [logits[:, -1]]
    for t in range(r - 1):
        key_valid[:, p + t] = True
        mask = key_valid[:, None, :] & (slots <= p + t)[None, None, :]
        logits, _, cache = model.apply(
            {"params": params}, cont[:, t : t + 1], pos[:, -1:] + 1 + t, mask, cache, p + t
        )
        step_logits.append(logits[:, -1])
    decoded = np.stack(step_logits, 1)
    full_ids = np.concatenate([prompt, cont], 1)
    full, _ = _full(params, full_ids, np.concatenate([pmask, np.ones_like(cont)], 1))
    np.testing.assert_allclose(decoded, full[:, p - 1 : p + r - 1], atol=1e-5)


def test_gqa_with_one_kv_head_per_query_head_matches_repeated_kv(params):
    """GQA against a reference: K shared across groups equals MHA with the kv heads repeated."""
    cfg_mha = tfm.ModelConfig(**{**CFG.__dict__, "num_kv_heads": 4})
    p = jax.tree_util.tree_map(lambda x: x, params)
    for i in range(CFG.num_layers):
        attn = dict(p[f"layers_{i}"]["attn"])
        for name in ("k_proj", "v_proj"):
            attn[name] = jnp.repeat(attn[name], 2, axis=1)
            attn[name + "_bias"] = jnp.repeat(attn[name + "_bias"], 2, axis=0)
        p[f"layers_{i}"] = {**p[f"layers_{i}"], "attn": attn}
    ids = jnp.array([[3, 4, 5, 6, 7]])
    a = tfm.forward(CFG, params, ids)
    b = tfm.forward(cfg_mha, p, ids)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_rope_rotates_pairs_half_apart():
    """Rotate-half RoPE on a hand-made vector: dims (i, i + D/2) rotate by pos * theta^(-2i/D)."""
    d, theta, pos = 4, 100.0, 3
    x = jnp.arange(1.0, 5.0).reshape(1, 1, 1, d)
    y = np.asarray(tfm.rope(x, jnp.array([[pos]]), theta))[0, 0, 0]
    freqs = pos * theta ** (-np.arange(0, d, 2) / d)
    x = np.arange(1.0, 5.0)
    want = np.concatenate(
        [
            x[:2] * np.cos(freqs) - x[2:] * np.sin(freqs),
            x[2:] * np.cos(freqs) + x[:2] * np.sin(freqs),
        ]
    )
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_every_parameter_has_logical_axes():
    axes = tfm.logical_axes(CFG)
    shapes = jax.eval_shape(lambda k: tfm.init_params(CFG, k), jax.random.key(0))
    flat_axes = jax.tree_util.tree_leaves(
        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    flat_shapes = jax.tree_util.tree_leaves(shapes)
    assert len(flat_axes) == len(flat_shapes)
    for spec, shape in zip(flat_axes, flat_shapes):
        assert len(spec) == len(shape.shape)
    assert axes["embed"] == jax.sharding.PartitionSpec("vocab", "embed")
    assert axes["layers_0"]["mlp"]["gate_proj"] == jax.sharding.PartitionSpec("embed", "mlp")


def test_bad_head_counts_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        tfm.ModelConfig(vocab_size=10, num_heads=4, num_kv_heads=3)
