"""Bad input to the real CLI (`python -m jrl.train`): each case exits with status 2 and one last
stderr line `error: ...` that names the field or file and the fix, before anything compiles (run
with JAX_LOG_COMPILES=1: no "Compiling" line), and leaves an existing workdir exactly as it was
(same files, bytes and modification times).

Where each bad-input case of the issue is tested (tr = tests/cli/train_test.py):
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
  tests/data/math_data_test.py::test_drop_truncate_and_error_overlong_prompts)
- an infinite learning rate (every float field must be finite), a positional argument, a
  truncated safetensors file of model.hf_path: here, [infinite_learning_rate],
  [positional_argument], [truncated_safetensors] (a truncated GGUF file:
  tests/models/gguf_test.py::test_a_truncated_gguf_is_one_line_before_any_tensor_is_read)
- a data file without read permission: here, test_data_file_without_read_permission (in
  process, the permission check answered "no": as root, which these tests may run as, every file
  is readable)
- a config file that does not exist (one letter off, a folder off), a config file without
  get_config: here, test_bad_input_exits_2_and_leaves_workdir[config_file_*] and
  test_missing_config_file_names_the_closest
- a setting of a switched-off feature (in a config file, on the command line even at its
  default), an invalid value of a switched-off feature: here, [*_while_off] cases and
  test_switched_off_feature[set-*] / [invalid-*] (every on/off section);
  the shipped configs and presets still validate (test_shipped_configs_and_presets_validate) and
  a feature turned off on the command line drops the config file's settings of it
  (test_turning_a_feature_off_drops_the_files_settings_of_it)
"""

