"""GSM8K / MATH tasks from local files: padding, order, overlong prompts, field errors."""

import json

import datasets
import numpy as np
import pytest

from jrl import data
from jrl.data.math_data import MathTask, gsm8k_task, math_task
from jrl.tokenizer import BOS_ID, CHAR_VOCAB, PAD_ID, char_tokenizer

# Prompt "Q:<question>=" with bos: len(question) + 4 tokens: 7, 9, 5, 15, 7.
TRAIN = [
    {"question": "1+1", "answer": "#### 2"},
    {"question": "12+30", "answer": "#### 42"},
    {"question": "7", "answer": "#### 7"},
    {"question": "100+200+300", "answer": "#### 600"},
    {"question": "9+9", "answer": "#### 18"},
]
EVAL = [
    {"question": "2+3", "answer": "#### 5"},
    {"question": "4", "answer": "#### 4"},
    {"question": "5+5", "answer": "#### 10"},
]
TEMPLATE = "Q:{question}="


def ids(text):
    """Character ids worked out from the vocabulary, not through the tokenizer."""
    return [CHAR_VOCAB.index(c) for c in text]


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture
def tok():
    return char_tokenizer()


@pytest.fixture
def files(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", TRAIN), write_jsonl(tmp_path / "eval.jsonl", EVAL)


def make(tok, files, **kwargs):
    options = dict(
        train_files=files[0],
        eval_files=files[1],
        template=TEMPLATE,
        max_prompt_length=20,
        max_response_length=8,
    )
    return gsm8k_task(tok, **{**options, **kwargs})


def test_left_padding_keys_and_attributes(tok, files):
    task = make(tok, files)
    assert task.prompt_length == 15  # the longest prompt, "Q:100+200+300=" with bos
    assert (task.max_response_length, task.eos_id, task.pad_id, task.bos_id) == (8, 2, 0, 1)
    batch = task.eval_batch()
    assert sorted(batch) == ["attention_mask", "input_ids", "row_id", "split"]
    assert all(v.dtype == np.int32 for v in batch.values())
    expected = [
        [PAD_ID] * 8 + [BOS_ID] + ids("Q:2+3="),
        [PAD_ID] * 10 + [BOS_ID] + ids("Q:4="),
        [PAD_ID] * 8 + [BOS_ID] + ids("Q:5+5="),
    ]
    np.testing.assert_array_equal(batch["input_ids"], expected)
    np.testing.assert_array_equal(batch["attention_mask"], (np.array(expected) != PAD_ID) * 1)
    np.testing.assert_array_equal(batch["row_id"], [0, 1, 2])
    np.testing.assert_array_equal(batch["split"], [1, 1, 1])
    assert task.ground_truths_for(batch["split"], batch["row_id"]) == [
        "#### 5",
        "#### 4",
        "#### 10",
    ]
    assert task.ground_truths_for([0], [3]) == ["#### 600"]
    with pytest.raises(IndexError, match="split 0, row_id 99"):
        task.ground_truths_for([0], [99])
    assert task.decode_responses(batch["input_ids"], batch["attention_mask"])[1] == "Q:4="
    assert make(tok, files, eval_size=2).eval_batch()["row_id"].tolist() == [0, 1]


def test_epochs_are_seeded_permutations(tok, files):
    task = make(tok, files, seed=3)
    seq = np.concatenate([task.train_batch(s, 2)["row_id"] for s in range(5)])  # 2 epochs of 5
    assert sorted(seq[:5]) == [0, 1, 2, 3, 4] and sorted(seq[5:]) == [0, 1, 2, 3, 4]
    # The documented order: epoch e is the permutation drawn from (seed, spawn key (2, stream, e)).
    rng = lambda e: np.random.default_rng(np.random.SeedSequence(3, spawn_key=(2, 0, e)))  # noqa: E731
    expected = np.concatenate([rng(0).permutation(5), rng(1).permutation(5)])
    np.testing.assert_array_equal(seq, expected)
    # Same (seed, stream, step) -> same batch, on a fresh task too (resuming at step 3).
    again = make(tok, files, seed=3)
    np.testing.assert_array_equal(again.train_batch(3, 2)["row_id"], seq[6:8])
    batch = again.train_batch(3, 2)
    np.testing.assert_array_equal(batch["split"], [0, 0])
    np.testing.assert_array_equal(
        batch["input_ids"][0, -len(TRAIN[seq[6]]["question"]) - 1 :],
        ids(TRAIN[seq[6]]["question"] + "="),
    )
    assert task.epoch(3, 2) == 1 and task.epoch(2, 2) == 0
    # A batch larger than the split spans epochs.
    np.testing.assert_array_equal(task.train_batch(0, 10)["row_id"], expected)
    other_stream = np.concatenate([task.train_batch(s, 5, stream=1)["row_id"] for s in range(1)])
    assert other_stream.tolist() != expected[:5].tolist()
    other_seed = make(tok, files, seed=4).train_batch(0, 5)["row_id"]
    assert other_seed.tolist() != expected[:5].tolist()


def test_drop_truncate_and_error_overlong_prompts(tok, files):
    dropped = make(tok, files, max_prompt_length=8)  # rows 1 (9 tokens) and 3 (15) too long
    assert dropped.num_dropped == {"train": 2, "eval": 0}
    assert dropped.num_truncated == {"train": 0, "eval": 0}
    assert dropped.num_examples == {"train": 5, "eval": 3}
    assert dropped.num_train == 3 and dropped.prompt_length == 7
    seen = np.concatenate([dropped.train_batch(s, 3)["row_id"] for s in range(4)])
    assert sorted(set(seen.tolist())) == [0, 2, 4]

    cut = make(tok, files, max_prompt_length=8, overlong_prompts="truncate")
    assert cut.num_truncated == {"train": 2, "eval": 0} and cut.num_dropped["train"] == 0
    assert cut.num_train == 5 and cut.prompt_length == 8
    rows = cut.encode(0, [3, 1, 2])
    np.testing.assert_array_equal(
        rows["input_ids"],
        [ids("200+300="), ids("Q:12+30="), [PAD_ID] * 3 + [BOS_ID] + ids("Q:7=")],
    )
    with pytest.raises(
        ValueError,
        match=r"train prompt 1 has 9 tokens > max_prompt_length=8 "
        r"\(2 of 5 are too long\)",
    ):
        make(tok, files, max_prompt_length=8, overlong_prompts="error")
    with pytest.raises(ValueError, match="all 5 train prompts are longer.*shortest has 5"):
        make(tok, files, max_prompt_length=4)
    with pytest.raises(ValueError, match="overlong_prompts='cut'"):
        make(tok, files, overlong_prompts="cut")


def test_held_out_eval_without_eval_files(tok, files):
    task = make(tok, files, eval_files=(), eval_size=2)
    batch = task.eval_batch()
    np.testing.assert_array_equal(batch["split"], [0, 0])
    train = task.train_batch(0, 3)["row_id"]
    assert task.num_train == 3 and task.eval_size == 2
    assert sorted(train.tolist() + batch["row_id"].tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="eval_size=0 with no eval_files"):
        make(tok, files, eval_files=())


def test_field_file_and_format_errors(tok, files, tmp_path):
    math_file = write_jsonl(tmp_path / "math.jsonl", [{"problem": "1+1", "solution": "2"}])
    with pytest.raises(
        ValueError, match="field 'question' not in train.*fields present are problem, solution"
    ):
        make(tok, (math_file, files[1]))
    with pytest.raises(ValueError, match="does not exist"):
        make(tok, (str(tmp_path / "missing.jsonl"), files[1]))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match="could not read train file"):
        make(tok, (str(bad), files[1]))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="hold no records"):
        make(tok, (str(tmp_path / "empty.jsonl"), files[1]))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="extension '.txt'"):
        make(tok, (str(tmp_path / "x.txt"), files[1]))
    with pytest.raises(ValueError, match="no train files given"):
        make(tok, ((), files[1]))
    with pytest.raises(ValueError, match="field 'answer.value' not in train.*'answer' has fields"):
        make(tok, files, answer_field="answer.value")
    with pytest.raises(ValueError, match="field 'level' not in train"):
        make(tok, files, template="{level}: {question}")
    with pytest.raises(ValueError, match="not a format string.*double|literal braces"):
        make(tok, files, template="\\boxed{} {question}")
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        make(tok, files, prompt_format="chat")
    with pytest.raises(ValueError, match="system_prompt needs prompt_format='chat'"):
        make(tok, files, system_prompt="hi")


