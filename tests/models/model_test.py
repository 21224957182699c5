"""The decoder: causal masking, padding invariance, KV-cache decode == full forward (sliding windows
included), logical axes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import transformer as tfm
from helpers.tiny_decoders import CFG, GEMMA_CFG, random_params


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


def _decode(cfg, params, prompt, pmask, cont):
    """Prefill a left-padded batch, then decode `cont` token by token: the logits predicting each
    continuation token [B, R]; the rollout's slot layout (prompt in [0, P), response from P)."""
    apply = jax.jit(tfm.Transformer(cfg).apply)  # two compiles: prefill and one decode step
    b, p = prompt.shape
    r = cont.shape[1]
    s = p + r
    key_valid = np.zeros((b, s), bool)
    key_valid[:, :p] = pmask
    slots = np.arange(s)
    cache = tfm.init_cache(cfg, b, s)
    mask = key_valid[:, None, :] & (slots[None, None, :] <= np.arange(p)[None, :, None])
    pos = tfm.positions_from_mask(jnp.asarray(pmask))
    out = apply({"params": params}, prompt, pos, mask, cache, 0)
    cache = out.cache
    step_logits = [tfm.lm_logits(cfg, out.hidden[:, -1], out.head)]
    for t in range(r - 1):
        key_valid[:, p + t] = True
        mask = key_valid[:, None, :] & (slots <= p + t)[None, None, :]
        out = apply({"params": params}, cont[:, t : t + 1], pos[:, -1:] + 1 + t, mask, cache, p + t)
        cache = out.cache
        step_logits.append(tfm.lm_logits(cfg, out.hidden[:, -1], out.head))
    return np.stack(step_logits, 1)


_forward = jax.jit(tfm.forward, static_argnums=0)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_kv_cache_decode_equals_full_forward(params, family):
    """Every decode step's logits equal the full pass (sliding windows applied in both)."""
    cfg, params = (CFG, params) if family == "llama" else (GEMMA_CFG, random_params(GEMMA_CFG))
    prompt = np.array([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5]], np.int32)
    pmask = (prompt > 0).astype(np.int32)
    cont = np.array([[7, 8, 9, 10], [11, 12, 13, 14]], np.int32)
    p, r = prompt.shape[1], cont.shape[1]
    decoded = _decode(cfg, params, prompt, pmask, cont)
    full_ids = np.concatenate([prompt, cont], 1)
    full_mask = np.concatenate([pmask, np.ones_like(cont)], 1)
    full = _forward(cfg, params, jnp.asarray(full_ids), jnp.asarray(full_mask))
    np.testing.assert_allclose(decoded, full[:, p - 1 : p + r - 1], atol=1e-5)
    if cfg.sliding_window:  # and the window matters at this length
        unwindowed = dataclasses.replace(cfg, sliding_window=None, layer_types=None)
        other = _forward(unwindowed, params, jnp.asarray(full_ids), jnp.asarray(full_mask))
        assert np.abs(np.asarray(other - full)[:, -1]).max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_per_row_cache_index_writes_each_row_at_its_own_offset(params, family):
    """A [B] cache index: rows take their continuation tokens in different chunks (row 0: 1,
    then 3; row 1: nothing, 3, then 1), a row given the slot past the cache is left unchanged,
    and every token's logits equal the full pass (sliding windows measured per row)."""
    cfg, params = (CFG, params) if family == "llama" else (GEMMA_CFG, random_params(GEMMA_CFG))
    apply = jax.jit(tfm.Transformer(cfg).apply)
    prompt = np.array([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5]], np.int32)
    pmask = (prompt > 0).astype(np.int32)
    cont = np.array([[7, 8, 9, 10], [11, 12, 13, 14]], np.int32)
    (b, p), r = prompt.shape, cont.shape[1]
    s = p + r
    pos = tfm.positions_from_mask(jnp.asarray(pmask))
    causal = pmask.astype(bool)[:, None, :] & np.tri(p, dtype=bool)[None]
    cache = apply({"params": params}, prompt, pos, causal, tfm.init_cache(cfg, b, p), 0).cache
    cache = jax.tree.map(lambda c: jnp.pad(c, ((0, 0), (0, 0), (0, r), (0, 0))), cache)
    key_valid = np.concatenate([pmask.astype(bool), np.ones((b, r), bool)], 1)
    full_ids = np.concatenate([prompt, cont], 1)
    full_mask = np.concatenate([pmask, np.ones_like(cont)], 1)
    full = np.asarray(_forward(cfg, params, jnp.asarray(full_ids), jnp.asarray(full_mask)))
    done = np.zeros(b, int)  # continuation tokens each row has written
    for chunk, takes in ((1, [True, False]), (3, [True, True]), (1, [False, True])):
        start = done.copy()
        t = start[:, None] + np.arange(chunk)[None]  # [B, L] continuation index per token
        ids = np.take_along_axis(cont, np.minimum(t, r - 1), 1)
        mask = key_valid[:, None, :] & (np.arange(s)[None, None] <= p + t[..., None])
        index = np.where(takes, p + start, s)  # s: past the cache, the row writes nothing
        out = apply({"params": params}, ids, pos[:, -1:] + 1 + t, mask, cache, jnp.asarray(index))
        cache = out.cache
        logits = np.asarray(tfm.lm_logits(cfg, out.hidden, out.head))
        for row in np.flatnonzero(takes):
            want = full[row, p + t[row]]
            np.testing.assert_allclose(logits[row], want, atol=1e-5)
        done += np.where(takes, chunk, 0)
    np.testing.assert_array_equal(done, r)