import concurrent.futures
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import GOLDEN, REPO, tiny_config

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
    (d / "no_get_config.py").write_text("config = None  # a config file must define get_config\n")
    # A config file that turns rollout correction on as verl does (by setting rollout_is)
    (d / "verl_style.py").write_text(
        "from jrl import config as config_lib\n\n\n"
        "def get_config(arg=None):\n"
        "    c = config_lib.base_config()\n"
        "    c.algorithm.rollout_correction.rollout_is = 'token'\n"
        "    return c\n"
    )
    (d / "corrupt.parquet").write_bytes(bytes(range(256)) * 4)
    (d / "not_a_tokenizer").mkdir()
    (d / "not_a_tokenizer" / "README.txt").write_text("model card only")
    (d / "corrupt_tokenizer").mkdir()
    (d / "corrupt_tokenizer" / "tokenizer.json").write_text("{ not json")
    # A Hugging Face checkpoint whose safetensors file was cut short (an interrupted copy)
    shutil.copytree(os.path.join(GOLDEN, "llama"), d / "truncated_hf")
    weights = d / "truncated_hf" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1000)
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
    """`python -m jrl.train` on args, after the tiny config unless args name a --config."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
    tiny = [] if any(a.startswith("--config=") for a in args) else [TINY]
    # Hub ids never reach the network here: offline, and an empty Hugging Face cache
    env.update(HF_HUB_OFFLINE="1", HF_HOME=os.path.join(os.path.dirname(workdir), "hf_home"))
    return subprocess.run(
        [sys.executable, "-m", "jrl.train", *tiny, f"--workdir={workdir}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


TINY = "--config=configs/grpo_math.py:tiny"
# The config files shipped in configs/ (more may come: each must be listed in the error).
SHIPPED = ["configs/dapo_math.py", "configs/gemma_tools_cpu.py", "configs/group_ppo_math.py"]
SHIPPED += ["configs/grpo_gemma_cpu.py", "configs/grpo_math.py", "configs/gsm8k_tools.py"]
SHIPPED += ["configs/ppo_math.py", "configs/tool_math.py"]

# id -> (arguments after the tiny config; DATA is the data fixture's directory), and the pieces
# the last stderr line must hold: the problem (field or file, value) and the fix.
CASES = {
    "rollout_n_below_1": (["--config.rollout.n=0"], ["error: rollout.n=0 must be >= 1."]),
    "negative_learning_rate": (
        ["--config.actor.lr=-0.001"],
        ["error: actor.lr=-0.001 must be >= 0."],
    ),
    "infinite_learning_rate": (
        ["--config.actor.lr=inf"],
        ["error: actor.lr=inf is not a finite number; give a finite value (the default: 0.001)."],
    ),
    "positional_argument": (
        ["--config.total_steps=3", "stray"],
        ["error: unexpected argument 'stray': every setting is a flag, --name=value"],
    ),
    "truncated_safetensors": (
        ["--config.model.hf_path=DATA/truncated_hf"],
        [
            "error: DATA/truncated_hf/model.safetensors is not a readable safetensors file",
            "it is damaged or was not fully written; copy or download it again.",
        ],
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
    "empty_stop_string": (
        ["--config.rollout.stop=('',)"],
        ["error: rollout.stop string '': give a non-empty string without NUL characters."],
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
    "config_file_one_letter_off": (
        ["--config=configs/grpo_mat.py"],
        [
            "error: --config=configs/grpo_mat.py: config file 'configs/grpo_mat.py' does not "
            "exist (did you mean 'configs/grpo_math.py'?); the config files: ",
            *SHIPPED,
        ],
    ),
    "config_file_without_get_config": (
        ["--config=DATA/no_get_config.py:tiny"],
        [
            "error: --config=DATA/no_get_config.py:tiny: config file 'DATA/no_get_config.py' "
            "defines no get_config(arg=None) returning a config; the config files: ",
            *SHIPPED,
        ],
    ),
    # verl turns rollout correction on by setting rollout_is; jrl names its switch instead.
    "rollout_is_set_on_the_command_line_while_off": (
        ["--config.algorithm.rollout_correction.rollout_is=token"],
        [
            "error: --config.algorithm.rollout_correction.rollout_is=token has no effect while "
            "rollout correction is off (algorithm.rollout_correction.enable=False): turn it on "
            "with --config.algorithm.rollout_correction.enable=True, or leave it out."
        ],
    ),
    "rollout_is_set_in_a_config_file_while_off": (
        ["--config=DATA/verl_style.py"],
        [
            "error: algorithm.rollout_correction.rollout_is='token' has no effect while rollout "
            "correction is off (algorithm.rollout_correction.enable=False): turn it on with "
            "--config.algorithm.rollout_correction.enable=True, or leave it at the default "
            "('sequence')."
        ],
    ),
    "rollout_is_invalid_while_off": (
        ["--config.algorithm.rollout_correction.rollout_is=bogus"],
        [
            "error: algorithm.rollout_correction.rollout_is='bogus' is unknown; valid: token, "
            "sequence, '' (off)."
        ],
    ),
    # The config file sets the buffer's length; the command line turns the buffer off and sets it.
    "overlong_buffer_len_given_while_turned_off": (
        [
            "--config=configs/dapo_math.py:tiny",
            "--config.reward.overlong_buffer.enable=False",
            "--config.reward.overlong_buffer.len=3",
        ],
        [
            "error: --config.reward.overlong_buffer.len=3 has no effect while the overlong buffer "
            "is off (reward.overlong_buffer.enable=False): turn it on with "
            "--config.reward.overlong_buffer.enable=True, or leave it out."
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
    from jrl.run import trainer

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
    cfg = tiny_config()
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
    from jrl import config as config_lib
    from jrl.run import trainer

    path = os.path.join(data, "train.jsonl")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != path and access(p, mode))
    cfg = tiny_config()
    cfg.task.name, cfg.task.reward, cfg.warmup.sft_steps = "gsm8k", "gsm8k", 0
    cfg.task.train_files, cfg.task.eval_size = path, 2
    with pytest.raises(config_lib.ConfigError) as e:
        trainer.build(cfg)
    assert str(e.value) == (
        f"train file {path!r} is not readable (permission denied): make it readable (chmod a+r) "
        "or copy it somewhere this user can read."
    )


def test_missing_config_file_names_the_closest(monkeypatch):
    """A folder one letter off finds the file by its name; a name like none gets no guess."""
    from jrl import config as config_lib

    monkeypatch.chdir(REPO)
    listed = "; the config files: " + ", ".join(SHIPPED) + "."
    assert config_lib.config_path_error("config/ppo_math.py:tiny") == (
        "--config=config/ppo_math.py:tiny: config file 'config/ppo_math.py' does not exist (did "
        "you mean 'configs/ppo_math.py'?)" + listed
    )
    assert config_lib.config_path_error("configs/sft.py") == (
        "--config=configs/sft.py: config file 'configs/sft.py' does not exist" + listed
    )
    assert config_lib.config_path_error("configs") == (
        "--config=configs: config file 'configs' is a directory" + listed
    )
    assert config_lib.config_path_error("configs/grpo_math.py:tiny") is None


def _off(field, value, feature, state, fix, default):
    return (
        f"{field}={value!r} has no effect while {feature} is off ({state}): turn it on with "
        f"--config.{fix}, or leave it at the default ({default!r})."
    )


# Each on/off section (in the tiny GRPO config every one is off): a field set away from its
# default, and the one-line error naming it and the switch.
SET_WHILE_OFF = {
    "rollout_correction": (
        {"algorithm.rollout_correction.rollout_is_threshold": "0.5_2.0"},
        _off(
            "algorithm.rollout_correction.rollout_is_threshold",
            "0.5_2.0",
            "rollout correction",
            "algorithm.rollout_correction.enable=False",
            "algorithm.rollout_correction.enable=True",
            "2.0",
        ),
    ),
    "bypass_mode": (
        {"algorithm.rollout_correction.bypass_mode": True},
        _off(
            "algorithm.rollout_correction.bypass_mode",
            True,
            "rollout correction",
            "algorithm.rollout_correction.enable=False",
            "algorithm.rollout_correction.enable=True",
            False,
        ),
    ),
    "lora": (
        {"lora.alpha": 16.0},
        _off("lora.alpha", 16.0, "LoRA", "lora.rank=0", "lora.rank=16 (any rank >= 1)", 32.0),
    ),
    "filter_groups": (
        {"algorithm.filter_groups.max_num_gen_batches": 2},
        _off(
            "algorithm.filter_groups.max_num_gen_batches",
            2,
            "dynamic sampling",
            "algorithm.filter_groups.enable=False",
            "algorithm.filter_groups.enable=True",
            4,
        ),
    ),
    "overlong_buffer": (
        {"reward.overlong_buffer.len": 4},
        _off(
            "reward.overlong_buffer.len",
            4,
            "the overlong buffer",
            "reward.overlong_buffer.enable=False",
            "reward.overlong_buffer.enable=True",
            2,
        ),
    ),
    "kl_in_reward": (
        {"algorithm.kl_penalty": "low_var_kl"},
        _off(
            "algorithm.kl_penalty",
            "low_var_kl",
            "KL in the reward",
            "algorithm.use_kl_in_reward=False",
            "algorithm.use_kl_in_reward=True",
            "kl",
        ),
    ),
    "kl_coef_in_reward": (
        {"algorithm.kl_ctrl.kl_coef": 0.01},
        _off(
            "algorithm.kl_ctrl.kl_coef",
            0.01,
            "KL in the reward",
            "algorithm.use_kl_in_reward=False",
            "algorithm.use_kl_in_reward=True",
            0.001,
        ),
    ),
    "adaptive_kl_controller": (
        {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.target_kl": 0.05},
        _off(
            "algorithm.kl_ctrl.target_kl",
            0.05,
            "the adaptive KL controller",
            "algorithm.kl_ctrl.type='fixed'",
            "algorithm.kl_ctrl.type=adaptive",
            0.1,
        ),
    ),
    "kl_loss": (
        {"actor.kl_loss_coef": 0.01},
        _off(
            "actor.kl_loss_coef",
            0.01,
            "the KL loss",
            "actor.use_kl_loss=False",
            "actor.use_kl_loss=True",
            0.001,
        ),
    ),
    "critic": (
        {"critic.share_backbone": True},
        _off(
            "critic.share_backbone",
            True,
            "the critic",
            "algorithm.adv_estimator='grpo' trains none",
            "algorithm.adv_estimator=gae (the estimators with a critic: gae, group_ppo)",
            False,
        ),
    ),
    "group_ppo": (
        {"algorithm.group_params.group_max_size": 8},
        _off(
            "algorithm.group_params.group_max_size",
            8,
            "GROUP-PPO",
            "algorithm.adv_estimator='grpo'",
            "algorithm.adv_estimator=group_ppo",
            16,
        ),
    ),
    "multi_turn": (
        {"rollout.multi_turn.format": "compact"},
        _off(
            "rollout.multi_turn.format",
            "compact",
            "multi-turn tool use",
            "rollout.multi_turn.enable=False",
            "rollout.multi_turn.enable=True",
            "hermes",
        ),
    ),
    "multi_turn_tools": (
        {"rollout.multi_turn.tools": "calc,python"},
        _off(
            "rollout.multi_turn.tools",
            "calc,python",
            "multi-turn tool use",
            "rollout.multi_turn.enable=False",
            "rollout.multi_turn.enable=True",
            "calc",
        ),
    ),
    "two_fields_in_one_line": (
        {"lora.dropout": 0.1, "lora.alpha": 8.0},
        "lora.alpha=8.0, lora.dropout=0.1 have no effect while LoRA is off (lora.rank=0): turn "
        "it on with --config.lora.rank=16 (any rank >= 1), or leave them at the defaults "
        "(32.0, 0.0).",
    ),
}


# Each on/off section, switched off: an invalid value is refused as such.
INVALID_WHILE_OFF = {
    "rollout_correction": (
        {"algorithm.rollout_correction.rollout_is_threshold": "0.5_x"},
        "algorithm.rollout_correction.rollout_is_threshold='x' is not a number or 'lower_upper' "
        "pair.",
    ),
    "lora": (
        {"lora.dropout": 1.0},
        "lora.dropout=1.0 must be in [0, 1) (the probability of dropping an adapter input); "
        "e.g. --config.lora.dropout=0.05.",
    ),
    "lora_target": (
        {"lora.target_modules": "q_proj,qkv"},
        "lora.target_modules entry='qkv' is unknown; valid names: down_proj, gate_proj, k_proj, "
        "o_proj, q_proj, up_proj, v_proj.",
    ),
    "filter_groups": (
        {"algorithm.filter_groups.max_num_gen_batches": 0},
        "algorithm.filter_groups.max_num_gen_batches=0 must be >= 1.",
    ),
    "overlong_buffer": (
        {"reward.overlong_buffer.penalty_factor": -1.0},
        "reward.overlong_buffer.penalty_factor=-1.0 must be >= 0 (the penalty reached at "
        "max_response_length).",
    ),
    "kl_in_reward": (
        {"algorithm.kl_ctrl.kl_coef": -0.1},
        "algorithm.kl_ctrl.kl_coef=-0.1 must be >= 0.",
    ),
    "adaptive_kl_controller": (
        {"algorithm.kl_ctrl.horizon": 0},
        "algorithm.kl_ctrl.horizon must be > 0, got 0.",
    ),
    "kl_loss": ({"actor.kl_loss_coef": -1.0}, "actor.kl_loss_coef=-1.0 must be >= 0."),
    "critic": (
        {"critic.critic_warmup": -1},
        "critic.critic_warmup=-1 must be >= 0 (0: none).",
    ),
}


@pytest.mark.parametrize(
    "kind, section",
    [("set", k) for k in SET_WHILE_OFF] + [("invalid", k) for k in INVALID_WHILE_OFF],
)
def test_switched_off_feature(kind, section):
    """A setting of a switched-off feature, or an invalid one: validate's one-line error."""
    from jrl import config as config_lib

    fields, message = (SET_WHILE_OFF if kind == "set" else INVALID_WHILE_OFF)[section]
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.validate(tiny_config(**fields))
    assert str(e.value) == message


