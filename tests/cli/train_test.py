"""End to end: the tiny config trains 3 steps with finite metrics and one compile; config errors."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from jrl import config as config_lib
from jrl import models
from jrl import tokenizer as tokenizer_lib
from jrl.models import transformer
from jrl import step as step_lib
from jrl.run import trainer
from conftest import REPO, tiny_config, tiny_model
from configs import grpo_math

VERL_METRICS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/step",
    "perf/throughput",
)


def test_tiny_run_three_steps_finite_metrics_single_compile(tmp_path, monkeypatch):
    traces = []
    make_step = step_lib.make_step

    def counting_make_step(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def traced(state, batch):
            traces.append(1)  # runs only while jax traces the function
            return step(state, batch)

        return traced

    monkeypatch.setattr(step_lib, "make_step", counting_make_step)
    cfg = tiny_config()
    cfg.actor.use_kl_loss = True  # exercise the reference model and KL loss path too
    monkeypatch.chdir(tmp_path.parent)
    final = trainer.run(
        cfg, tmp_path.name
    )  # a relative workdir, like the default runs/<config>/<time>
    assert len(traces) == 1, f"the fused step was traced {len(traces)} times in 3 steps"

    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        for name in VERL_METRICS + ("actor/kl_loss",):
            assert name in r, name
            assert math.isfinite(r[name]), (name, r[name])
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[-1]
    assert 0.0 <= final["val/accuracy"] <= 1.0
    assert os.listdir(tmp_path / ".") and any(
        f.startswith("events.out.tfevents") for f in os.listdir(tmp_path)
    )


@pytest.mark.parametrize(
    "field,value,message",
    [
        (
            "algorithm.adv_estimator",
            "grpoo",
            r"algorithm.adv_estimator='grpoo' is unknown \(did you mean 'grpo'\?\); "
            r"valid names: .*gae.*rloo",
        ),
        (
            "actor.policy_loss",
            "nope",
            r"actor.policy_loss='nope' is unknown; valid names: .*vanilla",
        ),
        (
            "actor.ppo_mini_batch_size",
            5,
            r"data.train_batch_size=32 is not divisible by actor.ppo_mini_batch_size=5",
        ),
        ("rollout.n", 1, r"needs rollout.n >= 2 \(got 1\)"),
        ("actor.clip_ratio_high", 1.5, r"actor.clip_ratio_high=1.5 must be in \(0, 1\)"),
        ("actor.lr", -1e-3, r"actor.lr=-0.001 must be >= 0"),
        (
            "actor.lr",
            float("inf"),
            r"actor.lr=inf is not a finite number; give a finite value \(the default: 0.001\).",
        ),
        ("critic.lr", float("nan"), r"critic.lr=nan is not a finite number"),
        (
            "actor.betas",
            (0.9, float("inf")),
            r"actor.betas=\(0.9, inf\) holds inf, which is not a finite number; give a finite "
            r"value \(the default: \(0.9, 0.999\)\).",
        ),
        ("reward.timeout_s", float("inf"), r"reward.timeout_s=inf is not a finite number"),
        ("reward.timeout_s", 0.0, r"reward.timeout_s=0.0 must be > 0 \(seconds per call"),
    ],
)
def test_config_errors_name_the_field_and_fix(field, value, message):
    cfg = grpo_math.get_config()
    section, name = field.split(".")
    cfg[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(cfg)


def test_cli_bad_config_exits_2_with_one_line_before_compiling(tmp_path):
    workdir = tmp_path / "w"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jrl.train",
            "--config=configs/grpo_math.py:tiny",
            "--config.algorithm.adv_estimator=bogus",
            f"--workdir={workdir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "algorithm.adv_estimator='bogus' is unknown" in errors[0]
    assert not workdir.exists()


def test_unknown_preset_is_rejected():
    with pytest.raises(config_lib.ConfigError, match="unknown preset 'big'"):
        grpo_math.get_config("big")


def test_gsm8k_jsonl_with_hf_model_three_steps_single_compile(tmp_path, monkeypatch):
    """grpo_math on a tiny local GSM8K-format jsonl and a tiny HF-format (Qwen2) checkpoint: the
    Python reward runs inside the fused step through a host callback; one compile, finite
    metrics."""
    rows = [
        {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a, b in [(3, 4), (10, 7), (2, 2), (8, 1), (5, 5), (6, 3), (9, 9), (1, 0)]
    ]
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    traces = []
    make_step = step_lib.make_step

    def counting_make_step(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def traced(state, batch):
            traces.append(1)
            return step(state, batch)

        return traced

    monkeypatch.setattr(step_lib, "make_step", counting_make_step)
    # A tiny Qwen2-style checkpoint in HF format (config.json, safetensors, tokenizer files).
    hf_dir = tmp_path / "hf_model"
    model_cfg = tiny_model(96, intermediate_size=64, qkv_bias=True)
    models.save_pretrained(
        model_cfg,
        transformer.init_params(model_cfg, jax.random.key(0)),
        str(hf_dir),
        tokenizer=tokenizer_lib.char_tokenizer(),
    )
    cfg = tiny_config()
    cfg.model.hf_path = str(hf_dir)
    cfg.tokenizer = ""  # the checkpoint's own tokenizer
    cfg.task.name = "gsm8k"
    cfg.task.reward = "gsm8k"
    cfg.task.train_files = str(data_file)
    cfg.task.eval_size = 2
    cfg.task.template = "{question} Answer:"
    cfg.data.max_prompt_length = 40
    cfg.data.max_response_length = 6
    cfg.warmup.sft_steps = 0
    # AdamW's decay moves every weight even in a step whose rewards are all 0 (no policy
    # gradient), so the exported policy below differs from the checkpoint it started from.
    cfg.actor.weight_decay = 0.1
    workdir = tmp_path / "run"
    trainer.run(cfg, str(workdir))
    assert len(traces) == 1
    got = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for r in got[1:]:
        for name in VERL_METRICS:
            assert math.isfinite(r[name]), (name, r[name])
    # Round trip: the trained policy exported as an HF checkpoint reloads with identical logits.
    from jrl.run import checkpoint as checkpoint_lib
    from jrl.run import exporter as export_lib

    out = tmp_path / "exported"
    assert export_lib.export(str(workdir), str(out)) == 3
    tok, policy_cfg = trainer.policy_model(cfg)
    params, _ = checkpoint_lib.restore_params(str(workdir), cfg, policy_cfg)
    reloaded_cfg, reloaded = models.load_pretrained(str(out))
    ids = jax.numpy.array([[1, 20, 21, 22, 30], [0, 0, 1, 25, 26]])
    mask = (ids > 0).astype("int32")
    want = models.forward(policy_cfg, params, ids, mask)
    got = models.forward(reloaded_cfg, reloaded, ids, mask)
    assert float(jax.numpy.max(jax.numpy.abs(want - got))) == 0.0
    assert (
        float(
            jax.numpy.max(
                jax.numpy.abs(
                    want
                    - models.forward(model_cfg, models.load_pretrained(str(hf_dir))[1], ids, mask)
                )
            )
        )
        > 0
    )  # training moved it


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "--config.rollout.nn=8",
            "error: unknown config field 'rollout.nn' (did you mean 'rollout.n'?)",
        ),
        (
            "--config.actor.lr=abc",
            "error: flag --config.actor.lr=abc: could not convert string to float",
        ),
    ],
)
def test_cli_bad_override_exits_2_with_one_line(tmp_path, override, message):
    workdir = tmp_path / "w"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jrl.train",
            "--config=configs/grpo_math.py:tiny",
            override,
            f"--workdir={workdir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-500:]
    assert not workdir.exists()


def test_cli_unwritable_workdir_exits_2(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jrl.train",
            "--config=configs/grpo_math.py:tiny",
            f"--workdir={blocker / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "is not writable" in proc.stderr.strip().splitlines()[-1]
    assert blocker.read_text() == "not a directory"


def test_cli_checkpoint_of_another_model_size_exits_2_and_changes_nothing(tmp_path):
    workdir = tmp_path / "w"
    base = [
        sys.executable,
        "-m",
        "jrl.train",
        "--config=configs/grpo_math.py:tiny",
        f"--workdir={workdir}",
        "--config.warmup.sft_steps=0",
    ]
    first = subprocess.run(
        base + ["--config.total_steps=1"], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert first.returncode == 0, first.stderr[-2000:]
    snapshot = _saved_files(workdir)
    proc = subprocess.run(  # past the config check (config.json), to the checkpoint's shapes
        base + ["--config.model.hidden_size=64", "--allow_changes"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint") and "params/embed is (88, 32)" in last, last
    assert _saved_files(workdir) == snapshot


def _saved_files(workdir):
    """Bytes of every file in a workdir, the run log (appended to by every start) aside."""
    return {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.name != "train.log"}
