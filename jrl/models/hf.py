"""Hugging Face checkpoints in and out: `config.json` + safetensors <-> (ModelConfig, params).

Supported `model_type`s: llama (Llama 2 / 3.x), mistral, qwen2 (Qwen2 / Qwen2.5), qwen3, gemma2,
gemma3_text (Gemma 3 text-only checkpoints), and the mixtures of experts qwen3_moe (Qwen3-MoE)
and mixtral. `config.json` is parsed by transformers' own config classes, so old and new field
spellings (`rope_theta` / `rope_scaling` / `rope_parameters`, missing `layer_types`, ...) get the
defaults transformers gives them. Weights are read with the `safetensors` library (numpy,
bfloat16 through ml_dtypes); torch is never needed. Loading streams: one tensor at a time is read,
converted and placed (on a device, or into its shards with `load_pretrained(..., shardings=...)`),
so no host holds the whole model (a sparse layer's experts: one layer's [E, ...] at a time).

Weight layouts (HF `nn.Linear` stores [out, in]):
  q/k/v_proj.weight [N*D, H] <-> attn/{q,k,v}_proj [H, N, D];  biases [N*D] <-> [N, D]
  o_proj.weight [H, N*D] <-> attn/o_proj [N, D, H];  MLP and lm_head weights are transposed.
  Norm weights are copied as stored (Gemma's (1 + w) offset lives in `norm_unit_offset`).
  Experts (the released checkpoints' layout, which transformers 5's `save_pretrained` writes
  too): one [out, in] tensor per expert and projection, Qwen3-MoE's
  `mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.
  {w1,w3,w2}.weight` (gate, up, down) <-> moe/{gate,up}_proj [E, H, I], moe/down_proj [E, I, H],
  one tensor a projection, stacked over the experts; the router `mlp.gate.weight` (Mixtral:
  `block_sparse_moe.gate.weight`) [E, H] <-> moe/router [H, E]. Checkpoints holding the experts
  fused as transformers 5 does in memory (`save_pretrained(save_original_format=False)`:
  `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) load too
  (`_unfused`); export writes the per-expert layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import transformers
from flax import traverse_util
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jrl import partitioning
from jrl.models import transformer as tfm
from jrl.registry import Registry

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors some checkpoints carry that hold nothing jrl needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _check_false(c, *names):
    for name in names:
        if getattr(c, name, False):
            raise ValueError(
                f"{c.model_type} checkpoints with {name}=true are not supported by jrl's decoder."
            )


def _read_rope(params: dict) -> dict:
    rope_type = params.get("rope_type", params.get("type", "default"))
    tfm.ROPE_SCALINGS.get(rope_type)  # an unsupported one raises UnknownName (a ValueError)
    out = {"rope_theta": float(params["rope_theta"]), "rope_scaling_type": rope_type}
    if rope_type != "default":
        out["rope_scaling_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_position_embeddings"] = int(
            params["original_max_position_embeddings"]
        )
    return out


def _write_rope(cfg: tfm.ModelConfig) -> dict:
    out = {"rope_type": cfg.rope_scaling_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_type != "default":
        out["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "llama3":
        out["low_freq_factor"] = cfg.rope_low_freq_factor
        out["high_freq_factor"] = cfg.rope_high_freq_factor
        out["original_max_position_embeddings"] = cfg.rope_original_max_position_embeddings
    return out


def _read_layer_windows(c) -> dict:
    """sliding_window / layer_types from a config with per-layer types (Qwen, Gemma)."""
    types = tuple(getattr(c, "layer_types", None) or ())
    window = getattr(c, "sliding_window", None)
    if window is None or tfm.SLIDING_ATTENTION not in types:
        return {"sliding_window": None, "layer_types": None}
    if all(t == tfm.SLIDING_ATTENTION for t in types):
        return {"sliding_window": int(window), "layer_types": None}
    return {"sliding_window": int(window), "layer_types": types}


def _layer_types(cfg: tfm.ModelConfig) -> list[str]:
    return [
        tfm.SLIDING_ATTENTION if cfg.is_sliding(i) else tfm.FULL_ATTENTION
        for i in range(cfg.num_layers)
    ]


def _write_qwen_windows(cfg: tfm.ModelConfig) -> dict:
    types = _layer_types(cfg)
    first = types.index(tfm.SLIDING_ATTENTION) if tfm.SLIDING_ATTENTION in types else len(types)
    return {
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": first,
        "layer_types": types,
    }


def _read_llama(c) -> dict:
    _check_false(c, "attention_bias", "mlp_bias")
    return {}


def _read_mistral(c) -> dict:
    window = getattr(c, "sliding_window", None)
    return {"sliding_window": None if window is None else int(window)}


def _read_qwen3(c) -> dict:
    _check_false(c, "attention_bias")
    return _read_layer_windows(c)


def _read_gemma2(c) -> dict:
    _check_false(c, "attention_bias", "use_bidirectional_attention")
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    scalar = float(c.query_pre_attn_scalar)
    return {
        "query_pre_attn_scalar": None if scalar == head_dim else scalar,
        "attn_logit_softcapping": c.attn_logit_softcapping,
        "final_logit_softcapping": c.final_logit_softcapping,
        **_read_layer_windows(c),
    }


def _read_gemma3(c) -> dict:
    # Gemma 3's attention ignores attn_logit_softcapping (transformers never applies it).
    return {**_read_gemma2(c), "attn_logit_softcapping": None}


def _read_experts(c, num_experts) -> dict:
    return {
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(c.num_experts_per_tok),
        "router_aux_loss_coef": float(c.router_aux_loss_coef),
        "output_router_logits": bool(c.output_router_logits),
    }


# ModelConfig fields both families write to config.json under their own names.
_EXPERT_FIELDS = (
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "output_router_logits",
    "sliding_window",
)


def _fields(cfg: tfm.ModelConfig, names) -> dict:
    return {name: getattr(cfg, name) for name in names}


def _read_qwen3_moe(c) -> dict:
    """Qwen3-MoE: Qwen3's attention (one window on every layer with use_sliding_window), and
    experts on the layers that decoder_sparse_step and mlp_only_layers leave sparse."""
    _check_false(c, "attention_bias")
    width = int(c.moe_intermediate_size)
    return {
        **_read_mistral(c),
        **_read_experts(c, c.num_experts),
        "moe_intermediate_size": None if width == c.intermediate_size else width,
        "norm_topk_prob": bool(c.norm_topk_prob),
        "decoder_sparse_step": int(c.decoder_sparse_step),
        "mlp_only_layers": tuple(sorted(int(i) for i in c.mlp_only_layers or ())),
    }


def _write_qwen3_moe(cfg: tfm.ModelConfig) -> dict:
    same = ("num_experts", "norm_topk_prob", "decoder_sparse_step")
    return {
        **_fields(cfg, _EXPERT_FIELDS + same),
        "moe_intermediate_size": cfg.expert_size,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "use_sliding_window": cfg.sliding_window is not None,
    }


def _read_mixtral(c) -> dict:
    """Mixtral: Mistral's attention, every layer sparse, experts intermediate_size wide."""
    if getattr(c, "router_jitter_noise", 0.0):
        raise ValueError(
            f"mixtral checkpoints with router_jitter_noise={c.router_jitter_noise} are not "
            "supported: jrl's router adds no noise; set it to 0 in config.json."
        )
    return {**_read_mistral(c), **_read_experts(c, c.num_local_experts)}