def test_command_line_setting_at_its_default_while_off_is_refused():
    """`--config.x=v` of a switched-off feature stops the run even where v is the default (jrl's
    rollout_is defaults to 'sequence'; a verl user types it to turn correction on)."""
    from jrl import config as config_lib

    argv = ["train", TINY, "--config.algorithm.rollout_correction.rollout_is=sequence"]
    assert config_lib.unused_override(tiny_config(), argv) == (
        "--config.algorithm.rollout_correction.rollout_is=sequence has no effect while rollout "
        "correction is off (algorithm.rollout_correction.enable=False): turn it on with "
        "--config.algorithm.rollout_correction.enable=True, or leave it out."
    )
    on = tiny_config(**{"algorithm.rollout_correction.enable": True})
    assert config_lib.unused_override(on, [*argv, "--config.rollout.n=2"]) is None


def test_multi_turn_setting_at_its_default_while_off_is_refused():
    """`--config.rollout.multi_turn.max_assistant_turns=5` (the default) without
    `rollout.multi_turn.enable=True` would run one turn per row: refused, naming the switch."""
    from jrl import config as config_lib

    argv = ["train", TINY, "--config.rollout.multi_turn.max_assistant_turns=5"]
    assert config_lib.unused_override(tiny_config(), argv) == (
        "--config.rollout.multi_turn.max_assistant_turns=5 has no effect while multi-turn tool "
        "use is off (rollout.multi_turn.enable=False): turn it on with "
        "--config.rollout.multi_turn.enable=True, or leave it out."
    )


