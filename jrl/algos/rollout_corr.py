"""Rollout correction: importance-sampling weights and rejection masks between the rollout
policy's log-probs and the trainer's (verl 0.9.1's `algorithm.rollout_correction`,
`verl/trainer/ppo/rollout_corr_helper.py`).

The rollout samples with its own KV-cache forward (and, under bfloat16, its own rounding), so its
log-probs pi_rollout differ from the trainer's recomputed pi_old. With
log_ratio = log pi_old - log pi_rollout per token (m = response_mask):

IS weights (`rollout_is`):
  token:     w_t = exp(clip(log_ratio_t, -20, 20)) * m_t
  sequence:  w_t = exp(clip(sum_t(log_ratio_t m_t), -20, 20)) * m_t   (one weight per row)
  `rollout_is_threshold` "U" (TIS, truncated IS): w <- min(w, U);
                         "L_U" (IcePop): w <- w where L <= w <= U, else 0.
  `rollout_is_batch_normalize`: w <- w / mean (token: masked token mean; sequence: mean over rows
  with a token of the row's mean weight), when that mean is > 1e-8.
  The weights carry no gradient; every policy loss multiplies its token losses by them.

Rejection sampling (`rollout_rs`, comma-separated options, all must pass; thresholds
`rollout_rs_threshold`, one shared or one per option):
  token_k1 / seq_sum_k1 / seq_mean_k1:  k1 = -clip(log_ratio, +-20), kept where
      log(L) <= stat <= log(U) ("L_U"; a single "U" means L = 1/U)
  token_k2 / seq_*_k2:  k2 = 0.5 clip(log_ratio)^2,   kept where stat <= U
  token_k3 / seq_*_k3:  k3 = exp(lr) - 1 - lr (lr clipped), kept where stat <= U
  seq_sum / seq_mean / seq_max: the row's masked sum / mean / max of the token statistic; a
  rejected row loses every token. The new response_mask is m * keep.

Metrics are verl's, under "rollout_corr/" (rollout_is_*, rollout_rs_<option>_*, and the
off-policy diagnostics kl, k3_kl, training_ppl, rollout_ppl, log_ppl_*, ppl_ratio, chi2_*).

Thresholds are parsed on the host (`settings`), so a bad one is a clear error before compiling.
Everything else is jittable, batch-major [B, T] float32.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jrl.algos import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # |log ratio| bound before exp, as verl
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")  # bypass_mode's loss
RS_OPTIONS = tuple(
    f"{agg}_{k}" for agg in ("token", "seq_sum", "seq_mean") for k in ("k1", "k2", "k3")
) + ("seq_max_k2", "seq_max_k3")


def _float(spec: str, what: str) -> float:
    try:
        return float(spec)
    except ValueError:
        raise ValueError(f"{what}={spec!r} is not a number or 'lower_upper' pair.") from None


def parse_is_threshold(spec) -> tuple[float, Optional[float]]:
    """(upper, lower or None) of `rollout_is_threshold`: "U" / U (TIS) or "L_U" (IcePop)."""
    spec = str(spec).strip()
    if "_" in spec:
        lo, hi = spec.split("_", 1)
        upper, lower = _float(hi, "rollout_is_threshold"), _float(lo, "rollout_is_threshold")
    else:
        upper, lower = _float(spec, "rollout_is_threshold"), None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(
            f"rollout_is_threshold={spec!r} needs 0 < lower <= upper (e.g. '2.0' or '0.5_2.0')."
        )
    return upper, lower


def parse_rs(options: str, spec) -> dict[str, tuple[Optional[float], float]]:
    """{option: (lower or None, upper)} of `rollout_rs` / `rollout_rs_threshold` (ratio bounds
    for *_k1 options, a divergence bound for the others)."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(
                f"rollout_rs option {name!r} is unknown; valid: {', '.join(RS_OPTIONS)}."
            )
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not names or not specs or len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs={options!r} needs rollout_rs_threshold with one value, or one per option "
            f"(got {spec!r})."
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    out = {}
    for name, s in zip(names, specs):
        if name.endswith("k1"):
            lo, hi = s.split("_", 1) if "_" in s else (None, s)
            upper = _float(hi, "rollout_rs_threshold")
            lower = 1.0 / upper if lo is None else _float(lo, "rollout_rs_threshold")
        elif "_" in s:
            raise ValueError(f"rollout_rs_threshold for {name} is one upper bound, got {s!r}.")
        else:
            upper, lower = _float(s, "rollout_rs_threshold"), None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(
                f"rollout_rs_threshold for {name} needs 0 < lower <= upper, got {s!r}."
            )
        out[name] = (lower, upper)
    return out


