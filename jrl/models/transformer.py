"""One decoder-only transformer for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 families.

RMSNorm, rotary position embeddings (default, linear or llama3 scaling), grouped-query attention,
a gated MLP (SwiGLU or GeGLU), optional q/k/v bias, tied or untied embeddings, an optional scalar
value head. Family options, all off by default (`ModelConfig`): per-head q/k RMSNorm (Qwen3,
Gemma 3), RMSNorm scaling by (1 + w) (Gemma), the embedding scaled by sqrt(hidden) (Gemma),
norms on the attention and MLP outputs too (Gemma 2/3: four norms per block), attention and final
logit soft-capping (Gemma 2), a query scale other than 1/sqrt(head_dim) (Gemma), sliding-window
attention on all layers (Mistral) or on a per-layer pattern (Gemma 2/3, Qwen), and a separate rope
theta for the sliding layers (Gemma 3). Every parameter carries logical axis names ("vocab",
"embed", "heads", "kv_heads", "head_dim", "mlp") that `jrl.sharding` maps onto a device mesh.

One call serves three uses:
  * the full forward over a sequence (training, log-probs, values): `cache=None`;
  * prefill and KV-cache decode (rollout): pass `cache` (from `init_cache`) and `cache_index`,
    the cache slot of the first input token. The new keys / values are written there and the
    queries attend over the whole cache, as `attn_mask` allows.

Sliding windows are measured in slots: input token l sits in slot `cache_index + l` (slot l
without a cache) and may see the keys in slots (slot - sliding_window, slot]. A row's real tokens
must therefore occupy consecutive slots (left padding, right padding and the rollout layout
"prompt in slots [0, P), response from slot P" all do), as in Hugging Face's masks.

Shapes: B batch, L input length, S key length (L without a cache, the cache length with one),
H hidden, N query heads, K kv heads, D head dim, V vocabulary, F MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# MLP activations by their Hugging Face names (`hidden_act` / `hidden_activation`).
ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}


def _default_inv_freq(inv_freq, cfg):
    return inv_freq


def _linear_inv_freq(inv_freq, cfg):
    return inv_freq / cfg.rope_scaling_factor


def _llama3_inv_freq(inv_freq, cfg):
    """Llama 3.1: wavelengths above original_max / low_freq_factor slow down by `factor`, those
    below original_max / high_freq_factor stay, and the band between is interpolated."""
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return np.where(medium, smoothed, scaled)


# RoPE frequency scalings by their Hugging Face `rope_type`: f(inverse frequencies, cfg).
ROPE_SCALINGS: dict[str, Callable] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of the decoder. Field names follow Hugging Face's where they exist.

    The defaults are a Llama-style decoder; `jrl.models.hf.model_config_from_hf` fills in the
    family options from a Hugging Face `config.json`.
    """

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2 uses biases on q, k, v
    tie_word_embeddings: bool = True
    lm_head: bool = True  # compute next-token logits (policy); False for a critic-only model
    value_head: bool = False  # a scalar value per position (critic)
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # master-weight dtype
    init_std: float = 0.02
    # Family options (defaults: Llama).
    hidden_act: str = (
        "silu"  # gated-MLP activation, a key of ACTIVATIONS (Gemma: gelu_pytorch_tanh)
    )
    qk_norm: bool = False  # RMSNorm over head_dim on every query / key head (Qwen3, Gemma 3)
    norm_unit_offset: bool = False  # RMSNorm multiplies by (1 + scale), scale starts at 0 (Gemma)
    scale_embeddings: bool = False  # multiply the token embeddings by sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too (Gemma 2 / 3)
    query_pre_attn_scalar: float | None = None  # scores scale 1/sqrt(this); None: head_dim
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    sliding_window: int | None = None  # keys a sliding layer sees, itself included; None: off
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" /
    # "sliding_attention"; None: every layer sliding when sliding_window is set (Mistral)
    rope_local_base_freq: float | None = None  # sliding layers' unscaled rope theta (Gemma 3)
    rope_scaling_type: str = "default"  # a key of ROPE_SCALINGS: default | linear | llama3
    rope_scaling_factor: float = 1.0  # linear / llama3: how much longer the context becomes
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position_embeddings: int = 8192  # llama3: the pre-training context
    max_position_embeddings: int = 8192  # recorded for export; no limit is enforced
    hf_model_type: str | None = None  # family written on export; None: inferred from features

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def __post_init__(self):
        if self.layer_types is not None and not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads="
                f"{self.num_kv_heads}; choose kv heads that divide the query heads."
            )
        if not (self.lm_head or self.value_head):
            raise ValueError("model has neither lm_head nor value_head; enable at least one.")
        _check_choice("hidden_act", self.hidden_act, ACTIVATIONS)
        _check_choice("rope_scaling_type", self.rope_scaling_type, ROPE_SCALINGS)
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"model.layer_types has {len(self.layer_types)} entries for "
                    f"model.num_layers={self.num_layers}; give one per layer."
                )
            for t in self.layer_types:
                _check_choice("layer_types entry", t, LAYER_TYPES)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"model.sliding_window={self.sliding_window} must be >= 1, or None for no window."
            )

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING_ATTENTION


