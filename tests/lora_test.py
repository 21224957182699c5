"""LoRA: adapters on a frozen base (jrl/models/lora.py), in the model, the fused step, checkpoints
and export."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jrl import config as config_lib
from jrl import rollout
from jrl.models import lora
from jrl.models import transformer as tfm

CFG = tfm.ModelConfig(vocab_size=23, hidden_size=32, intermediate_size=48, num_heads=4)
CFG = dataclasses.replace(CFG, num_kv_heads=2, qkv_bias=True, tie_word_embeddings=False)
LORA = ml_collections.ConfigDict(
    dict(rank=4, alpha=8.0, target_modules=",".join(lora.TARGETS), dropout=0.0)
)
IDS = np.array([[0, 0, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8, 9]])
MASK = (np.arange(7)[None] >= np.array([[2], [0]])).astype(np.int32)


def _logits(cfg, params):
    return tfm.apply_full(cfg, params, jnp.asarray(IDS), jnp.asarray(MASK))[0]


def _moved(trainable, key):
    """`trainable` with random B (a trained adapter; B starts at zero)."""
    leaves, tree = jax.tree.flatten(trainable["lora"])
    keys = jax.random.split(key, len(leaves))
    leaves = [0.05 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    return {**trainable, "lora": jax.tree.unflatten(tree, leaves)}


@pytest.fixture(scope="module")
def model():
    params = tfm.init_params(CFG, jax.random.key(0))
    base, trainable = lora.init_trainable(params, LORA, jax.random.key(1))
    return params, base, _moved(trainable, jax.random.key(2))


def test_adapter_shapes_and_step0_equals_base(model):
    params, base, _ = model
    _, fresh = lora.init_trainable(params, LORA, jax.random.key(1))
    ad = fresh["lora"]["layers"]
    # A [L, *in, r], B [L, r, *out]: q_proj W [L, H, N, D], o_proj W [L, N, D, H].
    assert ad["attn"]["q_proj"]["a"].shape == (2, 32, 4)
    assert ad["attn"]["q_proj"]["b"].shape == (2, 4, 4, 8)
    assert ad["attn"]["o_proj"]["a"].shape == (2, 4, 8, 4)
    assert ad["attn"]["o_proj"]["b"].shape == (2, 4, 32)
    assert ad["mlp"]["down_proj"]["a"].shape == (2, 48, 4)
    bound = 1 / np.sqrt(32)  # PEFT: uniform in +-1/sqrt(fan_in)
    assert 0.5 * bound < np.abs(np.asarray(ad["attn"]["q_proj"]["a"])).max() <= bound
    full = lora.combine(base, fresh, lora.scale(LORA))
    np.testing.assert_array_equal(_logits(CFG, full), _logits(CFG, params))


def test_adapted_forward_equals_merged_weights(model):
    """x W + s x A B (the model) == x (W + s A B) (merged weights), on the layer-by-layer path,
    the rematerialised scan and the KV-cache rollout."""
    params, base, trainable = model
    s = lora.scale(LORA)
    full = lora.combine(base, trainable, s)
    merged = lora.merge(base, trainable, s)
    want = _logits(CFG, merged)
    assert np.abs(np.asarray(want - _logits(CFG, params))).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(_logits(CFG, full), want, atol=1e-5)
    remat = dataclasses.replace(CFG, remat="block")
    np.testing.assert_allclose(_logits(remat, full), want, atol=1e-5)
    # The rollout's log-probs (adapters in the decode loop) are the merged model's.
    prompt, pmask = jnp.asarray(IDS[:, :4]), jnp.asarray(MASK[:, :4])
    out = rollout.generate(
        CFG, full, prompt, pmask, jax.random.key(3), max_new_tokens=3, eos_id=22, pad_id=0
    )
    ids = jnp.concatenate([prompt, out.response_ids], 1)
    mask = jnp.concatenate([pmask, out.response_mask], 1)
    logp = jax.nn.log_softmax(tfm.apply_full(CFG, merged, ids, mask)[0][:, 3:-1], -1)
    want_logp = jnp.take_along_axis(logp, out.response_ids[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.log_probs * out.response_mask, want_logp * out.response_mask, atol=1e-5)


def test_lora_config_errors():
    cfg = config_lib.base_config()
    cfg.lora.rank = 8
    config_lib.validate(cfg)
    for field, value, words in (
        ("rank", -1, "lora.rank=-1"),
        ("target_modules", "q_proj,qproj", "did you mean 'q_proj'"),
        ("target_modules", "", "lora.target_modules is empty"),
        ("dropout", 0.1, "lora.dropout=0.1"),
        ("alpha", 0.0, "lora.alpha=0.0"),
    ):
        bad = config_lib.base_config()
        bad.lora.rank = 8
        bad.lora[field] = value
        with pytest.raises(config_lib.ConfigError, match=words.replace("(", r"\(")):
            config_lib.validate(bad)
