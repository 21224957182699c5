"""Answers to look at: a few greedy eval answers (prompt, completion, reward) per eval.

`jrl.run.trainer.make_eval(..., num_samples=N)` returns the first N eval rows' greedy responses
next to the metrics, under "samples/..."; `split` takes them off the metrics, `rows` decodes them
with the task's tokenizer, `markdown` renders them for tensorboard's text tab and `lines` for a
terminal. The trainer writes them to `DIR/samples.jsonl` (one JSON object per answer, with "step")
and to tensorboard at every eval; `python -m jrl.eval --show=N` prints N answers of the checkpoint
it evaluates; `read(DIR)` loads the file. """

from __future__ import annotations

import json

import numpy as np
from etils import epath

from jrl.run.metric_writers import SAMPLES_FILE

PREFIX = "samples/"


def split(metrics: dict) -> tuple[dict, dict]:
    """(metrics without the "samples/..." arrays, those arrays without the prefix)."""
    rest = {k: v for k, v in metrics.items() if not k.startswith(PREFIX)}
    found = {k[len(PREFIX) :]: v for k, v in metrics.items() if k.startswith(PREFIX)}
    return rest, found


def rows(task, batch: dict, samples: dict) -> list[dict]:
    """[{"prompt", "completion", "reward"}] of the sample arrays of `split` (the first rows of
    `batch`): the prompt without special tokens, the completion with them (an answer's EOS
    shows whether it ended), the reward as a float."""
    if not samples:
        return []
    ids, mask = np.asarray(samples["response_ids"]), np.asarray(samples["response_mask"])
    n = ids.shape[0]
    prompts = task.decode_responses(batch["input_ids"][:n], batch["attention_mask"][:n])
    completions = task.decode_responses(ids, mask, skip_special_tokens=False)
    scores = np.asarray(samples["score"]).reshape(-1).tolist()
    return [
        {"prompt": p, "completion": c, "reward": float(r)}
        for p, c, r in zip(prompts, completions, scores)
    ]


def _cell(text: str) -> str:
    """A markdown table cell: pipes escaped, newlines as <br>."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown(rows: list[dict]) -> str:
    """A markdown table of `rows` (tensorboard renders text summaries as markdown)."""
    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    lines += [
        f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']:g} |" for r in rows
    ]
    return "\n".join(lines)


def lines(rows: list[dict], width: int = 100) -> list[str]:
    """One terminal line per row: `reward R | 'prompt' -> 'completion'` (Python string literals:
    newlines show as \\n) in at most `width` characters. The completion (a multi-turn answer
    with its tool turns) is kept whole where it fits; a long prompt gives way from its start,
    keeping its end, the question (`...er: 72\\nQ: 318*57\\nA:'`); what still does not fit is
    cut at the end."""
    out = []
    for r in rows:
        head = f"reward {r['reward']:g} | "
        prompt, completion = repr(r["prompt"]), repr(r["completion"])
        room = width - len(head) - len(" -> ") - len(completion)
        if len(prompt) > room:
            prompt = "..." + prompt[len(prompt) - max(room - 3, 0) :] if room > 3 else "..."
        line = f"{head}{prompt} -> {completion}"
        out.append(line if len(line) <= width else line[: width - 3] + "...")
    return out


def read(workdir, step: int | None = None) -> list[dict]:
    """The rows of `DIR/samples.jsonl` (all steps, or those of `step`); [] without the file."""
    path = epath.Path(workdir) / SAMPLES_FILE
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if step is None or r["step"] == step]
