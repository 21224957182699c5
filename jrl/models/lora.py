"""LoRA: low-rank adapters trained on a frozen base model.

A targeted projection W of every decoder block (q/k/v/o_proj, gate/up/down_proj, Hugging Face's
names) computes x W + (alpha / r) (x A) B. In jrl's layouts, with the base's stacked [L] axis:

    W [L, *in, *out]    A [L, *in, r]    B [L, r, *out]

(q_proj W [L, H, N, D]: in (H,), out (N, D); o_proj W [L, N, D, H]: in (N, D), out (H,); the
MLP's are 2-D per layer). A starts as PEFT's does (uniform in +-1/sqrt(fan_in)), B at zero, so
the adapted model starts exactly at the base.

Mixtures of experts (Qwen3-MoE, Mixtral): the targets gate_proj / up_proj / down_proj also adapt
every expert's projection, as PEFT's target names do (its "gate_proj" adapts each module of that
name, each expert's in a checkpoint's per-expert layout; Mixtral's are w1 / w3 / w2): one A / B
per expert, W [L, E, in, out], A [L, E, in, r], B [L, E, r, out], under the block module "moe".
The experts' forward computes with W + A B (`transformer.MoE`: the low-rank product folded into
the weights at each forward, as PEFT does for stacked expert parameters, its
`target_parameters`; the rollout folds them once), so LoRA dropout does not reach them (PEFT
refuses dropout there). The router is not adapted. `merge` folds them in like the others; the
PEFT export (`peft_tensors` with the model's config) writes them under the per-expert module
names of the checkpoint's layout, which PEFT loads (transformers 5 converts them to its fused
experts, `peft.utils.transformers_weight_conversion`).

The trees:
  base       the model's params without its value head: frozen, in `model.dtype`
  trainable  {"lora": adapters, **heads}: adapters {"layers": {"attn" | "mlp": {name: {"a",
             "b"}}}} in float32, plus the value head of a model that has one (trained fully)
  combine(base, trainable, scale) -> the params the model takes: base and heads, and "lora"
             with B scaled by alpha / r (`transformer.variables` routes it to the adapters)
  reference(base, trainable) -> the same model with the adapters off (the KL reference)

A run's train state holds these trees: `params` / `critic_params` the trainable ones (adapters and
value heads, float32), `ref_params` the frozen base (model.dtype), shared by policy, critic and the
KL reference. `lora_on(cfg)`, `init_lora`, `with_base`, `policy_params`, `reference_params` and
`state_axes` take the run's config and are the identity without LoRA (`lora.rank` 0).

`with_dropout(params, rate, key)` adds per-layer dropout keys to the combined params (the update's
training forwards; `transformer` then drops adapter inputs). `merge` folds the adapters into full
weights (export); `peft_tensors` / `peft_config` write them in PEFT's format
(`adapter_model.safetensors`, `adapter_config.json`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from jax.sharding import PartitionSpec
from jrl.models import hf, hub

from jrl.models import transformer

# Projection (Hugging Face's name) -> (jrl module inside a block, number of input dims of W).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("attn", 1),
    "k_proj": ("attn", 1),
    "v_proj": ("attn", 1),
    "o_proj": ("attn", 2),
    "gate_proj": ("mlp", 1),
    "up_proj": ("mlp", 1),
    "down_proj": ("mlp", 1),
}
# The expert projections a target adapts too (block module "moe", see the module docstring).
EXPERT_TARGETS = transformer.EXPERT_PROJECTIONS
# Leading axes of a module's W that its adapters keep, not contracted: layers (and experts).
_LEAD = {"attn": 1, "mlp": 1, "moe": 2}
# Hugging Face's module path of each jrl block module (PEFT names adapters by it).
_HF_MODULE = {"attn": "self_attn", "mlp": "mlp"}
# Params trained in full next to the adapters (a value head on the policy or the critic).
HEAD_KEYS = ("value_head", "value_head_bias")


def target_list(target_modules: str) -> list[str]:
    """`lora.target_modules` ("q_proj,v_proj") as a list, in TARGETS order."""
    names = {t.strip() for t in target_modules.split(",") if t.strip()}
    return [t for t in TARGETS if t in names]


def scale(lora_cfg) -> float:
    """alpha / rank (PEFT's scaling without rsLoRA)."""
    return lora_cfg.alpha / lora_cfg.rank


def split(params) -> tuple[dict, dict]:
    """(base, heads): the params without / only the value head (HEAD_KEYS)."""
    base = {k: v for k, v in params.items() if k not in HEAD_KEYS}
    return base, {k: v for k, v in params.items() if k in HEAD_KEYS}


def _modules(name: str) -> tuple[tuple[str, int, int], ...]:
    """(block module, number of input dims of W, its key's fold) of each projection target
    `name` adapts: its module (fold 0), and with experts theirs (fold 1)."""
    module, num_in = TARGETS[name]
    return ((module, num_in, 0),) + ((("moe", 1, 1),) if name in EXPERT_TARGETS else ())


def init_adapters(base, targets, rank: int, key) -> dict:
    """Adapters of `targets` (HF names) on the stacked blocks of `base` (of the modules it has:
    no dense MLP where every layer is a mixture of experts, no experts in a dense model): A
    uniform in +-1/sqrt(fan_in) (PEFT's kaiming_uniform(a=sqrt(5))), B zero; float32."""
    out: dict = {}
    for i, name in enumerate(targets):
        for module, num_in, fold in _modules(name):
            if module not in base["layers"]:
                continue
            w, lead = base["layers"][module][name], _LEAD[module]
            shape_in, shape_out = w.shape[lead : lead + num_in], w.shape[lead + num_in :]
            bound = 1.0 / math.sqrt(math.prod(shape_in))
            k = jax.random.fold_in(key, i)
            k = jax.random.fold_in(k, fold) if fold else k
            a_shape = (*w.shape[:lead], *shape_in, rank)
            a = jax.random.uniform(k, a_shape, jnp.float32, -bound, bound)
            b = jnp.zeros((*w.shape[:lead], rank, *shape_out), jnp.float32)
            out.setdefault(module, {})[name] = {"a": a, "b": b}
    return {"layers": out}


def init_trainable(params, lora_cfg, key) -> tuple[dict, dict]:
    """(frozen base, trainable) of a model's `params` under `lora_cfg` (`cfg.lora`). The value
    head, trained in full, gets float32 master weights whatever the base's dtype (a run holds
    the base in the compute dtype): in bfloat16, Adam steps under half an ulp of an entry would
    be lost."""
    base, heads = split(params)
    adapters = init_adapters(base, target_list(lora_cfg.target_modules), lora_cfg.rank, key)
    return base, {"lora": adapters, **jax.tree.map(lambda x: x.astype(jnp.float32), heads)}


def _scaled(adapters, s: float):
    return jax.tree.map(
        lambda ab: {"a": ab["a"], "b": ab["b"] * s},
        adapters,
        is_leaf=lambda x: isinstance(x, dict) and "a" in x,
    )


def combine(base, trainable, s: float):
    """The params the model takes: `base`, the heads and the adapters (B scaled by `s` = alpha
    / rank). `base` None: `trainable` is the whole model already (no LoRA)."""
    if base is None:
        return trainable
    out = {**base, **trainable}
    out["lora"] = _scaled(trainable["lora"], s)
    return out


def with_dropout(params, rate: float, key):
    """The combined `params` (`combine`) with dropout of probability `rate` on every adapter's
    input (PEFT's lora_dropout: x -> A sees x * mask / (1 - rate); the base projection sees x
    unchanged). Each projection of each layer draws its own mask from `key`. For the training
    forwards of the update only; `rate` 0 or `key` None: `params` unchanged. The experts'
    adapters, folded into their weights, get none (see the module docstring)."""
    if not rate or key is None:
        return params
    num_layers = next(iter(jax.tree.leaves(params["lora"]))).shape[0]
    layers = {module: dict(names) for module, names in params["lora"]["layers"].items()}
    for i, (module, name) in enumerate(
        (m, n) for m, names in params["lora"]["layers"].items() for n in names
    ):
        if module == "moe":
            continue
        keys = jax.random.split(jax.random.fold_in(key, i), num_layers)
        layers[module][name] = {
            **params["lora"]["layers"][module][name],
            # per layer (stacked on [L] like the weights): uint32 key data and the rate
            "dropout_key": jax.random.key_data(keys),
            "dropout_rate": jnp.full((num_layers,), rate, jnp.float32),
        }
    return {**params, "lora": {**params["lora"], "layers": layers}}


def reference(base, trainable):
    """The adapted model with its adapters off: the base (and the heads). No copy is made."""
    return {**base, **{k: v for k, v in trainable.items() if k != "lora"}}


def _deltas(adapters, s: float):
    """{(module, name): s * A @ B} [L, (E,) *in, *out] in float32."""
    out = {}
    for module, names in adapters["layers"].items():
        lead = _LEAD[module]
        for name, ab in names.items():
            a, b = ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32)
            r = a.shape[-1]
            d = a.reshape(*a.shape[:lead], -1, r) @ b.reshape(*b.shape[:lead], r, -1)
            out[(module, name)] = (s * d).reshape(*a.shape[:-1], *b.shape[lead + 1 :])
    return out


