"""Models: one decoder for the Llama / Qwen2 family."""

from jrl.models.transformer import (
    ModelConfig,
    Transformer,
    apply_full,
    causal_mask,
    forward,
    init_cache,
    init_params,
    logical_axes,
    positions_from_mask,
)

__all__ = [
    "ModelConfig",
    "Transformer",
    "apply_full",
    "causal_mask",
    "forward",
    "init_cache",
    "init_params",
    "logical_axes",
    "positions_from_mask",
]
