"""One decoder-only transformer for the Llama / Qwen2 family.

RMSNorm, rotary position embeddings (configurable theta), grouped-query attention, SwiGLU MLP,
optional q/k/v bias, tied or untied embeddings, an optional scalar value head. Every parameter
carries logical axis names ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp") that
`jrl.sharding` maps onto a device mesh.

One call serves three uses:
  * the full forward over a sequence (training, log-probs, values): `cache=None`;
  * prefill and KV-cache decode (rollout): pass `cache` (from `init_cache`) and `cache_index`,
    the cache slot of the first input token. The new keys / values are written there and the
    queries attend over the whole cache, as `attn_mask` allows.

Shapes: B batch, L input length, S key length (L without a cache, the cache length with one),
H hidden, N query heads, K kv heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of the decoder. Field names follow Hugging Face's where they exist."""

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
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

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads="
                f"{self.num_kv_heads}; choose kv heads that divide the query heads."
            )
        if not (self.lm_head or self.value_head):
            raise ValueError("model has neither lm_head nor value_head; enable at least one.")


def _param(module, name, shape, axes, cfg: ModelConfig, init=None):
    init = init or nn.initializers.normal(cfg.init_std)
    return module.param(
        name, nn.with_logical_partitioning(init, axes), shape, jnp.dtype(cfg.param_dtype)
    )


class RMSNorm(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", (x.shape[-1],), ("embed",), self.cfg, nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta):
    """Rotary embedding, the rotate-half convention of HF Llama. x [B, L, heads, D], positions [B, L]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, D/2]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

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

        q = rope(proj("q_proj", n, "heads"), positions_BL, cfg.rope_theta)
        kk = rope(proj("k_proj", k, "kv_heads"), positions_BL, cfg.rope_theta)
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
        q = q.reshape(b, l, k, n // k, d)  # query heads grouped by the kv head they share
        scores = jnp.einsum("blkgd,bskd->bkgls", q, kk.astype(dt)).astype(jnp.float32) / jnp.sqrt(d)
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
        y = jax.nn.silu(x @ gate.astype(dt)) * (x @ up.astype(dt))
        return y @ down.astype(dt)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask, cache=None, cache_index=None):
        a, cache = Attention(self.cfg, name="attn")(
            RMSNorm(self.cfg, name="input_norm")(x), positions, mask, cache, cache_index
        )
        x = x + a
        x = x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="post_attn_norm")(x))
        return x, cache


class Transformer(nn.Module):
    """Decoder. `__call__` returns (logits [B, L, V] f32 or None, values [B, L] f32 or None, cache)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, input_ids_BL, positions_BL, mask_BLS, cache=None, cache_index=None):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        embed = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
        x = jnp.take(embed, input_ids_BL, axis=0).astype(dt)
        new_cache = []
        for i in range(cfg.num_layers):
            x, c = Block(cfg, name=f"layers_{i}")(
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
            logits = (x @ head.astype(dt)).astype(jnp.float32)
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
