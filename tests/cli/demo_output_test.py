"""What a run shows: a few console lines (no library INFO logs, no `datasets` progress bars), a
log file, sample answers in samples.jsonl / tensorboard / `jrl.eval --show`, and a warm-up that
stops at the first step at the target accuracy; a run on a user's own files (data=custom) with
its reward function from a file path."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboardX.proto import event_pb2

from jrl import data, sft
from jrl.run import checkpoint as checkpoint_lib
from jrl.run import console, samples
from jrl import tokenizer as tokenizer_lib
from conftest import REPO
from configs import grpo_math

BAR = re.compile(r"\|\s*\d+/\d+ \[")  # a tqdm progress-bar frame: "| 2/3 [00:05<..."


def console_lines(text: str) -> list[str]:
    """The lines of a run's output without the progress bar's frames and blank redraws."""
    parts = re.split(r"[\r\n]", text)
    return [p for p in parts if p.strip() and not BAR.search(p)]


def text_summaries(workdir) -> dict:
    """{step: text} of the "samples" text summaries in the workdir's event files."""
    out = {}
    for name in os.listdir(workdir):
        if not name.startswith("events.out.tfevents"):
            continue
        raw, pos = open(os.path.join(workdir, name), "rb").read(), 0
        while pos < len(raw):
            (length,) = np.frombuffer(raw[pos : pos + 8], "<u8")
            event = event_pb2.Event.FromString(raw[pos + 12 : pos + 12 + int(length)])
            pos += 16 + int(length)
            for value in event.summary.value:
                if value.tag.startswith("samples"):
                    out[event.step] = value.tensor.string_val[0].decode()
    return out


def bar_frames(text: str) -> list[str]:
    """The progress bar's frames of a run's output."""
    return [p for p in re.split(r"[\r\n]", text) if BAR.search(p)]