def _check_choice(name, value, table):
    if value not in table:
        raise ValueError(f"model.{name}={value!r} is not one of {', '.join(sorted(table))}.")


def rope_inv_freq(cfg: ModelConfig, layer: int) -> np.ndarray:
    """Inverse rotary frequencies [D/2] (float32) of `layer`.

    theta^(-2i/D) with the configured scaling; a sliding layer of a model with
    `rope_local_base_freq` uses that theta instead, unscaled (Gemma 3's local layers).
    """
    d = cfg.head_size
    exponents = np.arange(0, d, 2, dtype=np.float64) / d
    if cfg.rope_local_base_freq is not None and cfg.is_sliding(layer):
        return (1.0 / cfg.rope_local_base_freq**exponents).astype(np.float32)
    inv_freq = 1.0 / cfg.rope_theta**exponents
    return ROPE_SCALINGS[cfg.rope_scaling_type](inv_freq, cfg).astype(np.float32)


def _param(module, name, shape, axes, cfg: ModelConfig, init=None):
    init = init or nn.initializers.normal(cfg.init_std)
    return module.param(
        name, nn.with_logical_partitioning(init, axes), shape, jnp.dtype(cfg.param_dtype)
    )


class RMSNorm(nn.Module):
    """x / rms(x) * scale over the last axis (named `axis`); scale is (1 + w) with a unit offset."""

    cfg: ModelConfig
    axis: str = "embed"

    @nn.compact
    def __call__(self, x):
        offset = self.cfg.norm_unit_offset
        init = nn.initializers.zeros if offset else nn.initializers.ones
        scale = _param(self, "scale", (x.shape[-1],), (self.axis,), self.cfg, init)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
        return (y * (scale.astype(jnp.float32) + float(offset))).astype(x.dtype)