def test_parquet_nested_fields_and_chat_template(tok, tmp_path):
    records = [
        {"prompt": [{"role": "user", "content": "2+2"}], "reward_model": {"ground_truth": "4"}},
        {"prompt": [{"role": "user", "content": "3*3"}], "reward_model": {"ground_truth": "9"}},
        {"prompt": [{"role": "user", "content": "1"}], "reward_model": {"ground_truth": "1"}},
    ]
    path = str(tmp_path / "train.parquet")
    datasets.Dataset.from_list(records).to_parquet(path)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    options = dict(train_files=path, question_field="prompt", eval_size=1, seed=0)
    options.update(answer_field="reward_model.ground_truth", max_prompt_length=64)
    task = math_task(tok, prompt_format="chat", **options)
    batch = task.encode(0, [0, 1])
    assert task.decode_responses(batch["input_ids"], batch["attention_mask"]) == [
        "user:2+2;a:",
        "user:3*3;a:",
    ]
    assert task.prompt_length == len("user:2+2;a:")  # the chat template adds no bos
    assert task.ground_truths_for([0, 0, 0], [0, 1, 2]) == ["4", "9", "1"]
    with pytest.raises(ValueError, match="field 'prompt' holds chat messages"):
        math_task(tok, prompt_format="plain", **options)
    # A chat template over the template's user text, with a system prompt.
    plain = write_jsonl(tmp_path / "q.jsonl", [{"problem": "1+2", "solution": "\\boxed{3}"}] * 2)
    task = math_task(
        tok,
        train_files=plain,
        template="{question}=",
        prompt_format="chat",
        system_prompt="be brief",
        eval_size=1,
        max_prompt_length=64,
    )
    batch = task.eval_batch()
    assert task.decode_responses(batch["input_ids"], batch["attention_mask"]) == [
        "system:be brief;user:1+2=;a:"
    ]


