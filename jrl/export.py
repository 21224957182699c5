"""Export a run's policy as a Hugging Face checkpoint.

  python -m jrl.export --workdir=DIR [--step=N] --out=HF_DIR [--overwrite] [--dtype=bfloat16]
  python -m jrl.export --workdir=DIR --out=ADAPTER_DIR --adapter_only   # a LoRA run, PEFT format

Reads the config the checkpoint was written with (`extra["config"]` of checkpoint N, else
`DIR/config.json`; `--config=configs/X.py` replaces it), restores the policy params of checkpoint
N (default: the newest one that reads back) and writes HF_DIR: config.json, model.safetensors, the
tokenizer's files (the built-in character tokenizer too) and generation_config.json, which
`transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)` and `jrl.models.load_pretrained` load.
A value head (a critic sharing the policy's backbone) is left out. A LoRA run exports its
adapters merged into the base's weights, or with `--adapter_only` the adapters alone in PEFT's
format (adapter_config.json + adapter_model.safetensors) for `peft.PeftModel.from_pretrained`
and vLLM. HF_DIR must be new or empty;
`--overwrite` replaces its contents. The export is written to a temporary directory next to
HF_DIR and moved into place once complete.

Exit status: 0 done; 2 bad arguments (a workdir without checkpoints, a step that is not saved, a
non-empty HF_DIR without --overwrite, ...), with a one-line message on stderr.

The export itself is `jrl.run.exporter.export`.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from jrl.run import cli
from jrl.run.exporter import export

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """This CLI's flags, defined when it runs (importing the module defines none)."""
    cli.define_workdir("The run's directory (its checkpoints and config.json).")
    cli.define_config(" Default: the config the checkpoint was written with.")
    flags.DEFINE_integer("step", None, "Checkpoint step to export; default: the newest readable.")
    flags.DEFINE_string("out", None, "Output directory of the Hugging Face checkpoint.")
    flags.DEFINE_bool("overwrite", False, "Replace the contents of a non-empty --out.")
    flags.DEFINE_bool(
        "adapter_only",
        False,
        "A LoRA run: write only its adapters, in PEFT's format (adapter_config.json + "
        "adapter_model.safetensors), instead of merged full weights.",
    )
    flags.DEFINE_string(
        "dtype", "", "Weight dtype of the export (float32 | bfloat16); '': the model's."
    )


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.workdir:
        cli.fail("--workdir is required: the directory of the run to export.")
    if not FLAGS.out:
        cli.fail("--out is required: the directory to write the Hugging Face checkpoint to.")
    if FLAGS.dtype not in ("", "float32", "bfloat16"):
        cli.fail(f"--dtype={FLAGS.dtype} is not supported; pass float32 or bfloat16.")
    try:
        step = export(
            FLAGS.workdir,
            FLAGS.out,
            step=FLAGS.step,
            overwrite=FLAGS.overwrite,
            dtype=FLAGS.dtype or None,
            cfg=FLAGS.config,
            adapter_only=FLAGS.adapter_only,
        )
    except ValueError as e:  # ExportError, CheckpointError, ConfigError, unsupported models
        cli.fail(str(e))
    print(json.dumps({"workdir": FLAGS.workdir, "step": step, "out": os.path.abspath(FLAGS.out)}))


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=cli.parse_flags)
