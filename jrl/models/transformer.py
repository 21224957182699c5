"""One decoder-only transformer for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3
families and the Qwen3-MoE / Mixtral mixtures of experts.

RMSNorm, rotary position embeddings (default, linear or llama3 scaling), grouped-query attention,
a gated MLP (SwiGLU or GeGLU), optional q/k/v bias, tied or untied embeddings, an optional scalar
value head. Family options, all off by default (`ModelConfig`): per-head q/k RMSNorm (Qwen3,
Gemma 3), RMSNorm scaling by (1 + w) (Gemma), the embedding scaled by sqrt(hidden) (Gemma),
norms on the attention and MLP outputs too (Gemma 2/3: four norms per block), attention and final
logit soft-capping (Gemma 2), a query scale other than 1/sqrt(head_dim) (Gemma), sliding-window
attention on all layers (Mistral) or on a per-layer pattern (Gemma 2/3, Qwen), and a separate rope
theta for the sliding layers (Gemma 3), and sparse MLPs (`MoE`, `num_experts` > 0: a router
and SwiGLU experts on the layers `ModelConfig.is_sparse` names; maths in `jrl.models.moe`), whose
routing a forward reports (`Output.routing`) and can take from elsewhere (routing replay).
Every parameter carries logical axis names ("vocab", "embed", "heads", "kv_heads", "head_dim",
"mlp", "expert") that `jrl.sharding` maps onto a device mesh.

The decoder blocks' parameters are stacked: `params["layers"]` is one block's tree with a
leading [num_layers] axis (logical name "layers"; `jrl.models.hf` maps layer i to Hugging Face's
`model.layers.{i}.*`). With `remat` the full forward runs the blocks as a `scan` over that axis
(one block compiled, not num_layers; each iteration keeps only its input for the backward,
which a loop guarantees on every backend); whether a layer slides its window goes in as a
scanned input, the forward's rotary tables (`rope_tables`) as a broadcast one. Without remat
(small models: faster on CPU) and in the rollout (each layer with its own KV cache) the layers
run one by one.

One call serves three uses:
  * the full forward over a sequence (training, log-probs, values): `cache=None, mask=None`, rows
    right-padded (`full_forward` moves each row's left padding to its end and back), so causal
    masking alone is exact and attention runs through `jrl.models.attention` (blockwise, or a
    fused kernel, at long lengths: no [L, L] scores of a whole sequence);
  * prefill and KV-cache decode (rollout): pass `cache` (from `init_cache`), `cache_index`, the
    cache slot of the first input token, and a [B, L, S] mask. The new keys / values are written
    there and the queries attend over the cache, as the mask allows (a prefill from slot 0 only
    over the slots it fills). `cache_index` may also be a [B] array, a start slot per row
    (`write_cache_rows`: the multi-turn rollout, whose rows advance at their own pace).

The module returns the final hidden states and the output projection, not logits: callers take
`lm_logits` where they need them (the last position in the rollout) or log-probs a chunk of
positions at a time (`token_log_probs`), so no [B, L, V] array is needed at real vocabularies.
Memory knobs (`ModelConfig`, not architecture: a checkpoint computes the same with any of them):
`remat` rematerialises decoder blocks in the backward, `attention` / `attention_block_size`
choose the attention implementation, `logits_chunk_size` the positions per log-prob chunk.

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
from typing import Any

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jrl import partitioning
from jrl.models import attention as attention_lib
from jrl.models import moe
from jrl.registry import Registry

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# The attention kinds a layer may have (`ModelConfig.layer_types` entries); no entry values.
LAYER_TYPES = Registry(
    "layer type (model.layer_types entry)", dict.fromkeys((FULL_ATTENTION, SLIDING_ATTENTION))
)

# MLP activations by their Hugging Face names (`hidden_act` / `hidden_activation`).
ACTIVATIONS = Registry(
    "MLP activation (model.hidden_act)",
    {
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    },
)


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


# Rematerialisation of decoder blocks in the backward (`ModelConfig.remat`): what a block keeps
# from its forward; everything else is recomputed. None: no rematerialisation.
REMAT_POLICIES = Registry(
    "remat policy (model.remat)",
    {
        "none": None,  # every activation of every layer is kept for the backward
        "block": jax.checkpoint_policies.nothing_saveable,  # only each block's input is kept
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # + projection outputs
    },
)

# Fields of ModelConfig that choose how the model is computed, not what it computes.
COMPUTE_FIELDS = (
    "dtype",
    "remat",
    "attention",
    "attention_block_size",
    "logits_chunk_size",
    "scan_cached_layers",
)

# RoPE frequency scalings by their Hugging Face `rope_type`: f(inverse frequencies, cfg).
ROPE_SCALINGS = Registry(
    "RoPE scaling (model.rope_scaling_type / Hugging Face rope_type)",
    {"default": _default_inv_freq, "linear": _linear_inv_freq, "llama3": _llama3_inv_freq},
)


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
    # Mixture of experts (Qwen3-MoE, Mixtral; `MoE`, `jrl.models.moe`); 0 experts: dense.
    num_experts: int = 0  # experts of a sparse layer (HF num_experts / num_local_experts)
    num_experts_per_tok: int = 0  # experts each token is routed to (top k)
    moe_intermediate_size: int | None = None  # an expert's width; None: intermediate_size
    norm_topk_prob: bool = False  # top-k weights divided by their sum (Qwen3-MoE; Mixtral: on)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % this == 0 (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers with the dense MLP instead (Qwen3-MoE)
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight (HF's field)
    output_router_logits: bool = False  # HF: whether training adds that loss (see moe.py)
    hf_model_type: str | None = None  # family written on export; None: inferred from features
    # How to compute (COMPUTE_FIELDS): the same function whatever these are.
    remat: str = "none"  # a key of REMAT_POLICIES: none | block | dots
    attention: str = "auto"  # full-forward attention (jrl.models.attention.IMPLEMENTATIONS)
    attention_block_size: int = 512  # query positions per block of blockwise attention
    # decode attention over the KV cache (jrl.models.attention.DECODE_IMPLEMENTATIONS)
    decode_attention: str = "blockwise"
    logits_chunk_size: int = 0  # positions per log-prob / entropy chunk; 0: all at once
    # the forwards with a KV cache (prefill, decode, the grouped forward) run the layers as one
    # scan over a stacked cache [layers, B, K, S, D] (one layer traced: compile time and memory
    # of deep models); False: layer by layer, each with its own cache (faster on XLA:CPU)
    scan_cached_layers: bool = False
    # the experts' grouped matmul (jrl.models.moe.MATMULS); not a run config field yet
    moe_matmul: str = "auto"

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def __post_init__(self):
        if self.layer_types is not None and not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if not isinstance(self.mlp_only_layers, tuple):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads="
                f"{self.num_kv_heads}; choose kv heads that divide the query heads."
            )
        if not (self.lm_head or self.value_head):
            raise ValueError("model has neither lm_head nor value_head; enable at least one.")
        ACTIVATIONS.get(self.hidden_act)  # each raises UnknownName (a ValueError) if unknown
        ROPE_SCALINGS.get(self.rope_scaling_type)
        REMAT_POLICIES.get(self.remat)
        attention_lib.IMPLEMENTATIONS.get(self.attention)
        attention_lib.DECODE_IMPLEMENTATIONS.get(self.decode_attention)
        moe.MATMULS.get(self.moe_matmul)
        if self.attention_block_size < 1 or self.logits_chunk_size < 0:
            raise ValueError(
                f"model.attention_block_size={self.attention_block_size} must be >= 1 and "
                f"model.logits_chunk_size={self.logits_chunk_size} >= 0 (0: one chunk)."
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"model.layer_types has {len(self.layer_types)} entries for "
                    f"model.num_layers={self.num_layers}; give one per layer."
                )
            for t in self.layer_types:
                LAYER_TYPES.get(t)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"model.sliding_window={self.sliding_window} must be >= 1, or None for no window."
            )
        self._check_experts()

    def _check_experts(self):
        if self.num_experts < 0:
            raise ValueError(f"model.num_experts={self.num_experts} must be >= 0 (0: dense).")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} must be in [1, "
                f"model.num_experts={self.num_experts}]."
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be >= 1.")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"model.mlp_only_layers={list(self.mlp_only_layers)} names layers outside "
                f"[0, model.num_layers={self.num_layers})."
            )
        if self.moe_intermediate_size is not None and self.moe_intermediate_size < 1:
            raise ValueError(
                f"model.moe_intermediate_size={self.moe_intermediate_size} must be >= 1, or "
                "None for model.intermediate_size."
            )

    @property
    def expert_size(self) -> int:
        """An expert's width (I)."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts (Qwen3-MoE's rule; every layer of
        Mixtral): experts exist, the layer is not in mlp_only_layers and (layer + 1) is a
        multiple of decoder_sparse_step."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def sparse_layers(self) -> tuple[int, ...]:
        """The sparse layers, in order (`Output.routing` stacks them)."""
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    def mlp_kinds(self) -> tuple[bool, ...]:
        """The MLP kinds among the layers, sorted: (False,) dense only, (True,) sparse only,
        (False, True) both (the params then hold both in every layer; see `MoE`)."""
        return tuple(sorted({self.is_sparse(i) for i in range(self.num_layers)}))

    def layer_kinds(self) -> tuple[bool, ...]:
        """The attention kinds among the layers, sorted: (False,) full only, (True,) sliding
        only, (False, True) both (Gemma 2 / 3)."""
        return tuple(sorted({self.is_sliding(i) for i in range(self.num_layers)}))

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING_ATTENTION


