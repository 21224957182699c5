"""The reward tests' shared batch (math_rewards_test, reward_failure_test): a GSM8K task of the
character tokenizer, four hand-written responses to its eval prompts (`TEXTS`: what a reward
reads of them) and a reward jitted over them."""

import json

import jax
import numpy as np

from jrl.data.math_data import gsm8k_task
from jrl.tokenizer import CHAR_VOCAB, EOS_ID, PAD_ID, char_tokenizer


def char_gsm8k_task(tmp_path):
    """A GSM8K task of the character tokenizer over files written under `tmp_path`: 4 train
    problems, 2 eval ones (1+1 -> 2, 40+2 -> 42)."""

    def write(name, records):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)

    train = write(
        "train.jsonl", [{"question": f"{i}+{i}", "answer": f"#### {2 * i}"} for i in range(4)]
    )
    evals = write(
        "eval.jsonl",
        [{"question": "1+1", "answer": "#### 2"}, {"question": "40+2", "answer": "#### 42"}],
    )
    return gsm8k_task(
        char_tokenizer(),
        train_files=train,
        eval_files=evals,
        template="{question}=",
        max_prompt_length=16,
        max_response_length=20,
    )


def ids(text):
    return [CHAR_VOCAB.index(c) for c in text]


R = 20
# Rows 0, 1 answer eval prompt 0 (ground truth 2); rows 2, 3 answer eval prompt 1 (42).
RESPONSES = [
    ("#### 2", True, "9"),  # eos, then garbage outside the mask
    ("so 3", True, ""),
    ("#### 42", False, ""),  # the mask stops after "#### 4" (tokens past it are not decoded)
    ("the answer is 42", False, "xxxx"),  # fills R with no eos
]
TEXTS = ["#### 2", "so 3", "#### 4", "the answer is 42xxxx"]


def response_arrays():
    ids_, mask = np.full((4, R), PAD_ID, np.int32), np.zeros((4, R), np.int32)
    for b, (text, eos, tail) in enumerate(RESPONSES):
        row = ids(text) + ([EOS_ID] if eos else []) + ids(tail)
        ids_[b, : len(row)] = row
        mask[b, : len(ids(text)) + eos] = 1
    mask[2, len("#### 4") :] = 0
    mask[3, :] = 1
    return ids_, mask


def rows_of(task):
    """The eval prompts repeated twice per prompt, as the fused step does."""
    return {k: np.repeat(v, 2, axis=0) for k, v in task.eval_batch().items()}


def jitted(reward):
    return jax.jit(lambda b, r, mk: reward(b, r, mk, eos_id=EOS_ID))
