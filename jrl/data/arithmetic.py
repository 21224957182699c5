"""The built-in task: deterministic synthetic arithmetic, `<bos>37+48=` -> `85<eos>`.

Problems are triples (a, op, b) with integer operands uniform in [0, 10**num_digits), written
without leading zeros; subtraction may give a negative answer, written with a leading "-". The
set of all distinct problems is numbered 0..N-1 (N = len(ops) * 10**(2*num_digits)); a held-out
eval split of `eval_size` problem numbers is drawn once from `seed`, and train batches sample the
remaining problems uniformly with replacement from `np.random.default_rng([seed, stream, step])`,
so a batch is a pure function of (seed, stream, step) and a resumed run sees the same data.

Batches are dicts of numpy arrays with static shapes (P = prompt length, R = response length):
  input_ids       [Bp, P] int32  `<bos>` + prompt tokens, LEFT-padded with the pad id
  attention_mask  [Bp, P] int32  1 on real tokens (bos included), 0 on padding
  answer_ids      [Bp, R] int32  answer tokens, then eos, then pad (the SFT targets)
  answer_mask     [Bp, R] int32  1 on the answer tokens and the eos, 0 after
  answer_len      [Bp]    int32  number of answer tokens, eos excluded
"""

from typing import NamedTuple, Optional, Sequence

import numpy as np

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MAX_DIGITS = 9  # keeps len(ops) * 10**(2*num_digits) problem numbers inside int64


class Problems(NamedTuple):
    """A batch of problems: `a` [N] int64, `op` [N] str (one of OPS), `b` [N] int64."""

    a: np.ndarray
    op: np.ndarray
    b: np.ndarray


def problem_text(a: int, op: str, b: int) -> str:
    """The prompt text without bos, e.g. `problem_text(37, "+", 48) == "37+48="`."""
    return f"{a}{op}{b}="


def answer_text(a: int, op: str, b: int) -> str:
    """The answer text without eos, computed with Python ints, e.g. `"85"`, `"-11"`."""
    return str(OPS[op](int(a), int(b)))


def left_pad(rows: Sequence[Sequence[int]], width: int, pad_id: int):
    """Left-pads token lists to `width`: returns (ids [N, width] int32, mask [N, width] int32)."""
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = 1
    return ids, mask