def test_sliding_window_sees_the_last_window_tokens_only():
    """One sliding layer, window 2: position t reads tokens t-1 and t, whatever the padding."""
    cfg = tfm.ModelConfig(
        vocab_size=23,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=16,
        sliding_window=2,
    )
    params = random_params(cfg, std=0.5)
    ids = np.array([[3, 4, 5, 6, 7], [9, 4, 5, 6, 7]])  # differ at position 0 only
    logits = np.asarray(_forward(cfg, params, jnp.asarray(ids), jnp.ones_like(ids)))
    change = np.abs(logits[0] - logits[1]).max(-1)
    assert change[0] > 1e-3 and change[1] > 1e-3
    np.testing.assert_allclose(change[2:], 0, atol=1e-6)
    padded = np.array([[0, 0, 3, 4, 5, 6, 7]])
    lp = _forward(cfg, params, jnp.asarray(padded), jnp.asarray((padded > 0).astype(np.int32)))
    np.testing.assert_allclose(lp[0, 2:], logits[0], atol=1e-5)


def test_default_config_keeps_its_parameter_names(params):
    """The family options add parameters only when switched on."""
    assert set(params["layers"]) == {"attn", "input_norm", "mlp", "post_attn_norm"}
    gemma = jax.eval_shape(lambda k: tfm.init_params(GEMMA_CFG, k), jax.random.key(0))
    assert set(gemma["layers"]) == {
        "attn",
        "attn_out_norm",
        "input_norm",
        "mlp",
        "mlp_out_norm",
        "post_attn_norm",
    }
    assert gemma["layers"]["attn"]["q_norm"]["scale"].shape == (2, 16)  # stacked over layers


def test_gqa_with_one_kv_head_per_query_head_matches_repeated_kv(params):
    """GQA against a reference: K shared across groups equals MHA with the kv heads repeated."""
    cfg_mha = tfm.ModelConfig(**{**CFG.__dict__, "num_kv_heads": 4})
    p = jax.tree_util.tree_map(lambda x: x, params)
    attn = dict(p["layers"]["attn"])  # every layer's at once: [L, H, K, D], biases [L, K, D]
    for name in ("k_proj", "v_proj"):
        attn[name] = jnp.repeat(attn[name], 2, axis=2)
        attn[name + "_bias"] = jnp.repeat(attn[name + "_bias"], 2, axis=1)
    p["layers"] = {**p["layers"], "attn": attn}
    ids = jnp.array([[3, 4, 5, 6, 7]])
    a = tfm.forward(CFG, params, ids)
    b = tfm.forward(cfg_mha, p, ids)
    np.testing.assert_allclose(a, b, atol=1e-5)


