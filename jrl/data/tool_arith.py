"""Arithmetic with a calculator: the arithmetic task whose supervised warm-up shows, on part of
its problems, how to answer with a tool call (the `compact` format of docs/multi_turn.md).

Prompts, RL batches, the eval split and the reward's reference (`answer_ids` / `answer_len`, the
final answer) are `ArithmeticTask`'s; the reward reads the model's final turn, after the last
tool block (`;` ends one). The warm-up batches (stream `WARMUP_STREAM`) also carry the
warm-up's own targets: for a `tool_demos` share of their rows a demonstration

    37*48=  ->  <37*48>=1776;1776<eos>      model: <37*48>   tool: =1776;   model: 1776<eos>

and for the others the direct answer `1776<eos>`. In a `1 - tool_call_share` share of the
demonstrations the opening `<` (the choice to call) is not trained, only the call's argument and
the final answer: the warm-up then teaches copying a call's argument on many rows while the share
of rows that train the first token to be `<` (which sets how often the warmed-up model calls)
stays small.

  sft_ids        [Bp, R] int32  the demonstration (or the answer), then eos, then pad
  sft_mask       [Bp, R] int32  1 on its tokens and the eos (the forward reads them all)
  sft_loss_mask  [Bp, R] int32  1 where the model is trained: its own tokens and the eos, not the
                                tool's answer `=1776;` (masked as in RL, where tool tokens have
                                response_mask 0), nor the `<` of a demonstration outside the
                                `tool_call_share`

Which rows are demonstrations is a function of (seed, step), from a stream of its own, so the
problems themselves are the arithmetic task's. The reward for this task is
"arithmetic_final_answer": the model's answer after the last tool block.
"""

from typing import Optional, Sequence

import numpy as np

from jrl.data.arithmetic import ArithmeticTask, Problems, answer_text

WARMUP_STREAM = 1  # the stream of jrl.sft.sft_warmup's batches
# The compact call format (jrl/tools/formats.py CompactFormat): <argument>, then the host's =answer;
OPEN, CLOSE, ANSWER, END = "<", ">", "=", ";"


def call_text(a: int, op: str, b: int) -> str:
    """The model's call of a problem, e.g. `call_text(37, "*", 48) == "<37*48>"`."""
    return f"{OPEN}{a}{op}{b}{CLOSE}"


def demo_segments(a: int, op: str, b: int, tool: bool) -> list[tuple[str, bool]]:
    """The warm-up answer of a problem as (text, the model writes it) segments, eos excluded:
    with `tool`, [("<37*48>", True), ("=1776;", False), ("1776", True)]; else [("1776", True)]."""
    answer = answer_text(a, op, b)
    if not tool:
        return [(answer, True)]
    return [(call_text(a, op, b), True), (f"{ANSWER}{answer}{END}", False), (answer, True)]


class ToolArithTask(ArithmeticTask):
    """`ArithmeticTask` with tool-call demonstrations in its warm-up batches (module docstring).

    `tool_demos`: the share of warm-up rows that are demonstrations, in [0, 1];
    `tool_call_share`: the share of demonstrations whose opening `<` is trained, in [0, 1]. The
    response length R defaults to the longest demonstration plus eos, whatever `tool_demos` (runs
    with and without tools then have the same budget)."""

    def __init__(
        self,
        tokenizer,
        *,
        tool_demos: float = 0.5,
        tool_call_share: float = 1.0,
        num_digits: int = 2,
        ops: Sequence[str] = ("+",),
        max_response_length: Optional[int] = None,
        **kwargs,
    ):
        if not 0.0 <= tool_demos <= 1.0:
            raise ValueError(f"tool_demos={tool_demos}: must be a share in [0, 1], e.g. 0.5.")
        if not 0.0 <= tool_call_share <= 1.0:
            raise ValueError(f"tool_call_share={tool_call_share}: must be a share in [0, 1].")
        self.tool_demos, self.tool_call_share = float(tool_demos), float(tool_call_share)
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        self._encode = encode
        # A bound on the longest demonstration (+ eos): the longest call and twice the longest
        # answer (|a op b| peaks at an operand extreme; the call text at the largest operands).
        top, extremes = 10**num_digits - 1, (0, 10**num_digits - 1)
        longest_answer = max(
            len(encode(answer_text(a, op, b))) for op in ops for a in extremes for b in extremes
        )
        longest_call = max(len(encode(call_text(top, op, top))) for op in ops)
        need = longest_call + len(encode(ANSWER + END)) + 2 * longest_answer + 1
        if max_response_length is not None and max_response_length < need:
            raise ValueError(
                f"max_response_length={max_response_length} < {need} needed for the longest tool "
                "demonstration plus eos: raise it or leave it unset."
            )
        super().__init__(
            tokenizer,
            num_digits=num_digits,
            ops=ops,
            max_response_length=max_response_length or need,
            **kwargs,
        )


    def train_batch(
        self, step: int, batch_size: int, stream: int = 0, rows: slice = slice(None)
    ) -> dict:
        """`ArithmeticTask.train_batch`; on `WARMUP_STREAM` with the warm-up's targets added."""
        problems = self.sample_train_problems(step, batch_size, stream)
        mine = Problems(*(field[rows] for field in problems))
        batch = self.encode(mine)
        if stream == WARMUP_STREAM:
            rng = np.random.default_rng(
                np.random.SeedSequence([self.seed, stream, step], spawn_key=(3,))
            )
            tool = rng.random(batch_size) < self.tool_demos
            call = rng.random(batch_size) < self.tool_call_share
            batch.update(self.demonstrations(mine, tool[rows], call[rows]))
        return batch

    def demonstrations(self, problems: Problems, tool, call=None) -> dict:
        """`sft_ids`, `sft_mask`, `sft_loss_mask` [N, R] of `problems`, row i a tool-call
        demonstration where `tool[i]`, its opening `<` trained where `call[i]` (default: every
        row; module docstring)."""
        n, width = len(problems.a), self.max_response_length
        ids = np.full((n, width), self.pad_id, np.int32)
        mask = np.zeros((n, width), np.int32)
        loss_mask = np.zeros((n, width), np.int32)
        triples = zip(problems.a.tolist(), problems.op.tolist(), problems.b.tolist())
        for i, (a, op, b) in enumerate(triples):
            tokens, trained = [], []
            for text, model in demo_segments(a, op, b, bool(tool[i])):
                piece = self._encode(text)
                tokens += piece
                trained += [int(model)] * len(piece)
            tokens, trained = tokens + [self.eos_id], trained + [1]
            if len(tokens) > width:
                raise ValueError(
                    f"a demonstration has {len(tokens)} tokens with eos > max_response_length "
                    f"{width}: raise max_response_length to {len(tokens)}."
                )
            ids[i, : len(tokens)] = tokens
            mask[i, : len(tokens)] = 1
            loss_mask[i, : len(tokens)] = trained
            if tool[i] and call is not None and not call[i]:
                loss_mask[i, 0] = 0  # the choice to call: not trained on this row
        return dict(sft_ids=ids, sft_mask=mask, sft_loss_mask=loss_mask)