def _shipped_configs():
    """(config file, presets) of every file in configs/ with each of its presets, and none."""
    sys.path.insert(0, REPO)
    cases = []
    for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
        if name.endswith(".py") and not name.startswith("_"):
            module = importlib.import_module(f"configs.{name[:-3]}")
            if not hasattr(module, "get_config"):  # configs/common.py: what the files share
                continue
            for preset in ("", *getattr(module, "PRESETS", {})):
                cases.append((name[:-3], preset))
    # ppo_math.py's own preset, and combinations the docs show
    cases += [("ppo_math", "shared"), ("group_ppo_math", "shared"), ("ppo_math", "shared,tiny")]
    cases += [("grpo_math", "model=qwen2.5-7b,lora,data=gsm8k")]
    return cases


@pytest.mark.parametrize("name, preset", _shipped_configs())
def test_shipped_configs_and_presets_validate(name, preset):
    from jrl import config as config_lib

    cfg = importlib.import_module(f"configs.{name}").get_config(preset or None)
    if cfg.task.name != "arithmetic":  # what the command line must add: the data files ...
        cfg.task.train_files = "train.jsonl"  # validate only checks it is set
    if cfg.task.name == "custom":  # ... and, for data=custom, the user's reward function
        cfg.task.reward = "my_reward.py:score"
    if cfg.tokenizer == "":  # ... and a checkpoint or a tokenizer for model= presets (a chat
        # model's with the hermes tool format: validate only checks it is not the character one)
        hermes = cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.format == "hermes"
        cfg.tokenizer = "/models/Qwen2.5-0.5B-Instruct" if hermes else "char"
    config_lib.validate(cfg)


