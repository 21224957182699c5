"""Bad input to the real CLI (`python -m jrl.train`): each case exits with status 2 and one last
stderr line `error: ...` that names the field or file and the fix, before anything compiles (run
with JAX_LOG_COMPILES=1: no "Compiling" line), and leaves an existing workdir exactly as it was
(same files, bytes and modification times).

Where each bad-input case of the issue is tested (tr = tests/train_test.py):
- unknown config key with a close match, a wrong type (a string for a float):
  tr::test_cli_bad_override_exits_2_with_one_line
- an unknown name in a choice field: tr::test_cli_bad_config_exits_2_with_one_line_before_compiling
- n < 1, a negative learning rate, a clip ratio out of range, batch sizes that do not divide,
  grpo / rloo with n = 1, a missing data file (or a directory), a corrupt one, a file without the
  question field, a record without it, a tokenizer path that is not a tokenizer, a corrupt
  tokenizer, prompts too long with overlong_prompts='error' or with every prompt dropped:
  here, test_bad_input_exits_2_and_leaves_workdir[<case>]
- an unwritable workdir: tr::test_cli_unwritable_workdir_exits_2
- a checkpoint whose shapes do not match the config:
  tr::test_cli_checkpoint_of_another_model_size_exits_2_and_changes_nothing
- prompts too long, dropped or truncated as configured and counted: here,
  test_long_prompts_are_counted_in_the_step_0_row (the task's own counts:
  tests/math_data_test.py::test_drop_truncate_and_error_overlong_prompts)
- a data file without read permission: here, test_data_file_without_read_permission (in
  process, the permission check answered "no": as root, which these tests may run as, every file
  is readable)
"""

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny config on a GSM8K-style file: no warm-up (it needs the arithmetic task), 2 eval rows
# held out, and a short template so that prompt lengths are easy to count by hand.
GSM8K = [
    "--config.task.name=gsm8k",
    "--config.task.reward=gsm8k",
    "--config.warmup.sft_steps=0",
    "--config.task.eval_size=2",
    "--config.task.template={question} Answer:",
]
# Six questions of 17 characters ("What is 1 plus 2?"): with the character tokenizer each prompt
# is <bos> + 17 + len(" Answer:") = 1 + 17 + 8 = 26 tokens.
QUESTIONS = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (3, 3)]
PROMPT_TOKENS = 26


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Data and tokenizer files for the cases, outside any workdir."""
    d = tmp_path_factory.mktemp("data")
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"} for a, b in QUESTIONS]
    write_jsonl(d / "train.jsonl", rows)
    write_jsonl(
        d / "no_question.jsonl", [{"problem": r["question"], "answer": r["answer"]} for r in rows]
    )
    one_missing = [dict(r) for r in rows]
    del one_missing[3]["question"]
    write_jsonl(d / "one_missing.jsonl", one_missing)
    (d / "corrupt.parquet").write_bytes(bytes(range(256)) * 4)
    (d / "not_a_tokenizer").mkdir()
    (d / "not_a_tokenizer" / "README.txt").write_text("model card only")
    (d / "corrupt_tokenizer").mkdir()
    (d / "corrupt_tokenizer" / "tokenizer.json").write_text("{ not json")
    return str(d)


def snapshot(root) -> dict:
    """Every path under `root` -> (bytes, mtime) for files, None for directories."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = None
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def run_cli(workdir, args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
    # Hub ids never reach the network here: offline, and an empty Hugging Face cache
    env.update(HF_HUB_OFFLINE="1", HF_HOME=os.path.join(os.path.dirname(workdir), "hf_home"))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jrl.train",
            "--config=configs/grpo_math.py:tiny",
            f"--workdir={workdir}",
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# id -> (arguments after the tiny config; DATA is the data fixture's directory), and the pieces
# the last stderr line must hold: the problem (field or file, value) and the fix.
CASES = {
    "rollout_n_below_1": (["--config.rollout.n=0"], ["error: rollout.n=0 must be >= 1."]),
    "negative_learning_rate": (
        ["--config.actor.lr=-0.001"],
        ["error: actor.lr=-0.001 must be >= 0."],
    ),
    "clip_ratio_out_of_range": (
        ["--config.actor.clip_ratio_low=1.5"],
        ["error: actor.clip_ratio_low=1.5 must be in (0, 1)."],
    ),
    "batch_sizes_do_not_divide": (
        ["--config.actor.ppo_mini_batch_size=3"],
        [
            "error: data.train_batch_size=4 is not divisible by actor.ppo_mini_batch_size=3",
            "choose a mini-batch size (in prompts) that divides it",
        ],
    ),
    "grpo_with_n_1": (
        ["--config.rollout.n=1"],
        [
            "error: algorithm.adv_estimator='grpo' compares samples of a prompt",
            "needs rollout.n >= 2 (got 1)",
            "set --config.rollout.n=8",
        ],
    ),
    "rloo_with_n_1": (
        ["--config.algorithm.adv_estimator=rloo", "--config.rollout.n=1"],
        ["error: algorithm.adv_estimator='rloo'", "needs rollout.n >= 2 (got 1)"],
    ),
    "missing_data_file": (
        [*GSM8K, "--config.task.train_files=DATA/missing.parquet"],
        [
            "error: train file 'DATA/missing.parquet' does not exist",
            "check the path given in train_files",
        ],
    ),
    "data_path_is_a_directory": (
        [*GSM8K, "--config.task.train_files=DATA"],
        ["error: train file 'DATA' is a directory", "'DATA/*.parquet'"],
    ),
    "corrupt_data_file": (
        [*GSM8K, "--config.task.train_files=DATA/corrupt.parquet"],
        [
            "error: could not read train file(s) ['DATA/corrupt.parquet'] as parquet",
            "Parquet magic bytes not found",
            "check that each file is a valid parquet file",
        ],
    ),
    "data_file_without_question_field": (
        [*GSM8K, "--config.task.train_files=DATA/no_question.jsonl"],
        [
            "error: field 'question' not in train file(s) ['DATA/no_question.jsonl']",
            "the fields present are problem, answer",
            "set the task's question_field / answer_field",
        ],
    ),
    "data_record_without_question": (
        [*GSM8K, "--config.task.train_files=DATA/one_missing.jsonl"],
        [
            "error: train record 3 (counting from 0) of ['DATA/one_missing.jsonl'] has no "
            "'question' (null or absent in 1 of 6 records): fix or remove those records."
        ],
    ),
    "path_that_is_not_a_tokenizer": (
        ["--config.tokenizer=DATA/not_a_tokenizer"],
        [
            "error: tokenizer directory 'DATA/not_a_tokenizer' has no tokenizer files",
            "save one there with tokenizer.save_pretrained(path), or pass 'char'",
        ],
    ),
    # jrl/tokenizer.py passes the JSON parser's message on without a fix: only the problem here.
    "corrupt_tokenizer": (
        ["--config.tokenizer=DATA/corrupt_tokenizer"],
        ["error: could not load a tokenizer from 'DATA/corrupt_tokenizer'"],
    ),
    "hub_id_while_offline": (
        ["--config.model.hf_path=someorg/some-model", "--config.tokenizer="],
        [
            "error: model.hf_path='someorg/some-model' is not a local path, and downloading it "
            "from the Hugging Face Hub failed (",
            "pass a local checkpoint directory (config.json + safetensors) or a .gguf file "
            "instead, e.g. --config.model.hf_path=/path/to/model.",
        ],
    ),
    "missing_gguf_file": (
        ["--config.model.hf_path=DATA/none.gguf", "--config.tokenizer="],
        ["error: model.hf_path='DATA/none.gguf': no such .gguf file; pass an existing file"],
    ),
    "stop_string_of_two_tokens": (
        ["--config.rollout.stop=('12',)"],
        ["error: rollout.stop string '12' is not one token of this tokenizer"],
    ),
    "prompt_too_long_with_error_setting": (
        [
            *GSM8K,
            "--config.task.train_files=DATA/train.jsonl",
            "--config.data.max_prompt_length=20",
            "--config.task.overlong_prompts=error",
        ],
        [
            f"error: train prompt 0 has {PROMPT_TOKENS} tokens > max_prompt_length=20 (6 of 6 are "
            "too long): raise max_prompt_length, or set overlong_prompts='drop' or 'truncate'."
        ],
    ),
    "every_prompt_dropped": (
        [
            *GSM8K,
            "--config.task.train_files=DATA/train.jsonl",
            "--config.data.max_prompt_length=20",
        ],
        [
            "error: all 6 train prompts are longer than max_prompt_length=20 (the shortest has "
            f"{PROMPT_TOKENS} tokens): raise max_prompt_length or set overlong_prompts='truncate'."
        ],
    ),
}


def _prepare_and_run(case, data, root):
    """Runs the CLI on `case` with an existing workdir under `root`; returns (process, the
    workdir's snapshot before, after)."""
    args, _ = CASES[case]
    workdir = os.path.join(root, case)
    os.makedirs(workdir)
    with open(os.path.join(workdir, "NOTES.txt"), "w") as f:
        f.write("an earlier run's workdir\n")
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write('{"step": 0, "val/accuracy": 0.5}\n')
    before = snapshot(workdir)
    proc = run_cli(workdir, [a.replace("DATA", data) for a in args])
    return proc, before, snapshot(workdir)


@pytest.fixture(scope="module")
def outcomes(request, data, tmp_path_factory):
    """The selected cases' CLI runs, two at a time (each run is mostly imports, ~3 s)."""
    selected = []  # the cases of this run (after -k and the like)
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module.__name__ == __name__ and "case" in params:
            selected.append(params["case"])
    root = str(tmp_path_factory.mktemp("workdirs"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = {case: pool.submit(_prepare_and_run, case, data, root) for case in selected}
        return {case: run.result() for case, run in runs.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_and_leaves_workdir(case, data, outcomes):
    proc, before, after = outcomes[case]
    _, pieces = CASES[case]
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 2, proc.stderr[-3000:]
    for piece in pieces:
        assert piece.replace("DATA", data) in last, (piece, last)
    assert last.startswith("error: ") and last.count("error:") == 1, last
    assert "Compiling" not in proc.stderr, proc.stderr[-3000:]
    assert after == before


class _StopAfterStep0(Exception):
    pass


@pytest.mark.parametrize("mode", ["drop", "truncate"])
def test_long_prompts_are_counted_in_the_step_0_row(mode, tmp_path, monkeypatch):
    """A gsm8k run whose prompts are partly over data.max_prompt_length: the step-0 metrics row
    counts the dropped or truncated ones per split. The run stops right after that row (the
    counts come before any RL step, so no step needs compiling)."""
    sys.path.insert(0, REPO)
    from configs import grpo_math
    from jrl import trainer

    def question(a, b):
        return {"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}

    # Prompt tokens (character tokenizer): <bos> + question + " Answer:", so 26 for a one-digit
    # pair, 27 for (10, 2) (= the maximum: kept whole), 28 for two two-digit operands.
    train_pairs = [*QUESTIONS, (10, 2), (10, 20), (11, 22), (12, 30)]
    eval_pairs = [(1, 1), (2, 3), (4, 4), (40, 50), (60, 70)]
    too_long = {"train": 3, "eval": 2}
    for split, pairs in (("train", train_pairs), ("eval", eval_pairs)):
        lengths = [1 + len(question(a, b)["question"]) + len(" Answer:") for a, b in pairs]
        assert sum(n > 27 for n in lengths) == too_long[split]
    cfg = grpo_math.get_config("tiny")
    cfg.task.name, cfg.task.reward, cfg.warmup.sft_steps = "gsm8k", "gsm8k", 0
    cfg.task.train_files = write_jsonl(
        tmp_path / "train.jsonl", [question(a, b) for a, b in train_pairs]
    )
    cfg.task.eval_files = write_jsonl(
        tmp_path / "eval.jsonl", [question(a, b) for a, b in eval_pairs]
    )
    cfg.task.template = "{question} Answer:"
    cfg.task.overlong_prompts = mode
    cfg.data.max_prompt_length, cfg.data.max_response_length = 27, 4

    class StopAfterStep0(trainer.MetricWriter):
        def write(self, step, metrics):
            super().write(step, metrics)
            self.close()
            raise _StopAfterStep0

    monkeypatch.setattr(trainer, "MetricWriter", StopAfterStep0)
    with pytest.raises(_StopAfterStep0):
        trainer.run(cfg, str(tmp_path / "run"))
    (row,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    counted = {"drop": too_long, "truncate": {"train": 0, "eval": 0}}[mode]
    cut = {"truncate": too_long, "drop": {"train": 0, "eval": 0}}[mode]
    for split in ("train", "eval"):
        assert row[f"data/prompts_dropped/{split}"] == counted[split], row
        assert row[f"data/prompts_truncated/{split}"] == cut[split], row
    assert row["step"] == 0 and "val/accuracy" in row


def test_data_file_without_read_permission(data, monkeypatch):
    sys.path.insert(0, REPO)
    from configs import grpo_math
    from jrl import config as config_lib
    from jrl import trainer

    path = os.path.join(data, "train.jsonl")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != path and access(p, mode))
    cfg = grpo_math.get_config("tiny")
    cfg.task.name, cfg.task.reward, cfg.warmup.sft_steps = "gsm8k", "gsm8k", 0
    cfg.task.train_files, cfg.task.eval_size = path, 2
    with pytest.raises(config_lib.ConfigError) as e:
        trainer.build(cfg)
    assert str(e.value) == (
        f"train file {path!r} is not readable (permission denied): make it readable (chmod a+r) "
        "or copy it somewhere this user can read."
    )