def settings(rc) -> dict[str, Any]:
    """The parsed `rollout_correction` config section (raises ValueError naming a bad field). Every
    field read must be present (defaults: jrl.config.schema.base_config)."""
    level = rc["rollout_is"] or ""
    if level and level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} is unknown; valid: token, sequence, '' (off).")
    upper, lower = parse_is_threshold(rc["rollout_is_threshold"])
    rs = rc["rollout_rs"] or ""
    loss_type = rc["loss_type"]
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is unknown; valid: {', '.join(LOSS_TYPES)}.")
    return {
        "level": level,
        "upper": upper,
        "lower": lower,
        "batch_normalize": bool(rc["rollout_is_batch_normalize"]),
        "rs": parse_rs(rs, rc["rollout_rs_threshold"]) if rs else {},
        "loss_type": loss_type,
    }


# ----------------------------------------------------------------------------- helpers


def _over(x, keep):
    """Mean of x over entries where keep (0 if none)."""
    keep = keep.astype(jnp.float32)
    return jnp.sum(x * keep) / jnp.maximum(jnp.sum(keep), 1.0)


def _std(x, keep):
    """Unbiased std of x over entries where keep (0 for fewer than two)."""
    n = jnp.sum(keep)
    mu = _over(x, keep)
    var = jnp.sum(jnp.where(keep, (x - mu) ** 2, 0.0)) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(n > 1, jnp.sqrt(var), 0.0)


def _max(x, keep):
    return jnp.max(jnp.where(keep, x, -jnp.inf))


def _min(x, keep):
    return jnp.min(jnp.where(keep, x, jnp.inf))


