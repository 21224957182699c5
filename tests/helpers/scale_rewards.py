"""A user reward ("tests.helpers.scale_rewards:vowel_share") for the scale-out tests
(tests/run/scale_test.py): it runs on the host through `jax.pure_callback` like the GSM8K / MATH
rewards, and it differs within the groups of an untrained policy, so the compared runs make real
updates (a correctness reward would be 0 for every sample, every advantage 0 and every update
rounding noise)."""


def vowel_share(responses, ground_truths):
    """The share of vowels and of the digits 0, 3, 6, 9 among a response's characters."""
    return [sum(c in "aeiou0369" for c in r) / max(len(r), 1) for r in responses]
