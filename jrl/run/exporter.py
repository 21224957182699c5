"""Export of a run's checkpoint as a Hugging Face checkpoint (`export`); the run's config and
policy are restored by jrl.run.checkpoint. The command line is jrl/export.py."""

from __future__ import annotations

import os
import shutil
import tempfile

import ml_collections

from jrl import config as config_lib
from jrl import models
from jrl.models import lora as lora_lib
from jrl.run import checkpoint as checkpoint_lib
from jrl.run import trainer


class ExportError(ValueError):
    """A workdir, step or output directory that cannot be used; the message names the fix."""


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
        cfg = checkpoint_lib.load_config(workdir, step)
    config_lib.validate(cfg)
    if adapter_only and not lora_lib.lora_on(cfg):
        raise ExportError(
            f"--adapter_only exports LoRA adapters, but the run in {workdir} trained every "
            "parameter (lora.rank=0); leave --adapter_only out to export its full weights."
        )
    tok, model_cfg = trainer.policy_model(cfg)
    if adapter_only:
        _, trainable, step = checkpoint_lib.restore_lora(workdir, cfg, model_cfg, step)
    else:  # a value head (a critic sharing the backbone) is left out by save_pretrained
        params, step = checkpoint_lib.restore_params(workdir, cfg, model_cfg, step)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.tmp-")
    try:
        if adapter_only:
            lora_lib.save_peft(tmp, trainable, cfg.lora, cfg.model.hf_path, model_cfg)
        else:
            models.save_pretrained(model_cfg, params, tmp, tokenizer=tok, dtype=dtype or None)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return step