def _clamped_std(x, mask, lo, hi):
    """verl's std of a statistic clamped to [lo, hi]: sqrt(max(mean(c^2) - mean(c)^2, 0))."""
    c = jnp.clip(x, lo, hi)
    var = masked_mean(c * c, mask) - masked_mean(c, mask) ** 2
    return jnp.where(jnp.sum(mask) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


# ----------------------------------------------------------------------------- IS weights


def is_weights(
    log_ratio, mask, level: str, upper: float, lower: Optional[float], batch_normalize=False
):
    """(IS weights [B, T] without gradient, metrics without prefix); see the module doc."""
    valid = mask > 0
    if level == "token":
        for_metrics = log_ratio
        raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        for_metrics = masked_sum(log_ratio, mask, axis=-1)[:, None]
        raw = jnp.broadcast_to(
            jnp.exp(jnp.clip(for_metrics, -SAFETY_BOUND, SAFETY_BOUND)), mask.shape
        )
    raw = raw * mask
    if lower is None:
        weights = jnp.minimum(raw, upper)
    else:
        weights = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    lo = 1.0 / upper if lower is None else lower
    m = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "sequence":
        m["rollout_is_max"] = jnp.exp(jnp.minimum(jnp.max(for_metrics), SAFETY_BOUND))
        m["rollout_is_min"] = jnp.exp(jnp.min(for_metrics))
        m["rollout_is_ratio_fraction_high"] = jnp.mean(for_metrics > math.log(upper))
        m["rollout_is_ratio_fraction_low"] = jnp.mean(for_metrics < math.log(lo))
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).astype(jnp.float32), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lo).astype(jnp.float32), mask)
        m["rollout_is_max"] = _max(weights, valid)
        m["rollout_is_min"] = _min(weights, valid)
    m["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    clamped = jnp.clip(weights, 0.0, upper)
    normalised = clamped / (masked_mean(clamped, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalised * normalised, mask)
    rows = jnp.ones(mask.shape[:1], bool)
    seq_w = masked_mean(weights, mask, axis=-1)
    m["rollout_is_seq_mean"] = jnp.mean(seq_w)
    m["rollout_is_seq_std"] = _std(seq_w, rows)
    m["rollout_is_seq_max"] = jnp.max(seq_w)
    m["rollout_is_seq_min"] = jnp.min(seq_w)
    m["rollout_is_seq_max_deviation"] = jnp.max(jnp.abs(seq_w - 1.0))
    raw_seq = masked_mean(raw, mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = jnp.mean(raw_seq > upper)
    m["rollout_is_seq_fraction_low"] = jnp.mean(raw_seq < lo)
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        m["rollout_is_oob_ratio"] = masked_mean(oob.astype(jnp.float32), mask)
    weights = jax.lax.stop_gradient(weights)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            has = jnp.sum(mask, -1) > 0
            mean = jnp.sum(jnp.where(has, seq_w, 0.0)) / jnp.maximum(jnp.sum(has), 1e-8)
        ok = mean > 1e-8
        weights = jnp.where(ok, weights / jnp.where(ok, mean, 1.0), weights)
        m["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
    return weights, m


# ----------------------------------------------------------------------------- rejection


def rejection_mask(log_ratio, mask, thresholds: dict):
    """(new response_mask [B, T] = mask * keep, metrics without prefix) for the parsed
    `rollout_rs` options {option: (lower, upper)}; see the module doc."""
    valid = mask > 0
    seq_valid = jnp.sum(mask, -1) > 0
    lr = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    token_stats = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": jnp.exp(lr) - 1.0 - lr}
    row_stat = {
        "seq_sum": lambda x: masked_sum(x, mask, axis=-1),
        "seq_mean": lambda x: masked_mean(x, mask, axis=-1),
        "seq_max": lambda x: jnp.where(seq_valid, jnp.max(jnp.where(valid, x, -jnp.inf), -1), 0.0),
    }
    combined = jnp.ones_like(mask)
    metrics = {}
    for name, (lower, upper) in thresholds.items():
        agg, k = name.rsplit("_", 1)
        is_k1 = k == "k1"
        hi = math.log(upper) if is_k1 else upper
        lo = math.log(lower) if is_k1 else 0.0
        tok = token_stats[k]
        if agg == "token":
            stat, seq_values = tok, masked_mean(tok, mask, axis=-1)
            keep = (stat <= hi) & (stat >= lo) if is_k1 else stat <= hi
        else:
            seq_values = row_stat[agg](tok)
            stat = jnp.broadcast_to(seq_values[:, None], mask.shape)
            row_keep = (seq_values <= hi) & (seq_values >= lo) if is_k1 else seq_values <= hi
            keep = jnp.broadcast_to(row_keep[:, None], mask.shape)
        p = f"rollout_rs_{name}"
        metrics[f"{p}_mean"] = masked_mean(stat, mask)
        if agg == "token":
            metrics[f"{p}_max"], metrics[f"{p}_min"] = _max(stat, valid), _min(stat, valid)
            metrics[f"{p}_fraction_high"] = masked_mean((stat > hi).astype(jnp.float32), mask)
            low = masked_mean((stat < lo).astype(jnp.float32), mask)
        else:
            metrics[f"{p}_max"] = _max(seq_values, seq_valid)
            metrics[f"{p}_min"] = _min(seq_values, seq_valid)
            metrics[f"{p}_fraction_high"] = _over(seq_values > hi, seq_valid)
            low = _over(seq_values < lo, seq_valid)
        metrics[f"{p}_fraction_low"] = low if is_k1 else jnp.float32(0.0)
        metrics[f"{p}_std"] = _clamped_std(stat, mask, lo, hi)
        any_row = jnp.any(seq_valid)
        for key, value in (
            ("seq_mean", _over(seq_values, seq_valid)),
            ("seq_std", _std(seq_values, seq_valid)),
            ("seq_max", _max(seq_values, seq_valid)),
            ("seq_min", _min(seq_values, seq_valid)),
            ("seq_max_deviation", _max(jnp.abs(seq_values), seq_valid)),
            ("seq_fraction_high", _over(seq_values > hi, seq_valid)),
        ):
            metrics[f"{p}_{key}"] = jnp.where(any_row, value, 0.0)
        if is_k1:
            metrics[f"{p}_seq_fraction_low"] = _over(seq_values < lo, seq_valid)
        keep_f = keep.astype(jnp.float32)
        combined = combined * keep_f
        metrics[f"{p}_masked_fraction"] = masked_mean(1.0 - keep_f, mask)
        row_kept = jnp.all(keep | ~valid, axis=-1)
        metrics[f"{p}_seq_masked_fraction"] = _over(~row_kept, seq_valid)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - combined, mask)
    lost = jnp.any(valid & ~((combined > 0.5) & valid), axis=-1)
    metrics["rollout_rs_seq_masked_fraction"] = jnp.mean(lost.astype(jnp.float32))
    return mask * combined, metrics


# ----------------------------------------------------------------------------- diagnostics


def offpolicy_metrics(log_prob, rollout_log_prob, mask):
    """verl's off-policy diagnostics of training log-probs vs the rollout's (no prefix)."""
    row_train = masked_mean(log_prob, mask, axis=-1)
    row_roll = masked_mean(rollout_log_prob, mask, axis=-1)
    log_ratio = log_prob - rollout_log_prob
    diff = row_roll - row_train
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    seq_sum = jnp.clip(masked_sum(log_ratio, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": jnp.mean(jnp.exp(-row_train)),
        "training_log_ppl": jnp.mean(-row_train),
        "kl": masked_mean(rollout_log_prob - log_prob, mask),
        "k3_kl": masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, mask),
        "rollout_ppl": jnp.mean(jnp.exp(-row_roll)),
        "rollout_log_ppl": jnp.mean(-row_roll),
        "log_ppl_diff": jnp.mean(diff),
        "log_ppl_abs_diff": jnp.mean(jnp.abs(diff)),
        "log_ppl_diff_max": jnp.max(diff),
        "log_ppl_diff_min": jnp.min(diff),
        "ppl_ratio": jnp.mean(jnp.exp(diff)),
        "chi2_token": masked_mean(jnp.exp(safe) ** 2, mask) - 1.0,
        "chi2_seq": jnp.mean(jnp.exp(2.0 * seq_sum)) - 1.0,
    }


def correct(log_prob, rollout_log_prob, response_mask, parsed: dict):
    """(IS weights [B, T] or None, new response_mask [B, T], metrics under "rollout_corr/") of
    the trainer's `log_prob` vs the rollout's, for `parsed = settings(config)`. No gradient."""
    log_prob, rollout_log_prob = jax.lax.stop_gradient((log_prob, rollout_log_prob))
    mask = jnp.asarray(response_mask, jnp.float32)
    log_prob = jnp.where(mask > 0, log_prob, 0.0)
    rollout_log_prob = jnp.where(mask > 0, rollout_log_prob, 0.0)
    log_ratio = log_prob - rollout_log_prob
    weights, metrics = None, {}
    if parsed["level"]:
        weights, m = is_weights(
            log_ratio,
            mask,
            parsed["level"],
            parsed["upper"],
            parsed["lower"],
            parsed["batch_normalize"],
        )
        metrics.update(m)
    new_mask = mask
    if parsed["rs"]:
        new_mask, m = rejection_mask(log_ratio, mask, parsed["rs"])
        metrics.update(m)
    metrics.update(offpolicy_metrics(log_prob, rollout_log_prob, mask))
    metrics = {f"rollout_corr/{k}": jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return weights, new_mask, metrics
