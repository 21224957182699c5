"""Policy losses (a registry picked by `actor.policy_loss`), loss aggregation, value loss, entropy.

Numerically the same as verl 0.9.1 (`verl/trainer/ppo/core_algos.py`). Arrays are batch-major
[B, T]; position t is action t (the response token y_{t+1}): `log_prob[:, t]` = log pi(y_{t+1} |
prompt, y_1..y_t), `advantages[:, t]` belongs to that action. Write

    log_ratio = log_prob - old_log_prob,  ratio = exp(log_ratio),
        A = advantages,  m = response_mask.

The function `make_policy_loss` returns zeroes every input where m == 0 before the loss sees it,
so garbage on padding never reaches the loss, the metrics, or the gradient (d loss / d log_prob is
exactly 0 there).

Micro-batches (verl 0.9.1's global batch info): `counts` = `batch_counts(mask of the whole
mini-batch)` makes every aggregate and every metric of a micro-batch its share of the mini-batch's
value (normalised by the mini-batch's token / sequence / row counts), so summing micro-batches
gives exactly the loss, gradient and metrics of the whole mini-batch. Without `counts` the
(micro-)batch is its own whole. Exceptions, as in verl: clip_cov's and kl_cov's token statistics
(covariance means, how many tokens to pick) are those of each micro-batch.

Every policy loss returns the same metric keys (verl's names), 0 where a loss has no such quantity:
  actor/pg_clipfrac        fraction of valid tokens whose loss was clipped (loss-specific, below)
  actor/ppo_kl             masked_mean(old_log_prob - log_prob)  (kl_cov: masked_mean(|log_ratio|))
  actor/pg_clipfrac_lower  fraction of valid tokens hit by the dual clip (vanilla) / clipped with
                           A < 0 (geo_mean)

`make_policy_loss(actor, rollout_correction)` binds every loss parameter once
(`policy_loss_params`) from the actor config section: clip_ratio_low / clip_ratio_high (None ->
clip_ratio, verl's rule), clip_ratio_c, loss_scale_factor (0 / None -> T), tau_pos, tau_neg,
clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, dro_beta, and the parsed
rollout-correction settings (bypass_mode). Defaults and comments:
jrl.config.schema.base_config. verl nests the clip_cov / kl_cov ones under `actor.policy_loss`; in
jrl `actor.policy_loss` is the loss name, so they sit directly in the actor section.
"""

import functools
from typing import Callable, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

from jrl.algos import EPS_MEAN, check_positive, masked_mean, masked_sum, rollout_corr, zero_masked
from jrl.registry import Registry

METRIC_KEYS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
LOG_RATIO_CLAMP = 20.0  # |log_ratio| bound before exp in vanilla / sapo / cispo
GSPO_LOG_RATIO_MAX = 10.0  # upper bound on GSPO's token log-ratio

# ----------------------------------------------------------------------------- aggregation


def batch_counts(loss_mask) -> dict[str, jax.Array]:
    """The normalisers of a (mini-)batch's mask [B, T]: valid `tokens`, `seqs` (rows with at least
    one valid token) and `rows` (B), float32 scalars."""
    loss_mask = jnp.asarray(loss_mask, jnp.float32)
    return {
        "tokens": jnp.sum(loss_mask),
        "seqs": jnp.sum(jnp.sum(loss_mask, axis=-1) > 0).astype(jnp.float32),
        "rows": jnp.float32(loss_mask.shape[0]),
    }


def _mean_over_rows_with_tokens(row_losses, loss_mask, counts):
    """Sum of row_losses [B] over the rows with a valid token / counts' `seqs` (0 if none)."""
    has_tokens = jnp.sum(loss_mask, axis=-1) > 0
    return jnp.sum(jnp.where(has_tokens, row_losses, 0.0)) / jnp.maximum(counts["seqs"], 1)


def _token_mean(loss_mat, loss_mask, loss_scale_factor, counts):
    """sum(l * m) / sum(m) over the whole (mini)batch; 0 for an empty mask (verl: NaN)."""
    del loss_scale_factor
    n_tokens = counts["tokens"]
    return masked_sum(loss_mat, loss_mask) / jnp.where(n_tokens > 0, n_tokens, 1.0)


def _seq_mean_token_sum(loss_mat, loss_mask, loss_scale_factor, counts):
    """Mean over rows with a valid token of sum_t(l * m)."""
    del loss_scale_factor
    row_sums = masked_sum(loss_mat, loss_mask, axis=-1)
    return _mean_over_rows_with_tokens(row_sums, loss_mask, counts)