def rope_inv_freq(cfg: ModelConfig, sliding: bool = False) -> np.ndarray:
    """Inverse rotary frequencies [D/2] (float32) of a full (or, with `sliding`, a sliding) layer.

    theta^(-2i/D) with the configured scaling; the sliding layers of a model with
    `rope_local_base_freq` use that theta instead, unscaled (Gemma 3's local layers).
    """
    d = cfg.head_size
    exponents = np.arange(0, d, 2, dtype=np.float64) / d
    if cfg.rope_local_base_freq is not None and sliding:
        return (1.0 / cfg.rope_local_base_freq**exponents).astype(np.float32)
    inv_freq = 1.0 / cfg.rope_theta**exponents
    return ROPE_SCALINGS.get(cfg.rope_scaling_type)(inv_freq, cfg).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions_BL, length: int) -> dict:
    """The rotary embedding's cos and sin at `positions` [B, L] (each in [0, length)):
    {sliding: (cos, sin)}, each [B, L, 1, D] float32, one entry per distinct set of frequencies
    (two only for a model with both kinds of layer and `rope_local_base_freq`, Gemma 3; see
    `_layer_rope`). The angles of positions 0..length-1 are tabulated at trace time (float32
    products, as HF computes them) and the tables gathered at `positions`, once per forward for
    every layer: computed from the positions in the graph, XLA:CPU fused a sin and a cos into
    the rotation of every query and key element of every layer, forward and backward, where
    they cost ~8x the rotation itself."""
    kinds = cfg.layer_kinds() if cfg.rope_local_base_freq is not None else (False,)
    gather = lambda t: jnp.take(jnp.asarray(t), positions_BL, axis=0, mode="clip")[:, :, None]
    out = {}
    for sliding in kinds:
        angles = np.arange(length, dtype=np.float32)[:, None] * rope_inv_freq(cfg, sliding)
        angles = np.concatenate([angles, angles], -1)  # [length, D]
        out[sliding] = gather(np.cos(angles)), gather(np.sin(angles))
    return out


def _layer_rope(rope: dict, sliding):
    """A layer's (cos, sin) from `rope_tables`; `sliding` is a bool, or traced in the scan over
    the layers of a model with both kinds (then a select between the two tables)."""
    if len(rope) == 1:
        return next(iter(rope.values()))
    if isinstance(sliding, (bool, np.bool_)):
        return rope[bool(sliding)]
    return jax.tree.map(lambda s, f: jnp.where(sliding, s, f), rope[True], rope[False])


def _activation(x, *last_axes):
    """Pins an activation [B, L, ...] to rows over the batch mesh axes (data, fsdp) and its last
    dims to `last_axes` (logical names; none: replicated), when traced under a mesh. Without
    it XLA may follow FSDP-sharded weights and split activations on the hidden dim instead,
    every device holding every row."""
    spec = ("batch",) + (None,) * (x.ndim - 1 - len(last_axes)) + last_axes
    return partitioning.constrain(x, jax.sharding.PartitionSpec(*spec))


def _adapter(module, name: str, x, num_in: int):
    """x @ A @ B of projection `name`'s LoRA adapter (variable collection "lora", see
    `jrl.models.lora`: A [*in, r], B [r, *out], B already scaled by alpha / r), contracting the
    last `num_in` dims of x; None when the projection has no adapter (the base alone). With a
    dropout key (`lora.with_dropout`) x is dropped first, x * mask / (1 - rate), as PEFT does."""
    if not module.has_variable("lora", name):
        return None
    adapter = module.get_variable("lora", name)
    if "dropout_key" in adapter:  # training forward with lora.dropout (`lora.with_dropout`)
        key, rate = jax.random.wrap_key_data(adapter["dropout_key"]), adapter["dropout_rate"]
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        x = jnp.where(keep, x / (1.0 - rate).astype(x.dtype), jnp.zeros((), x.dtype))
    h = jnp.tensordot(x, adapter["a"].astype(x.dtype), num_in)
    return jnp.tensordot(h, adapter["b"].astype(x.dtype), 1)


