"""jrl.export and jrl.eval on a tiny run trained in-process (2 RL steps, checkpoints 1 and 2).

The run learns 1-digit addition in a short supervised warm-up, so its eval accuracy is neither 0
nor 1 and the figures below can disagree when something is wrong. The transformers comparison
needs torch (skipped without it).
"""

import json
import os
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import jrl.models
from jrl import tokenizer as tokenizer_lib
from jrl.run import checkpoint as checkpoint_lib
from jrl.run import evaluator as eval_lib
from jrl.run import exporter as export_lib
from jrl.run import trainer
from conftest import REPO, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, eval batch, the run's metrics.jsonl rows) of the tiny config trained 2 steps."""
    cfg = tiny_config()
    cfg.total_steps = 2
    cfg.checkpoint.every_steps = 1  # checkpoints 1 and 2
    cfg.task.num_digits = 1  # learnable in a short warm-up: accuracy strictly between 0 and 1
    cfg.warmup.sft_steps = 300
    cfg.warmup.sft_lr = 3e-3
    cfg.warmup.check_every = 25
    workdir = str(tmp_path_factory.mktemp("run"))
    trainer.run(cfg, workdir)
    task = trainer.build(cfg).task
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return workdir, task.eval_batch(), rows


def _flat(params):
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}


def test_export_round_trip_logits(run, tmp_path):
    workdir, batch, _ = run
    out = tmp_path / "hf"
    assert export_lib.export(workdir, out) == 2  # default: the newest checkpoint

    cfg = checkpoint_lib.load_config(workdir)
    _, model_cfg = trainer.policy_model(cfg)
    params, step = checkpoint_lib.restore_params(workdir, cfg, model_cfg)
    assert step == 2
    hf_cfg, hf_params = jrl.models.load_pretrained(out)
    want, got = _flat(params), _flat(hf_params)
    assert sorted(want) == sorted(got)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))

    ids = np.concatenate([batch["input_ids"][:4], np.full((4, 3), 7, np.int32)], axis=1)
    mask = np.concatenate([batch["attention_mask"][:4], np.ones((4, 3), np.int32)], axis=1)
    logits = np.asarray(jrl.models.forward(model_cfg, params, jnp.asarray(ids), jnp.asarray(mask)))
    reloaded = jrl.models.forward(hf_cfg, hf_params, jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(reloaded), logits)

    tok = tokenizer_lib.load_hf_tokenizer(str(out))
    char = tokenizer_lib.char_tokenizer()
    text = "12+7=19<eos>"
    assert tok.encode(text) == char.encode(text) and len(tok) == len(char)
    assert (tok.pad_token_id, tok.eos_token_id) == (char.pad_token_id, char.eos_token_id)

    # An earlier step exports different weights.
    out1 = tmp_path / "hf1"
    assert export_lib.export(workdir, out1, step=1) == 1
    _, params1 = jrl.models.load_pretrained(out1)
    assert not np.array_equal(_flat(params1)[("embed",)], want[("embed",)])

    torch = pytest.importorskip("torch")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = model(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
        ).logits.numpy()
    real = mask.astype(bool)  # logits at left padding mean nothing
    assert np.max(np.abs(hf_logits[real] - logits[real])) <= 1e-4


def test_export_errors(run, tmp_path):
    workdir, _, _ = run
    with pytest.raises(checkpoint_lib.CheckpointError, match=r"has no checkpoints"):
        export_lib.export(str(tmp_path / "empty"), tmp_path / "a")
    with pytest.raises(checkpoint_lib.CheckpointError, match=r"step 7 is not .*\(available: 1, 2"):
        export_lib.export(workdir, tmp_path / "b", step=7)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")  # a stale file of another model
    with pytest.raises(export_lib.ExportError, match=r"is not empty.*--overwrite"):
        export_lib.export(workdir, out)
    assert os.listdir(out) == ["model.safetensors.index.json"]  # untouched
    assert export_lib.export(workdir, out, step=1, overwrite=True) == 1
    assert "model.safetensors.index.json" not in os.listdir(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []


def test_cli_bad_arguments_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jrl.export", f"--workdir={tmp_path}", f"--out={tmp_path}/o"],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: workdir {tmp_path} has no checkpoints (nothing committed under "
        f"{tmp_path}/checkpoints); pass the --workdir of a run that saved one."
    )


def _events(workdir):
    """(tag, step, value) of every scalar in the workdir's tensorboard event files."""
    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(workdir)):
        if not name.startswith("events.out.tfevents"):
            continue
        with open(os.path.join(workdir, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):  # TFRecord: length, crc, payload, crc
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.append((v.tag, event.step, v.simple_value))
    return out


def test_eval_figures(run):
    workdir, _, rows = run
    evaluator = eval_lib.Evaluator(workdir)
    assert evaluator.step == 2 and rows[-1]["step"] == 2
    hot = evaluator.evaluate(k=4, temperature=1.0, seed=0)
    greedy = hot["eval/greedy_accuracy"]
    assert greedy == rows[-1]["val/accuracy"]  # the trainer's greedy eval of the same params
    assert 0.0 < greedy < 1.0  # the figures below can tell right from wrong
    assert hot["num_prompts"] == 16
    mean, pass_ = hot["eval/mean@4"], hot["eval/pass@4"]
    assert 0.0 <= mean <= pass_ <= 1.0
    assert mean * 64 == round(mean * 64) and pass_ * 16 == round(pass_ * 16)  # counts of 64 / 16
    assert pass_ > mean  # at temperature 1 the 4 samples of some prompt disagree
    with open(os.path.join(workdir, "eval_2.json")) as f:
        assert json.load(f) == hot

    # Near temperature 0 every sample is the greedy answer: mean@4 == pass@4 == greedy accuracy,
    # and the 4 samples of each prompt score alike.
    cold_scores = evaluator.sample_scores(4, 1e-9, seed=1)
    np.testing.assert_array_equal(cold_scores, np.repeat(cold_scores[:, :1], 4, axis=1))
    cold = evaluator.evaluate(k=4, temperature=1e-9, seed=1)
    assert cold["eval/mean@4"] == cold["eval/pass@4"] == greedy
    assert len(evaluator._sampled) == 1  # one compile served both temperatures

    events = _events(workdir)
    for result in (hot, cold):
        for name, tag in [
            ("eval/greedy_accuracy", "eval/greedy_accuracy"),
            ("eval/mean@4", "eval/mean_4"),
            ("eval/pass@4", "eval/pass_4"),
        ]:
            assert (tag, 2, pytest.approx(result[name])) in events, tag

    with pytest.raises(ValueError, match=r"--k=0 must be >= 1"):
        evaluator.evaluate(k=0)


def test_pass_at_k_estimator():
    # 1 - C(n - c, k) / C(n, k) by hand: n=5, c=2, k=2 -> 1 - 3/10; c=0 -> 0; n - c < k -> 1.
    got = eval_lib.pass_at_k(5, np.array([2, 0, 4, 5]), 2)
    np.testing.assert_allclose(got, [0.7, 0.0, 1.0, 1.0], rtol=1e-12)
    np.testing.assert_allclose(eval_lib.pass_at_k(10, 3, 1), 0.3, rtol=1e-12)  # pass@1 = c / n
    np.testing.assert_array_equal(eval_lib.pass_at_k(4, np.array([0, 1, 4]), 4), [0.0, 1.0, 1.0])