def _seq_mean_token_mean(loss_mat, loss_mask, loss_scale_factor, counts):
    """Mean over rows with a valid token of sum_t(l * m) / (sum_t(m) + 1e-8)."""
    del loss_scale_factor
    row_means = masked_sum(loss_mat, loss_mask, axis=-1) / (jnp.sum(loss_mask, axis=-1) + 1e-8)
    return _mean_over_rows_with_tokens(row_means, loss_mask, counts)


def _seq_mean_token_sum_norm(loss_mat, loss_mask, loss_scale_factor, counts):
    """seq-mean-token-sum (the mean over rows with a valid token of sum_t(l * m)) divided by
    loss_scale_factor (None -> T, the padded response length), as verl 0.9.1. Keep the factor
    constant through a run (Dr.GRPO's constant normaliser)."""
    scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _seq_mean_token_sum(loss_mat, loss_mask, None, counts) / scale


def _token_sum(loss_mat, loss_mask, loss_scale_factor, counts):
    """sum(l * m) over the whole (mini)batch: no normaliser, so micro-batch sums add up as is."""
    del loss_scale_factor, counts
    return masked_sum(loss_mat, loss_mask)


AGG_MODES = Registry(
    "loss_agg_mode",
    {
        "token-mean": _token_mean,
        "token-sum": _token_sum,
        "seq-mean-token-sum": _seq_mean_token_sum,
        "seq-mean-token-mean": _seq_mean_token_mean,
        "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    },
)


def loss_agg_modes() -> list[str]:
    """Sorted names accepted as `loss_agg_mode`."""
    return AGG_MODES.names()


def agg_loss(
    loss_mat,
    loss_mask,
    loss_agg_mode: str,
    loss_scale_factor: Optional[float] = None,
    counts: Optional[dict] = None,
):
    """Aggregates a per-token loss [B, T] into a scalar; `loss_agg_mode` is static:
    token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    (see above).
    Entries where loss_mask == 0 never contribute, whatever their value. `counts`
    (`batch_counts` of the whole mini-batch) normalise a micro-batch's share; None: this batch's."""
    aggregate = AGG_MODES.get(loss_agg_mode)
    chex.assert_equal_shape([loss_mat, loss_mask])
    loss_mask = jnp.asarray(loss_mask, jnp.float32)
    counts = batch_counts(loss_mask) if counts is None else counts
    return aggregate(loss_mat, loss_mask, loss_scale_factor, counts)


def token_mean(x, mask, counts: Optional[dict] = None):
    """masked_mean(x, mask) = sum(x * m) / (sum(m) + 1e-8), with the token count of `counts` (the
    whole mini-batch's) when given: a micro-batch's share of the mini-batch's mean."""
    n_tokens = jnp.sum(mask) if counts is None else counts["tokens"]
    return masked_sum(x, mask) / (n_tokens + EPS_MEAN)


# ----------------------------------------------------------------------------- policy losses

PolicyLoss = Callable[..., tuple[jax.Array, dict]]
POLICY_LOSSES = Registry("policy loss")


class LossInput(NamedTuple):
    """What a policy loss is called with besides its settings (`_policy_loss` builds it): the
    arrays [B, T] in float32, 0 where response_mask == 0, and the helpers bound to this batch."""

    old_log_prob: jax.Array
    log_prob: jax.Array
    advantages: jax.Array
    response_mask: jax.Array  # float32
    # aggregate(loss_mat) multiplies by the rollout-correction IS weights (when given) and applies
    # the caller's loss_agg_mode; aggregate(loss_mat, mode=...) another mode,
    # aggregate(..., weighted=False) without the weights, aggregate(..., loss_mask=...) another mask
    aggregate: Callable[..., jax.Array]
    mean: Callable[[jax.Array], jax.Array]  # masked token mean, for metrics
    counts: dict  # the mini-batch's `batch_counts`
    key: Optional[jax.Array]  # a PRNG key (clip_cov) or None
    rollout_is_weights: Optional[jax.Array]  # [B, T], no gradient, or None


# `@register_policy_loss("name")` on `fn(x: LossInput, **params) -> (loss, metrics)`, `params`
# being those of `policy_loss_params` (name the ones the loss reads, take `**_` for the rest).
# `x.aggregate`, `x.mean` and `x.counts` all normalise by the whole mini-batch (module doc).
# Metrics may omit keys of METRIC_KEYS (they are reported as 0); other keys are passed through as
# a micro-batch's share of their mean over micro-batches (verl averages them).
register_policy_loss = POLICY_LOSSES.register


def policy_loss_names() -> list[str]:
    """Sorted names of the registered policy losses."""
    return POLICY_LOSSES.names()


def policy_loss_params(actor, rollout_correction) -> dict:
    """Every policy-loss parameter, bound from the `actor` and `algorithm.rollout_correction`
    config sections (each field must be present; defaults and comments in
    jrl.config.schema.base_config).
    clip_ratio_low / clip_ratio_high: the field, or actor.clip_ratio where it is None (verl).
    rollout_correction: `rollout_corr.settings` of the section when it is enabled, else None."""
    low, high = actor.clip_ratio_low, actor.clip_ratio_high
    return {
        "clip_ratio_low": actor.clip_ratio if low is None else low,
        "clip_ratio_high": actor.clip_ratio if high is None else high,
        "clip_ratio_c": actor.clip_ratio_c,
        "loss_scale_factor": actor.loss_scale_factor or None,  # 0 / None: T
        "tau_pos": actor.tau_pos,
        "tau_neg": actor.tau_neg,
        "clip_cov_ratio": actor.clip_cov_ratio,
        "clip_cov_lb": actor.clip_cov_lb,
        "clip_cov_ub": actor.clip_cov_ub,
        "kl_cov_ratio": actor.kl_cov_ratio,
        "ppo_kl_coef": actor.ppo_kl_coef,
        "dro_beta": actor.dro_beta,
        "rollout_correction": (
            rollout_corr.settings(rollout_correction) if rollout_correction.enable else None
        ),
    }


def make_policy_loss(actor, rollout_correction) -> Callable[..., tuple[jax.Array, dict]]:
    """The policy loss named by `actor.policy_loss`, aggregated with `actor.loss_agg_mode`, every
    parameter bound from `actor` and `rollout_correction` (cfg.algorithm.rollout_correction):

        fn(old_log_prob, log_prob, advantages, response_mask, *, counts=None,
           rollout_is_weights=None, key=None) -> (scalar loss, metrics)

    All arrays [B, T]. `counts`: `batch_counts` of the whole mini-batch when this is one of its
    micro-batches (module doc). `rollout_is_weights` [B, T] (rollout correction, no gradient):
    every token loss is multiplied by its weight before aggregation (geo_mean: by the row's
    geometric mean of the weights; bypass_mode computes its own and ignores these), as verl.
    `key`: a PRNG key, used by `clip_cov` for its random choice of tokens (as verl); losses that
    need no key ignore it (clip_cov without one is deterministic, see its docstring).
    """
    loss_fn = POLICY_LOSSES.get(actor.policy_loss)
    loss_agg_mode = actor.loss_agg_mode
    AGG_MODES.get(loss_agg_mode)
    params = policy_loss_params(actor, rollout_correction)

    def policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        *,
        counts=None,
        rollout_is_weights=None,
        key=None,
    ):
        return _policy_loss(
            loss_fn,
            params,
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            key=key,
            counts=counts,
            rollout_is_weights=rollout_is_weights,
        )

    return policy_loss