def test_turning_a_feature_off_drops_the_files_settings_of_it():
    """DAPO with the overlong buffer and dynamic sampling turned off on the command line (the
    parse function, in a process of its own: absl's flags are global): the settings the config
    file made for them go back to their defaults (max_num_gen_batches 3 -> 4, len 3 -> 2) and the
    config validates."""
    argv = [
        "train",
        "--config=configs/dapo_math.py:tiny",
        "--config.reward.overlong_buffer.enable=False",
        "--config.algorithm.filter_groups.enable=False",
    ]
    script = (
        "import json, sys\n"
        "from absl import flags\n"
        "from jrl import train, config\n"
        "from jrl.run import cli\n"
        f"sys.argv = {argv!r}\n"
        "cli.parse_flags(sys.argv)\n"
        "c = flags.FLAGS.config\n"
        "config.validate(c)\n"
        "print(json.dumps({'reward': c.reward.to_dict(),\n"
        "                  'filter_groups': c.algorithm.filter_groups.to_dict()}))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["reward"]["overlong_buffer"] == {"enable": False, "len": 2, "penalty_factor": 1.0}
    assert got["filter_groups"] == {"enable": False, "metric": "acc", "max_num_gen_batches": 4}


def test_reset_switched_off_keeps_what_the_command_line_gives():
    """ppo_math.py:shared run as GRPO: the critic's settings from the file go back to their
    defaults (share_backbone True -> False), a critic field given on the command line stays."""
    from jrl import config as config_lib

    sys.path.insert(0, REPO)
    from configs import ppo_math

    file_cfg = ppo_math.get_config("shared")
    cfg = ppo_math.get_config("shared")
    cfg.algorithm.adv_estimator = "grpo"
    cfg.critic.lr = 0.5
    argv = ["train", "--config.algorithm.adv_estimator=grpo", "--config.critic.lr=0.5"]
    config_lib.reset_switched_off(cfg, file_cfg, argv)
    assert (cfg.critic.share_backbone, cfg.critic.lr) == (False, 0.5)
    assert file_cfg.critic.share_backbone is True


def test_a_config_read_back_from_json_validates():
    """A run's config.json turns tuples into lists (critic.betas of a run without a critic): read
    back, it is the config it was written from, not a switched-off setting."""
    import ml_collections

    from jrl import config as config_lib

    cfg = ml_collections.ConfigDict(json.loads(json.dumps(tiny_config().to_dict())))
    assert isinstance(cfg.critic.betas, list)
    config_lib.validate(cfg)