def merge(base, trainable, s: float, dtype=None):
    """Full params with the adapters folded in: W + s * A @ B (summed in float32, stored in
    `dtype`, default the base weight's dtype), plus the heads."""
    layers = {m: dict(v) for m, v in base["layers"].items()}
    for (module, name), delta in _deltas(trainable["lora"], s).items():
        w = layers[module][name]
        layers[module][name] = (w.astype(jnp.float32) + delta).astype(dtype or w.dtype)
    return {**reference(base, trainable), "layers": layers}


def trainable_axes(base_axes, trainable) -> dict:
    """Logical axes of a trainable tree, from the base model's (`transformer.logical_axes`):
    A keeps W's input axes, B its output axes (the rank dim unsharded), heads their own."""
    out = {k: base_axes[k] for k in trainable if k != "lora"}
    adapters = {}
    for module, names in trainable["lora"]["layers"].items():
        lead = _LEAD[module]
        for name in names:
            spec = tuple(base_axes["layers"][module][name])
            num_in = 1 if module == "moe" else TARGETS[name][1]
            adapters.setdefault(module, {})[name] = {
                "a": PartitionSpec(*spec[: lead + num_in], None),
                "b": PartitionSpec(*spec[:lead], None, *spec[lead + num_in :]),
            }
    out["lora"] = {"layers": adapters}
    return out