class ArithmeticTask:
    """Synthetic arithmetic prompts and answers with static shapes.

    Attributes:
      prompt_length: P, the width of `input_ids` (bos, a, op, b, "=" unless `max_prompt_length`).
      answer_length: A, the most answer tokens over all problems, plus one for eos.
      max_response_length: R, the width of `answer_ids` (defaults to A).
      eval_problems: the held-out `Problems`, in the fixed order of `eval_batch()`.
      num_problems / num_train: the number of distinct problems / train problems.
    """

    def __init__(
        self,
        tokenizer,
        *,
        num_digits: int = 2,
        ops: Sequence[str] = ("+",),
        eval_size: int = 256,
        seed: int = 0,
        max_prompt_length: Optional[int] = None,
        max_response_length: Optional[int] = None,
    ):
        ops = tuple(ops)
        if not ops or len(set(ops)) != len(ops) or any(op not in OPS for op in ops):
            raise ValueError(f"ops={ops!r}: give distinct ops from {sorted(OPS)}, e.g. ('+', '-').")
        if not 1 <= num_digits <= MAX_DIGITS:
            raise ValueError(f"num_digits={num_digits}: must be in [1, {MAX_DIGITS}].")
        for name in ("eos", "pad"):
            if getattr(tokenizer, f"{name}_token_id") is None:
                raise ValueError(f"tokenizer has no {name} token: set tokenizer.{name}_token.")
        self.tokenizer = tokenizer
        self.num_digits, self.ops, self.seed = num_digits, ops, seed
        self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        self._base = 10**num_digits
        self.num_problems = len(ops) * self._base**2

        if not 0 <= eval_size < self.num_problems:
            raise ValueError(
                f"eval_size={eval_size} leaves no train problems: there are only "
                f"{self.num_problems} distinct problems for num_digits={num_digits}, ops={ops}; "
                "lower eval_size or raise num_digits."
            )
        self.eval_size = eval_size
        self.num_train = self.num_problems - eval_size

        min_prompt = 1 + 2 * num_digits + 2  # bos, a, op, b, "="
        if max_prompt_length is None:
            max_prompt_length = min_prompt
        elif max_prompt_length < min_prompt:
            raise ValueError(
                f"max_prompt_length={max_prompt_length} < {min_prompt} needed for "
                f"num_digits={num_digits}: raise it to at least {min_prompt} or leave it unset."
            )
        self.prompt_length = max_prompt_length
        # The longest answer sits at an operand extreme: |a op b| is monotone in each operand.
        extremes = (0, self._base - 1)
        self.answer_length = 1 + max(
            len(answer_text(a, op, b)) for op in ops for a in extremes for b in extremes
        )
        if max_response_length is None:
            max_response_length = self.answer_length
        elif max_response_length < self.answer_length:
            raise ValueError(
                f"max_response_length={max_response_length} < {self.answer_length} needed for "
                f"the longest answer plus eos: raise it to at least {self.answer_length} or leave "
                "it unset."
            )
        self.max_response_length = max_response_length

        # Held-out problem numbers, sorted; `_shift[k]` = train numbers below the k-th of them.
        # A spawned stream: no entropy [seed, step] of a train batch equals it.
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
        self._eval_index = np.sort(rng.choice(self.num_problems, eval_size, replace=False))
        self._shift = self._eval_index - np.arange(eval_size)
        eval_order = rng.permutation(eval_size)
        self.eval_problems = self._problems(self._eval_index[eval_order])
        self._eval_batch = None

    def _problems(self, index: np.ndarray) -> Problems:
        """Problem numbers [N] -> `Problems` (number = op_index * base**2 + a * base + b)."""
        index = np.asarray(index, np.int64)
        op_index, rest = np.divmod(index, self._base**2)
        a, b = np.divmod(rest, self._base)
        return Problems(a=a, op=np.asarray(self.ops)[op_index], b=b)

    def sample_train_problems(self, step: int, batch_size: int, stream: int = 0) -> Problems:
        """`batch_size` train problems, uniform with replacement; a function of (seed, stream,
        step). Streams keep uses apart (0: RL steps, 1: the supervised warm-up)."""
        rng = np.random.default_rng([self.seed, stream, step])
        k = rng.integers(0, self.num_train, size=batch_size, dtype=np.int64)
        # The k-th train number skips every held-out number at or below it.
        return self._problems(k + np.searchsorted(self._shift, k, side="right"))

    def encode(self, problems: Problems) -> dict:
        """`Problems` [N] -> the batch dict described in the module docstring."""
        triples = list(zip(problems.a.tolist(), problems.op.tolist(), problems.b.tolist()))
        if not triples:
            return self._encode_tokens([], [])
        encode = lambda texts: self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        prompts = encode([problem_text(*t) for t in triples])
        answers = encode([answer_text(*t) for t in triples])
        return self._encode_tokens(prompts, answers)

    def _encode_tokens(self, prompts, answers) -> dict:
        """Token lists (no specials) -> padded arrays with bos / eos added."""
        bos = [] if self.bos_id is None else [self.bos_id]
        prompts = [bos + list(p) for p in prompts]
        longest = max(map(len, prompts), default=0)
        if longest > self.prompt_length:
            raise ValueError(
                f"a prompt has {longest} tokens > prompt length {self.prompt_length}: "
                f"raise max_prompt_length to {longest}."
            )
        longest = 1 + max(map(len, answers), default=0)
        if longest > self.max_response_length:
            raise ValueError(
                f"an answer has {longest} tokens with eos > max_response_length "
                f"{self.max_response_length}: raise max_response_length to {longest}."
            )
        input_ids, attention_mask = left_pad(prompts, self.prompt_length, self.pad_id)
        n, width = len(answers), self.max_response_length
        answer_ids = np.full((n, width), self.pad_id, np.int32)
        answer_mask = np.zeros((n, width), np.int32)
        answer_len = np.array([len(a) for a in answers], np.int32).reshape(n)
        for i, ans in enumerate(answers):
            answer_ids[i, : len(ans) + 1] = list(ans) + [self.eos_id]
            answer_mask[i, : len(ans) + 1] = 1
        return dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            answer_ids=answer_ids,
            answer_mask=answer_mask,
            answer_len=answer_len,
        )

    def train_batch(
        self, step: int, batch_size: int, stream: int = 0, rows: slice = slice(None)
    ) -> dict:
        """The train batch of `step`: `batch_size` rows, same (seed, stream, step) -> same batch.
        `rows`: only those rows of it (a host's share in a multi-host run)."""
        problems = self.sample_train_problems(step, batch_size, stream)
        return self.encode(Problems(*(field[rows] for field in problems)))

    def eval_batch(self) -> dict:
        """The whole eval split (`eval_size` rows) in a fixed order; computed once."""
        if self._eval_batch is None:
            self._eval_batch = self.encode(self.eval_problems)
        return {k: v.copy() for k, v in self._eval_batch.items()}

    def decode_responses(self, response_ids, response_mask, skip_special_tokens: bool = True):
        """Token ids [B, T] and mask [B, T] -> B strings of the masked tokens (for logging).

        Works for prompts too: `decode_responses(batch["input_ids"], batch["attention_mask"])`.
        """
        ids, mask = np.asarray(response_ids), np.asarray(response_mask)
        rows = [row[m > 0].tolist() for row, m in zip(ids, mask)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)