def _write_mixtral(cfg: tfm.ModelConfig) -> dict:
    return {**_fields(cfg, _EXPERT_FIELDS), "num_local_experts": cfg.num_experts}


def _int_if_whole(x: float):
    """transformers types some float-valued fields as int; whole numbers go in as ints."""
    return int(x) if float(x).is_integer() else x


def _write_gemma2(cfg: tfm.ModelConfig) -> dict:
    return {
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_size),
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        # With no sliding layer the window is never used, but transformers still builds its mask.
        "sliding_window": cfg.sliding_window or cfg.max_position_embeddings,
        "layer_types": _layer_types(cfg),
    }


def _write_gemma3(cfg: tfm.ModelConfig) -> dict:
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq or cfg.rope_theta}
    rope = {"full_attention": _write_rope(cfg), "sliding_attention": local}
    return {**_write_gemma2(cfg), "rope_parameters": rope}


_GEMMA = {"norm_unit_offset": True, "scale_embeddings": True, "sandwich_norms": True}


@dataclasses.dataclass(frozen=True)
class Family:
    """How one Hugging Face `model_type` maps onto ModelConfig."""

    architecture: str  # the *ForCausalLM class written to config.json
    fixed: dict  # ModelConfig fields every checkpoint of the family has
    read: Callable[[Any], dict]  # HF config object -> family-specific ModelConfig fields
    write: Callable[[tfm.ModelConfig], dict]  # ModelConfig -> family-specific HF config fields
    act_key: str = "hidden_act"  # the config.json field naming the MLP activation


