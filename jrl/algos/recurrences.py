"""Reverse-time recurrences shared by the advantage estimators (GAE, discounted returns).

Arrays are batch-major [B, T] float32 and must already be 0 where response_mask == 0. Masked
positions (padding, or holes of multi-turn data) pass every carry through unchanged, so the
recurrences skip them.
"""

import jax
import jax.numpy as jnp


def reverse_scan(step, init, *xs_BT):
    """Runs `step(carry, xs_t) -> (carry, y_t)` over t = T-1..0 (batched over B); returns
    y [B, T]."""
    _, ys_TB = jax.lax.scan(step, init, tuple(x.T for x in xs_BT), reverse=True)
    return ys_TB.T


def gae_advantages(token_level_rewards, response_mask, values, gamma, lam):
    """Unwhitened GAE advantages A [B, T]: reverse scan with carries (nextV, A_next), both 0 past
    the end,
        delta_t = r_t + gamma * nextV - V_t;   A_t = delta_t + gamma * lam * A_next
    where only valid positions replace the carries (nextV <- V_t, A_next <- A_t)."""

    def step(carry, xs):
        next_value, next_adv = carry
        reward, value, valid = xs
        delta = reward + gamma * next_value - value
        adv = delta + gamma * lam * next_adv
        next_value = jnp.where(valid != 0, value, next_value)
        next_adv = jnp.where(valid != 0, adv, next_adv)
        return (next_value, next_adv), next_adv

    zeros = jnp.zeros(response_mask.shape[:1], jnp.float32)
    return reverse_scan(step, (zeros, zeros), token_level_rewards, values, response_mask)


def discounted_returns(token_level_rewards, response_mask, gamma):
    """Discounted return-to-go G [B, T], reverse over t with carry c (c_T = 0):
    G_t = r_t + gamma * c_{t+1};   c_t = G_t where mask_t = 1, else c_{t+1} (passed through)."""

    def step(carry, xs):
        reward, valid = xs
        ret = reward + gamma * carry
        return jnp.where(valid != 0, ret, carry), ret

    init = jnp.zeros(response_mask.shape[:1], jnp.float32)
    return reverse_scan(step, init, token_level_rewards, response_mask)


def reward_to_go(token_level_rewards):
    """Undiscounted sum_{t' >= t} r_t' [B, T] (callers pass masked rewards)."""
    return jnp.flip(jnp.cumsum(jnp.flip(token_level_rewards, -1), axis=-1), -1)
