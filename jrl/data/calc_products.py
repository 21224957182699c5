"""Products a small pretrained model cannot work out in its head, with a calculator it may call:
`Q: 729*52\\nA:` after worked examples, for a base model (no chat template) and the `tags` tool
format (docs/multi_turn.md):

    Q: 23*17
    A: <calc>23*17</calc> = 391. Answer: 391          model: <calc>23*17</calc>  tool: ` = 391`
    ...                                               model: `. Answer: 391` and a newline
    Q: 729*52
    A:

Problems are a x b with a of `num_digits` digits and b of one digit fewer (default 3 x 2: 900 x
90 = 81000 problems, 4- and 5-digit products). A held-out eval split of `eval_size` problem
numbers is drawn once from `seed`; train batches sample the other problems uniformly with
replacement from `np.random.default_rng([seed, stream, step])` (a pure function of seed,
stream and step).

The worked examples (`prefix`, one `Q: ...\\nA: ...` pair a line) come in two built-in sets:
`TOOL_EXAMPLES` for runs with tools, where three of the four examples call the calculator and a
small one is answered directly, and `DIRECT_EXAMPLES` for runs without, the same problems
answered directly. Which examples call sets how often the base model calls: with every example
calling, Gemma 3 270M calls on every problem (greedy) and leaves RL nothing to learn; with three
of four (the small direct one third), it calls on about a third of its samples and seldom when
greedy, so the greedy accuracy starts near 0 and rises as RL makes calling its first choice.

The answer is the model's own: the reward (`final_answer`, a host reward named by its path
`jrl.data.calc_products:final_answer`) reads the last number on the first line of the model's
final turn, which the step hands it (its tokens after the last tool answer,
`jrl.shaping.final_turn_mask`): `. Answer: 391` scores 1 for 391, the tool's ` = 391` is never
read, a final turn that states no number scores 0. Batches carry `row_id` (the problem number)
and `split` (0 train, 1 eval) for `ground_truths_for`.

Batches (P = prompt length):
  input_ids       [Bp, P] int32  bos + prompt tokens, LEFT-padded
  attention_mask  [Bp, P] int32  1 on real tokens
  row_id          [Bp]    int32  the problem number, (a - a0) * nb + (b - b0) (a0, b0 the
                                 smallest operands, nb the number of second operands)
  split           [Bp]    int32  1 for a held-out problem
There are no reference answers for a supervised warm-up (run with warmup.sft_steps=0).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np

from jrl.data.arithmetic import ArithmeticTask, left_pad

# The worked examples before each problem (`prefix`): with tools, three calls and a small
# product answered directly; without tools, the same problems answered directly.
EXAMPLES = ((23, 17, True), (412, 36, True), (9, 8, False), (706, 29, True))


def example_text(a: int, b: int, call: bool) -> str:
    """One worked example, e.g. `Q: 23*17\\nA: <calc>23*17</calc> = 391. Answer: 391\\n` (a
    call, the tool's ` = 391`, the model's answer) or `Q: 9*8\\nA: Answer: 72\\n`."""
    if call:
        return f"Q: {a}*{b}\nA: <calc>{a}*{b}</calc> = {a * b}. Answer: {a * b}\n"
    return f"Q: {a}*{b}\nA: Answer: {a * b}\n"


TOOL_EXAMPLES = "".join(example_text(a, b, call) for a, b, call in EXAMPLES)
DIRECT_EXAMPLES = "".join(example_text(a, b, False) for a, b, _ in EXAMPLES)


def question_text(a: int, b: int) -> str:
    """The problem after the examples: `Q: 729*52\\nA:` (the model's answer starts with a
    space)."""
    return f"Q: {a}*{b}\nA:"


_NUMBER = re.compile(r"-?\d[\d,]*")


def stated_answer(text: str) -> Optional[str]:
    """The last number on the first line of `text` (thousands commas dropped), or None."""
    numbers = _NUMBER.findall(text.split("\n", 1)[0])
    return numbers[-1].replace(",", "") if numbers else None


def final_answer(responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
    """Host reward of this task: 1.0 when the last number on the first line of the response
    (the model's final turn) is the ground truth, else 0.0."""
    return [float(stated_answer(r) == g) for r, g in zip(responses, ground_truths)]


class CalcProductsTask:
    """Few-shot products with a calculator (module docstring).

    Attributes: prompt_length (P), max_response_length (R), eos_id, pad_id, bos_id, tokenizer,
    eval_problems ((a, b) int64 arrays of the eval split, in the order of `eval_batch()`),
    num_problems, num_train."""

    def __init__(
        self,
        tokenizer,
        *,
        tools: bool = True,
        prefix: Optional[str] = None,
        num_digits: int = 3,
        eval_size: int = 64,
        seed: int = 0,
        max_prompt_length: Optional[int] = None,
        max_response_length: Optional[int] = None,
    ):
        if not 2 <= num_digits <= 5:
            raise ValueError(
                f"num_digits={num_digits}: the operands have num_digits and num_digits - 1 "
                "digits; give 2 to 5 (3: 3-digit x 2-digit products)."
            )
        for name in ("eos", "pad"):
            if getattr(tokenizer, f"{name}_token_id") is None:
                raise ValueError(f"tokenizer has no {name} token: set tokenizer.{name}_token.")
        self.tokenizer, self.seed, self.num_digits = tokenizer, seed, num_digits
        self.tools = tools
        self.prefix = (TOOL_EXAMPLES if tools else DIRECT_EXAMPLES) if prefix is None else prefix
        self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        self._a0, self._b0 = 10 ** (num_digits - 1), 10 ** (num_digits - 2)
        self._na, self._nb = 9 * self._a0, 9 * self._b0  # operands with exactly that many digits
        self.num_problems = self._na * self._nb
        if not 0 <= eval_size < self.num_problems:
            raise ValueError(
                f"eval_size={eval_size} leaves no train problems: there are {self.num_problems} "
                f"for num_digits={num_digits}; lower eval_size."
            )
        self.eval_size, self.num_train = eval_size, self.num_problems - eval_size

        top_a, top_b = 10 * self._a0 - 1, 10 * self._b0 - 1
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        self._encode = encode
        extremes = [(a, b) for a in (self._a0, top_a) for b in (self._b0, top_b)]
        longest = max(len(encode(self.prefix + question_text(a, b))) for a, b in extremes)
        need = 1 + longest + 4  # bos, the prompt, slack for operands that split into more tokens
        if max_prompt_length is None:
            max_prompt_length = need
        self.prompt_length = max_prompt_length
        # The longest answer with a call: the call, the tool's answer and the restated answer.
        product = top_a * top_b
        answer = f" <calc>{top_a}*{top_b}</calc> = {product}. Answer: {product}\n"
        self.answer_length = len(encode(answer)) + 4
        self.max_response_length = max_response_length or self.answer_length

        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
        self._eval_index = np.sort(rng.choice(self.num_problems, eval_size, replace=False))
        self._shift = self._eval_index - np.arange(eval_size)
        self._eval_order = self._eval_index[rng.permutation(eval_size)]
        self.eval_problems = self.operands(self._eval_order)
        self._eval_batch = None

    def operands(self, index) -> tuple[np.ndarray, np.ndarray]:
        """Problem numbers [N] -> (a, b) [N] int64 (number = (a - a0) * nb + (b - b0))."""
        i, j = np.divmod(np.asarray(index, np.int64), self._nb)
        return i + self._a0, j + self._b0

    def sample_train_numbers(self, step: int, batch_size: int, stream: int = 0) -> np.ndarray:
        """`batch_size` train problem numbers, uniform with replacement over the problems outside
        the eval split; a function of (seed, stream, step)."""
        rng = np.random.default_rng([self.seed, stream, step])
        k = rng.integers(0, self.num_train, size=batch_size, dtype=np.int64)
        return k + np.searchsorted(self._shift, k, side="right")  # skip the held-out numbers

    def encode(self, numbers) -> dict:
        """Problem numbers [N] -> the batch dict of the module docstring."""
        numbers = np.asarray(numbers, np.int64)
        a, b = self.operands(numbers)
        bos = [] if self.bos_id is None else [self.bos_id]
        prompts = [
            bos + self._encode(self.prefix + question_text(x, y))
            for x, y in zip(a.tolist(), b.tolist())
        ]
        longest = max(map(len, prompts), default=0)
        if longest > self.prompt_length:
            raise ValueError(
                f"a prompt has {longest} tokens > prompt length {self.prompt_length}: raise "
                f"data.max_prompt_length to {longest} or leave it unset."
            )
        input_ids, attention_mask = left_pad(prompts, self.prompt_length, self.pad_id)
        return dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            row_id=numbers.astype(np.int32),
            split=np.isin(numbers, self._eval_index).astype(np.int32),
        )

    def train_batch(
        self, step: int, batch_size: int, stream: int = 0, rows: slice = slice(None)
    ) -> dict:
        """The train batch of `step` (`rows`: a host's share of it)."""
        return self.encode(self.sample_train_numbers(step, batch_size, stream)[rows])

    def eval_batch(self) -> dict:
        """The whole eval split in a fixed order; computed once."""
        if self._eval_batch is None:
            self._eval_batch = self.encode(self._eval_order)
        return {k: v.copy() for k, v in self._eval_batch.items()}

    def ground_truths_for(self, split, row_id) -> list[str]:
        """The product of each problem number (the split is implied by the number)."""
        del split
        a, b = self.operands(row_id)
        return [str(x * y) for x, y in zip(a.tolist(), b.tolist())]

    decode_responses = ArithmeticTask.decode_responses  # B strings of masked tokens (logging)