def _policy_loss(
    loss_fn,
    params: dict,
    *,
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    loss_agg_mode: str,
    key: Optional[jax.Array],
    counts: Optional[dict],
    rollout_is_weights: Optional[jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(scalar loss, metrics) of `loss_fn` with its bound `params` (see `make_policy_loss`)."""
    mask = jnp.asarray(response_mask, jnp.float32)
    chex.assert_rank(mask, 2)
    chex.assert_equal_shape([mask, old_log_prob, log_prob, advantages])
    old_log_prob, log_prob, advantages = (
        zero_masked(jnp.asarray(x, jnp.float32), mask) for x in (old_log_prob, log_prob, advantages)
    )
    if rollout_is_weights is not None:
        chex.assert_equal_shape([mask, rollout_is_weights])
        rollout_is_weights = jax.lax.stop_gradient(
            zero_masked(jnp.asarray(rollout_is_weights, jnp.float32), mask)
        )
    counts = batch_counts(mask) if counts is None else counts
    scale_factor = params["loss_scale_factor"]

    def aggregate(loss_mat, mode=loss_agg_mode, weighted=True, loss_mask=mask):
        if weighted and rollout_is_weights is not None:
            loss_mat = loss_mat * rollout_is_weights
        return agg_loss(loss_mat, loss_mask, mode, scale_factor, counts)

    x = LossInput(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        aggregate,
        functools.partial(token_mean, mask=mask, counts=counts),
        counts,
        key,
        rollout_is_weights,
    )
    loss, metrics = loss_fn(x, **params)
    share = mask.shape[0] / counts["rows"]  # this micro-batch's share of the mini-batch's rows
    out = {k: jnp.asarray(metrics.get(k, 0.0), jnp.float32) for k in METRIC_KEYS}
    out.update({k: v * share for k, v in metrics.items() if k not in METRIC_KEYS})
    return loss, jax.lax.stop_gradient(out)


def _ppo_clip_terms(advantages, ratio, low, high):
    """The two PPO terms l1 = -A * ratio, l2 = -A * clip(ratio, 1 - low, 1 + high)."""
    return -advantages * ratio, -advantages * jnp.clip(ratio, 1.0 - low, 1.0 + high)


def _ppo_kl(log_ratio, mean):
    """mean(old_log_prob - log_prob) over valid tokens: the sample KL(old || new) verl logs."""
    return mean(-log_ratio)


@register_policy_loss("vanilla")
def vanilla(x: LossInput, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, **_):
    """PPO clip (Schulman et al. 2017, arXiv:1707.06347) with asymmetric clip ranges (DAPO,
    arXiv:2503.14476) and dual clip (Ye et al. 2019, arXiv:1912.09729).

        ratio = exp(clip(log_ratio, -20, 20))
        l1 = -A ratio;  l2 = -A clip(ratio, 1 - eps_low, 1 + eps_high);  c1 = max(l1, l2)
        l3 = -A clip_ratio_c;  loss_t = min(l3, c1) if A < 0 else c1;
            aggregated with loss_agg_mode.
    pg_clipfrac = mean_m(l2 > l1); pg_clipfrac_lower = mean_m(c1 > l3 and A < 0).
    Parameters: clip_ratio_low, clip_ratio_high, clip_ratio_c (must be > 1).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}.")
    log_ratio = jnp.clip(x.log_prob - x.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    l1, l2 = _ppo_clip_terms(x.advantages, jnp.exp(log_ratio), clip_ratio_low, clip_ratio_high)
    clipped = jnp.maximum(l1, l2)
    l3 = -x.advantages * clip_ratio_c
    losses = jnp.where(x.advantages < 0, jnp.minimum(l3, clipped), clipped)
    metrics = {
        "actor/pg_clipfrac": x.mean((l2 > l1).astype(jnp.float32)),
        "actor/ppo_kl": _ppo_kl(log_ratio, x.mean),
        "actor/pg_clipfrac_lower": x.mean(
            ((clipped > l3) & (x.advantages < 0)).astype(jnp.float32)
        ),
    }
    return x.aggregate(losses), metrics


def _dppo(x: LossInput, keep, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, **_):
    """DPPO's shared body: a TIS-truncated, detached ratio times -A log_prob on the tokens the
    divergence test `keep(log_prob, old_log_prob, eps_low, eps_high) -> (keep if A > 0, keep if
    A <= 0)` keeps."""
    log_ratio = jnp.clip(x.log_prob - x.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    truncated = jax.lax.stop_gradient(jnp.minimum(ratio, clip_ratio_c))
    keep_pos, keep_neg = keep(x.log_prob, x.old_log_prob, clip_ratio_low, clip_ratio_high)
    valid = jnp.where(x.advantages > 0, keep_pos, keep_neg).astype(jnp.float32)
    valid = jax.lax.stop_gradient(valid)
    losses = -x.advantages * truncated * x.log_prob * valid
    metrics = {
        "actor/pg_clipfrac": x.mean(1.0 - valid),
        "actor/ppo_kl": _ppo_kl(log_ratio, x.mean),
        "actor/pg_clipfrac_lower": x.mean((ratio > clip_ratio_c).astype(jnp.float32) * valid),
    }
    return x.aggregate(losses), metrics


@register_policy_loss("dppo_tv")
def dppo_tv(x: LossInput, **params):
    """DPPO-Binary-TV, divergence-constrained PPO (arXiv:2602.04879).

        ratio = exp(clip(log_ratio, -20, 20));  w = sg(min(ratio, clip_ratio_c))
            (TIS, no dual clip)
        keep_t = (p_t - p_old_t <= eps_high) if A_t > 0 else (p_t - p_old_t >= -eps_low),
            p = exp(log_prob)
        loss_t = -A_t w_t log_prob_t keep_t, aggregated with loss_agg_mode
    clip_ratio / clip_ratio_low / clip_ratio_high are total-variation bounds on the token
    probability here, not ratio bounds. pg_clipfrac = mean_m(1 - keep); pg_clipfrac_lower =
    mean_m(ratio > clip_ratio_c and keep). Parameters: clip_ratio_low, clip_ratio_high,
    clip_ratio_c.
    """

    def keep(log_prob, old_log_prob, low, high):
        diff = jnp.exp(log_prob) - jnp.exp(old_log_prob)
        return diff <= high, diff >= -low

    return _dppo(x, keep, **params)


@register_policy_loss("dppo_kl")
def dppo_kl(x: LossInput, **params):
    """DPPO-Binary-KL (arXiv:2602.04879): as dppo_tv with the binary KL of the token event
        d_t = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    keep_t = (d_t <= eps_high or p <= p_old) if A_t > 0 else (d_t <= eps_low or p >= p_old).
    Parameters: clip_ratio_low, clip_ratio_high (KL bounds here), clip_ratio_c.
    """

    def keep(log_prob, old_log_prob, low, high):
        prob, old_prob = jnp.exp(log_prob), jnp.exp(old_log_prob)
        d = old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * jnp.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        return (d <= high) | (prob <= old_prob), (d <= low) | (prob >= old_prob)

    return _dppo(x, keep, **params)


@register_policy_loss("dro")
def dro(x: LossInput, *, dro_beta, **_):
    """Direct reward optimisation with a quadratic log-ratio penalty (Richemond et al. 2024,
    arXiv:2405.19107):  loss_t = -(log_prob_t A_t - 0.5 dro_beta log_ratio_t^2), aggregated with
    loss_agg_mode. No clipping. Parameters: dro_beta (> 0)."""
    beta = check_positive("dro_beta", dro_beta)
    log_ratio = x.log_prob - x.old_log_prob
    losses = -(x.log_prob * x.advantages - 0.5 * beta * jnp.square(log_ratio))
    return x.aggregate(losses), {"actor/ppo_kl": _ppo_kl(log_ratio, x.mean)}


@register_policy_loss("bypass_mode")
def bypass_mode(x: LossInput, *, rollout_correction, **params):
    """Bypass mode of rollout correction (verl 0.9.1): old_log_prob IS the rollout's log-prob (the
    old-log-prob forward is skipped). IS weights and the rejection mask are computed here from
    sg(log_prob) vs old_log_prob (`jrl.algos.rollout_corr.correct` with the parsed
    `rollout_correction` settings; the section must be enabled), then with m' = the
    rejection-masked response_mask:
      loss_type ppo_clip:   `vanilla` on m' (its ratio already corrects; no IS weights)
      loss_type reinforce:  loss_t = -A_t log_prob_t w_t on m'; actor/ppo_kl = mean_m'(old - new)
    Aggregation normalises by the mini-batch's counts before rejection (verl's global batch
    info). Metrics also carry rollout_corr/* of the evolving policy (averaged over micro-batches).
    Caller-given rollout_is_weights are ignored.
    """
    if rollout_correction is None:
        raise ValueError(
            "policy loss 'bypass_mode' needs algorithm.rollout_correction.enable=True"
            " (and bypass_mode)."
        )
    parsed = rollout_correction
    weights, kept, corr_metrics = rollout_corr.correct(
        x.log_prob, x.old_log_prob, x.response_mask, parsed
    )
    share = x.response_mask.shape[0] / x.counts["rows"]  # verl averages metrics over micro-batches
    kept_mean = lambda v: masked_mean(v, kept) * share  # noqa: E731
    if parsed["loss_type"] == "reinforce":
        losses = -x.advantages * x.log_prob * (1.0 if weights is None else weights)
        loss = x.aggregate(losses, weighted=False, loss_mask=kept)
        metrics = {"actor/ppo_kl": kept_mean(x.old_log_prob - x.log_prob)}
    else:
        aggregate = functools.partial(x.aggregate, weighted=False, loss_mask=kept)
        loss, metrics = vanilla(x._replace(aggregate=aggregate, mean=kept_mean), **params)
    return loss, {**metrics, **corr_metrics}


@register_policy_loss("gspo")
def gspo(x: LossInput, *, clip_ratio_low, clip_ratio_high, **_):
    """GSPO, group sequence policy optimisation (Zheng et al. 2025, arXiv:2507.18071).

        s_b = sum_t(log_ratio * m) / max(|y_b|, 1)          (sequence log-ratio, length-normalised)
        log r_t = log_prob_t - sg(log_prob_t) + sg(s_b), clamped above at 10
        loss_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))
    The value of r_t is exp(s_b) on every token; its gradient is r_t d log_prob_t. Aggregated
    with the caller's loss_agg_mode (verl 0.9.1; the paper and older verl use seq-mean-token-mean,
    so set actor.loss_agg_mode=seq-mean-token-mean for the paper's objective).
    pg_clipfrac = mean_m(l2 > l1). Parameters: clip_ratio_low, clip_ratio_high.
    """
    log_ratio = x.log_prob - x.old_log_prob
    lengths = jnp.maximum(jnp.sum(x.response_mask, axis=-1), 1.0)
    seq_log_ratio = masked_sum(log_ratio, x.response_mask, axis=-1) / lengths
    token_log_ratio = (
        x.log_prob
        - jax.lax.stop_gradient(x.log_prob)
        + jax.lax.stop_gradient(seq_log_ratio)[:, None]
    )
    ratio = jnp.exp(jnp.minimum(token_log_ratio, GSPO_LOG_RATIO_MAX))
    l1, l2 = _ppo_clip_terms(x.advantages, ratio, clip_ratio_low, clip_ratio_high)
    loss = x.aggregate(jnp.maximum(l1, l2))
    metrics = {
        "actor/pg_clipfrac": x.mean((l2 > l1).astype(jnp.float32)),
        "actor/ppo_kl": _ppo_kl(log_ratio, x.mean),
    }
    return loss, metrics


@register_policy_loss("geo_mean")
def geo_mean(x: LossInput, *, clip_ratio_low, clip_ratio_high, **_):
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv:2507.20673).

    Token log-ratios are clipped one-sidedly by the sign of A, then averaged per sequence:
        c_t = clip(log_ratio_t, -eps_low, eps_high);
            k_t = sign(A_t) min(sign(A_t) log_ratio_t, sign(A_t) c_t)
        R_b = exp(sum_t(k_t m) / (|y_b| + 1e-8));  A_b = sum_t(A_t m) / (|y_b| + 1e-8)
        loss = mean over all B rows of -A_b R_b w_b       (loss_agg_mode is ignored, as in verl)
    with rollout IS weights w [B, T]: w_b = exp(sum_t(log(w_t + 1e-10) m) / (|y_b| + 1e-8)) (their
    geometric mean over the row); without them w_b = 1.
    pg_clipfrac = mean_m(log_ratio != c and A > 0); pg_clipfrac_lower = same with A < 0.
    Parameters: clip_ratio_low, clip_ratio_high.
    """
    low, high = clip_ratio_low, clip_ratio_high
    log_ratio = x.log_prob - x.old_log_prob
    clamped = jnp.clip(log_ratio, -low, high)
    sign = jnp.sign(x.advantages)
    pessimistic = sign * jnp.minimum(sign * log_ratio, sign * clamped)
    lengths = jnp.sum(x.response_mask, axis=-1) + 1e-8
    seq_ratio = jnp.exp(masked_sum(pessimistic, x.response_mask, axis=-1) / lengths)
    seq_adv = masked_sum(x.advantages, x.response_mask, axis=-1) / lengths
    row_losses = -seq_adv * seq_ratio
    if x.rollout_is_weights is not None:
        log_w = masked_sum(jnp.log(x.rollout_is_weights + 1e-10), x.response_mask, axis=-1)
        row_losses = row_losses * jnp.exp(log_w / lengths)
    loss = jnp.sum(row_losses) / x.counts["rows"]  # the mean over the mini-batch's rows
    was_clipped = log_ratio != clamped
    metrics = {
        "actor/pg_clipfrac": x.mean((was_clipped & (x.advantages > 0)).astype(jnp.float32)),
        "actor/ppo_kl": _ppo_kl(log_ratio, x.mean),
        "actor/pg_clipfrac_lower": x.mean((was_clipped & (x.advantages < 0)).astype(jnp.float32)),
    }
    return loss, metrics


@register_policy_loss("sapo")
def sapo(x: LossInput, *, tau_pos, tau_neg, **_):
    """SAPO, soft adaptive policy optimisation (arXiv:2511.20347): a smooth sigmoid gate instead of
    a hard clip.

        ratio = exp(clip(log_ratio, -20, 20));  tau_t = tau_pos if A_t > 0 else tau_neg
        loss_t = -A_t * sigmoid(tau_t (ratio_t - 1)) * 4 / tau_t
    Always aggregated with seq-mean-token-mean (loss_agg_mode is ignored, as in verl).
    No clip fractions (reported 0). Parameters: tau_pos, tau_neg.
    """
    log_ratio = jnp.clip(x.log_prob - x.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tau = jnp.where(x.advantages > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss = x.aggregate(-gate * x.advantages, mode="seq-mean-token-mean")
    return loss, {"actor/ppo_kl": _ppo_kl(log_ratio, x.mean)}


@register_policy_loss("cispo")
def cispo(x: LossInput, *, clip_ratio_low, clip_ratio_high, **_):
    """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, arXiv:2506.13585).

        ratio = exp(clip(log_ratio, -20, 20));  w = sg(clip(ratio, 1 - eps_low, 1 + eps_high))
        loss_t = -w A_t log_prob_t, aggregated with loss_agg_mode
    Every token keeps a gradient (w is a constant weight).
    pg_clipfrac = mean_m(ratio != clip(ratio)). Parameters: clip_ratio_low, clip_ratio_high.
    """
    low, high = clip_ratio_low, clip_ratio_high
    log_ratio = jnp.clip(x.log_prob - x.old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    weight = jnp.clip(ratio, 1.0 - low, 1.0 + high)
    losses = -jax.lax.stop_gradient(weight) * x.advantages * x.log_prob
    metrics = {
        "actor/pg_clipfrac": x.mean((ratio != weight).astype(jnp.float32)),
        "actor/ppo_kl": _ppo_kl(log_ratio, x.mean),
    }
    return x.aggregate(losses), metrics


@register_policy_loss("gpg")
def gpg(x: LossInput, **_):
    """GPG, group policy gradient (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE,
    loss_t = -log_prob_t A_t, aggregated with loss_agg_mode. No clipping (clip fractions 0).
    verl reports no metrics here; jrl still reports actor/ppo_kl (it is well defined)."""
    return x.aggregate(-x.log_prob * x.advantages), {
        "actor/ppo_kl": _ppo_kl(x.log_prob - x.old_log_prob, x.mean)
    }


def _top_ranked(score_BT, count):
    """Boolean [B, T]: the `count` (traced int) entries with the highest score; ties go to the
    lower row-major position. Entries with score -inf are ranked last (select them by masking)."""
    flat = score_BT.reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return (rank < count).reshape(score_BT.shape)


def _covariance(advantages, log_prob, mask, mean):
    """Per-token centred product (A - mean(A)) * (sg(log_prob) - mean(sg(log_prob)))."""
    log_prob = jax.lax.stop_gradient(log_prob)
    return (advantages - mean(advantages)) * (log_prob - mean(log_prob))


@register_policy_loss("clip_cov")
def clip_cov(
    x: LossInput, *, clip_ratio_low, clip_ratio_high, clip_cov_ratio, clip_cov_lb, clip_cov_ub, **_
):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617).

        l1, l2 as in PPO with ratio = exp(log_ratio) (no clamp); loss_t = max(l1, l2) * corr_t
        cov_t = (A_t - mean_m(A)) (log_prob_t - mean_m(log_prob))      (no gradient)
        candidates: valid tokens not already clipped by PPO (l2 <= l1) with lb < cov_t < ub
        corr_t = 0 (token detached from the loss) for min(n_clip, #candidates) of the candidates,
        n_clip = max(floor(clip_cov_ratio * #valid tokens), 1); 1 elsewhere.
    Which candidates: verl draws them uniformly at random (torch.randperm). jrl does the same when
    `key` is given; with key=None it deterministically takes the candidates with the largest
    covariance (ties to the lower position).
    pg_clipfrac = mean_m(corr == 0). Parameters: clip_ratio_low, clip_ratio_high, clip_cov_ratio,
    clip_cov_lb, clip_cov_ub.
    """
    ratio_of_tokens = check_positive("clip_cov_ratio", clip_cov_ratio)
    valid = x.response_mask != 0
    log_ratio = x.log_prob - x.old_log_prob
    l1, l2 = _ppo_clip_terms(x.advantages, jnp.exp(log_ratio), clip_ratio_low, clip_ratio_high)
    cov = _covariance(
        x.advantages, x.log_prob, x.response_mask, lambda v: masked_mean(v, x.response_mask)
    )
    candidate = valid & ~(l2 > l1) & (cov < clip_cov_ub) & (cov > clip_cov_lb)
    n_clip = jnp.maximum(jnp.floor(ratio_of_tokens * jnp.sum(valid)), 1.0)
    priority = cov if x.key is None else jax.random.uniform(x.key, cov.shape)
    detached = candidate & _top_ranked(jnp.where(candidate, priority, -jnp.inf), n_clip)
    losses = jnp.where(detached, 0.0, jnp.maximum(l1, l2))
    metrics = {
        "actor/pg_clipfrac": x.mean(detached.astype(jnp.float32)),
        "actor/ppo_kl": _ppo_kl(log_ratio, x.mean),
    }
    return x.aggregate(losses), metrics


@register_policy_loss("kl_cov")
def kl_cov(x: LossInput, *, kl_cov_ratio, ppo_kl_coef, **_):
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617).

        ratio = exp(log_ratio) (no clamp);  loss_t = -A_t ratio_t, except on the k valid tokens of
        largest cov_t = (A_t - mean(A)) (log_prob_t - mean(log_prob)) (means over valid tokens, no
        gradient), where loss_t = -A_t ratio_t + ppo_kl_coef |log_ratio_t|;
        k = max(floor(kl_cov_ratio * #valid tokens), 1) (0 if there are none).
    Deterministic top-k; ties go to the lower position. Note: actor/ppo_kl is
    masked_mean(|log_ratio|) here, as verl reports it. Parameters: kl_cov_ratio, ppo_kl_coef.
    """
    ratio_of_tokens = check_positive("kl_cov_ratio", kl_cov_ratio)
    valid = x.response_mask != 0
    n_valid = jnp.sum(valid)
    log_ratio = x.log_prob - x.old_log_prob
    abs_kl = jnp.abs(log_ratio)
    l1 = -x.advantages * jnp.exp(log_ratio)
    cov = _covariance(
        x.advantages,
        x.log_prob,
        x.response_mask,
        lambda v: masked_sum(v, valid) / jnp.maximum(n_valid, 1),
    )
    k = jnp.maximum(jnp.floor(ratio_of_tokens * n_valid), 1.0)
    penalised = valid & _top_ranked(jnp.where(valid, cov, -jnp.inf), k)
    losses = jnp.where(penalised, l1 + ppo_kl_coef * abs_kl, l1)
    return x.aggregate(losses), {"actor/ppo_kl": x.mean(abs_kl)}


# ----------------------------------------------------------------------------- value, entropy


def value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode, counts=None):
    """Clipped value loss (PPO critic). All [B, T]; position t is V(s_{t+1}) of action t.

        v_clip = clip(vpreds, values - c, values + c),  c = cliprange_value
        loss = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2)),  R = returns
    Returns (loss, vf_clipfrac = mean_m((v_clip - R)^2 > (vpreds - R)^2)); with `counts` (of the
    whole mini-batch) both are a micro-batch's share.
    """
    mask = jnp.asarray(response_mask, jnp.float32)
    chex.assert_equal_shape([vpreds, returns, values, mask])
    vpreds, returns, values = (
        zero_masked(jnp.asarray(x, jnp.float32), mask) for x in (vpreds, returns, values)
    )
    vpreds_clipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = jnp.square(vpreds - returns)
    clipped = jnp.square(vpreds_clipped - returns)
    loss = 0.5 * agg_loss(jnp.maximum(unclipped, clipped), mask, loss_agg_mode, None, counts)
    return loss, token_mean((clipped > unclipped).astype(jnp.float32), mask, counts)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) over the last axis, in float32: H = -sum_v p_v log p_v.

    Computed from log_softmax (max-shifted), so large logits do not overflow, and entries with
    p = 0 (e.g. logits of -inf) contribute exactly 0 to the value and the gradient.
    """
    log_p = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    p = jnp.exp(log_p)
    return -jnp.sum(p * jnp.where(p > 0, log_p, 0.0), axis=-1)