# ----------------------------------------------------------------------------- PEFT format


def _peft_module(module: str, name: str, model_cfg):
    """(PEFT's module path of adapter `name` of block module `module`, after
    "base_model.model.", with "{i}" for the layer and "{e}" for an expert; whether layer i
    holds it): without `model_cfg` a dense model's, in every layer; with it, named as the
    checkpoint's tensors (`hf.weight_names`: Qwen3-MoE's experts `mlp.experts.{e}.gate_proj`,
    Mixtral's `block_sparse_moe.experts.{e}.w1`), in the layers where the module computes (the
    dense MLP in dense layers, the experts in sparse ones)."""
    if model_cfg is None:
        if module == "moe":
            raise ValueError("naming the experts' adapters needs the model's config (model_cfg)")
        return f"model.layers.{{i}}.{_HF_MODULE[module]}.{name}", lambda i: True
    path = hf.weight_names(model_cfg)[("layers", module, name)][0].removesuffix(".weight")
    if module == "attn":
        return path, lambda i: True
    return path, lambda i: model_cfg.is_sparse(i) == (module == "moe")


def peft_tensors(trainable, model_cfg=None) -> dict[str, np.ndarray]:
    """The adapters under PEFT's tensor names and layouts (float32, unscaled: PEFT applies
    alpha / r itself): `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
    [r, in_features] and `...lora_B.weight` [out_features, r]; an expert's per expert, under its
    module in the checkpoint's per-expert layout (`_peft_module`; needs `model_cfg`)."""
    tensors = {}
    for module, names in trainable["lora"]["layers"].items():
        for name, ab in names.items():
            a, b = np.asarray(jax.device_get(ab["a"])), np.asarray(jax.device_get(ab["b"]))
            r = a.shape[-1]
            path, holds = _peft_module(module, name, model_cfg)
            for i in filter(holds, range(a.shape[0])):
                experts = range(a.shape[1]) if module == "moe" else (None,)
                for e in experts:
                    a_i, b_i = (a[i], b[i]) if e is None else (a[i, e], b[i, e])
                    prefix = "base_model.model." + path.format(i=i, e=e)
                    a_i = a_i.reshape(-1, r).T  # [r, in]
                    b_i = b_i.reshape(r, -1).T  # [out, r]
                    tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a_i, np.float32)
                    tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_i, np.float32)
    return tensors


def peft_target_modules(lora_cfg, model_cfg=None) -> list[str]:
    """PEFT's `target_modules` of `lora_cfg.target_modules`: the names themselves, and with
    `model_cfg` each module name they adapt in that model (Mixtral's experts: w1, w3, w2)."""
    targets = target_list(lora_cfg.target_modules)
    if model_cfg is None:
        return targets
    kinds = model_cfg.mlp_kinds()
    present = {"attn": True, "mlp": False in kinds, "moe": True in kinds}
    names = [
        _peft_module(module, name, model_cfg)[0].rsplit(".", 1)[1]
        for name in targets
        for module, _, _ in _modules(name)
        if present[module]
    ]
    return list(dict.fromkeys(names))


