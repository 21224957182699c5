"""What the command-line tools print: warnings and errors of the libraries, not their INFO logs.

orbax logs about fifty INFO lines per checkpoint and absl / jax add their own; on the console
they would bury the progress bar and the few lines a run means to show (its summary, the warm-up
result, one line per eval, the final JSON line). `quiet_console()` raises the console's threshold
to WARNING unless `--verbosity` was given; `log_to_file(workdir)` keeps every INFO record in
`workdir/train.log` (local workdirs; a run's own INFO lines included).

(transformers' "PyTorch was not found" notice is hidden by `jrl/__init__.py`.)
"""

from __future__ import annotations

import logging
import os

LOG_FILE = "train.log"  # INFO log of a run in its workdir (train.<i>.log on process i > 0)


def quiet_console(verbosity_given: bool) -> None:
    """Console (absl's stderr handler) at WARNING, unless `--verbosity` was given: then absl's
    own level (`--verbosity=0` INFO, `1` DEBUG) is kept. Records still reach other handlers (the
    log file) at the level absl set."""
    from absl import logging as absl_logging

    if not verbosity_given:
        absl_logging.get_absl_handler().setLevel(logging.WARNING)


class _RunLog(logging.FileHandler):
    """The INFO log file of one run (a separate class, so a second run replaces it)."""


def log_to_file(workdir: str, process_index: int = 0) -> str | None:
    """Appends every record that reaches the root logger (INFO and up under absl's default
    verbosity) to `workdir/train.log`; replaces the file handler of an earlier run in this
    process. A URI workdir (gs://...) gets no log file. Returns the file's path or None."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _RunLog)]:
        root.removeHandler(handler)
        handler.close()
    if "://" in workdir:
        return None
    name = LOG_FILE if process_index == 0 else f"train.{process_index}.log"
    handler = _RunLog(os.path.join(workdir, name))
    handler.setLevel(logging.INFO)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s %(filename)s:%(lineno)d] %(message)s")
    )
    root.addHandler(handler)
    return handler.baseFilename


def _count(n: float) -> str:
    """1234567 -> '1.23M' (parameter counts)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    """2.8e9 -> '2.8 GB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def shorten(text: str, width: int = 160) -> str:
    """`text` as a Python literal (newlines show as \\n), its middle cut out past `width`
    characters: the start and the end (where a template's instruction goes) stay."""
    shown = repr(text)
    if len(shown) <= width:
        return shown
    head = width // 3
    return f"{shown[:head]} ... {shown[-(width - head - 5) :]}"


# A checkpoint at least this large is announced in the run summary, with its size.
LARGE_CHECKPOINT_BYTES = 100e6


def checkpoint_line(ckpt_cfg, checkpoint_bytes: int) -> str | None:
    """The summary line about checkpoints: their size when large, or that none will be written
    (then the run cannot resume); None for small checkpoints that will be written."""
    every, at_end = ckpt_cfg.every_steps, ckpt_cfg.at_end
    if not every and not at_end:
        return (
            "checkpoints: none (checkpoint.every_steps=0, checkpoint.at_end=False; only a "
            "preemption saves one): a stopped run restarts from step 0, and jrl.eval / jrl.export "
            "have nothing to read"
        )
    if checkpoint_bytes < LARGE_CHECKPOINT_BYTES:
        return None
    when = [f"every {every} steps"] if every else []
    when += ["at the end"] if at_end else []
    kept = f", the newest {ckpt_cfg.max_to_keep} kept" if ckpt_cfg.max_to_keep else ""
    return (
        f"checkpoints: about {_bytes(checkpoint_bytes)} each (parameters + optimizer state), "
        f"{' and '.join(when)}{kept}; fewer: --config.checkpoint.every_steps=0 (none periodic), "
        f"--config.checkpoint.at_end=False (no final one)"
    )


def run_summary(
    cfg,
    model_cfg,
    num_params: int,
    mesh,
    workdir: str,
    *,
    eval_prompts: int,
    prompt: str,
    checkpoint_bytes: int,
) -> list[str]:
    """The lines a run prints before it starts: model size, devices and mesh, the RL settings
    with the number of eval prompts actually evaluated, one prompt as the model sees it (template
    and special tokens included), the checkpoints when large or none, and the workdir with what
    it will hold."""
    import jax

    devices = jax.devices()
    axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
    checkpoints = checkpoint_line(cfg.checkpoint, checkpoint_bytes)
    return [
        f"model: {_count(num_params)} parameters ({model_cfg.num_layers} layers, hidden "
        f"{model_cfg.hidden_size}, vocabulary {model_cfg.vocab_size}), {model_cfg.dtype} compute",
        f"devices: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()}), "
        f"{jax.process_count()} process(es); mesh {axes}",
        f"RL: {cfg.algorithm.adv_estimator}, {cfg.total_steps} steps x "
        f"{cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples; eval every "
        f"{cfg.eval_every or cfg.total_steps} steps on {eval_prompts} held-out prompts",
        f"prompt: {shorten(prompt)} (task {cfg.task.name}, the first eval prompt as the model "
        f"sees it)",
        *([checkpoints] if checkpoints else []),
        f"workdir: {workdir} (metrics.jsonl, samples.jsonl, tensorboard events, checkpoints, "
        f"{LOG_FILE})",
    ]
