"""What a resume checks: config.json records the config and fingerprints of the input files; a
resume with a field that changes the maths or with changed data stops with exit 2 and a one-line
diff (before the step compiles or anything is written), unless --allow_changes or the field is
safe."""

import fnmatch
import hashlib
import json

from helpers.cli import TINY, cache_env, last_line, run
from jrl import config as config_lib
from jrl.run import checkpoint as checkpoint_lib
from jrl.run import console
from jrl.run import workdir as workdir_lib
from conftest import tiny_config

ROWS = [
    {"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (3, 3)]
]
GSM8K = [
    "--config.task.name=gsm8k",
    "--config.task.reward=gsm8k",
    "--config.task.eval_size=2",
    "--config.task.template={question} Answer:",
]


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_fingerprint_is_size_and_sha256_of_first_and_last_mib(tmp_path):
    small = tmp_path / "small.jsonl"
    small.write_bytes(b"abc\n")
    big = tmp_path / "big.bin"
    data = bytes(range(256)) * 12289  # 3 MiB + 256 bytes
    big.write_bytes(data)
    cfg = tiny_config()
    cfg.task.train_files = f"{small},{big}"
    prints = workdir_lib.fingerprints(cfg)
    assert sorted(prints) == ["task.train_files[0]", "task.train_files[1]"]
    assert prints["task.train_files[0]"]["size"] == 4
    assert prints["task.train_files[0]"]["sha256_head_tail"] == hashlib.sha256(b"abc\n").hexdigest()
    mib = 1 << 20
    want = hashlib.sha256(data[:mib] + data[-mib:]).hexdigest()
    assert prints["task.train_files[1]"]["sha256_head_tail"] == want
    assert prints["task.train_files[1]"]["size"] == len(data)


def test_changes_lists_math_fields_and_inputs_not_safe_fields(tmp_path):
    cfg = tiny_config()
    prints = {"task.train_files[0]": {"path": "/d/a.jsonl", "size": 10, "sha256_head_tail": "x"}}
    saved = json.loads(workdir_lib.config_json(cfg, prints))
    assert workdir_lib.changes(saved, cfg, prints) == []
    assert checkpoint_lib.config_from_json(saved).actor.lr == cfg.actor.lr  # loads as a config
    cfg.actor.lr = 1e-3
    cfg.rollout.n = 8
    cfg.total_steps = 100  # safe
    cfg.checkpoint.every_steps = 7  # safe
    cfg.mesh.shape = (1, -1, 1)  # safe: the same step laid out otherwise
    cfg.task.train_files = "/elsewhere/a.jsonl"  # compared by fingerprint, not by path
    moved = {
        "task.train_files[0]": {"path": "/elsewhere/a.jsonl", "size": 12, "sha256_head_tail": "y"}
    }
    assert workdir_lib.changes(saved, cfg, moved) == [
        "actor.lr 0.0002 -> 0.001",
        "rollout.n 4 -> 8",
        "task.train_files[0] /elsewhere/a.jsonl changed (10 -> 12 bytes)",
    ]
    assert (
        workdir_lib.changes(
            saved,
            tiny_config(),
            {
                "task.train_files[0]": {
                    **prints["task.train_files[0]"],
                    "path": "/elsewhere/a.jsonl",
                }
            },
        )
        == []
    )  # the same file, moved
    same_size = {"task.train_files[0]": {**moved["task.train_files[0]"], "size": 10}}
    assert workdir_lib.changes(saved, cfg, same_size)[-1].endswith("(same size, other content)")
    del saved["rollout"]["n"]  # a field jrl did not have when the run started: not compared
    del saved[workdir_lib.FINGERPRINTS_KEY]  # a workdir without fingerprints: data not compared
    assert workdir_lib.changes(saved, cfg, moved) == ["actor.lr 0.0002 -> 0.001"]


def test_resume_safe_fields_name_the_configs_own_fields():
    """Each pattern of what a resume may change matches a field of base_config (a renamed or
    removed field, or a section that is not there, is refused), and the run-steering fields
    are among them: a resume may change how many answers an eval shows (eval_samples)."""
    fields = config_lib.flat_keys(config_lib.base_config())
    for pattern in config_lib.resume_safe_fields():
        assert fnmatch.filter(fields, pattern), pattern
    saved = json.loads(workdir_lib.config_json(tiny_config(), {}))
    changed = tiny_config(**{"eval_samples": 2, "eval_every": 3, "checkpoint.max_to_keep": 1})
    assert workdir_lib.changes(saved, changed, {}) == []
    assert workdir_lib.changes(saved, tiny_config(seed=5), {}) == ["seed 0 -> 5"]


def test_check_resume_raises_one_line_or_warns_with_allow_changes(tmp_path, caplog):
    cfg = tiny_config()
    (tmp_path / "config.json").write_text(workdir_lib.config_json(cfg, {}))
    cfg.data.train_batch_size = 8
    try:
        workdir_lib.check_resume(str(tmp_path), cfg, {})
        raise AssertionError("no error")
    except workdir_lib.ChangedInputsError as e:
        assert str(e) == (
            f"--workdir={tmp_path} was trained with other inputs: data.train_batch_size 4 -> 8; "
            "resume with the same config and files, pass --allow_changes to resume anyway, or "
            "start over with --fresh or another --workdir."
        )
    with caplog.at_level("WARNING"):
        workdir_lib.check_resume(str(tmp_path), cfg, {}, allow_changes=True)
    assert "data.train_batch_size 4 -> 8" in caplog.text


def _snapshot(root):
    """Every file's bytes and modification time (the lock file's bytes only: it records each
    holder while it runs and is emptied on exit; the run log aside: every start appends to it)."""
    return {
        p: (p.read_bytes(), None if p.name == workdir_lib.LOCK_FILE else p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and p.name != console.LOG_FILE
    }


def test_cli_resume_with_changed_config_or_data_exits_2_and_changes_nothing(tmp_path_factory):
    env = {**cache_env(), "JAX_LOG_COMPILES": "1"}
    tmp = tmp_path_factory.mktemp("changed_inputs")
    data = tmp / "train.jsonl"
    _write_rows(data, ROWS)
    workdir = tmp / "w"
    args = [*TINY, *GSM8K, f"--workdir={workdir}", "--config.total_steps=1"]
    code, err = run([*args, f"--config.task.train_files={data}"], env)
    assert code == 0, err[-3000:]
    saved = json.loads((workdir / "config.json").read_text())
    (record,) = saved[workdir_lib.FINGERPRINTS_KEY]
    assert record["input"] == "task.train_files[0]" and record["size"] == data.stat().st_size
    before = _snapshot(workdir)

    code, err = run([*args, f"--config.task.train_files={data}", "--config.actor.lr=0.002"], env)
    assert code == 2
    assert last_line(err) == (
        f"error: --workdir={workdir} was trained with other inputs: actor.lr 0.0002 -> 0.002; "
        "resume with the same config and files, pass --allow_changes to resume anyway, or start "
        "over with --fresh or another --workdir."
    )
    assert "Compiling jit(step)" not in err and "Compiling jit(init)" not in err

    _write_rows(data, ROWS + ROWS[:1])  # one more row
    code, err = run([*args, f"--config.task.train_files={data}"], env)
    assert code == 2
    grown = len(json.dumps(ROWS[0])) + 1
    assert last_line(err).startswith(
        f"error: --workdir={workdir} was trained with other inputs: task.train_files[0] {data} "
        f"changed ({data.stat().st_size - grown} -> {data.stat().st_size} bytes); "
    ), last_line(err)
    assert "Compiling jit(step)" not in err and "Compiling jit(init)" not in err
    assert _snapshot(workdir) == before  # nothing written
