"""The decoders of the model tests (model_test, shared_prompt_test): a Llama-like one and a
Gemma-like one, and random parameters for either."""

import jax
import numpy as np

from conftest import tiny_gemma, tiny_model
from jrl.models import transformer as tfm

# Llama-like: rope theta, q / k / v biases, an untied head and a value head.
CFG = tiny_model(23, rope_theta=500.0, qkv_bias=True, tie_word_embeddings=False, value_head=True)

# Gemma-style: every family option on, layer 0 sliding (window 3) with its own rope theta.
GEMMA_CFG = tiny_gemma(
    23,
    ("sliding_attention", "full_attention"),
    query_pre_attn_scalar=24.0,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=10.0,
    rope_theta=1e4,
    rope_local_base_freq=100.0,
    rope_scaling_type="linear",
    rope_scaling_factor=2.0,
)


def random_params(cfg, seed=0, std=0.3):
    """Params of `cfg` drawn from N(0, std^2), norm scales included (no eager init to trace)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: tfm.init_params(cfg, k), jax.random.key(0))
    return jax.tree.map(lambda s: std * rng.standard_normal(s.shape).astype(np.float32), shapes)
