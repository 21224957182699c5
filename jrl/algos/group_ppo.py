"""GROUP-PPO: segment-level advantages with variance-ratio segmentation (jrl's own estimator).

Between PPO (a critic baseline at every token) and GRPO (one advantage per response): each
response is cut into segments, every token of a segment shares one advantage, and the critic is
trained only where a segment starts. `jrl.algos.advantages` registers it as the
estimator "group_ppo"; docs/algorithms.md (GROUP-PPO) explains it.

Conventions (as in `advantages`, verl's alignment): token arrays are [B, T] float32; position t
belongs to the action y_{t+1} chosen in state (prompt, y_1..y_t); `values[:, t]` = V of that state,
read before the token is chosen; `response_mask` m [B, T] is 1 on valid tokens. Only valid tokens
take part: masked positions (right padding, or holes of multi-turn data) are skipped by every
scan, so "the next token", segment lengths L_k and the discount exponents count valid tokens only.

Per row, with A_tok the unwhitened per-token GAE advantages (`recurrences.gae_advantages`):

  1. w_t = (1 - exp(old_log_prob_t))^2.
  2. Forward scan (segmentation). The open segment starts at a (the first valid token), with
     W = sum w_n and Q = sum w_n A_tok[n]^2 over it. For each next valid token t:
         W' = W + w_t,  Q' = Q + w_t A_tok[t]^2
         rho_t = (W' A_tok[a]^2 + eps) / (Q' + eps)            (r_grpo / r_ppo)
         rho_t > tau or (valid tokens in [a, t]) > L:  t starts a new segment, W = w_t,
                                                       Q = w_t A_tok[t]^2
         otherwise                                     W, Q = W', Q'
     The last valid token always ends a segment.
  3. Backward scan over segments k = K..1, segment k = [a_k, e_k] with L_k tokens:
         R_k     = sum_{t in k} gamma^(t - a_k) r_t
         delta_k = R_k + gamma^L_k V[a_{k+1}] - V[a_k]        (V[a_{K+1}] = 0)
         A_k     = delta_k + (gamma lam)^L_k A_{k+1}          (A_{K+1} = 0)
  4. advantages = masked_whiten(A_k on every token of segment k) over the whole batch;
     returns = A_k + V[a_k] (before whitening); critic_mask = 1 exactly at the starts a_k.

Limiting cases: L = 1 gives `gae` (and critic_mask = m); tau = +inf with L >= T gives one segment
per row, A = sum_t gamma^t r_t - V[0]; gamma = lam = 1 gives A_k = G(a_k) - V[a_k].

Parameters (bound from the `algorithm` section): gamma, lam, and `group_params(algorithm)`:
group_variance_threshold, group_max_size, group_epsilon, adaptive_threshold, threshold_lr,
min_threshold, max_threshold (defaults and comments in jrl.config.schema.base_config).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.algos import masked_var, masked_whiten, recurrences, zero_masked

EV_EPS = 1e-5  # verl's guard in critic/vf_explained_var: 1 - Var(R - V) / (Var(R) + 1e-5)


class GroupParams(NamedTuple):
    """`algorithm.group_params`, bound once by `group_params` (defaults:
    jrl.config.schema.base_config)."""

    group_variance_threshold: float  # initial tau
    group_max_size: int  # L: most valid tokens per segment
    group_epsilon: float  # eps in rho
    adaptive_threshold: bool  # adapt tau once per step from the critic's EV
    threshold_lr: float  # eta of the log-space update
    min_threshold: float  # tau stays in [min_threshold, max_threshold]
    max_threshold: float


def group_params(algorithm) -> GroupParams:
    """The validated `algorithm.group_params` section (every field must be present)."""
    section = algorithm.group_params
    p = GroupParams(*(section[f] for f in GroupParams._fields))
    checks = [
        (p.group_variance_threshold > 0, "group_variance_threshold must be > 0"),
        (int(p.group_max_size) == p.group_max_size >= 1, "group_max_size must be an integer >= 1"),
        (p.group_epsilon > 0, "group_epsilon must be > 0"),
        (p.threshold_lr >= 0, "threshold_lr must be >= 0"),
        (0 < p.min_threshold <= p.max_threshold, "need 0 < min_threshold <= max_threshold"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"algorithm.group_params: {message}; got {p}.")
    return p._replace(group_max_size=int(p.group_max_size))


class GroupPPOOutput(NamedTuple):
    """Outputs of `group_ppo`; every [B, T] array is exactly 0 where response_mask == 0."""

    advantages: jax.Array  # [B, T] segment advantages, whitened over the batch
    returns: jax.Array  # [B, T] A_k + V[a_k] on segment k (value-loss targets)
    critic_mask: jax.Array  # [B, T] float32, 1 at segment starts a_k
    metrics: dict  # group/* scalars (see `group_ppo`)
    segment_advantages: jax.Array  # [B, T] A_k on segment k, before whitening
    token_returns: jax.Array  # [B, T] per-token GAE returns A_tok + V (for `update_threshold`)
    rho: jax.Array  # [B, T] rho_t of each tentative addition; 0 at a row's first valid token


def init_threshold(algorithm) -> jax.Array:
    """The initial tau: `algorithm.group_params.group_variance_threshold` as a float32 scalar."""
    return jnp.float32(group_params(algorithm).group_variance_threshold)


def explained_variance(returns, values, mask) -> jax.Array:
    """verl's critic/vf_explained_var over valid tokens:

        EV = 1 - Var(returns - values) / (Var(returns) + 1e-5)

    with the unbiased `masked_var` (0 when fewer than two tokens are valid, so EV = 1 then).
    """
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + EV_EPS)


def update_threshold(
    threshold, returns_tok, values, response_mask, *, params: GroupParams
) -> jax.Array:
    """The adaptive threshold, once per training step:

        EV = explained_variance(returns_tok, values, m)     (returns_tok = per-token GAE returns)
        log tau <- clip(log tau - threshold_lr * EV, log min_threshold, log max_threshold)

    A critic that explains the returns (EV > 0) lowers tau (shorter, more PPO-like segments); one
    that does not (EV < 0) raises it (longer, more GRPO-like segments). With
    `adaptive_threshold=False` tau is returned unchanged. Returns a float32 scalar.
    """
    p = params
    threshold = jnp.asarray(threshold, jnp.float32)
    if not p.adaptive_threshold:
        return threshold
    mask = jnp.asarray(response_mask, jnp.float32)
    ev = explained_variance(zero_masked(returns_tok, mask), zero_masked(values, mask), mask)
    log_tau = jnp.log(threshold) - p.threshold_lr * ev
    return jnp.exp(jnp.clip(log_tau, math.log(p.min_threshold), math.log(p.max_threshold)))


def _segment_starts(adv_tok, weights, mask, tau, max_size, eps):
    """Forward segmentation scan over t (batched over B), step 2 of the module docstring.

    Carries per row: started (a valid token was seen), a (start position), A_tok[a], W, Q, n
    (valid tokens in the open segment). Returns [B, T] arrays: is_start (bool), start position of
    each token's segment (int32), rho_t (0 where no tentative addition was evaluated) and
    evaluated (bool: t was tentatively added, i.e. a valid token after the row's first).
    """
    batch, length = adv_tok.shape

    def step(carry, xs):
        started, start, start_adv, w_sum, q_sum, count = carry
        t, adv, w, valid = xs
        valid = valid != 0
        wq = w * adv * adv
        w_try, q_try = w_sum + w, q_sum + wq
        rho = (w_try * start_adv * start_adv + eps) / (q_try + eps)
        evaluated = valid & started
        new = valid & (~started | (rho > tau) | (count + 1 > max_size))
        grow = valid & ~new
        carry = (
            started | valid,
            jnp.where(new, t, start),
            jnp.where(new, adv, start_adv),
            jnp.where(new, w, jnp.where(grow, w_try, w_sum)),
            jnp.where(new, wq, jnp.where(grow, q_try, q_sum)),
            jnp.where(new, 1, jnp.where(grow, count + 1, count)),
        )
        return carry, (new, carry[1], jnp.where(evaluated, rho, 0.0), evaluated)

    zeros_f = jnp.zeros((batch,), jnp.float32)
    zeros_i = jnp.zeros((batch,), jnp.int32)
    init = (jnp.zeros((batch,), bool), zeros_i, zeros_f, zeros_f, zeros_f, zeros_i)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[:, None], (length, batch))
    _, ys_TB = jax.lax.scan(step, init, (positions, adv_tok.T, weights.T, mask.T))
    return tuple(y.T for y in ys_TB)


def _segment_advantages(rewards, values, mask, is_start, gamma, lam):
    """Backward scan over t (batched over B), step 3 of the module docstring; A_k at each a_k.

    Carries per row, for the segment being walked back from its end e_k: R (discounted reward
    sum from t to e_k), gamma^n and (gamma lam)^n (n = valid tokens from t to e_k), and from the
    segment after it: V[a_{k+1}] and A_{k+1} (both 0 past the last segment). At a valid start
    a_k the segment closes: A_k is emitted and the carries reset for segment k-1. Masked
    positions pass every carry through. Returns [B, T]: A_k at a_k, 0 elsewhere.
    """

    def step(carry, xs):
        ret, disc, disc_lam, next_value, next_adv = carry
        reward, value, valid, start = xs
        ret = reward + gamma * ret
        disc = gamma * disc
        disc_lam = gamma * lam * disc_lam
        adv = ret + disc * next_value - value + disc_lam * next_adv
        close = (valid != 0) & start
        grow = (valid != 0) & ~start
        one, zero = jnp.ones_like(ret), jnp.zeros_like(ret)
        carry = (
            jnp.where(close, zero, jnp.where(grow, ret, carry[0])),
            jnp.where(close, one, jnp.where(grow, disc, carry[1])),
            jnp.where(close, one, jnp.where(grow, disc_lam, carry[2])),
            jnp.where(close, value, next_value),
            jnp.where(close, adv, next_adv),
        )
        return carry, jnp.where(close, adv, 0.0)

    batch = rewards.shape[0]
    zeros, ones = jnp.zeros((batch,), jnp.float32), jnp.ones((batch,), jnp.float32)
    xs = (rewards.T, values.T, mask.T, is_start.T)
    _, adv_TB = jax.lax.scan(step, (zeros, ones, ones, zeros, zeros), xs, reverse=True)
    return adv_TB.T


def group_ppo(
    *, token_level_rewards, response_mask, values, old_log_prob, threshold, gamma, lam, params
) -> GroupPPOOutput:
    """GROUP-PPO advantages, returns and critic mask (steps 1-4 of the module docstring).

    Args (all [B, T] except threshold; garbage where response_mask == 0 is ignored):
      token_level_rewards r, response_mask m, values V (V[:, t] read before token t),
      old_log_prob (log-probs of the rollout policy; w_t = (1 - exp(old_log_prob_t))^2),
      threshold tau: float32 scalar (the train state's; `init_threshold` at the start),
      gamma, lam: discount and GAE lambda; params: `GroupParams` (`group_params(algorithm)`).

    Metrics (float32 scalars):
      group/total_endpoints   K = number of segments in the batch (= sum of critic_mask)
      group/compression_ratio 1 - K / (valid tokens)               (0 for an empty batch)
      group/mean_segment_len  (valid tokens) / K                   (0 for an empty batch)
      group/threshold         the tau used here
      group/rho_mean          mean of rho_t over every tentative addition evaluated, i.e. over
                              all valid tokens except each row's first, whether or not t then
                              started a new segment (0 when there is none)
    """
    p = params
    mask = jnp.asarray(response_mask, jnp.float32)
    rewards = zero_masked(jnp.asarray(token_level_rewards, jnp.float32), mask)
    values = zero_masked(jnp.asarray(values, jnp.float32), mask)
    old_log_prob = zero_masked(jnp.asarray(old_log_prob, jnp.float32), mask)
    tau = jnp.asarray(threshold, jnp.float32)

    adv_tok = recurrences.gae_advantages(rewards, mask, values, gamma, lam)
    weights = jnp.square(1.0 - jnp.exp(old_log_prob))
    is_start, start_pos, rho, evaluated = _segment_starts(
        adv_tok, weights, mask, tau, p.group_max_size, p.group_epsilon
    )
    adv_at_start = _segment_advantages(rewards, values, mask, is_start, gamma, lam)
    seg_adv = zero_masked(jnp.take_along_axis(adv_at_start, start_pos, axis=1), mask)
    seg_returns = seg_adv + jnp.take_along_axis(values, start_pos, axis=1)

    critic_mask = jnp.where(is_start, 1.0, 0.0)
    segments, tokens = jnp.sum(critic_mask), jnp.sum(mask)
    tried = jnp.sum(evaluated.astype(jnp.float32))
    metrics = {
        "group/total_endpoints": segments,
        "group/compression_ratio": jnp.where(
            tokens > 0, 1.0 - segments / jnp.maximum(tokens, 1.0), 0.0
        ),
        "group/mean_segment_len": jnp.where(segments > 0, tokens / jnp.maximum(segments, 1.0), 0.0),
        "group/threshold": tau,
        "group/rho_mean": jnp.sum(rho) / jnp.maximum(tried, 1.0),
    }
    out = GroupPPOOutput(
        advantages=zero_masked(masked_whiten(seg_adv, mask), mask),
        returns=zero_masked(seg_returns, mask),
        critic_mask=critic_mask,
        metrics=metrics,
        segment_advantages=seg_adv,
        token_returns=zero_masked(adv_tok + values, mask),
        rho=rho,
    )
    return jax.lax.stop_gradient(out)
