"""Metric writers: `metrics.jsonl` and tensorboardX events in the workdir, and a console progress bar."""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

import numpy as np
import tqdm
from tensorboardX import SummaryWriter

# Progress-bar fields: (label, metric name, format).
_BAR_FIELDS = (
    ("reward", "critic/score/mean", "{:.3f}"),
    ("acc", "val/accuracy", "{:.3f}"),
    ("kl", "actor/ppo_kl", "{:.1e}"),
    ("tok/s", "perf/throughput", "{:.0f}"),
)


def to_python(metrics: Mapping) -> dict:
    """Host floats / ints from device or numpy scalars."""
    out = {}
    for k, v in metrics.items():
        v = np.asarray(v)
        out[k] = v.item() if v.ndim == 0 else v.tolist()
    return out


class MetricWriter:
    """Appends one JSON object per write to `workdir/metrics.jsonl` and the same scalars to
    tensorboard. `enabled=False` (every process but 0 in a multi-host run) writes nothing."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
        self._tb = SummaryWriter(logdir=workdir)

    def write(self, step: int, metrics: Mapping) -> None:
        if not self.enabled:
            return
        metrics = to_python(metrics)
        self._jsonl.write(json.dumps({"step": int(step), **metrics}) + "\n")
        self._jsonl.flush()
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


class ProgressBar:
    """tqdm bar over RL steps showing reward, last eval accuracy, KL and tokens/s (ETA from tqdm)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self._bar = tqdm.tqdm(
            total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True
        )
        self._shown: dict[str, str] = {}

    def update(self, metrics: Mapping, advance: int = 1) -> None:
        for label, key, fmt in _BAR_FIELDS:
            if key in metrics:
                self._shown[label] = fmt.format(float(metrics[key]))
        self._bar.set_postfix(self._shown, refresh=False)
        self._bar.update(advance)

    def write(self, line: str) -> None:
        self._bar.write(line)

    def close(self) -> None:
        self._bar.close()