def _plus(y, delta):
    return y if delta is None else y + delta


def product(spec: str, x, w, dt, decode: bool = False):
    """einsum(spec, x, w) in the compute dtype `dt`. With `decode` (the rollout's forwards, which
    have no backward) the product is taken in float32 (`preferred_element_type`) and rounded to
    `dt` once: the same numbers (a bfloat16 product accumulates in float32 on every backend),
    and XLA:CPU then multiplies bfloat16 operands as they are instead of converting the weights
    and the KV cache to float32 first. Training keeps the plain product: there the float32
    output would make the backward's products mixed-precision."""
    w = w.astype(dt)
    if not decode:
        return jnp.einsum(spec, x, w)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(dt)


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


def rotate(x, cos, sin):
    """Rotate-half rotary embedding of x [B, L, heads, D] by angles whose cos and sin
    (float32) broadcast against it."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def softcap(x, cap: float | None):
    """cap * tanh(x / cap), computed in float32; identity when cap is None."""
    if cap is None:
        return x
    return cap * jnp.tanh(x.astype(jnp.float32) / cap)


def sliding_window_mask(window: int, query_len: int, key_len: int, cache_index=None):
    """[L, S] bool: query l (slot cache_index + l) sees key slot s when slot - window < s.
    With a per-row `cache_index` [B]: [B, L, S]."""
    if jnp.ndim(cache_index) == 1:
        q_slot = cache_index[:, None] + jnp.arange(query_len)[None]
        return jnp.arange(key_len)[None, None, :] > q_slot[..., None] - window
    q_slot = jnp.arange(query_len) + (0 if cache_index is None else cache_index)
    return jnp.arange(key_len)[None, :] > q_slot[:, None] - window


def write_cache_rows(cache_BKSD, x_BLKD, start_B, layer=None):
    """The cache [B, K, S, D] with row b's L new keys or values written at slots start_B[b] ..
    start_B[b] + L - 1; slots at or past S are dropped, so a row given start S is left unchanged
    (the multi-turn rollout's per-row write offsets and masked writes). With `layer`: the
    stacked cache [layers, B, K, S, D] (`ModelConfig.scan_cached_layers`), written in that
    layer's entry."""
    b, l = x_BLKD.shape[:2]
    slots = start_B[:, None] + jnp.arange(l)[None]  # [B, L]
    rows = jnp.arange(b)[:, None]
    # advanced indices around a slice: the update is laid out [B, L, K, D]
    at = (rows, slice(None), slots) if layer is None else (layer, rows, slice(None), slots)
    return cache_BKSD.at[at].set(x_BLKD.astype(cache_BKSD.dtype), mode="drop")


def write_cache(cache, x_BLKD, index, layer=None):
    """The cache [B, K, S, D] with the L new keys or values x [B, L, K, D] written from slot
    `index` on: a scalar (every row; a dynamic-update-slice) or [B] (a slot per row,
    `write_cache_rows`). With `layer`: the stacked cache [layers, B, K, S, D], that layer's."""
    if jnp.ndim(index) == 1:  # a start slot per row [B]
        return write_cache_rows(cache, x_BLKD, index, layer)
    x = x_BLKD.astype(cache.dtype).transpose(0, 2, 1, 3)  # [B, K, L, D]
    if layer is None:
        return jax.lax.dynamic_update_slice(cache, x, (0, 0, index, 0))
    return jax.lax.dynamic_update_slice(cache, x[None], (layer, 0, 0, index, 0))


def _by_kind(cfg: ModelConfig, sliding, attend):
    """attend(window) of a layer: window = cfg.sliding_window on a sliding layer, else None.
    `sliding` is a bool, or traced inside the scan over the layers of a model that has both
    kinds (Gemma 2 / 3): then both are compiled and `lax.cond` picks one per layer."""
    kinds = cfg.layer_kinds()
    if len(kinds) == 1 or isinstance(sliding, (bool, np.bool_)):
        sliding = kinds[0] if len(kinds) == 1 else bool(sliding)
        return attend(cfg.sliding_window if sliding else None)
    return jax.lax.cond(sliding, lambda: attend(cfg.sliding_window), lambda: attend(None))


class Attention(nn.Module):
    cfg: ModelConfig
    decode: bool = False  # `product`'s: the rollout's forwards

    @nn.compact
    def __call__(self, x_BLH, rope, mask_BLS, sliding, cache=None, cache_index=None, layer=None):
        """`layer`: `cache` is the stacked cache of every layer (`ModelConfig.scan_cached_layers`)
        and this layer's entry is the one written and read."""
        cfg = self.cfg
        n, k, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.hidden_size
        dt = jnp.dtype(cfg.dtype)

        def proj(name, heads, axes):
            w = _param(self, name, (h, heads, d), ("embed", axes, "head_dim"), cfg)
            y = product("blh,hnd->blnd", x_BLH, w, dt, self.decode)
            y = _activation(_plus(y, _adapter(self, name, x_BLH, 1)), axes, None)
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
        cos, sin = _layer_rope(rope, sliding)
        q, kk = rotate(q, cos, sin), rotate(kk, cos, sin)
        v = proj("v_proj", k, "kv_heads")
        new_cache = None
        if cache is not None:  # head-major [B, K, S, D]: written at slot cache_index
            write = lambda c, x: write_cache(c, x, cache_index, layer)
            new_cache = {**cache, "k": write(cache["k"], kk), "v": write(cache["v"], v)}
            kk, v = new_cache["k"], new_cache["v"]  # with `layer`: the stacks, that layer's read
        scale = (cfg.query_pre_attn_scalar or d) ** -0.5
        if mask_BLS is None:  # full forward over right-padded rows: causal (+ window) alone
            attend = lambda window: attention_lib.causal_attention(
                q,
                kk,
                v,
                scale=scale,
                softcap=cfg.attn_logit_softcapping,
                sliding_window=window,
                implementation=cfg.attention,
                block_size=cfg.attention_block_size,
            )
        else:
            shared = None if cache is None or "prompt_k" not in cache else cache
            shared = shared and (shared["prompt_k"], shared["prompt_v"])
            attend = lambda window: _masked_attention(
                q, kk, v, mask_BLS, cache_index, window, scale, cfg, shared, layer
            )
        out = _by_kind(cfg, sliding, attend)
        wo = _param(self, "o_proj", (n, d, h), ("heads", "head_dim", "embed"), cfg)
        y = product("blnd,ndh->blh", out, wo, dt, self.decode)
        return _plus(y, _adapter(self, "o_proj", out, 2)), new_cache


def _masked_attention(
    q, k_BKSD, v_BKSD, mask, cache_index, window, scale, cfg: ModelConfig, prompt=None, layer=None
):
    """Attention over the head-major KV cache [B, K, S, D] (rollout: prefill and decode).

    `mask` [B, L, S]: what each query sees, materialised (one [B, K, G, L, S] score array; a
    prefill from slot 0, `cache_index` a Python int, attends only over the slots it fills).
    `mask` [B, S]: the slots each row's queries may see (real prompt slots, response slots), to
    which causality by slot and the window are added: query l sits at slot cache_index + l (per
    row with a [B] index), and `attention.decode_attention` reads the cache in blocks up to the
    last query's slot only. A row whose index is at or past S (a dropped write, see
    `write_cache_rows`) does not extend the blocks read; its outputs are garbage. `prompt`
    (with a [B, S] mask): the cache's `prompt_k` / `prompt_v` [G, K, P, D], the first P slots
    once per group of B / G consecutive rows (`with_shared_prompt`), read once per group.
    `layer`: the cache (and `prompt`) stacks every layer's [layers, ...] and this layer's is
    read: the decode attention slices its blocks from the stack (`decode_attention`'s `layer`);
    the materialised paths take the layer's whole cache."""
    b, l, n, d = q.shape
    k = k_BKSD.shape[-3]
    q = q.reshape(b, l, k, n // k, d)  # query heads grouped by the kv head they share
    softcap = cfg.attn_logit_softcapping
    s = k_BKSD.shape[-2]
    if layer is not None and (mask.ndim == 3 or cfg.decode_attention == "xla"):
        prompt = None if prompt is None else tuple(x[layer] for x in prompt)
        k_BKSD, v_BKSD, layer = k_BKSD[layer], v_BKSD[layer], None
    if mask.ndim == 2 and cfg.decode_attention == "xla":  # the whole cache, materialised
        q_slot = jnp.reshape(cache_index, (-1, 1)) + jnp.arange(l)  # [B or 1, L]
        mask = mask[:, None, :] & (jnp.arange(s) <= q_slot[..., None])
    if mask.ndim == 2:
        shared = None
        if prompt is not None:  # with each group's first row's prompt slots
            groups, p = prompt[0].shape[-4], prompt[0].shape[-2]
            shared = (*prompt, mask[:: b // groups, :p])
        if jnp.ndim(cache_index) == 1:  # a start slot per row
            live = cache_index < s
            first, end = jnp.min(cache_index), jnp.max(jnp.where(live, cache_index, 0)) + l
            end = jnp.minimum(end, s)
            q_slot = cache_index[:, None] + jnp.arange(l)[None]
        else:
            first, end = cache_index, cache_index + l
            end = min(end, s) if isinstance(end, int) else jnp.minimum(end, s)
            q_slot = jnp.broadcast_to(cache_index + jnp.arange(l), (b, l))
        out = attention_lib.decode_attention(
            q,
            k_BKSD,
            v_BKSD,
            mask,
            q_slot,
            end,
            first_slot=first,
            prompt=shared,
            scale=scale,
            softcap=softcap,
            window=window,
            block_size=cfg.attention_block_size,
            layer=layer,
        )
        return out.reshape(b, l, n, d)
    if isinstance(cache_index, int) and cache_index == 0:  # a prefill: only the slots it fills
        k_BKSD, v_BKSD, mask = k_BKSD[:, :, :l], v_BKSD[:, :, :l], mask[..., :l]
    if window is not None:
        window_LS = sliding_window_mask(window, l, k_BKSD.shape[2], cache_index)
        mask = mask & (window_LS if window_LS.ndim == 3 else window_LS[None])
    bias = attention_lib.mask_bias(mask)[:, None, None]  # [B, 1, 1, L, S]
    out = attention_lib.attend_head_major(q, k_BKSD, v_BKSD, bias, scale, softcap)
    return out.reshape(b, l, n, d)


class MLP(nn.Module):
    cfg: ModelConfig
    decode: bool = False  # `product`'s: the rollout's forwards

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        h, f = cfg.hidden_size, cfg.intermediate_size
        gate = _param(self, "gate_proj", (h, f), ("embed", "mlp"), cfg)
        up = _param(self, "up_proj", (h, f), ("embed", "mlp"), cfg)
        down = _param(self, "down_proj", (f, h), ("mlp", "embed"), cfg)
        # Rows flattened to [B*L, H] around the matmuls: XLA:CPU fused the activation's backward
        # into a 3-D dot's output and took a slow path (the MLP's backward ran at 2x the time).
        x2 = x.reshape(-1, h)
        mul = lambda v, w: product("...h,hf->...f", v, w, dt, self.decode)
        proj = lambda name, w, v: _plus(mul(v, w), _adapter(self, name, v, 1))
        y = ACTIVATIONS.get(cfg.hidden_act)(proj("gate_proj", gate, x2)) * proj("up_proj", up, x2)
        y = _activation(y.reshape(*x.shape[:-1], f), "mlp").reshape(-1, f)
        return proj("down_proj", down, y).reshape(x.shape)


class MoE(nn.Module):
    """The sparse MLP of Qwen3-MoE / Mixtral (`jrl.models.moe` has the maths): a router [H, E]
    and E SwiGLU experts stacked one tensor per projection, gate / up [E, H, I] and down
    [E, I, H] (logical axis "expert" first).

    `__call__(x [B, L, H], routing=None, token_mask=None)` -> (y [B, L, H], `moe.Routing`):
    `routing` [B, L, k] int replaces the router's own top k (routing replay), except at tokens
    whose entry is negative (-1: none recorded), which keep their own; `token_mask` [B, L]
    marks the real tokens the load-balancing statistics count (None: all).

    LoRA (`jrl.models.lora`): an expert projection with an adapter ("lora" collection, A [E,
    in, r] and B [E, r, out], one pair per expert) computes with W + A B (`_expert_weights`),
    the low-rank product folded into the weights at each forward, as PEFT does for stacked
    expert parameters (its `target_parameters`); no dropout there."""

    cfg: ModelConfig
    decode: bool = False  # `product`'s: the rollout's forwards

    @nn.compact
    def __call__(self, x, routing=None, token_mask=None):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        e, h, f, k = cfg.num_experts, cfg.hidden_size, cfg.expert_size, cfg.num_experts_per_tok
        router = _param(self, "router", (h, e), ("embed", None), cfg)
        gate = _param(self, "gate_proj", (e, h, f), ("expert", "embed", "mlp"), cfg)
        up = _param(self, "up_proj", (e, h, f), ("expert", "embed", "mlp"), cfg)
        down = _param(self, "down_proj", (e, f, h), ("expert", "mlp", "embed"), cfg)
        adapted = lambda n, w: _expert_weights(w, self.get_variable("lora", n), dt)
        gate, up, down = (
            adapted(n, w) if self.has_variable("lora", n) else w
            for n, w in zip(EXPERT_PROJECTIONS, (gate, up, down))
        )
        x2 = x.reshape(-1, h)
        logits = product("th,he->te", x2, router, dt, self.decode)
        given = None if routing is None else routing.reshape(-1, k)
        if given is not None:  # where nothing was recorded (-1), the router's own top k
            own = moe.route(logits, k, cfg.norm_topk_prob)[3]
            given = jnp.where(given[:, :1] < 0, own, given)
        experts, weights, probs, own = moe.route(logits, k, cfg.norm_topk_prob, given)
        act = ACTIVATIONS.get(cfg.hidden_act)
        per_token = lambda a: a.reshape(*x.shape[:-1], k)  # [B, L, k]: rows stay split
        options = (act, dt, self.decode, cfg.moe_matmul)
        # expert parallel where the mesh splits the experts (moe.dispatch)
        y = moe.dispatch(x, per_token(experts), per_token(weights), (gate, up, down), *options)
        valid = None if token_mask is None else token_mask.reshape(-1)
        stats = moe.routing_stats(own, probs, valid)
        return y, moe.Routing(per_token(own), *stats)


# The expert projections, in the order `MoE` reads them (their LoRA adapters' names too).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _expert_weights(w_EIO, adapter, dt):
    """An expert projection's weights [..., E, in, out] with its LoRA adapter folded in, in the
    compute dtype: W + A B, A [..., E, in, r], B [..., E, r, out] (B already scaled by alpha /
    r)."""
    return w_EIO.astype(dt) + jnp.matmul(adapter["a"].astype(dt), adapter["b"].astype(dt))


def fold_expert_adapters(cfg: ModelConfig, params):
    """`params` (with a "lora" entry, `variables`) with the experts' adapters folded into the
    stacked expert weights (`_expert_weights`, in the compute dtype) and dropped from the
    adapters: what `MoE` computes at every forward, done once (the rollout, before its decode
    loop; no gradient flows through it). `params` itself when it holds no expert adapter."""
    adapters = params.get("lora", {}).get("layers", {})
    if "moe" not in adapters:
        return params
    dt = jnp.dtype(cfg.dtype)
    experts = dict(params["layers"]["moe"])
    for name, adapter in adapters["moe"].items():
        experts[name] = _expert_weights(experts[name], adapter, dt)
    rest = {m: v for m, v in adapters.items() if m != "moe"}
    out = {**params, "layers": {**params["layers"], "moe": experts}}
    if rest:
        return {**out, "lora": {**params["lora"], "layers": rest}}
    return {k: v for k, v in out.items() if k != "lora"}


def _no_routing(cfg: ModelConfig, x) -> moe.Routing:
    """A dense layer's `moe.Routing` in a model with sparse ones: zeros of the same shapes."""
    e = cfg.num_experts
    zeros = jnp.zeros((e,), jnp.float32)
    experts = jnp.zeros((*x.shape[:-1], cfg.num_experts_per_tok), jnp.int32)
    return moe.Routing(experts, zeros, zeros, jnp.zeros((), jnp.float32))


class Block(nn.Module):
    """Pre-norm block; with `sandwich_norms` the attention / MLP outputs are normed as well.

    Norm names: "input_norm" before attention, "post_attn_norm" before the MLP (HF Llama's
    post_attention_layernorm, Gemma's pre_feedforward_layernorm), "attn_out_norm" / "mlp_out_norm"
    on the outputs (Gemma's post_attention_layernorm / post_feedforward_layernorm).

    `sliding`: whether this layer attends through the sliding window (`_by_kind`); `rope`: the
    forward's `rope_tables`. A model with experts (`num_experts`) also passes `sparse`, whether
    this layer's MLP is the `MoE` ("moe"; else the dense "mlp"), a bool or traced like
    `sliding`, the layer's replayed experts `routing` [B, L, k] (or None) and the `token_mask`
    [B, L] its routing statistics count. A model with both kinds of layer holds both MLPs'
    parameters in every layer (the stack is one tree), each layer using one: `nn.cond` picks
    it inside the scan over layers, as `_by_kind` does the attention.
    Returns (x, (the layer's updated KV cache or None, its `moe.Routing` or None)): the form of
    a `scan` body over layers. With `layer` (the scan over layers with a cache,
    `ModelConfig.scan_cached_layers`) x comes as (x, the stacked cache) and goes out so, with
    this layer's entry written: (x, cache), (None, routing).
    """

    cfg: ModelConfig
    decode: bool = False  # `product`'s: the rollout's forwards

    @nn.compact
    def __call__(
        self,
        x,
        sliding,
        rope,
        mask=None,
        cache=None,
        cache_index=None,
        sparse=None,
        routing=None,
        token_mask=None,
        layer=None,
    ):
        cfg = self.cfg
        if layer is not None:
            x, cache = x
        a, cache = Attention(cfg, self.decode, name="attn")(
            RMSNorm(cfg, name="input_norm")(x),
            rope,
            mask,
            sliding,
            cache,
            cache_index,
            layer,
        )
        if cfg.sandwich_norms:
            a = RMSNorm(cfg, name="attn_out_norm")(a)
        x = x + a
        h = RMSNorm(cfg, name="post_attn_norm")(x)
        if not cfg.num_experts:
            m, routed = MLP(cfg, self.decode, name="mlp")(h), None
        else:
            dense, experts = MLP(cfg, self.decode, name="mlp"), MoE(cfg, self.decode, name="moe")
            use_dense = lambda _, h: (dense(h), _no_routing(cfg, h))
            use_experts = lambda _, h: experts(h, routing, token_mask)
            kinds = cfg.mlp_kinds()
            if len(kinds) == 1 or isinstance(sparse, (bool, np.bool_)):
                one_kind = kinds[0] if len(kinds) == 1 else bool(sparse)
                m, routed = (use_experts if one_kind else use_dense)(self, h)
            elif self.is_initializing():  # both kinds' parameters in every layer
                both = use_dense(self, h), use_experts(self, h)
                m, routed = jax.tree.map(lambda d, e: jnp.where(sparse, e, d), *both)
            else:
                m, routed = nn.cond(sparse, use_experts, use_dense, self, h)
        if cfg.sandwich_norms:
            m = RMSNorm(cfg, name="mlp_out_norm")(m)
        if layer is not None:
            return (_activation(x + m), cache), (None, routed)
        return _activation(x + m), (cache, routed)


class Output(NamedTuple):
    hidden: jax.Array  # [B, L, H] after the final norm, in the compute dtype
    head: jax.Array | None  # output projection in the compute dtype, as stored: [V, H] (tied
    # embeddings) or [H, V] (lm_head); None without an lm head. `lm_logits` takes either.
    values: jax.Array | None  # [B, L] float32 (None: no value head)
    cache: tuple | None  # the updated KV cache (None without one)
    # A model with experts: its sparse layers' `moe.Routing`, stacked [S, ...] in layer order
    # (`ModelConfig.sparse_layers`); experts [S, B, L, k]. None for a dense model.
    routing: moe.Routing | None = None


class Transformer(nn.Module):
    """Decoder. `__call__(ids, positions, mask, cache=None, cache_index=None)` -> `Output`;
    `mask` [B, L, S] bool, [B, S] with a cache (`_masked_attention`), or None for a full forward
    over right-padded rows (causal). `decode`: the rollout's forwards (`product`).

    A model with experts also takes `routing` [S, B, L, k] int32, experts to use in its S sparse
    layers instead of their routers' top k (routing replay; None: their own), and `token_mask_BL`
    [B, L], the real tokens the routing statistics count (None: every token)."""

    cfg: ModelConfig
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        input_ids_BL,
        positions_BL,
        mask_BLS=None,
        cache=None,
        cache_index=None,
        routing=None,
        token_mask_BL=None,
    ):
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        embed = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg)
        x = _activation(jnp.take(embed, input_ids_BL, axis=0).astype(dt))
        if cfg.scale_embeddings:
            x = x * jnp.asarray(cfg.hidden_size**0.5, dt)
        sliding = np.array([cfg.is_sliding(i) for i in range(cfg.num_layers)])
        # positions lie before the end of the input, or of the cache when there is one
        length = input_ids_BL.shape[1] if cache is None else cache_slots(cache)
        rope = rope_tables(cfg, positions_BL, length)
        policy = REMAT_POLICIES.get(cfg.remat)
        sparse = np.array([cfg.is_sparse(i) for i in range(cfg.num_layers)])
        routing = _layer_routing(cfg, routing)
        routed = None
        if self.is_initializing() or (cache is None and policy is not None):
            # A scan over the layers, each rematerialised: the backward keeps only each layer's
            # input (a loop, unlike an unrolled remat, holds XLA to that on every backend).
            block = Block if policy is None else nn.remat(Block, policy=policy, prevent_cse=False)
            args, in_axes = (x, sliding, rope, mask_BLS), (0, nn.broadcast, nn.broadcast)
            if cfg.num_experts:  # + cache, cache_index, sparse, routing, token_mask
                args += (None, None, sparse, routing, token_mask_BL)
                in_axes += (nn.broadcast, nn.broadcast, 0, 0, nn.broadcast)
            layers = nn.scan(
                block,
                variable_axes={"params": 0, "lora": 0},
                split_rngs={"params": True},
                in_axes=in_axes,
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, (_, routed) = layers(cfg, name="layers")(*args)
        elif cache is not None and cfg.scan_cached_layers:  # a scan over the stacked cache
            ids = jnp.arange(cfg.num_layers)
            args = (sliding, rope, mask_BLS, None, cache_index, sparse, routing, token_mask_BL, ids)
            bc = nn.broadcast
            layers = nn.scan(
                Block,
                variable_axes={"params": 0, "lora": 0},
                split_rngs={"params": False},
                in_axes=(0, bc, bc, bc, bc, 0 if cfg.num_experts else bc, 0, bc, 0),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            (x, cache), (_, routed) = layers(cfg, self.decode, name="layers")((x, cache), *args)
        else:  # layer by layer: rollout (each layer with its own KV cache), or no remat
            layers = self.variables["params"]["layers"]
            adapters = self.variables.get("lora", {}).get("layers")
            if not isinstance(layers, (list, tuple)):  # stacked; see `unstack_layers`
                stacked = {"layers": layers, "lora": {"layers": adapters}}
                unstacked = unstack_layers(cfg, stacked, cast=False)
                layers, adapters = unstacked["layers"], unstacked["lora"]["layers"]
            new_cache, by_layer = [], []
            for i in range(cfg.num_layers):
                block_vars = {"params": layers[i]}
                if adapters is not None:
                    block_vars["lora"] = adapters[i]
                moe_args = ()
                if cfg.num_experts:  # sparse, routing, token_mask
                    layer_routing = None if routing is None else routing[i]
                    moe_args = (bool(sparse[i]), layer_routing, token_mask_BL)
                x, (c, r) = Block(cfg, self.decode).apply(
                    block_vars,
                    x,
                    bool(sliding[i]),
                    rope,
                    mask_BLS,
                    None if cache is None else cache[i],
                    cache_index,
                    *moe_args,
                )
                new_cache.append(c)
                by_layer.append(r)
            if cfg.num_experts:
                routed = jax.tree.map(lambda *a: jnp.stack(a), *by_layer)
        x = RMSNorm(cfg, name="final_norm")(x)
        head = values = None
        if cfg.lm_head:
            if cfg.tie_word_embeddings:
                head = embed  # [V, H]: used as stored, so its gradient needs no transpose
            else:
                head = _param(
                    self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg
                )
            head = head.astype(dt)
        if cfg.value_head:
            w = _param(self, "value_head", (cfg.hidden_size, 1), ("embed", None), cfg)
            b = _param(self, "value_head_bias", (1,), (None,), cfg, nn.initializers.zeros)
            values = (x @ w.astype(dt) + b.astype(dt))[..., 0].astype(jnp.float32)
        if routed is not None:  # [num_layers, ...] -> the sparse layers' [S, ...]
            layers_ = cfg.sparse_layers()
            if len(layers_) < cfg.num_layers:
                routed = jax.tree.map(lambda a: a[np.array(layers_, int)], routed)
        if cache is not None and not cfg.scan_cached_layers:
            cache = tuple(new_cache)
        return Output(x, head, values, cache, routed if cfg.sparse_layers() else None)


def _layer_routing(cfg: ModelConfig, routing_S):
    """Replayed experts of every layer [num_layers, B, L, k] from the sparse layers' [S, B, L,
    k] (zeros at dense layers, which ignore them); None stays None."""
    if routing_S is None:
        return None
    layers = cfg.sparse_layers()
    if len(layers) == cfg.num_layers:
        return routing_S
    full = jnp.zeros((cfg.num_layers, *routing_S.shape[1:]), routing_S.dtype)
    return full.at[np.array(layers, int)].set(routing_S)


def unstack_layers(cfg: ModelConfig, params, cast: bool = True, split: bool = True):
    """`params` with the stacked blocks split into a list of per-layer trees, matrices (and the
    embedding / LM head) cast to the compute dtype with `cast` (1-D norm scales stay as
    stored). The rollout does this once, before its decode loop, so the loop reads each
    layer's weights where they lie, in the compute dtype, instead of slicing (and, on some
    backends, copying) them from the stack and casting them at every token. A LoRA
    adapter tree (`params["lora"]["layers"]`, see `variables`) is split the same way. Without
    `split` (the rollout's layers run as a scan, `cfg.scan_cached_layers`) the stack stays
    whole, its matrices cast."""
    dt = jnp.dtype(cfg.dtype)
    to_dt = lambda a, x: x.astype(dt) if cast and a.ndim > 2 else x  # stacked matrices: 3-D up
    if split:
        layers = lambda stacked: [
            jax.tree.map(lambda a, i=i: to_dt(a, a[i]), stacked) for i in range(cfg.num_layers)
        ]
    else:
        layers = lambda stacked: jax.tree.map(lambda a: to_dt(a, a), stacked)
    out = {**params, "layers": layers(params["layers"])}
    for name in ("embed", "lm_head") if cast else ():  # the head is read at every token
        if name in params:
            out[name] = params[name].astype(dt)
    if params.get("lora", {}).get("layers") is not None:
        out["lora"] = {**params["lora"], "layers": layers(params["lora"]["layers"])}
    return out


def variables(params) -> dict:
    """The Flax variables of `Transformer.apply` for `params`: a "lora" entry (adapters, see
    `jrl.models.lora.combine`) goes into the "lora" collection, the rest into "params"."""
    if "lora" not in params:
        return {"params": params}
    return {"params": {k: v for k, v in params.items() if k != "lora"}, "lora": params["lora"]}


def lm_logits(cfg: ModelConfig, hidden, head, decode: bool = False):
    """Next-token logits (float32) of final hidden states [..., H] through `Output.head`, rounded
    to the compute dtype first; `decode`: `product`'s (the same numbers)."""
    spec = "...h,vh->...v" if cfg.tie_word_embeddings else "...h,hv->...v"
    logits = (
        product(spec, hidden, head, hidden.dtype, True)
        if decode
        else jnp.einsum(spec, hidden, head)
    )
    logits = logits.astype(jnp.float32)
    return softcap(logits, cfg.final_logit_softcapping)


def init_cache(cfg: ModelConfig, batch: int, length: int):
    """An empty KV cache in the compute dtype: one {"k", "v"} of [B, K, S, D] per layer
    (head-major, so decode attention reads it without a transpose), or with
    `scan_cached_layers` one {"k", "v"} of [layers, B, K, S, D]. Either way every entry is
    [..., B, K, S, D]: `cache_rows` and the prefill work on the last four axes."""
    shape = (batch, cfg.num_kv_heads, length, cfg.head_size)
    zeros = lambda lead=(): jnp.zeros((*lead, *shape), jnp.dtype(cfg.dtype))
    if cfg.scan_cached_layers:
        return {"k": zeros((cfg.num_layers,)), "v": zeros((cfg.num_layers,))}
    return tuple({"k": zeros(), "v": zeros()} for _ in range(cfg.num_layers))


def cache_slots(cache) -> int:
    """The slots S of a KV cache (`init_cache`'s, either form)."""
    return (cache if isinstance(cache, dict) else cache[0])["k"].shape[-2]


def cache_rows(cache, index):
    """The cache's rows `index` ([S] int) in that order, without a shared prompt's entries (the
    rows may leave their groups: compaction). A stacked cache is gathered a layer at a time
    (`lax.map`): under a mesh, one gather of the whole stack's rows held a copy of every
    layer's cache on each device at once (the TPU compile of Qwen2.5-0.5B on a v5p-8: 6 GB
    more per chip)."""
    if isinstance(cache, dict):
        take = lambda c: jax.lax.map(lambda layer: layer[index], c)
        return {"k": take(cache["k"]), "v": take(cache["v"])}
    return tuple({"k": layer["k"][index], "v": layer["v"][index]} for layer in cache)


def with_shared_prompt(cache, prompt_cache):
    """`cache` (per layer {"k", "v"} [B, K, S, D], its first P slots holding each row's prompt)
    with each layer's prompt keys / values once per group of B / G consecutive rows
    (`prompt_cache`: per layer {"k", "v"} [G, K, P, D], the prefill's) as "prompt_k" /
    "prompt_v": decode attention (`_masked_attention` with a [B, S] mask) then reads the prompt
    slots from there, once per group, and only the later slots from each row's cache. (Stacked
    caches, `scan_cached_layers`: the same entries with the layers first.)"""
    shared = lambda layer, prompt: {**layer, "prompt_k": prompt["k"], "prompt_v": prompt["v"]}
    if isinstance(cache, dict):
        return shared(cache, prompt_cache)
    return tuple(shared(layer, prompt) for layer, prompt in zip(cache, prompt_cache))


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
    return Transformer(cfg).init(key, ids, positions_from_mask(jnp.ones_like(ids)))["params"]


def init_params(cfg: ModelConfig, key) -> Any:
    """Initial parameters: a plain pytree of arrays (see `logical_axes` for their axis names)."""
    return nn.unbox(_boxed_init(cfg, key))


def logical_axes(cfg: ModelConfig) -> Any:
    """The parameters' logical axis names: a pytree of `PartitionSpec`s shaped like the params."""
    return nn.get_partition_spec(jax.eval_shape(lambda k: _boxed_init(cfg, k), jax.random.key(0)))


def full_forward(cfg: ModelConfig, params, input_ids_BL, attention_mask_BL, routing=None) -> Output:
    """Full forward of rows with left and / or right padding (each row's real tokens consecutive):
    `Output` with hidden [B, L, H] and values [B, L] at the input positions (garbage at padding).
    A model with experts takes replayed experts `routing` [S, B, L, k] (None: its routers'
    own) and returns its `Output.routing` at the input positions too, its statistics counting
    the real tokens only.

    Each row is rotated so that its real tokens come first: then causal attention alone is exact
    (the padding sits after every real token) and needs no [B, L, L] mask."""
    l = input_ids_BL.shape[1]
    start_B = jnp.argmax(attention_mask_BL != 0, axis=-1)  # the first real token (left padding)
    aligned = (jnp.arange(l)[None] + start_B[:, None]) % l  # aligned slot t <- input position
    back = (jnp.arange(l)[None] - start_B[:, None]) % l  # input position s <- aligned slot
    ids = jnp.take_along_axis(input_ids_BL, aligned, axis=1)
    mask = jnp.take_along_axis(attention_mask_BL, aligned, axis=1)
    moe_args = {}
    if cfg.num_experts:  # [S, B, L, k] follow their rows' rotation
        rotate_ = lambda r, slots: jnp.take_along_axis(r, slots[None, :, :, None], axis=2)
        replay = None if routing is None else rotate_(routing, aligned)
        moe_args = {"routing": replay, "token_mask_BL": mask}
    out = Transformer(cfg).apply(variables(params), ids, positions_from_mask(mask), **moe_args)
    hidden = jnp.take_along_axis(out.hidden, back[..., None], axis=1)
    values = None if out.values is None else jnp.take_along_axis(out.values, back, axis=1)
    if out.routing is not None:
        out = out._replace(routing=out.routing._replace(experts=rotate_(out.routing.experts, back)))
    return out._replace(hidden=hidden, values=values)


class Prefill(NamedTuple):
    """Prompts run once and made ready for their rows' responses (`prefill`)."""

    last: Output  # hidden [B, 1, H] / values [B, 1] at each row's last prompt slot, per row
    cache: tuple  # per layer {"k", "v"} [B, K, P + R, D]: the prompt's slots, then R empty ones
    key_valid: jax.Array  # [B, P + R] bool: real prompt slots, then every response slot
    first_position: jax.Array  # [B] int32: the position id of response token 0
    prompt_cache: tuple  # per layer {"k", "v"} [G, K, P, D]: the prompts, each once
    # a model with experts: the prompts' `Output.routing` (experts [S, G, P, k], each prompt
    # once; statistics over their real tokens); None for a dense model
    routing: moe.Routing | None = None


def prefill(
    model, variables_, prompt_ids_GP, prompt_mask_GP, samples: int, new_slots: int, routing=None
):
    """Runs G left-padded prompts once (prompt token j in cache slot j, position ids skipping
    the padding) and gives each of its `samples` consecutive rows (`jnp.repeat` order, B = G x
    samples) a copy of its keys and values with `new_slots` response slots after them. Shared by
    the rollout and the grouped forward (`grouped_response_forward`); differentiable, so a
    prompt's gradient is the sum of its rows'. A model with experts takes replayed experts
    `routing` [S, G, P, k] (see `Transformer`) and reports the prompts' (`Prefill.routing`)."""
    cfg = model.cfg
    g, p = prompt_ids_GP.shape
    rows = lambda x: jnp.repeat(x, samples, axis=0)  # per prompt -> per row
    positions = positions_from_mask(prompt_mask_GP)
    valid = prompt_mask_GP.astype(bool)
    causal = valid[:, None, :] & jnp.tril(jnp.ones((p, p), bool))
    cache = init_cache(cfg, g, p)
    out = model.apply(variables_, prompt_ids_GP, positions, causal, cache, 0, routing, valid)
    last = Output(
        rows(out.hidden[:, -1:]),
        out.head,
        None if out.values is None else rows(out.values[:, -1:]),
        None,
    )
    # [.., B, K, S, D]: each prompt's rows, with the response slots after the prompt's
    grow = lambda c: jnp.pad(
        jnp.repeat(c, samples, axis=-4), [(0, 0)] * (c.ndim - 2) + [(0, new_slots), (0, 0)]
    )
    cache = jax.tree.map(grow, out.cache)
    key_valid = jnp.pad(rows(valid), ((0, 0), (0, new_slots)), constant_values=True)
    first = rows(positions[:, -1] + 1)
    return Prefill(last, cache, key_valid, first, out.cache, out.routing)


def grouped_response_forward(
    cfg: ModelConfig,
    params,
    prompt_ids_GP,
    prompt_mask_GP,
    ids_BR,
    routing=None,
    response_mask_BR=None,
):
    """Forward of B = G x n rows whose n consecutive rows share a prompt (a GRPO group), each
    prompt run once: the prompts (left-padded [G, P]) through `prefill`, then every row's
    response tokens [B, R] over its prompt's keys and values. Returns an `Output` whose hidden
    [B, R, H] and values [B, R] are those of positions P - 1 .. P + R - 2, the ones that predict
    the response tokens (the slice `full_forward(prompt + response)[:, P - 1 : -1]`); same
    function, computed on G x P + B x R tokens instead of B x (P + R).

    A model with experts takes replayed experts `routing` = (prompts' [S, G, P, k], responses'
    [S, B, R, k]) or None, and returns `Output.routing` as `full_forward` of prompt + response
    gives it: experts [S, B, P + R, k] (each prompt's repeated for its n rows), statistics
    counting a prompt's real tokens n times (once per row, as the full forward does) and the
    responses' where `response_mask_BR` [B, R] is 1 (None: every response token).

    The response queries attend over the cache through a [B, R, P + R] mask (the rollout's
    attention), so this suits short sequences, where the full forward's attention is "xla"."""
    model = Transformer(cfg)
    variables_ = variables(params)
    b, r = ids_BR.shape
    g, p = prompt_ids_GP.shape
    prompt_routing, response_routing = (None, None) if routing is None else routing
    pre = prefill(model, variables_, prompt_ids_GP, prompt_mask_GP, b // g, r, prompt_routing)
    causal = jnp.arange(p + r)[None, :] <= p + jnp.arange(r)[:, None]  # [R, P + R]
    mask = pre.key_valid[:, None, :] & causal[None]
    positions = pre.first_position[:, None] + jnp.arange(r)[None]
    out = model.apply(
        variables_, ids_BR, positions, mask, pre.cache, p, response_routing, response_mask_BR
    )
    join = lambda first, rest: jnp.concatenate([first, rest[:, :-1]], axis=1)
    values = None if out.values is None else join(pre.last.values, out.values)
    routed = None
    if out.routing is not None:  # the prompt's once per row, as a full forward counts them
        n, prompt = b // g, pre.routing
        routed = moe.Routing(
            jnp.concatenate([jnp.repeat(prompt.experts, n, axis=1), out.routing.experts], 2),
            *(n * once + rest for once, rest in zip(prompt[1:], out.routing[1:])),
        )
    return Output(join(pre.last.hidden, out.hidden), out.head, values, None, routed)


def apply_full(cfg: ModelConfig, params, input_ids_BL, attention_mask_BL):
    """Full forward with left / right padding: (logits [B, L, V] or None, values [B, L] or None).
    Builds the whole [B, L, V] logits: for tests and small models (`jrl.logprobs.token_log_probs`
    takes log-probs a chunk at a time)."""
    out = full_forward(cfg, params, input_ids_BL, attention_mask_BL)
    logits = None if out.head is None else lm_logits(cfg, out.hidden, out.head)
    return logits, out.values


def forward(cfg: ModelConfig, params, input_ids_BL, attention_mask_BL=None):
    """Next-token logits [B, L, V] (float32) of a (possibly padded) batch of sequences."""
    if attention_mask_BL is None:
        attention_mask_BL = jnp.ones_like(input_ids_BL)
    return apply_full(cfg, params, input_ids_BL, attention_mask_BL)[0]
