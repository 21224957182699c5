"""Response log-probs (jrl/logprobs.py): chunked log-probs and entropy equal the full logits'
(against a numpy reference) and never hold them; rematerialised blocks and blockwise attention
give the plain forward's log-probs and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import logprobs
from jrl.models import transformer as tfm

CFG = tfm.ModelConfig(
    vocab_size=37,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    qkv_bias=True,
    tie_word_embeddings=False,
    final_logit_softcapping=7.0,
)


def _batch(seed=0, b=3, p=5, r=7, vocab=37):
    """Left-padded prompts and right-padded responses of different lengths."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, vocab, (b, p)).astype(np.int32)
    pmask = np.ones((b, p), np.int32)
    pmask[1, :2] = 0  # left padding
    pmask[2, :4] = 0
    resp = rng.integers(1, vocab, (b, r)).astype(np.int32)
    rmask = np.ones((b, r), np.int32)
    rmask[0, 5:] = 0  # right padding (after EOS)
    rmask[2, 2:] = 0
    return tuple(jnp.asarray(x) for x in (prompt * pmask, pmask, resp * rmask, rmask))


def _numpy_log_probs(hidden, head, targets, temperature, cap):
    """Independent reference: full logits, log-softmax and entropy in float64 numpy."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
    logits = cap * np.tanh(logits / cap) / temperature
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    logp_all = logits - logz[..., None]
    logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
    entropy = -np.sum(np.exp(logp_all) * logp_all, -1)
    return logp, entropy


@pytest.mark.parametrize("chunk", [0, 3, 4, 16])  # 0: one chunk; 3 and 4 do not divide 10
def test_chunked_log_probs_and_entropy_equal_full_logits(chunk):
    cfg = dataclasses.replace(CFG, logits_chunk_size=chunk)
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.standard_normal((2, 10, 32)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((32, 37)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 37, (2, 10)), jnp.int32)
    logp, ent = logprobs.token_log_probs(cfg, hidden, head, targets, 0.7, with_entropy=True)
    want_logp, want_ent = _numpy_log_probs(hidden, head, targets, 0.7, 7.0)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-5)

    def loss(c, h, w):  # a scalar of both outputs, with unequal weights per position
        lp, en = logprobs.token_log_probs(c, h, w, targets, 0.7, with_entropy=True)
        weights = jnp.arange(20, dtype=jnp.float32).reshape(2, 10)
        return jnp.sum(lp * weights) + 0.3 * jnp.sum(en * weights[::-1])

    plain = dataclasses.replace(CFG, logits_chunk_size=0)
    got = jax.grad(lambda h, w: loss(cfg, h, w), argnums=(0, 1))(hidden, head)
    want = jax.grad(lambda h, w: loss(plain, h, w), argnums=(0, 1))(hidden, head)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_chunked_log_probs_hold_no_full_logits():
    """Compile-time memory of the gradient: the chunked path never holds [B, L, V] logits."""
    b, l, h, v = 2, 512, 16, 4096
    full_logits = b * l * v * 4

    def temp_bytes(chunk):
        cfg = dataclasses.replace(CFG, vocab_size=v, hidden_size=h, logits_chunk_size=chunk)
        f = lambda hid, w, t: jnp.sum(logprobs.token_log_probs(cfg, hid, w, t, 1.0, True)[0])
        args = (
            jax.ShapeDtypeStruct((b, l, h), jnp.float32),
            jax.ShapeDtypeStruct((h, v), jnp.float32),
            jax.ShapeDtypeStruct((b, l), jnp.int32),
        )
        grad = jax.jit(jax.grad(f, argnums=(0, 1)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(0) > full_logits  # the plain path does hold them (the check can fail)
    chunk_logits = full_logits // 16  # chunks of 32 positions
    assert temp_bytes(32) < min(8 * chunk_logits, full_logits / 2)  # a few chunks' worth


# Both kinds of layer, each with its own rotary theta (Gemma 3): the scan over layers then
# selects a layer's window and rotary tables from a traced flag.
MIXED_CFG = dataclasses.replace(
    CFG,
    sliding_window=3,
    layer_types=("sliding_attention", "full_attention"),
    rope_local_base_freq=100.0,
)


@pytest.mark.parametrize("remat", ["block", "dots"])
@pytest.mark.parametrize("base", [CFG, MIXED_CFG], ids=["llama", "mixed-layers"])
def test_remat_gives_the_same_values_and_gradients(remat, base):
    prompt, pmask, resp, rmask = _batch()
    params = tfm.init_params(base, jax.random.key(0))

    def loss(cfg, p):
        out = logprobs.response_outputs(cfg, p, prompt, pmask, resp, rmask, 1.0, True)
        return jnp.sum((out["log_prob"] + 0.1 * out["entropy"]) * rmask)

    want_v, want_g = jax.value_and_grad(lambda p: loss(base, p))(params)
    got_v, got_g = jax.value_and_grad(lambda p: loss(dataclasses.replace(base, remat=remat), p))(
        params
    )
    np.testing.assert_allclose(got_v, want_v, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_g, want_g)


def test_blockwise_attention_in_the_model_gives_the_same_log_probs_and_gradients():
    """The full forward with blockwise attention (blocks of 4 over 12 positions) equals the
    materialised one, padding and a sliding-window layer included."""
    cfg = dataclasses.replace(
        CFG, sliding_window=5, layer_types=("sliding_attention", "full_attention")
    )
    prompt, pmask, resp, rmask = _batch()
    params = tfm.init_params(cfg, jax.random.key(2))

    def loss(c, p):
        out = logprobs.response_outputs(c, p, prompt, pmask, resp, rmask)
        return jnp.sum(out["log_prob"] * rmask), out["log_prob"]

    grad = lambda c: jax.value_and_grad(lambda p: loss(c, p), has_aux=True)(params)
    (_, want_lp), want_g = grad(dataclasses.replace(cfg, attention="xla"))
    (_, got_lp), got_g = grad(
        dataclasses.replace(cfg, attention="blockwise", attention_block_size=4)
    )
    real = np.asarray(rmask, bool)
    np.testing.assert_allclose(np.asarray(got_lp)[real], np.asarray(want_lp)[real], atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_g, want_g)