# Supported Hugging Face `model_type`s.
FAMILIES = Registry(
    "Hugging Face model_type",
    {
        "llama": Family("LlamaForCausalLM", {}, _read_llama, lambda cfg: {}),
        "mistral": Family(
            "MistralForCausalLM",
            {},
            _read_mistral,
            lambda cfg: {"sliding_window": cfg.sliding_window},
        ),
        "qwen2": Family(
            "Qwen2ForCausalLM", {"qkv_bias": True}, _read_layer_windows, _write_qwen_windows
        ),
        "qwen3": Family("Qwen3ForCausalLM", {"qk_norm": True}, _read_qwen3, _write_qwen_windows),
        "gemma2": Family(
            "Gemma2ForCausalLM", _GEMMA, _read_gemma2, _write_gemma2, act_key="hidden_activation"
        ),
        "gemma3_text": Family(
            "Gemma3ForCausalLM",
            {**_GEMMA, "qk_norm": True},
            _read_gemma3,
            _write_gemma3,
            act_key="hidden_activation",
        ),
        "qwen3_moe": Family(
            "Qwen3MoeForCausalLM", {"qk_norm": True}, _read_qwen3_moe, _write_qwen3_moe
        ),
        "mixtral": Family(
            "MixtralForCausalLM", {"norm_topk_prob": True}, _read_mixtral, _write_mixtral
        ),
    },
)


def _read_rope_fields(c) -> dict:
    params = getattr(c, "rope_parameters", None)
    if params is None:
        raise ValueError(
            f"transformers {transformers.__version__} has no config.rope_parameters; "
            "jrl.models.hf needs transformers>=5: pip install -U transformers."
        )
    if tfm.FULL_ATTENTION not in params:
        return _read_rope(params)
    out = _read_rope(params[tfm.FULL_ATTENTION])
    local = _read_rope(params.get(tfm.SLIDING_ATTENTION) or params[tfm.FULL_ATTENTION])
    if local["rope_scaling_type"] != "default":
        raise ValueError("scaled rope on sliding-window layers is not supported.")
    if local["rope_theta"] != out["rope_theta"] or out["rope_scaling_type"] != "default":
        out["rope_local_base_freq"] = local["rope_theta"]
    return out


def model_config_from_hf(hf_config: dict, dtype: str = "float32") -> tfm.ModelConfig:
    """ModelConfig of a Hugging Face `config.json` (as a dict), compute and weights in `dtype`."""
    model_type = hf_config.get("model_type")
    family = FAMILIES.get(model_type)
    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    c = transformers.AutoConfig.for_model(model_type, **fields)
    head_dim = getattr(c, "head_dim", None)
    fields = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads,
        "num_kv_heads": c.num_key_value_heads or c.num_attention_heads,
        "head_dim": None
        if head_dim in (None, c.hidden_size // c.num_attention_heads)
        else head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": float(c.rms_norm_eps),
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "hidden_act": getattr(c, family.act_key),
        "max_position_embeddings": c.max_position_embeddings,
        "dtype": dtype,
        "param_dtype": dtype,
        "hf_model_type": model_type,
        **_read_rope_fields(c),
        **family.fixed,
        **family.read(c),
    }
    return tfm.ModelConfig(**fields)


