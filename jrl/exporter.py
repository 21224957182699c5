"""Export of a run's checkpoint as a Hugging Face checkpoint (`export`), and the restore of a
run's config and policy that jrl.evaluator shares. The command line is jrl/export.py."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from jrl import checkpoint as checkpoint_lib
from jrl import config as config_lib
from jrl import models, trainer
from jrl import step as step_lib
from jrl import tokenizer as tokenizer_lib
from jrl.models import lora as lora_lib
from jrl.models import transformer


class ExportError(ValueError):
    """A workdir, step or output directory that cannot be used; the message names the fix."""


# ------------------------------------------------------------------------------ the run's config


def _fill_defaults(cfg: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict) -> None:
    """Adds the fields of `defaults` that `cfg` lacks (configs saved before a field existed)."""
    for name, value in defaults.items():
        if name not in cfg:
            cfg[name] = value
        elif isinstance(value, ml_collections.ConfigDict) and isinstance(
            cfg[name], ml_collections.ConfigDict
        ):
            _fill_defaults(cfg[name], value)


def config_from_json(fields: dict) -> ml_collections.ConfigDict:
    """The ConfigDict of a saved config (`cfg.to_json_best_effort()`), with the fields added to
    jrl since it was saved at their defaults."""
    cfg = ml_collections.ConfigDict(fields)
    _fill_defaults(cfg, config_lib.base_config())
    return cfg


def _checkpoint_steps(workdir: str) -> list[int]:
    """Committed checkpoint steps under `workdir/checkpoints`, oldest first; [] when none."""
    directory = epath.Path(workdir) / checkpoint_lib.CHECKPOINTS_DIR
    if not directory.exists():
        return []
    with _checkpointer(workdir) as ckpt:
        return ckpt.all_steps()


def _checkpointer(workdir: str) -> checkpoint_lib.Checkpointer:
    """A Checkpointer that only reads (keeps every checkpoint, saves nothing by itself)."""
    return checkpoint_lib.Checkpointer(workdir, every_steps=0, max_to_keep=0, async_save=False)


def check_step(workdir: str, step: int | None) -> list[int]:
    """The workdir's checkpoint steps; raises ExportError when there are none or `step` is not
    one of them."""
    steps = _checkpoint_steps(workdir)
    if not steps:
        raise ExportError(
            f"workdir {workdir} has no checkpoints (nothing committed under "
            f"{os.path.join(workdir, checkpoint_lib.CHECKPOINTS_DIR)}); pass the --workdir of a "
            "run that saved one."
        )
    if step is not None and step not in steps:
        raise ExportError(
            f"step {step} is not among the checkpoints of {workdir} (available: "
            f"{', '.join(map(str, steps))}); pass one of them, or leave --step out for the newest."
        )
    return steps


def load_config(workdir: str, step: int | None = None) -> ml_collections.ConfigDict:
    """The config checkpoint `step` (default: the newest) was written with: its
    `extra["config"]`, else `workdir/config.json` (the last run's config)."""
    steps = check_step(workdir, step)
    step = steps[-1] if step is None else step
    extra_dir = epath.Path(workdir) / checkpoint_lib.CHECKPOINTS_DIR / str(step) / "extra"
    saved = None
    try:
        extra = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(extra_dir)
        saved = (extra or {}).get("config")
    except Exception as e:  # noqa: BLE001 - an unreadable extra item: fall back to config.json
        logging.warning("Could not read %s (%s); using config.json.", extra_dir, e)
    if saved is None:
        path = epath.Path(workdir) / "config.json"
        if not path.exists():
            raise ExportError(
                f"checkpoint {step} of {workdir} records no config and {path} is missing; pass "
                "the run's config with --config=configs/X.py."
            )
        saved = json.loads(path.read_text())
    return config_from_json(saved)


# ------------------------------------------------------------------------------ the policy


def policy_model(cfg) -> tuple:
    """(tokenizer, policy model config) of a run; unlike `trainer.build` it needs no data files."""
    tok = tokenizer_lib.get_tokenizer(cfg.tokenizer or cfg.model.hf_path)
    model_cfg, _ = step_lib.model_configs(cfg, trainer.model_config(cfg, len(tok)))
    return tok, model_cfg


def abstract_state(
    cfg, model_cfg: transformer.ModelConfig, with_base: bool = False
) -> step_lib.TrainState:
    """The run's train state as shapes (as jrl.trainer.run makes it), without the reference
    params (they are not needed to export or evaluate the policy; `with_base`: with them, for
    LoRA's frozen base)."""
    key_init, key_state = jax.random.split(jax.random.key(cfg.seed))
    state = jax.eval_shape(
        lambda: step_lib.init_state(
            cfg, model_cfg, transformer.init_params(model_cfg, key_init), key_state
        )
    )
    return state if with_base else state.replace(ref_params=None)


def restore_params(workdir: str, cfg, model_cfg: transformer.ModelConfig, step: int | None = None):
    """(policy params, step) of checkpoint `step` of `workdir`; default: the newest checkpoint
    that reads back (unreadable newer ones are skipped with a warning). A LoRA run's policy
    comes back merged: W + (alpha / r) A B, in float32."""
    if lora_lib.lora_on(cfg):
        base, trainable, step = restore_lora(workdir, cfg, model_cfg, step)
        return lora_lib.merge(base, trainable, lora_lib.scale(cfg.lora), "float32"), step
    state, _, step = _restore_state(workdir, cfg, model_cfg, step)
    return state.params, step


def restore_lora(workdir: str, cfg, model_cfg: transformer.ModelConfig, step: int | None = None):
    """(frozen base, trainable params, step) of a LoRA run's checkpoint: the base from
    model.hf_path (checked against the identity the checkpoint recorded) or, for a base made in
    the run (the demo's warm-up), from the workdir's reference/."""
    state, extra, step = _restore_state(workdir, cfg, model_cfg, step)
    if trainer.lora_base_from_hf(cfg):
        message = lora_lib.check_base(extra.get("lora_base") or {}, cfg.model.hf_path)
        if message:
            raise ExportError(message)
        loaded = models.load_pretrained(cfg.model.hf_path, dtype=model_cfg.param_dtype)[1]
        base, _ = lora_lib.split(loaded)
    else:
        with _checkpointer(workdir) as ckpt:
            base = ckpt.restore_reference(abstract_state(cfg, model_cfg, with_base=True).ref_params)
    return base, state.params, step


def _restore_state(workdir: str, cfg, model_cfg: transformer.ModelConfig, step: int | None):
    """(train state without its reference, extra, step) of checkpoint `step` (None: newest)."""
    check_step(workdir, step)
    target = abstract_state(cfg, model_cfg)
    with _checkpointer(workdir) as ckpt:
        if step is None:
            state, extra, step = ckpt.restore_latest(target)
        else:
            where = str(ckpt.directory / str(step))
            try:
                state, extra = ckpt.restore(step, target)
            except checkpoint_lib.CheckpointError:
                raise
            except Exception as e:
                first = str(e).splitlines()[0][:300] if str(e) else ""
                raise ExportError(
                    f"checkpoint {where} does not read back ({type(e).__name__}: {first}); pick "
                    "another --step."
                ) from e
    return state, extra or {}, int(step)


# ------------------------------------------------------------------------------ export


def _check_out(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"--out={out_dir} is a file; pass a directory path.")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ExportError(
            f"--out={out_dir} is not empty; pass a new directory, or --overwrite to replace its "
            "contents."
        )


def export(
    workdir: str,
    out_dir: str,
    *,
    step: int | None = None,
    overwrite: bool = False,
    dtype: str | None = None,
    cfg: ml_collections.ConfigDict | None = None,
    adapter_only: bool = False,
) -> int:
    """Writes the policy of checkpoint `step` (default: newest readable) of `workdir` as a
    Hugging Face checkpoint in `out_dir` (weights in `dtype`, default the model's param dtype;
    a LoRA run's adapters merged into them). `adapter_only`: a LoRA run's adapters alone in
    PEFT's format instead (adapter_config.json, adapter_model.safetensors in float32).
    `cfg` replaces the config saved in the workdir. Returns the exported step."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    _check_out(out_dir, overwrite)
    if cfg is None:
        cfg = load_config(workdir, step)
    config_lib.validate(cfg)
    if adapter_only and not lora_lib.lora_on(cfg):
        raise ExportError(
            f"--adapter_only exports LoRA adapters, but the run in {workdir} trained every "
            "parameter (lora.rank=0); leave --adapter_only out to export its full weights."
        )
    tok, model_cfg = policy_model(cfg)
    if adapter_only:
        _, trainable, step = restore_lora(workdir, cfg, model_cfg, step)
    else:  # a value head (a critic sharing the backbone) is left out by save_pretrained
        params, step = restore_params(workdir, cfg, model_cfg, step)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.tmp-")
    try:
        if adapter_only:
            lora_lib.save_peft(tmp, trainable, cfg.lora, cfg.model.hf_path)
        else:
            models.save_pretrained(model_cfg, params, tmp, tokenizer=tok, dtype=dtype or None)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return step
