"""A scripted tool host for multi-turn rollouts of a tiny model (tests/multi_turn_test.py,
tests/moe_step_test.py): token ids, prompts, and `ScriptedHost`, which answers each row's calls in
order from a script and records what it was given."""

import numpy as np

from jrl import multi_turn

PAD, EOS, CALL = 0, 2, 3  # CALL ends a tool call: a stop id besides EOS
K = 4
PROMPTS = np.array([[0, 0, 1, 5, 6], [1, 7, 8, 9, 4], [0, 1, 3, 3, 3], [0, 0, 0, 6, 7]], np.int32)
PMASK = (np.arange(5)[None] >= np.array([[2], [0], [1], [3]])).astype(np.int32)


def turn_result(b, blocks, finished, reward, stats):
    ids = np.full((b, K), PAD, np.int32)
    for row, block in blocks.items():
        ids[row, : len(block)] = block
    lens = np.array([len(blocks.get(row, ())) for row in range(b)], np.int32)
    return multi_turn.TurnResult(ids, lens, finished, reward, stats)


class ScriptedHost:
    """Answers each row's calls, in order, from a script of (block, finished) and records what
    it was given."""

    block_size, stop_ids, stat_names = K, (EOS, CALL), ("calls", "tool_tokens")

    def __init__(self, script):
        self.script = {row: list(items) for row, items in script.items()}
        self.calls = []

    def __call__(self, ids, length, turn_start, waiting, turns):
        b = ids.shape[0]
        self.calls.append(
            {
                k: v.copy()
                for k, v in zip(
                    ("ids", "length", "start", "waiting", "turns"),
                    (ids, length, turn_start, waiting, turns),
                )
            }
        )
        blocks, finished = {}, np.zeros(b, bool)
        stats = np.zeros((b, 2), np.float32)
        for row in np.flatnonzero(waiting):
            block, finished[row] = self.script[row].pop(0)
            blocks[row] = block
            stats[row] = 1, len(block)
        return turn_result(b, blocks, finished, 0.5 * waiting.astype(np.float32), stats)