def infer_model_type(cfg: tfm.ModelConfig) -> str:
    """The Hugging Face family a ModelConfig exports as: `hf_model_type`, else from its features."""
    if cfg.hf_model_type:
        return cfg.hf_model_type
    if cfg.num_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if cfg.sandwich_norms:
        return "gemma3_text" if cfg.qk_norm else "gemma2"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias or cfg.layer_types is not None:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


# Fields that do not change what a checkpoint computes.
_NOT_ARCHITECTURE = (
    "lm_head",
    "value_head",
    "param_dtype",
    "init_std",
    "hf_model_type",
    "max_position_embeddings",
    "moe_matmul",
    *tfm.COMPUTE_FIELDS,
)
_ROPE_SCALING_FIELDS = (
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
)


def _architecture(cfg: tfm.ModelConfig) -> dict:
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_ARCHITECTURE}
    out["head_dim"] = cfg.head_size
    unused = {"default": _ROPE_SCALING_FIELDS, "linear": _ROPE_SCALING_FIELDS[1:]}
    for k in unused.get(cfg.rope_scaling_type, ()):
        out.pop(k)
    return out


def hf_config_dict(cfg: tfm.ModelConfig, dtype: str, tokenizer=None) -> dict:
    """The `config.json` dict of a ModelConfig (transformers' full form, `model_type` included).

    Raises ValueError when the architecture has no exact Hugging Face counterpart.
    """
    model_type = infer_model_type(cfg)
    family = FAMILIES.get(model_type)
    if not cfg.lm_head:
        raise ValueError("model.lm_head=False (critic-only) has no Hugging Face causal-LM form.")
    fields = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        family.act_key: cfg.hidden_act,
        "rope_parameters": _write_rope(cfg),
        "architectures": [family.architecture],
        "dtype": dtype,
        "bos_token_id": getattr(tokenizer, "bos_token_id", None),
        "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "pad_token_id": getattr(tokenizer, "pad_token_id", None),
        **family.write(cfg),
    }
    hf = transformers.AutoConfig.for_model(model_type, **fields).to_dict()
    back = _architecture(model_config_from_hf(hf))
    want = _architecture(cfg)
    diff = [f"{k}={want[k]!r}" for k in want if back.get(k) != want[k]]
    if diff:
        raise ValueError(
            f"model with {', '.join(diff)} cannot be written as a {model_type} checkpoint; "
            f"set model.hf_model_type to a family that has these features "
            f"({', '.join(FAMILIES.names())})."
        )
    return hf


# ---------------------------------------------------------------------------------------------
# weights: names and layouts

# Layout converters: (jrl array -> HF array, (HF array, jrl shape) -> jrl array). They use only
# array methods, so `jax.eval_shape` gives the HF shape of a jrl shape without touching data.
_LAYOUTS: dict[str, tuple[Callable, Callable]] = {
    "copy": (lambda x: x, lambda y, shape: y),
    "transpose": (lambda x: x.T, lambda y, shape: y.T),
    "heads_in": (lambda x: x.reshape(x.shape[0], -1).T, lambda y, shape: y.T.reshape(shape)),
    "heads_out": (lambda x: x.reshape(-1, x.shape[-1]).T, lambda y, shape: y.T.reshape(shape)),
    "flat": (lambda x: x.reshape(-1), lambda y, shape: y.reshape(shape)),
}