def _rope_reference(x, positions, theta):
    """Rotate-half RoPE in NumPy: dims (i, i + D/2) of x [B, L, H, D] rotate by the angle
    position * theta^(-2i/D), the angle's product taken in float32 as HF takes it."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1] // 2
    inv_freq = (1.0 / theta ** (np.arange(0, 2 * h, 2) / (2 * h))).astype(np.float32)
    angles = (np.asarray(positions, np.float32)[..., None] * inv_freq)[:, :, None, :]
    cos, sin = np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def test_rope_rotates_pairs_half_apart():
    """Rotate-half RoPE on a hand-made vector: dims (i, i + D/2) rotate by pos * theta^(-2i/D)."""
    d, theta, pos = 4, 100.0, 3
    cfg = tfm.ModelConfig(vocab_size=5, num_heads=1, num_kv_heads=1, head_dim=d, rope_theta=theta)
    x = jnp.arange(1.0, 5.0).reshape(1, 1, 1, d)
    cos, sin = tfm._layer_rope(tfm.rope_tables(cfg, jnp.array([[pos]]), pos + 1), False)
    y = np.asarray(tfm.rotate(x, cos, sin))[0, 0, 0]
    freqs = pos * theta ** (-np.arange(0, d, 2) / d)
    x = np.arange(1.0, 5.0)
    want = np.concatenate(
        [
            x[:2] * np.cos(freqs) - x[2:] * np.sin(freqs),
            x[2:] * np.cos(freqs) + x[:2] * np.sin(freqs),
        ]
    )
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_rope_tables_gather_the_rotation_of_each_kind_of_layer():
    """The forward's tabulated cos / sin, gathered at positions, rotate as the NumPy reference
    with each layer kind's own theta (Gemma 3: the sliding layers' local base frequency)."""
    cfg = tfm.ModelConfig(
        vocab_size=11,
        head_dim=8,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        rope_theta=1000.0,
        rope_local_base_freq=10.0,
    )
    positions = jnp.array([[0, 1, 2, 9], [5, 5, 6, 7]])
    tables = tfm.rope_tables(cfg, positions, 10)
    x = jax.random.normal(jax.random.key(0), (2, 4, 3, 8))
    for sliding, theta in ((True, 10.0), (False, 1000.0)):
        cos, sin = tfm._layer_rope(tables, sliding)
        want = _rope_reference(x, positions, theta)
        np.testing.assert_allclose(tfm.rotate(x, cos, sin), want, atol=1e-6)
    # one table when every layer shares its frequencies
    assert len(tfm.rope_tables(CFG, positions, 10)) == 1


@pytest.mark.parametrize("cfg", [CFG, GEMMA_CFG], ids=["llama", "gemma"])
def test_every_parameter_has_logical_axes(cfg):
    axes = tfm.logical_axes(cfg)
    shapes = jax.eval_shape(lambda k: tfm.init_params(cfg, k), jax.random.key(0))
    flat_axes = jax.tree_util.tree_leaves(
        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    flat_shapes = jax.tree_util.tree_leaves(shapes)
    assert len(flat_axes) == len(flat_shapes)
    for spec, shape in zip(flat_axes, flat_shapes):
        assert len(spec) == len(shape.shape)
    assert axes["embed"] == jax.sharding.PartitionSpec("vocab", "embed")
    P = jax.sharding.PartitionSpec
    assert axes["layers"]["mlp"]["gate_proj"] == P("layers", "embed", "mlp")
    if cfg.qk_norm:
        assert axes["layers"]["attn"]["k_norm"]["scale"] == P("layers", "head_dim")
        assert axes["layers"]["mlp_out_norm"]["scale"] == P("layers", "embed")


def test_bad_head_counts_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        tfm.ModelConfig(vocab_size=10, num_heads=4, num_kv_heads=3)