def apply_rope(x, positions, inv_freq):
    """Rotate-half rotary embedding. x [B, L, heads, D], positions [B, L], inv_freq [D/2]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def rope(x, positions, theta):
    """Rotary embedding, the rotate-half convention of HF Llama. x [B, L, heads, D], positions [B, L]."""
    d = x.shape[-1]
    return apply_rope(x, positions, 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d))


def softcap(x, cap: float | None):
    """cap * tanh(x / cap), computed in float32; identity when cap is None."""
    if cap is None:
        return x
    return cap * jnp.tanh(x.astype(jnp.float32) / cap)


def sliding_window_mask(window: int, query_len: int, key_len: int, cache_index=None):
    """[L, S] bool: query l (slot cache_index + l) sees key slot s when slot - window < s."""
    q_slot = jnp.arange(query_len) + (0 if cache_index is None else cache_index)
    return jnp.arange(key_len)[None, :] > q_slot[:, None] - window


class Attention(nn.Module):
    cfg: ModelConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x_BLH, positions_BL, mask_BLS, cache=None, cache_index=None):
        cfg = self.cfg
        n, k, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.hidden_size
        dt = jnp.dtype(cfg.dtype)

        def proj(name, heads, axes):
            w = _param(self, name, (h, heads, d), ("embed", axes, "head_dim"), cfg)
            y = jnp.einsum("blh,hnd->blnd", x_BLH, w.astype(dt))
            if cfg.qkv_bias:
                b = _param(
                    self, name + "_bias", (heads, d), (axes, "head_dim"), cfg, nn.initializers.zeros
                )
                y = y + b.astype(dt)
            return y

        q, kk = proj("q_proj", n, "heads"), proj("k_proj", k, "kv_heads")
        if cfg.qk_norm:
            q = RMSNorm(cfg, "head_dim", name="q_norm")(q)
            kk = RMSNorm(cfg, "head_dim", name="k_norm")(kk)
        inv_freq = rope_inv_freq(cfg, self.layer)
        q, kk = apply_rope(q, positions_BL, inv_freq), apply_rope(kk, positions_BL, inv_freq)
        v = proj("v_proj", k, "kv_heads")
        new_cache = None
        if cache is not None:
            kk = jax.lax.dynamic_update_slice(
                cache["k"], kk.astype(cache["k"].dtype), (0, cache_index, 0, 0)
            )
            v = jax.lax.dynamic_update_slice(
                cache["v"], v.astype(cache["v"].dtype), (0, cache_index, 0, 0)
            )
            new_cache = {"k": kk, "v": v}
        b, l = q.shape[:2]
        if cfg.is_sliding(self.layer):
            window = sliding_window_mask(cfg.sliding_window, l, kk.shape[1], cache_index)
            mask_BLS = mask_BLS & window[None]
        q = q.reshape(b, l, k, n // k, d)  # query heads grouped by the kv head they share
        scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        scores = jnp.einsum("blkgd,bskd->bkgls", q, kk.astype(dt)).astype(jnp.float32) * scale
        scores = softcap(scores, cfg.attn_logit_softcapping)
        scores = jnp.where(mask_BLS[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bkgls,bskd->blkgd", probs, v.astype(dt)).reshape(b, l, n, d)
        wo = _param(self, "o_proj", (n, d, h), ("heads", "head_dim", "embed"), cfg)
        return jnp.einsum("blnd,ndh->blh", out, wo.astype(dt)), new_cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        h, f = cfg.hidden_size, cfg.intermediate_size
        gate = _param(self, "gate_proj", (h, f), ("embed", "mlp"), cfg)
        up = _param(self, "up_proj", (h, f), ("embed", "mlp"), cfg)
        down = _param(self, "down_proj", (f, h), ("mlp", "embed"), cfg)
        y = ACTIVATIONS[cfg.hidden_act](x @ gate.astype(dt)) * (x @ up.astype(dt))
        return y @ down.astype(dt)


class Block(nn.Module):
    """Pre-norm block; with `sandwich_norms` the attention / MLP outputs are normed as well.

    Norm names: "input_norm" before attention, "post_attn_norm" before the MLP (HF Llama's
    post_attention_layernorm, Gemma's pre_feedforward_layernorm), "attn_out_norm" / "mlp_out_norm"
    on the outputs (Gemma's post_attention_layernorm / post_feedforward_layernorm).
    """

    cfg: ModelConfig
    layer: int = 0

    @nn.compact
    def __call__(self, x, positions, mask, cache=None, cache_index=None):
        cfg = self.cfg
        a, cache = Attention(cfg, self.layer, name="attn")(
            RMSNorm(cfg, name="input_norm")(x), positions, mask, cache, cache_index
        )
        if cfg.sandwich_norms:
            a = RMSNorm(cfg, name="attn_out_norm")(a)
        x = x + a
        m = MLP(cfg, name="mlp")(RMSNorm(cfg, name="post_attn_norm")(x))
        if cfg.sandwich_norms:
            m = RMSNorm(cfg, name="mlp_out_norm")(m)
        return x + m, cache


class Transformer(nn.Module):
    """Decoder. `__call__` returns (logits [B, L, V] f32 or None, values [B, L] f32 or None, cache)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, input_ids_BL, positions_BL, mask_BLS, cache=None, cache_index=None):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        embed = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
        x = jnp.take(embed, input_ids_BL, axis=0).astype(dt)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(cfg.hidden_size**0.5, dt)
        new_cache = []
        for i in range(cfg.num_layers):
            x, c = Block(cfg, i, name=f"layers_{i}")(
                x, positions_BL, mask_BLS, None if cache is None else cache[i], cache_index
            )
            new_cache.append(c)
        x = RMSNorm(cfg, name="final_norm")(x)
        logits = values = None
        if cfg.lm_head:
            if cfg.tie_word_embeddings:
                head = embed.T
            else:
                head = _param(
                    self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg
                )
            logits = softcap((x @ head.astype(dt)).astype(jnp.float32), cfg.final_logit_softcapping)
        if cfg.value_head:
            w = _param(self, "value_head", (cfg.hidden_size, 1), ("embed", None), cfg)
            b = _param(self, "value_head_bias", (1,), (None,), cfg, nn.initializers.zeros)
            values = (x @ w.astype(dt) + b.astype(dt))[..., 0].astype(jnp.float32)
        return logits, values, (None if cache is None else tuple(new_cache))


def init_cache(cfg: ModelConfig, batch: int, length: int) -> tuple[dict[str, Any], ...]:
    """An empty KV cache: one {"k", "v"} of [B, S, K, D] per layer, in the compute dtype."""
    shape = (batch, length, cfg.num_kv_heads, cfg.head_size)
    zeros = lambda: jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return tuple({"k": zeros(), "v": zeros()} for _ in range(cfg.num_layers))


def positions_from_mask(mask_BL):
    """Position ids that skip left padding: 0 at the first real token. mask [B, L] (1 = real)."""
    return jnp.maximum(jnp.cumsum(mask_BL.astype(jnp.int32), axis=-1) - 1, 0)


def causal_mask(mask_BL):
    """[B, L, L] bool: query i may attend to key j <= i when key j is a real token."""
    l = mask_BL.shape[-1]
    causal = jnp.tril(jnp.ones((l, l), bool))
    return causal[None] & mask_BL.astype(bool)[:, None, :]


def _boxed_init(cfg: ModelConfig, key):
    ids = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2), jnp.int32)
    return Transformer(cfg).init(key, ids, positions_from_mask(mask), causal_mask(mask))["params"]


def init_params(cfg: ModelConfig, key) -> Any:
    """Initial parameters: a plain pytree of arrays (see `logical_axes` for their axis names)."""
    return nn.unbox(_boxed_init(cfg, key))


def logical_axes(cfg: ModelConfig) -> Any:
    """The parameters' logical axis names: a pytree of `PartitionSpec`s shaped like the params."""
    return nn.get_partition_spec(jax.eval_shape(lambda k: _boxed_init(cfg, k), jax.random.key(0)))


def apply_full(cfg: ModelConfig, params, input_ids_BL, attention_mask_BL):
    """Full forward with left / right padding: (logits [B, L, V] or None, values [B, L] or None)."""
    logits, values, _ = Transformer(cfg).apply(
        {"params": params},
        input_ids_BL,
        positions_from_mask(attention_mask_BL),
        causal_mask(attention_mask_BL),
    )
    return logits, values


def forward(cfg: ModelConfig, params, input_ids_BL, attention_mask_BL=None):
    """Next-token logits [B, L, V] (float32) of a (possibly padded) batch of sequences."""
    if attention_mask_BL is None:
        attention_mask_BL = jnp.ones_like(input_ids_BL)
    return apply_full(cfg, params, input_ids_BL, attention_mask_BL)[0]