def weight_names(cfg: tfm.ModelConfig) -> dict[tuple[str, ...], tuple[str, str]]:
    """jrl parameter path -> (HF tensor name, layout) for every parameter but the value head.
    Paths under "layers" are the decoder blocks' parameters, stacked over layers (leading axis):
    their HF name has a "{i}" for the layer (`model.layers.{i}.mlp.up_proj.weight`), an
    expert's also an "{e}" for the expert (its tensors stacked over the experts)."""
    table = {
        ("embed",): ("model.embed_tokens.weight", "copy"),
        ("final_norm", "scale"): ("model.norm.weight", "copy"),
    }
    if cfg.lm_head and not cfg.tie_word_embeddings:
        table[("lm_head",)] = ("lm_head.weight", "transpose")
    # Norm before the MLP: HF Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm.
    norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
    if cfg.sandwich_norms:
        norms = {
            "input_norm": "input_layernorm",
            "attn_out_norm": "post_attention_layernorm",
            "post_attn_norm": "pre_feedforward_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        }
    jrl, hf = "layers", "model.layers.{i}."
    for p in ("q", "k", "v"):
        table[(jrl, "attn", f"{p}_proj")] = (hf + f"self_attn.{p}_proj.weight", "heads_in")
        if cfg.qkv_bias:
            table[(jrl, "attn", f"{p}_proj_bias")] = (hf + f"self_attn.{p}_proj.bias", "flat")
    table[(jrl, "attn", "o_proj")] = (hf + "self_attn.o_proj.weight", "heads_out")
    if cfg.qk_norm:
        for p in ("q", "k"):
            table[(jrl, "attn", f"{p}_norm", "scale")] = (hf + f"self_attn.{p}_norm.weight", "copy")
    kinds = cfg.mlp_kinds()
    for p in ("gate", "up", "down") if False in kinds else ():
        table[(jrl, "mlp", f"{p}_proj")] = (hf + f"mlp.{p}_proj.weight", "transpose")
    if True in kinds:  # the sparse layers' router and experts
        mixtral = infer_model_type(cfg) == "mixtral"
        block = hf + ("block_sparse_moe." if mixtral else "mlp.")
        table[(jrl, "moe", "router")] = (block + "gate.weight", "transpose")
        for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            expert = f"experts.{{e}}.{w}.weight" if mixtral else f"experts.{{e}}.{p}_proj.weight"
            table[(jrl, "moe", f"{p}_proj")] = (block + expert, "transpose")
    for name, hf_name in norms.items():
        table[(jrl, name, "scale")] = (hf + hf_name + ".weight", "copy")
    return table


class Part(NamedTuple):
    """The HF tensors of one jrl value: a whole parameter, or one layer of a stacked one."""

    names: tuple[str, ...]  # one tensor; one per expert (`experts`); none: zeros, no tensor
    layout: str  # a key of _LAYOUTS
    shape: tuple[int, ...]  # the jrl shape of one tensor (of the whole value when none)
    experts: bool = False  # one tensor per expert, stacked on a leading [E] axis


def hf_tensors(cfg: tfm.ModelConfig, key: tuple[str, ...], shape) -> list[Part]:
    """The `Part`s making up the parameter at `key` of `shape`: one, or one per layer (in
    order) for a stacked block parameter. In a model with both dense and sparse layers every
    layer holds both MLPs (`tfm.Block`); a layer's unused one has no tensor (zeros in jrl,
    nothing written)."""
    hf, layout = weight_names(cfg)[key]
    if key[0] != "layers":
        return [Part((hf,), layout, tuple(shape))]
    layer_shape = tuple(shape[1:])
    kind = {"mlp": False, "moe": True}.get(key[1])
    parts = []
    for i in range(cfg.num_layers):
        if kind is not None and cfg.is_sparse(i) != kind:
            parts.append(Part((), layout, layer_shape))
        elif "{e}" in hf:
            names = tuple(hf.format(i=i, e=e) for e in range(cfg.num_experts))
            parts.append(Part(names, layout, layer_shape[1:], experts=True))
        else:
            parts.append(Part((hf.format(i=i),), layout, layer_shape))
    return parts


def _hf_shape(layout: str, shape) -> tuple[int, ...]:
    return jax.eval_shape(_LAYOUTS[layout][0], jax.ShapeDtypeStruct(shape, np.float32)).shape


# ---------------------------------------------------------------------------------------------
# reading


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it (single file or a sharded index)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{index} is not a safetensors index ({type(e).__name__}: {e}); copy or "
                "download the checkpoint again."
            ) from None
        return files
    single = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(single):
        raise ValueError(
            f"{path!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}: jrl reads safetensors "
            "checkpoints only (re-save the model with safe_serialization=True)."
        )
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