def test_registry(tok, files):
    task = data.make_task(
        "gsm8k",
        tok,
        train_files=files[0],
        eval_files=files[1],
        template=TEMPLATE,
        max_prompt_length=20,
    )
    assert isinstance(task, MathTask) and task.answer_format == "gsm8k"
    assert task.max_response_length == 1024 and task.eval_size == 3  # None / 0: the defaults
    assert (
        make(tok, files, max_prompt_length=None, max_response_length=0).max_response_length == 1024
    )
    math_file = write_jsonl(files[0] + ".math.jsonl", [{"problem": "1+1", "solution": "2"}] * 3)
    task = data.make_task("math", tok, train_files=math_file, eval_size=1, template="{question}")
    assert task.answer_format == "boxed" and task.ground_truths_for([0], [2]) == ["2"]
    assert isinstance(
        data.make_task("arithmetic", tok, num_digits=1, eval_size=4), data.ArithmeticTask
    )
    names = "arithmetic, calc_products, custom, few_shot_arithmetic, gsm8k, math, tool_arith"
    with pytest.raises(ValueError, match=f"unknown task 'gsm9k'.*{names}"):
        data.make_task("gsm9k", tok)
    # custom: the question as written (no instruction), the answer as the ground truth.
    own = write_jsonl(files[0] + ".own.jsonl", [{"question": "7+8=", "answer": "15"}] * 3)
    task = data.make_task("custom", tok, train_files=own, eval_size=1)
    batch = task.eval_batch()
    assert task.decode_responses(batch["input_ids"], batch["attention_mask"], False) == [
        "<bos>7+8="
    ]
    assert task.ground_truths_for(batch["split"], batch["row_id"]) == ["15"]
    assert task.name == "custom" and task.answer_format is None


def test_task_options_bind_the_config_beside_the_registry_entry():
    from jrl import config as config_lib

    cfg = config_lib.base_config()
    cfg.seed, cfg.data.max_prompt_length, cfg.data.max_response_length = 3, 0, 64
    cfg.task.num_digits, cfg.task.ops = 1, "+-"
    assert data.task_options(cfg) == dict(
        seed=3, eval_size=256, max_prompt_length=None, max_response_length=64,
        num_digits=1, ops=("+", "-"),
    )  # fmt: skip
    cfg.task.name, cfg.task.train_files, cfg.task.template = "gsm8k", "a.jsonl", "Q: {question}"
    cfg.task.system_prompt, cfg.task.eval_size = "", 5  # empty fields: the task's defaults
    assert data.task_options(cfg) == dict(
        seed=3, eval_size=5, max_prompt_length=None, max_response_length=64,
        train_files="a.jsonl", eval_files="", prompt_format="plain", system_prompt=None,
        overlong_prompts="drop", template="Q: {question}",
    )  # fmt: skip


def test_rows_pick_a_hosts_share_of_the_same_batch(tok, files):
    task = make(tok, files)
    whole = task.train_batch(3, 4)
    part = task.train_batch(3, 4, rows=slice(2, 4))
    assert part.keys() == whole.keys()
    for k in whole:
        np.testing.assert_array_equal(part[k], whole[k][2:4], err_msg=k)
    # The rows are the positions of the step's seeded order, not file rows.
    assert list(part["row_id"]) == list(task.train_indices(3, 4)[2:4])