def peft_config(lora_cfg, base_model_name_or_path: str = "", model_cfg=None) -> dict:
    """PEFT's `adapter_config.json` of a LoRA adapter trained with `lora_cfg` (on the model of
    `model_cfg`, when given: its module names, `peft_target_modules`)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": int(lora_cfg.rank),
        "lora_alpha": float(lora_cfg.alpha),
        "lora_dropout": float(lora_cfg.dropout),
        "target_modules": peft_target_modules(lora_cfg, model_cfg),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft(out_dir, trainable, lora_cfg, base_model_name_or_path: str = "", model_cfg=None):
    """Writes `out_dir`/adapter_config.json and adapter_model.safetensors (PEFT's format);
    `model_cfg` (needed for a mixture of experts' adapters) names the modules as its checkpoint
    does."""
    os.makedirs(out_dir, exist_ok=True)
    safetensors.numpy.save_file(
        peft_tensors(trainable, model_cfg),
        os.path.join(out_dir, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = peft_config(lora_cfg, base_model_name_or_path, model_cfg)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


# ----------------------------------------------------------------------------- a run's state
# `cfg` is a run's config (its `lora` section); `state` a train state
# (`jrl.train_state.TrainState`).


def lora_on(cfg) -> bool:
    return bool(cfg.lora.rank)


def lora_dropout_on(cfg) -> bool:
    """Whether the update's forwards drop adapter inputs (LoRA with lora.dropout > 0)."""
    return lora_on(cfg) and cfg.lora.dropout > 0


def init_lora(cfg, critic_cfg, params, key):
    """(policy trainable, critic trainable or None, base) of a LoRA run starting from `params`;
    `critic_cfg` is a separate critic's model config (None without one)."""
    base, trainable = init_trainable(params, cfg.lora, jax.random.fold_in(key, 1))
    critic = None
    if critic_cfg is not None:  # its own adapters on the same base, and a fresh value head
        float32 = dataclasses.replace(critic_cfg, param_dtype="float32")
        _, head = split(transformer.init_params(float32, key))
        _, critic = init_trainable({**base, **head}, cfg.lora, jax.random.fold_in(key, 2))
    return trainable, critic, base


def with_base(cfg, base, trainable, dropout_key=None):
    """The full params of a model from its trainable part (see `init_lora`); with a
    `dropout_key` (the update's training forwards) and lora.dropout > 0 the adapters' inputs are
    dropped (`with_dropout`). Without LoRA, `trainable` itself."""
    if not lora_on(cfg) or trainable is None:
        return trainable
    full = combine(base, trainable, scale(cfg.lora))
    return with_dropout(full, cfg.lora.dropout, dropout_key)


def policy_params(cfg, state):
    """The policy's full params (with LoRA: base + adapters)."""
    return with_base(cfg, state.ref_params, state.params)


def reference_params(cfg, state):
    """The KL reference's params (with LoRA: the policy with its adapters off, no copy)."""
    if not lora_on(cfg):
        return state.ref_params
    return reference(state.ref_params, state.params)


def state_axes(cfg, abstract_state, policy_axes, critic_axes=None) -> dict:
    """`jrl.sharding.state_shardings`' logical axes of a train state, from the full models' axes
    (`transformer.logical_axes`): with LoRA those of the trainable trees and of the base."""
    if not lora_on(cfg):
        return dict(policy_axes=policy_axes, critic_axes=critic_axes)
    critic = abstract_state.critic_params
    return dict(
        policy_axes=trainable_axes(policy_axes, abstract_state.params),
        critic_axes=None if critic is None else trainable_axes(critic_axes, critic),
        reference_axes={k: policy_axes[k] for k in abstract_state.ref_params},
    )


# ----------------------------------------------------------------------------- base identity


def base_identity(hf_path: str) -> dict:
    """What a LoRA checkpoint records of its base: `hf_path` and a fingerprint (sha256 of the
    checkpoint's config.json and the names and sizes of its weight files; of a .gguf file, its
    name and size)."""
    hf_path = hub.local_path(hf_path)
    digest = hashlib.sha256()
    if os.path.isfile(hf_path):  # a .gguf file
        digest.update(json.dumps([os.path.basename(hf_path), os.path.getsize(hf_path)]).encode())
        return {"hf_path": os.path.abspath(hf_path), "fingerprint": digest.hexdigest()[:16]}
    with open(os.path.join(hf_path, "config.json"), "rb") as f:
        digest.update(f.read())
    sizes = {
        name: os.path.getsize(os.path.join(hf_path, name))
        for name in sorted(os.listdir(hf_path))
        if name.endswith((".safetensors", ".safetensors.index.json"))
    }
    digest.update(json.dumps(sizes, sort_keys=True).encode())
    return {"hf_path": os.path.abspath(hf_path), "fingerprint": digest.hexdigest()[:16]}


def check_base(saved: dict, hf_path: str) -> str | None:
    """None when `hf_path` is the base a checkpoint recorded (`base_identity`), else a one-line
    message naming the difference and the fix."""
    now = base_identity(hf_path)
    if now["fingerprint"] == saved.get("fingerprint"):
        return None
    return (
        f"the base model at {hf_path} is not the one the LoRA checkpoints were trained on "
        f"({saved.get('hf_path')}, fingerprint {saved.get('fingerprint')}; now "
        f"{now['fingerprint']}); point --config.model.hf_path at that base, or start a fresh "
        f"--workdir."
    )