@contextlib.contextmanager
def _open(file: str):
    """`safe_open(file)`; a one-line ValueError naming the file when it does not open (the
    safetensors library parses the header and checks that the tensors' declared bytes lie
    within the file: a truncated or damaged file fails here)."""
    if not os.path.isfile(file):
        raise ValueError(f"{file} does not exist; copy or download the checkpoint again.")
    try:
        handle = safe_open(file, framework="np")
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{file} is not a readable safetensors file ({str(e).splitlines()[0]}): it is "
            "damaged or was not fully written; copy or download it again."
        ) from None
    with handle as f:
        yield f


def check_weights(path) -> None:
    """Raises ValueError (one line, naming the file) unless every safetensors file of the
    checkpoint directory `path` exists and opens (`_open`): run before anything is written or
    loaded."""
    path = os.fspath(path)
    for file in sorted(set(_weight_files(path).values())):
        with _open(file):
            pass


def load_config(path, dtype: str = "float32") -> tfm.ModelConfig:
    """ModelConfig of a local Hugging Face checkpoint directory (its `config.json`; no weights
    are read), compute and weights in `dtype`. Raises ValueError for a missing directory or
    config and for an unsupported family."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path!r} does not exist; pass a local directory.")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise ValueError(f"{path!r} has no {CONFIG_FILE}; it is not a Hugging Face checkpoint.")
    with open(config_path) as f:
        return model_config_from_hf(json.load(f), dtype)


def abstract_params(cfg: tfm.ModelConfig) -> Any:
    """The params tree of `cfg` as `jax.ShapeDtypeStruct`s (nothing computed or read): what
    `load_pretrained(path, dtype)` returns for `cfg = load_config(path, dtype)`, ready for
    `jrl.sharding.param_shardings`."""
    return jax.eval_shape(lambda k: tfm.init_params(cfg, k), jax.random.key(0))


def _flat_shardings(shardings, keys) -> dict[tuple[str, ...], Any]:
    """Parameter path -> its sharding (None: `jnp.asarray`'s default placement)."""
    if shardings is None:
        return dict.fromkeys(keys)
    flat = traverse_util.flatten_dict(shardings)
    missing = ["/".join(k) for k in keys if k not in flat]
    if missing:
        raise ValueError(f"shardings has no entry for params: {', '.join(missing[:8])}.")
    bad = ["/".join(k) for k in keys if not isinstance(flat[k], jax.sharding.Sharding)]
    if bad:
        raise ValueError(f"shardings entries are not jax.sharding.Sharding: {', '.join(bad[:8])}.")
    return {k: flat[k] for k in keys}


# place(host array, sharding) -> jax.Array in that sharding.
Place = Callable[[np.ndarray, jax.sharding.Sharding], jax.Array]


def _place(value: np.ndarray, sharding, place: Place) -> jax.Array:
    """A host array as a jax.Array: on the default device, or `place`d in `sharding`."""
    if sharding is None:
        return jax.numpy.asarray(value)
    return place(value, sharding)


def load_pretrained(
    path, dtype: str = "float32", shardings=None, place: Place | None = None
) -> tuple[tfm.ModelConfig, Any]:
    """(ModelConfig, params) of a local Hugging Face checkpoint directory (`jrl.models.
    load_pretrained` also takes a .gguf file or a Hub id).

    The directory holds `config.json` and `model.safetensors` (or shards listed in
    `model.safetensors.index.json`). Params come back as a nested dict of jax arrays in `dtype`
    (the config's compute and parameter dtype too). Raises ValueError, one line, for a missing
    directory / config / weights, an unsupported family, missing, unexpected or mis-shaped tensors
    (all checked from the files' headers before any tensor is read).

    Tensors are read, converted and placed one at a time, so the host holds at most one
    checkpoint tensor (in two layouts) at once, never the whole model. `shardings=None` puts
    each on the default device. Otherwise `shardings` is a nested dict of
    `jax.sharding.Sharding`s (NamedShardings) keyed like the params, and each param comes back
    as a global jax.Array in its sharding, every process building only its addressable shards
    (each process reads whole tensors, so each needs the checkpoint directory). Entries the
    checkpoint has no tensor for (a value head) are ignored, so the shardings of a train
    state's params serve as they are. `place(host_array, sharding)` puts one tensor into its
    sharding; default `jrl.partitioning.put` (each process builds only its addressable shards,
    copied out of the host array). To shard a checkpoint on its own:

        cfg = hf.load_config(path, dtype)
        shardings = jrl.sharding.param_shardings(
            mesh, hf.abstract_params(cfg), transformer.logical_axes(cfg))
        cfg, params = hf.load_pretrained(path, dtype, shardings)
    """
    path = os.fspath(path)
    cfg = load_config(path, dtype)
    files = _weight_files(path)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(_open(file)) for file in sorted(set(files.values()))}
        source = TensorSource(
            shapes=lambda: {
                n: tuple(handles[f].get_slice(n).get_shape()) for n, f in files.items()
            },
            read=lambda name: handles[files[name]].get_tensor(name),
        )
        return cfg, load_tensors(cfg, source, path, dtype, shardings, place)


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where a checkpoint's tensors come from, under their Hugging Face names and layouts."""

    shapes: Callable[[], dict[str, tuple[int, ...]]]  # every tensor's name -> shape (headers only)
    read: Callable[[str], np.ndarray]  # one tensor's values