# Worked examples before each problem of `FewShotArithmeticTask` (one a line).
FEW_SHOT = "12+7=19\n30+45=75\n8+61=69\n"


class FewShotArithmeticTask(ArithmeticTask):
    """The same problems for a pretrained language model: each prompt is `prefix` (worked
    examples, one a line) then the problem, `<bos>12+7=19\\n30+45=75\\n8+61=69\\n37+48=`, and the
    answer is scored on its text by a host reward ("first_line": the response up to its first
    newline is the answer). Batches also carry `row_id` (the problem number) and `split` (0
    train, 1 eval) for `ground_truths_for`. `max_prompt_length` defaults to the longest prompt's
    tokens plus 4 (a tokenizer may split some operands into more tokens than the extremes)."""

    def __init__(self, tokenizer, *, prefix: str = FEW_SHOT, **kwargs):
        self.prefix = prefix
        if kwargs.get("max_prompt_length") is None:
            top = 10 ** kwargs.get("num_digits", 2) - 1
            texts = [
                prefix + problem_text(a, op, b)
                for op in kwargs.get("ops", ("+",))
                for a in (0, top)
                for b in (0, top)
            ]
            lengths = map(len, tokenizer(texts, add_special_tokens=False)["input_ids"])
            kwargs["max_prompt_length"] = 1 + max(lengths) + 4  # bos, prompt, slack
        super().__init__(tokenizer, **kwargs)

    def _numbers(self, problems: Problems) -> np.ndarray:
        """`Problems` -> their problem numbers (the inverse of `_problems`)."""
        op_index = np.array([self.ops.index(op) for op in problems.op.tolist()], np.int64)
        return (op_index * self._base + problems.a) * self._base + problems.b

    def encode(self, problems: Problems) -> dict:
        triples = list(zip(problems.a.tolist(), problems.op.tolist(), problems.b.tolist()))
        encode = lambda texts: self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        prompts = encode([self.prefix + problem_text(*t) for t in triples]) if triples else []
        answers = encode([answer_text(*t) for t in triples]) if triples else []
        out = self._encode_tokens(prompts, answers)
        numbers = self._numbers(problems).astype(np.int32)
        out["row_id"] = numbers
        out["split"] = np.isin(numbers, self._eval_index).astype(np.int32)
        return out

    def ground_truths_for(self, split, row_id) -> list[str]:
        """The answer text of each problem number (the split is implied by the number)."""
        del split
        problems = self._problems(np.asarray(row_id, np.int64))
        return [answer_text(*t) for t in zip(problems.a, problems.op, problems.b)]