def cli(module: str, *args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    """`python -m module args` as a new user runs it (no notice-hiding variable set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    options = ["--config.total_steps=2", "--config.eval_every=1", "--config.eval_samples=3"]
    proc = cli("jrl.train", "--config=configs/grpo_math.py:tiny", f"--workdir={workdir}", *options)
    return workdir, proc


def test_cli_prints_summary_warmup_evals_and_json_only(cli_run):
    workdir, proc = cli_run
    lines = console_lines(proc.stdout + proc.stderr)
    # 5 summary lines, the warm-up, 3 evals (steps 0, 1, 2) with one answer each, the JSON line.
    expected = ["model: ", "devices: ", "RL: grpo, 2 steps", "prompt: '<bos>"]
    expected += [f"workdir: {workdir} ", "warm-up: 2 "]
    expected += [p for s in (0, 1, 2) for p in (f"step {s}: val/accuracy ", "  e.g. reward ")]
    assert len(lines) == len(expected) + 1, "\n".join(lines)
    for line, prefix in zip(lines, expected):
        assert line.startswith(prefix), (line, prefix)
    assert json.loads(lines[-1])["workdir"] == str(workdir)
    assert "model: 21.4K parameters" in lines[0]  # tiny: embed 88 x 32 + 2 blocks (hand count)
    assert lines[2].endswith("on 16 held-out prompts")  # the tiny preset's task.eval_size
    # The prompt is an eval problem "a+b=" after the bos token; its first answer shows it again.
    prompt = re.fullmatch(r"prompt: '<bos>(\d+\+\d+=)' \(task arithmetic, .*\)", lines[3])
    assert prompt and f" | '{prompt.group(1)}' -> " in lines[7]
    frames = bar_frames(proc.stdout + proc.stderr)
    assert frames and not any("kl=" in f for f in frames)  # no KL term in the demo: no kl shown
    # orbax's INFO records went to the log file, not the console.
    log = open(os.path.join(workdir, "train.log")).read()
    assert " INFO absl " in log and "orbax" in log


# The "Your own data" example of docs/usage.md, at the tiny preset's size: a jsonl file of
# question / answer records, a template, a reward function in a file, no checkpoints and a KL loss.
REWARD_PY = """
def exact(responses, ground_truths):
    return [float(r.split("\\n")[0].strip() == g.strip()) for r, g in zip(responses, ground_truths)]
"""


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory):
    home = tmp_path_factory.mktemp("own_data")
    (home / "data").mkdir()
    for name, n in (("train", 40), ("eval", 5)):  # 5 eval records: fewer than eval_size (16)
        rows = [{"question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(n)]
        (home / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (home / "my_reward.py").write_text(REWARD_PY)
    options = [
        "--config.task.train_files=data/train.jsonl",
        "--config.task.eval_files=data/eval.jsonl",
        "--config.task.template=Question: {question} Answer:",
        "--config.task.reward=my_reward.py:exact",  # a file, not a module on PYTHONPATH
        "--config.data.max_response_length=4",
        "--config.total_steps=2",
        "--config.checkpoint.every_steps=0",
        "--config.checkpoint.at_end=False",
        "--config.actor.use_kl_loss=True",
    ]
    config = f"--config={REPO}/configs/grpo_math.py:tiny,data=custom"
    proc = cli("jrl.train", config, "--workdir=run", *options, cwd=str(home))
    return home / "run", proc


def test_own_data_run_shows_its_prompt_count_and_no_datasets_lines(custom_run):
    workdir, proc = custom_run
    output = proc.stdout + proc.stderr
    # datasets' "Generating train split: ..." progress bars are off while jrl reads the files.
    assert "Generating" not in output and "examples/s" not in output, output
    lines = console_lines(output)
    assert lines[2].endswith("eval every 2 steps on 5 held-out prompts"), lines[2]
    assert lines[3] == (
        "prompt: '<bos>Question: What is 0 plus 1? Answer:' (task custom, the first eval prompt "
        "as the model sees it)"
    )
    assert lines[4].startswith("checkpoints: none (checkpoint.every_steps=0, ")
    frames = bar_frames(output)
    assert frames and "kl=" in frames[-1]  # the KL loss is on: its value is shown
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert steps == [0, 1, 2]
    # No checkpoint was written (orbax creates the directory, nothing is committed in it).
    assert not os.listdir(workdir / "checkpoints") and not os.listdir(workdir / "reference")
    assert checkpoint_lib.Checkpointer(workdir, every_steps=0, max_to_keep=0).all_steps() == []
    rows = samples.read(workdir)
    assert rows[0]["prompt"] == "Question: What is 0 plus 1? Answer:"


def test_checkpoint_line_and_sizes():
    ckpt = grpo_math.get_config().checkpoint  # every 50 steps, the newest 3 kept, at the end
    assert console.checkpoint_line(ckpt, 50e6) is None  # small: not announced
    # Gemma 3 270M: about 268M float32 parameters + Adam's two moments: 12 bytes each.
    line = console.checkpoint_line(ckpt, 268e6 * 12)
    assert line.startswith(
        "checkpoints: about 3.22 GB each (parameters + optimizer state), every 50 steps and at the "
        "end, the newest 3 kept;"
    )
    ckpt.every_steps = 0
    line = console.checkpoint_line(ckpt, 3e9)
    assert line.startswith("checkpoints: about 3 GB each (parameters + optimizer state), at the e")
    ckpt.at_end = False
    assert console.checkpoint_line(ckpt, 1).startswith("checkpoints: none")
    tree = {  # 3 x 4 float32, 5 bfloat16, a PRNG key (two uint32), nothing
        "w": jax.ShapeDtypeStruct((3, 4), jnp.float32),
        "b": jnp.zeros(5, jnp.bfloat16),
        "key": jax.random.key(0),
        "ref": None,
    }
    assert checkpoint_lib.nbytes(tree) == 48 + 10 + 8


def test_long_prompts_keep_their_start_and_end():
    text = "Q: " + "x" * 300 + '\nwrite the answer after "####".'
    shown = console.shorten(text, width=100)
    assert len(shown) == 100
    assert shown.startswith("'Q: xxx") and shown.endswith('\\nwrite the answer after "####".\'')
    assert console.shorten("7+8=") == "'7+8='"


def test_samples_jsonl_tensorboard_and_eval_show_agree(cli_run):
    workdir, _ = cli_run
    rows = samples.read(workdir)
    assert [r["step"] for r in rows] == [0] * 3 + [1] * 3 + [2] * 3
    for r in rows:  # prompts are the eval split's "a+b=" problems
        assert re.fullmatch(r"\d+\+\d+=", r["prompt"]) and r["reward"] in (0.0, 1.0)
    assert [r["prompt"] for r in rows[:3]] == [r["prompt"] for r in rows[3:6]]
    texts = text_summaries(workdir)
    assert sorted(texts) == [0, 1, 2]
    assert texts[2] == samples.markdown(samples.read(workdir, step=2))
    # The checkpoint of step 2, restored by jrl.eval, answers the same prompts the same way.
    out = cli("jrl.eval", f"--workdir={workdir}", "--show=2", "--k=1").stdout.strip().splitlines()
    assert out[:2] == samples.lines(samples.read(workdir, step=2)[:2], width=1000)
    assert json.loads(out[-1])["step"] == 2


def test_rows_markdown_and_lines_of_known_answers():
    tok = tokenizer_lib.get_tokenizer("char")
    task = data.make_task("arithmetic", tok, num_digits=2, ops=("+",), eval_size=8, seed=0)
    batch = task.eval_batch()
    n = 2  # responses: the reference answers (answer + <eos>), the second cut before its EOS
    ids = batch["answer_ids"][:n]
    mask = (np.arange(ids.shape[1])[None] <= batch["answer_len"][:n, None]).astype(np.int32)
    mask[1, batch["answer_len"][1]] = 0
    found = {"response_ids": ids, "response_mask": mask, "score": np.array([1.0, 0.0])}
    rest, split = samples.split(
        {"val/accuracy": 0.5, **{f"samples/{k}": v for k, v in found.items()}}
    )
    assert rest == {"val/accuracy": 0.5} and sorted(split) == sorted(found)
    rows = samples.rows(task, batch, split)
    for row, reward, end in zip(rows, (1.0, 0.0), ("<eos>", "")):
        a, b = map(int, row["prompt"][:-1].split("+"))
        assert row == {"prompt": f"{a}+{b}=", "completion": f"{a + b}{end}", "reward": reward}
    assert samples.markdown([{"prompt": "1|2=", "completion": "x\ny", "reward": 0.5}]) == (
        "| prompt | completion | reward |\n|---|---|---|\n| 1\\|2= | x<br>y | 0.5 |"
    )
    assert samples.lines([{"prompt": "3+4=", "completion": "7<eos>", "reward": 1.0}]) == [
        "reward 1 | '3+4=' -> '7<eos>'"
    ]
    # a long prompt keeps its end (the question) and the completion stays whole: 40 characters
    long_prompt = {"prompt": "x" * 50 + "Q", "completion": "y", "reward": 0.0}
    assert samples.lines([long_prompt], width=40) == ["reward 0 | ...xxxxxxxxxxxxxxxxxQ' -> 'y'"]
    # a completion longer than the line is cut at the end
    long_answer = {"prompt": "1+1=", "completion": "z" * 50, "reward": 0.0}
    assert samples.lines([long_answer], width=30) == ["reward 0 | ... -> 'zzzzzzzz..."]


def test_warmup_stops_at_the_first_step_reaching_the_target(monkeypatch):
    # A fake warm-up whose accuracy after n steps is 2n / 100: the target 0.30 is first reached
    # at step 15. Checked every 10 steps until 0.15 (half the target) is seen at step 10, then
    # after every step: it stops at 15 (the old every-10-steps check stopped at 20, accuracy 0.40).
    cfg = grpo_math.get_config()
    cfg.warmup.check_every, cfg.warmup.target_accuracy, cfg.warmup.sft_steps = 10, 0.3, 100

    def make_sft_step(cfg, model_cfg):
        return optax.identity(), lambda p, o, b: ({"n": p["n"] + 1}, o, jnp.float32(0))

    checked = []

    def accuracy_fn(params, probe):
        checked.append(int(params["n"]))
        return {"val/accuracy": int(params["n"]) * 2 / 100}

    class Task:
        def train_batch(self, step, batch_size, stream=0):
            return {"x": np.zeros(1)}

    monkeypatch.setattr(sft, "make_sft_step", make_sft_step)
    params, steps, accuracy = sft.sft_warmup(cfg, None, Task(), {"n": jnp.int32(0)}, accuracy_fn)
    assert (steps, accuracy, int(params["n"])) == (15, 0.30, 15)
    assert checked == [0, 10, 11, 12, 13, 14, 15]
