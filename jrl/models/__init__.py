"""Models: one decoder for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 families and
the Qwen3-MoE / Mixtral mixtures of experts, and checkpoints in (`load_pretrained`,
`load_config`: a Hugging Face directory, a .gguf file or a Hub id) and out (`save_pretrained`,
Hugging Face's format)."""

from jrl.models.hf import model_config_from_hf, save_pretrained
from jrl.models.pretrained import load_config, load_pretrained
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
    "load_config",
    "load_pretrained",
    "logical_axes",
    "model_config_from_hf",
    "positions_from_mask",
    "save_pretrained",
]