def load_tensors(
    cfg: tfm.ModelConfig,
    source: TensorSource,
    path: str,
    dtype: str = "float32",
    shardings=None,
    place: Place | None = None,
) -> Any:
    """The params of `cfg` read from `source` one tensor at a time (as `load_pretrained` says);
    names, shapes and unexpected tensors are checked before any tensor is read."""
    source = _unfused(cfg, source)
    stored = source.shapes()
    shapes = traverse_util.flatten_dict(abstract_params(cfg))
    tensors = {key: hf_tensors(cfg, key, shape.shape) for key, shape in shapes.items()}
    names = [hf for parts in tensors.values() for part in parts for hf in part.names]
    missing = [hf for hf in names if hf not in stored]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks tensors: {', '.join(missing[:8])}.")
    known = set(names) | {"lm_head.weight"}
    unexpected = [n for n in stored if n not in known and not n.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        raise ValueError(
            f"checkpoint {path!r} has tensors jrl's {cfg.hf_model_type} decoder does not use: "
            f"{', '.join(sorted(unexpected)[:8])}."
        )
    for part in (part for parts in tensors.values() for part in parts):
        want = _hf_shape(part.layout, part.shape)
        for hf in part.names:
            if tuple(stored[hf]) != want:
                raise ValueError(
                    f"tensor {hf} has shape {tuple(stored[hf])}, the config implies {want}."
                )
    placements = _flat_shardings(shardings, shapes)
    place = place or partitioning.put
    host = jax.numpy.dtype(dtype)
    convert = _LAYOUTS
    read = lambda hf, part: convert[part.layout][1](source.read(hf), part.shape).astype(host)

    def value(part: Part) -> np.ndarray:
        if not part.experts:
            return read(part.names[0], part) if part.names else np.zeros(part.shape, host)
        out = np.empty((len(part.names), *part.shape), host)  # one layer's experts
        for e, hf in enumerate(part.names):
            out[e] = read(hf, part)
        return out

    flat = {}
    for key, parts in tensors.items():
        if key[0] != "layers":
            flat[key] = _place(value(parts[0]), placements[key], place)
        else:  # stacked: filled on the devices one layer at a time
            layers = (value(part) for part in parts)
            flat[key] = _place_stacked(layers, shapes[key].shape, dtype, placements[key], place)
    return traverse_util.unflatten_dict(flat)


# transformers 5's in-memory experts (`save_pretrained(save_original_format=False)` writes them)
_FUSED = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")


def _unfused(cfg: tfm.ModelConfig, source: TensorSource) -> TensorSource:
    """`source` with fused experts seen as the per-expert tensors `weight_names` names: a
    layer's `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows)
    as `experts.{e}.gate_proj.weight` and `up_proj.weight` [I, H], `mlp.experts.down_proj`
    [E, H, I] as `experts.{e}.down_proj.weight` [H, I]; Mixtral's under `block_sparse_moe.`
    as w1 / w3 / w2, with its router `mlp.gate.weight`. The host keeps one fused tensor, the
    one being read. `source` unchanged when it has none."""
    stored = source.shapes()
    fused = {n: m.groups() for n in stored if (m := _FUSED.match(n))}
    if not fused:
        return source
    mixtral = infer_model_type(cfg) == "mixtral"
    block = "block_sparse_moe." if mixtral else "mlp."
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {}
    virtual = {}  # per-expert name -> (fused name, index into it, shape)
    for n, (layer, what) in fused.items():
        num_experts, rows, cols = stored[n]
        halves = {"down": slice(None)}
        if what == "gate_up_proj":
            halves = {"gate": slice(0, rows // 2), "up": slice(rows // 2, rows)}
        for e in range(num_experts):
            for p, part in halves.items():
                shape = (rows if p == "down" else rows // 2, cols)
                name = f"{layer}{block}experts.{e}.{names.get(p, p + '_proj')}.weight"
                virtual[name] = (n, (e, part), shape)
        router = f"{layer}mlp.gate.weight"
        if mixtral and router in stored:
            virtual[f"{layer}{block}gate.weight"] = (router, (), tuple(stored[router]))
    hidden = {n for n, _, _ in virtual.values()}
    last: dict[str, np.ndarray] = {}

    def read(name: str) -> np.ndarray:
        if name not in virtual:
            return source.read(name)
        n, index, _ = virtual[name]
        if n not in last:
            last.clear()
            last[n] = source.read(n)
        return np.ascontiguousarray(last[n][index])

    def shapes() -> dict[str, tuple[int, ...]]:
        out = {n: shape for n, shape in stored.items() if n not in hidden}
        return {**out, **{name: shape for name, (_, _, shape) in virtual.items()}}

    return TensorSource(shapes=shapes, read=read)


def _place_stacked(layers, shape, dtype: str, sharding, place: Place) -> jax.Array:
    """A stacked [num_layers, ...] parameter from its layers (host arrays, in order), filled in
    on the devices (or into `sharding`) one layer at a time: the host holds one layer's tensor,
    never the whole stack."""
    dtype = jax.numpy.dtype(dtype)
    if sharding is None:
        stacked, layer_sharding = jax.numpy.zeros(shape, dtype), None
        set_layer = jax.jit(_set_layer, donate_argnums=0)
    else:
        stacked = jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)()
        spec = sharding.spec
        layer_sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec[1:])
        )
        set_layer = jax.jit(_set_layer, donate_argnums=0, out_shardings=sharding)
    for i, value in enumerate(layers):
        stacked = set_layer(stacked, _place(value, layer_sharding, place), i)
        del value  # the next layer is read only once this one is on its devices
    return stacked


def _set_layer(stacked, value, i):
    return jax.lax.dynamic_update_index_in_dim(stacked, value, i, 0)


# ---------------------------------------------------------------------------------------------
# writing


def save_pretrained(
    model_config: tfm.ModelConfig, params, out_dir, tokenizer=None, dtype: str | None = None
) -> str:
    """Writes a checkpoint `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads.

    Files: config.json (model_type, architectures and every field transformers reads),
    model.safetensors (HF names and layouts, in `dtype`, default the config's `param_dtype`),
    and with a tokenizer its files plus generation_config.json (bos / eos / pad ids). A value
    head is not written (HF causal LMs have none). Returns `out_dir`.
    """
    out_dir = os.fspath(out_dir)
    dtype = dtype or model_config.param_dtype
    hf_config = hf_config_dict(model_config, dtype, tokenizer)
    flat = traverse_util.flatten_dict(params)
    tensors = {}
    for key in weight_names(model_config):
        parts = hf_tensors(model_config, key, flat[key].shape)
        for i, part in enumerate(parts):
            if not part.names:  # the unused MLP of a layer (see hf_tensors)
                continue
            value = flat[key] if key[0] != "layers" else flat[key][i]  # one layer of a stack
            value = np.asarray(jax.device_get(value)).astype(jax.numpy.dtype(dtype))
            values = value if part.experts else value[None]
            for hf, v in zip(part.names, values):
                tensors[hf] = np.ascontiguousarray(_LAYOUTS[part.layout][0](v))
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        if tokenizer.eos_token_id is not None:
            gen = transformers.GenerationConfig(
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            gen.save_pretrained(out_dir)
    return out_dir
