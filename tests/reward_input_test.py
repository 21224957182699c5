"""What a reward reads of a multi-turn response: the model's final turn, never a tool's answer.

A policy under RL pressure learns whatever pays: if the reward read the tool's text as the
model's, a row that lets a tool print the answer (a calc result, a python program's output)
would score without the model stating it. The step hands every reward (JAX, host and user ones)
`shaping.final_turn_mask`; here a hand-made multi-turn rollout, whose tool block holds the right
answer in every form the rewards look for, goes through `step.rollout_and_reward` with the real
host rewards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_model
from jrl import multi_turn
from jrl import rewards
from jrl import step as step_lib
from jrl import shaping
from helpers.tools_fixtures import TOOL_BLOCK, qwen_style_tokenizer

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(12*34)"}}</tool_call><|im_end|>'
# the tool's output states the answer as gsm8k, math and a plain reader want it
BLOCK = TOOL_BLOCK.format("#### 408 \\boxed{408}")
ROWS = [  # [(text, who wrote it)] per row; ground truth 408 for all
    [(CALL, "model"), (BLOCK, "tool"), ("The tool has it.<|im_end|>", "model")],  # no answer
    [(CALL, "model"), (BLOCK, "tool"), ("#### 408, \\boxed{408}<|im_end|>", "model")],
    [("#### 408, \\boxed{408}<|im_end|>", "model")],  # no tool call
    [("#### 408<|im_end|>", "model"), (BLOCK, "tool")],  # the answer, then a tool's (cut row)
]
R = 256


class Task:
    """The ground truths the host rewards look up (every row: 408)."""

    answer_format = "gsm8k"

    def ground_truths_for(self, splits, rows):
        return ["408"] * len(rows)


def said_408(responses, truths):
    """A user reward: 1.0 when the response mentions the ground truth."""
    return [float(t in r) for r, t in zip(responses, truths)]


def _rollout(tok):
    ids = np.full((len(ROWS), R), tok.pad_token_id, np.int32)
    mask, valid = np.zeros_like(ids), np.zeros_like(ids)
    for b, row in enumerate(ROWS):
        t = 0
        for text, who in row:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids[b, t : t + len(piece)] = piece
            mask[b, t : t + len(piece)] = who == "model"
            valid[b, t : t + len(piece)] = 1
            t += len(piece)
        assert t <= R
    zeros = np.zeros(len(ROWS), np.float32)
    out = multi_turn.MultiTurnRollout(
        *(jnp.asarray(x) for x in (ids, mask, np.zeros(ids.shape, np.float32), valid, zeros)),
        *(jnp.ones(len(ROWS), jnp.int32) for _ in range(2)),
        jnp.zeros((len(ROWS), 0)),
    )
    return out, jnp.asarray(valid)


@pytest.mark.parametrize(
    "reward, options",
    [
        ("gsm8k", {"fallback": "last_number"}),
        ("gsm8k", {"fallback": "none"}),
        ("math", {"backend": "sympy"}),
        ("format", {}),
        ("reward_input_test:said_408", {}),
    ],
)
def test_a_tools_answer_is_never_the_models(monkeypatch, reward, options):
    tok = qwen_style_tokenizer()
    reward_fn = rewards.get_reward(reward, Task(), tok, **options)
    cfg = tiny_config(**{"rollout.n": 1, "rollout.multi_turn.enable": True})
    spec = step_lib.make_spec(
        cfg, tiny_model(len(tok)), reward_fn, eos_id=2, pad_id=0, max_new_tokens=R, tool_host=1
    )
    canned = _rollout(tok)
    monkeypatch.setattr(step_lib, "sample_responses", lambda *a, **k: canned)
    b = len(ROWS)
    prompts = {
        "input_ids": jnp.ones((b, 3), jnp.int32),
        "attention_mask": jnp.ones((b, 3), jnp.int32),
        "row_id": jnp.arange(b, dtype=jnp.int32),
        "split": jnp.zeros(b, jnp.int32),
    }
    exp = step_lib.rollout_and_reward(spec, None, prompts, jax.random.key(0))
    # row 0: only the tool stated the answer; row 3: the model did, then a tool did again
    assert np.asarray(exp["acc"]).tolist() == [0.0, 1.0, 1.0, 0.0]


def test_final_turn_mask_by_hand():
    # model m, tool t, padding .: "mm tt mmm ..", "mmm ....", "m tt ....", "tt mm ...."
    mask = np.array(
        [
            [1, 1, 0, 0, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 0, 0, 0, 0],
        ]
    )
    valid = np.array(
        [
            [1, 1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 0],
        ]
    )
    want = np.array(
        [
            [0, 0, 0, 0, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0, 0],  # a tool's block last: no final turn
            [0, 0, 1, 1, 0, 0, 0, 0, 0],
        ]
    )
    np.testing.assert_array_equal(shaping.final_turn_mask(mask, valid), want)
    np.testing.assert_array_equal(shaping.final_turn_mask(mask, mask), mask)  # one turn


def test_the_gsm8k_tool_config_extracts_answers_strictly():
    """Only a "####" answer scores in configs/gsm8k_tools.py (verl's gsm8k default): no last
    number of the final turn (e.g. of a call's arguments) is read as an answer."""
    from conftest import REPO
    from jrl import config as config_lib

    cfg = config_lib.load_file(f"{REPO}/configs/gsm8k_tools.py").get_config()
    assert rewards.reward_options(cfg.task)["fallback"] == "none"
