"""Tests for the built-in arithmetic task (jrl.data) and its exact-match reward (jrl.rewards)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import data, rewards
from jrl.data.arithmetic import ArithmeticTask
from jrl.rewards.arithmetic import exact_match
from jrl.tokenizer import char_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _texts(task, batch):
    prompts = task.decode_responses(batch["input_ids"], batch["attention_mask"])
    answers = task.decode_responses(batch["answer_ids"], batch["answer_mask"])
    return prompts, answers


def _solve(prompt):
    """Independent check: parse "a op b=" and compute with Python ints."""
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", prompt).groups()
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


# ---------------------------------------------------------------------------------------- task


def test_train_batch_is_deterministic(tok):
    task = ArithmeticTask(tok, ops=("+", "-"), seed=3)
    again = ArithmeticTask(tok, ops=("+", "-"), seed=3)
    a, b = task.train_batch(5, 32), again.train_batch(5, 32)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["input_ids"], task.train_batch(6, 32)["input_ids"])
    other_seed = ArithmeticTask(tok, ops=("+", "-"), seed=4).train_batch(5, 32)
    assert not np.array_equal(a["input_ids"], other_seed["input_ids"])
    np.testing.assert_array_equal(task.eval_batch()["input_ids"], again.eval_batch()["input_ids"])


def test_layout_and_dtypes(tok):
    task = ArithmeticTask(tok, num_digits=2, eval_size=16)
    assert (task.prompt_length, task.answer_length, task.max_response_length) == (7, 4, 4)
    batch = task.train_batch(0, 64)
    shapes = dict(
        input_ids=(64, 7),
        attention_mask=(64, 7),
        answer_ids=(64, 4),
        answer_mask=(64, 4),
        answer_len=(64,),
    )
    assert {k: v.shape for k, v in batch.items()} == shapes
    assert all(v.dtype == np.int32 for v in batch.values())
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = mask.sum(1)
    assert (n < 7).any()  # some prompts are shorter (single-digit operands) and padded
    for row, m, k in zip(ids, mask, n):
        np.testing.assert_array_equal(m, [0] * (7 - k) + [1] * k)  # left padding
        assert (row[: 7 - k] == 0).all() and row[7 - k] == tok.bos_token_id
        assert row[-1] == tok.convert_tokens_to_ids("=")
    for row, m, k in zip(batch["answer_ids"], batch["answer_mask"], batch["answer_len"]):
        assert row[k] == EOS and (row[k + 1 :] == 0).all() and (row[:k] > 3).all()
        np.testing.assert_array_equal(m, np.arange(4) <= k)


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_answers_are_correct(tok, ops):
    task = ArithmeticTask(tok, num_digits=2, ops=ops, eval_size=32)
    for batch in (task.train_batch(1, 128), task.eval_batch()):
        prompts, answers = _texts(task, batch)
        assert answers == [_solve(p) for p in prompts]
        np.testing.assert_array_equal(batch["answer_len"], [len(a) for a in answers])


def test_negative_answers(tok):
    task = ArithmeticTask(tok, num_digits=2, ops=("-",), eval_size=8)
    assert task.answer_length == 4  # "-99" + eos
    prompts, answers = _texts(task, task.train_batch(0, 256))
    negative = [a for a in answers if a.startswith("-")]
    assert negative and all(a[1:].isdigit() and a[1] != "0" for a in negative)
    assert answers == [_solve(p) for p in prompts]


def test_shapes_static_across_ops(tok):
    for ops, answer_length in [(("+",), 4), (("-",), 4), (("*",), 5), (("+", "-", "*"), 5)]:
        task = ArithmeticTask(tok, num_digits=2, ops=ops, eval_size=8, max_response_length=6)
        batch = task.train_batch(0, 8)
        assert task.answer_length == answer_length
        assert batch["input_ids"].shape == (8, 7) and batch["answer_ids"].shape == (8, 6)
    task = ArithmeticTask(tok, num_digits=3, max_prompt_length=12, eval_size=8)
    assert task.train_batch(0, 4)["input_ids"].shape == (4, 12)
    assert task.eval_batch()["input_ids"].shape == (8, 12)


def test_eval_and_train_are_disjoint(tok):
    # 1 digit, "+" and "-": 200 problems, 50 held out; train draws cover exactly the other 150.
    task = ArithmeticTask(tok, num_digits=1, ops=("+", "-"), eval_size=50, seed=1)
    as_tuples = lambda p: set(zip(p.a.tolist(), p.op.tolist(), p.b.tolist()))
    held_out = as_tuples(task.eval_problems)
    assert len(held_out) == 50 and task.num_train == 150
    seen = set()
    for step in range(20):
        seen |= as_tuples(task.sample_train_problems(step, 200))
    assert not seen & held_out
    assert len(seen) == 150
    prompts, _ = _texts(task, task.eval_batch())
    assert prompts == [f"{a}{op}{b}=" for a, op, b in zip(*task.eval_problems)]


def test_bad_sizes_raise(tok):
    with pytest.raises(ValueError, match="eval_size=100 leaves no train problems.*lower eval_size"):
        ArithmeticTask(tok, num_digits=1, eval_size=100)
    with pytest.raises(ValueError, match="max_prompt_length=6 < 7.*raise it to at least 7"):
        ArithmeticTask(tok, max_prompt_length=6)
    with pytest.raises(ValueError, match="max_response_length=4 < 5.*at least 5"):
        ArithmeticTask(tok, ops=("*",), max_response_length=4)
    with pytest.raises(ValueError, match="ops="):
        ArithmeticTask(tok, ops=("/",))
    with pytest.raises(ValueError, match="num_digits=0"):
        ArithmeticTask(tok, num_digits=0)


def test_make_task(tok):
    task = data.make_task("arithmetic", tok, num_digits=1, eval_size=4)
    assert isinstance(task, ArithmeticTask) and task.eval_batch()["input_ids"].shape == (4, 5)
    with pytest.raises(ValueError, match="unknown task 'gsm9k'.*arithmetic"):
        data.make_task("gsm9k", tok)


# -------------------------------------------------------------------------------------- reward


def _check(response, mask, answer, answer_len, expected):
    scores = exact_match(
        jnp.asarray(response, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        jnp.asarray(answer, jnp.int32),
        jnp.asarray(answer_len, jnp.int32),
        eos_id=EOS,
    )
    assert scores.dtype == jnp.float32 and scores.shape == (len(expected),)
    np.testing.assert_array_equal(np.asarray(scores), expected)


# answer "85" = ids [12, 9], eos = 2, pad = 0; R = 5.
ANSWER = [[12, 9, EOS, 0, 0]]


@pytest.mark.parametrize(
    "response,mask,expected",
    [
        ([12, 9, EOS, 0, 0], [1, 1, 1, 0, 0], 1.0),  # exact answer + eos
        ([12, 9, EOS, 7, EOS], [1, 1, 1, 0, 0], 1.0),  # garbage after eos is ignored
        ([12, 9, 4, EOS, 0], [1, 1, 1, 1, 0], 0.0),  # extra digit
        ([12, 8, EOS, 0, 0], [1, 1, 1, 0, 0], 0.0),  # wrong digit
        ([12, 9, 9, 9, 9], [1, 1, 1, 1, 1], 0.0),  # right digits, never eos
        ([12, 9, 7, 7, 7], [1, 1, 1, 1, 1], 0.0),  # right digits, then no eos
        ([12, 9, EOS, 0, 0], [1, 1, 0, 0, 0], 0.0),  # eos outside the response mask
        ([12, EOS, 0, 0, 0], [1, 1, 0, 0, 0], 0.0),  # stops early
    ],
)
def test_exact_match_cases(response, mask, expected):
    _check([response], [mask], ANSWER, [2], [expected])


def test_exact_match_answer_filling_the_response():
    # The answer needs 3 tokens + eos = 4 > R = 3: no response of width 3 can be right.
    _check([[5, 6, 7]], [[1, 1, 1]], [[5, 6, 7, EOS]], [3], [0.0])
    _check([[5, 6, 7, EOS]], [[1, 1, 1, 1]], [[5, 6, 7, EOS]], [3], [1.0])


def test_exact_match_answer_width_differs_from_response():
    response = [[12, 9, EOS, 0], [12, 9, 9, EOS], [12, 9, 9, 9]]
    mask = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    # R_a = 3 < R = 4: the answers "85", "85", "85".
    _check(response, mask, [[12, 9, EOS]] * 3, [2, 2, 2], [1.0, 0.0, 0.0])
    # R_a = 7 > R = 4: the answers "85", "859", "8599" (too long for R = 4 with its eos).
    wide = [[12, 9, EOS, 0, 0, 0, 0], [12, 9, 9, EOS, 0, 0, 0], [12, 9, 9, 9, EOS, 0, 0]]
    _check(response, mask, wide, [2, 3, 4], [1.0, 1.0, 0.0])


def test_exact_match_jit_and_registry(tok):
    task = ArithmeticTask(tok, ops=("+", "-", "*"), eval_size=8)
    batch = task.eval_batch()
    fn = rewards.get_reward("arithmetic_exact_match")
    R = task.max_response_length + 3
    response = np.full((8, R), 7, np.int32)  # garbage after the answer
    response[:, : task.max_response_length] = batch["answer_ids"]
    mask = (np.arange(R)[None] <= batch["answer_len"][:, None]).astype(np.int32)
    response[1, batch["answer_len"][1]] = 5  # row 1: a digit where eos should be; mask all 1
    mask[1] = 1
    response[2, 0] = 4 if response[2, 0] != 4 else 5  # row 2: first token wrong
    jitted = jax.jit(lambda b, r, m: fn(b, r, m, eos_id=EOS))
    scores = np.asarray(jitted(batch, response, mask))
    np.testing.assert_array_equal(scores, [1, 0, 0, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="unknown reward 'nope'.*arithmetic_exact_match"):
        rewards.get_reward("nope")


def test_rows_pick_a_hosts_share_of_the_same_batch(tok):
    task = ArithmeticTask(tok, ops=("+", "-"), seed=3)
    whole = task.train_batch(5, 32)
    for rows in (slice(0, 8), slice(8, 24), slice(24, 32)):
        part = task.train_batch(5, 32, rows=rows)
        assert part.keys() == whole.keys()
        for k in whole:
            np.testing.assert_array_equal(part[k], whole[k][rows], err_msg=k)


def test_few_shot_task_prompts_rows_and_ground_truths(tok):
    """Prompts are bos + prefix + problem; row_id / split name the problem; ground truths are
    the sums written out here."""
    task = data.make_task("few_shot_arithmetic", tok, prefix="1+1=2;", eval_size=16, seed=3)
    # bos + "1+1=2;" + "99+99=" = 1 + 6 + 6 tokens, plus 4 of slack
    assert task.prompt_length == 17
    batch = task.train_batch(0, 6)
    texts = task.decode_responses(batch["input_ids"], batch["attention_mask"])
    sums = []
    for text, row_id, split in zip(texts, batch["row_id"], batch["split"]):
        m = re.fullmatch(r"1\+1=2;(\d+)\+(\d+)=", text)
        a, b = int(m.group(1)), int(m.group(2))
        assert row_id == a * 100 + b and split == 0
        sums.append(str(a + b))
    assert task.ground_truths_for(batch["split"], batch["row_id"]) == sums
    ev = task.eval_batch()
    assert np.all(ev["split"] == 1) and len(set(ev["row_id"].tolist())) == 16
    first = np.argmax(batch["attention_mask"], 1)  # left padding: each row starts with bos
    assert np.all(batch["input_ids"][np.arange(6), first] == tok.bos_token_id)


@pytest.mark.parametrize(
    "response, score",
    [("19\n", 1.0), ("19", 1.0), ("19\n20+1=21", 1.0), ("1 9\n", 0.0), ("\n19", 0.0), ("190", 0.0)],
)
def test_first_line_reward_cases(response, score):
    assert rewards.arithmetic.first_line([response], ["19"]) == [score]
    assert rewards.HOST_REWARDS.get("first_line").make(None) is rewards.arithmetic.first_line
