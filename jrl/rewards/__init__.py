"""Rewards picked by name: `fn(batch, response_ids, response_mask, *, eos_id) -> scores [B]`.

`batch` is the prompt batch repeated per response row (e.g. `answer_ids`, `answer_len`);
`response_ids` / `response_mask` are [B, R]; scores are float32 sequence-level rewards.
"""

from jrl.rewards.arithmetic import arithmetic_exact_match, exact_match

REWARDS = {"arithmetic_exact_match": arithmetic_exact_match}


def get_reward(name: str):
    """The reward function registered as `name`."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}: valid names are {', '.join(sorted(REWARDS))}.")
    return REWARDS[name]
