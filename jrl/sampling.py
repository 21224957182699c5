"""Token sampling for the rollout: temperature, top-k, top-p or greedy, one uniform per row.

`sample_token` draws by inverse-CDF sampling: row b takes the first token, in vocabulary order,
whose cumulative (unnormalised, filtered, temperature-scaled) probability reaches
(1 - u_b) * total, u_b being the row's uniform in [0, 1). It never scans or sorts the whole
vocabulary:

- The cumulative sum is taken in two levels: the sums of blocks of `BLOCK` consecutive tokens
  (one reduction over the vocabulary), their prefix sum (V / BLOCK values per row), then the
  prefix sum inside the one block per row that holds the threshold, gathered.
- The log-prob is the token's logit minus the row's log-sum-exp (its max and one sum); no
  [B, V] log-softmax is written.
- Top-k takes the k + 1 largest logits (`lax.top_k`); top-p looks for its nucleus among the
  `TOP_P_CANDIDATES` largest ones (among the top k with top-k). The candidates are sampled in
  vocabulary order. When some row's kept set may reach beyond its candidates (a tie with the
  k-th logit, or a nucleus larger than the candidates), the batch takes the exact path instead
  (`lax.cond`): `filter_logits` over the whole vocabulary and the two-level inverse CDF.

The distribution is exactly the filtered softmax's, and the tokens are those of a single prefix
sum over the vocabulary except where float32 rounding, summing in another order, moves a
cumulative sum across the threshold by an ulp or so (docs/algorithms.md, "Sampling").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # tokens per block of the two-level cumulative sum (one TPU lane tile)
TOP_P_CANDIDATES = 256  # largest logits among which top-p looks for its nucleus first


def filter_logits(logits_BV, top_k: int = 0, top_p: float = 1.0):
    """Sets logits outside the top-k / nucleus (top-p) support to the dtype's minimum. 0 / 1.0
    switch a filter off.

    Top-k keeps every logit at least the k-th largest (ties with it are kept too). Top-p keeps
    the smallest set of most likely tokens whose probability reaches p (ties with the last kept
    token are kept too); the most likely token is always kept. This is the exact path: it sorts
    the whole vocabulary for top-p."""
    neg_inf = jnp.finfo(logits_BV.dtype).min
    if top_k and top_k < logits_BV.shape[-1]:
        kth = jax.lax.top_k(logits_BV, top_k)[0][..., -1:]
        logits_BV = jnp.where(logits_BV < kth, neg_inf, logits_BV)
    if top_p < 1.0:
        sorted_desc = jnp.sort(logits_BV, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1
        threshold = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
        logits_BV = jnp.where(logits_BV < threshold, neg_inf, logits_BV)
    return logits_BV


def sample_token(
    u_B, logits_BV, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy=False
):
    """Draws one token per row: row b takes the first token, in vocabulary order, whose
    cumulative probability (of the filtered, temperature-scaled softmax) reaches (1 - u_B[b])
    times the total, u_B[b] in [0, 1). Greedy: the most likely token (the first of ties).
    Returns (token [B] int32, log-prob [B] float32 under softmax(logits / T), before top-k /
    top-p).

    One uniform per row instead of a Gumbel variate per logit. Tokens outside the top-k / top-p
    support have probability 0 and are never drawn: a float32 prefix sum need not be monotone
    (a token adding 0 can sit one ulp below the one before it, the total one ulp above the last
    token with mass), so only tokens of positive probability are candidates, and the last of
    them is taken when rounding leaves none whose cumulative sum reaches the threshold."""
    x_BV = logits_BV / temperature
    v = x_BV.shape[-1]
    top_k = top_k if 0 < top_k < v else 0
    if greedy:
        token = jnp.argmax(x_BV, axis=-1)
        m_B = jnp.max(x_BV, axis=-1)
        x_B, z_B = m_B, _sum_exp(x_BV, m_B)  # the token's logit is the max
    elif not top_k and top_p >= 1.0:
        m_B = jnp.max(x_BV, axis=-1)
        token, x_B, z_B = _inverse_cdf(u_B, x_BV, m_B)
    else:
        token, x_B, m_B, z_B = _filtered(u_B, x_BV, top_k, top_p)
    return token.astype(jnp.int32), x_B - m_B - jnp.log(z_B)


def _sum_exp(x_BV, m_B):
    """sum_i exp(x_i - m) per row: the softmax's normaliser relative to the row max m."""
    return jnp.sum(jnp.exp(x_BV - m_B[:, None]), axis=-1)


def _pick(reached_BN, positive_BN):
    """Per row: the first index where `reached`, else the last where `positive`."""
    last = positive_BN.shape[-1] - 1 - jnp.argmax(positive_BN[:, ::-1], axis=-1)
    return jnp.where(jnp.any(reached_BN, axis=-1), jnp.argmax(reached_BN, axis=-1), last)


def _block_sums(w_BV, block: int):
    """Sums of consecutive blocks of `block` entries: [B, V] -> [B, V / block].

    With rows in groups of 8, the sum runs over [B/8, V/block, 8, block]: on a TPU that view is
    the [B, V] array's own (8, 128)-tiled layout, so the reduction reads it in place, where the
    plain [B, V/block, block] view is a relayout copy of the whole array first."""
    b, v = w_BV.shape
    if b % 8:
        return w_BV.reshape(b, v // block, block).sum(-1)
    w = w_BV.reshape(b // 8, 8, v // block, block).transpose(0, 2, 1, 3).sum(-1)
    return w.transpose(0, 2, 1).reshape(b, v // block)


def _inverse_cdf(u_B, x_BV, m_B, block: int = BLOCK):
    """(token [B], its x [B], total weight [B]) of the inverse CDF of the weights exp(x - m) (0
    where x is -inf, or the dtype's minimum when m is much larger), in two levels: the block of
    the threshold from the blocks' prefix sums, then the token inside it from that block's own."""
    b, v = x_BV.shape
    pad = -v % block
    if pad:
        x_BV = jnp.pad(x_BV, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    sums_BN = _block_sums(jnp.exp(x_BV - m_B[:, None]), block)
    cdf_BN = jnp.cumsum(sums_BN, axis=-1)
    threshold_B = (1.0 - u_B) * cdf_BN[:, -1]  # in (0, total]
    reached_BN = (sums_BN > 0) & (cdf_BN >= threshold_B[:, None])
    j_B = _pick(reached_BN, sums_BN > 0)
    before_B = jnp.where(j_B > 0, jnp.take_along_axis(cdf_BN, j_B[:, None] - 1, -1)[:, 0], 0.0)
    row_block = lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, block)
    x_BC = jax.vmap(row_block)(x_BV, j_B * block)
    w_BC = jnp.exp(x_BC - m_B[:, None])
    cdf_BC = before_B[:, None] + jnp.cumsum(w_BC, axis=-1)
    r_B = _pick((w_BC > 0) & (cdf_BC >= threshold_B[:, None]), w_BC > 0)
    x_B = jnp.take_along_axis(x_BC, r_B[:, None], -1)[:, 0]
    # a row of -inf (no token of positive weight) ends in the padding: its last token instead
    return jnp.minimum(j_B * block + r_B, v - 1), x_B, cdf_BN[:, -1]


def _filtered(u_B, x_BV, top_k: int, top_p: float):
    """(token [B], its x [B], row max [B], sum_exp [B]) of top-k and / or top-p sampling: among
    the largest logits when every row's kept set lies among them, else by the exact path."""
    v = x_BV.shape[-1]
    c = min(v, top_k + 1 if top_k else TOP_P_CANDIDATES)
    vals_BC, idx_BC = jax.lax.top_k(x_BV, c)  # descending
    m_B = vals_BC[:, 0]
    w_BC = jnp.exp(vals_BC - m_B[:, None])
    z_B = _sum_exp(x_BV, m_B)
    tau_B = vals_BC[:, top_k - 1] if top_k else jnp.full_like(m_B, -jnp.inf)
    if top_p < 1.0:
        # The nucleus of the top-k-filtered softmax (filter_logits's rule on the candidates).
        w_top_k = jnp.where(vals_BC >= tau_B[:, None], w_BC, 0.0)
        probs_BC = w_top_k / (jnp.sum(w_top_k, -1) if top_k else z_B)[:, None]
        mass_before_BC = jnp.cumsum(probs_BC, axis=-1) - probs_BC
        n_keep_B = jnp.sum((vals_BC >= tau_B[:, None]) & (mass_before_BC < top_p), axis=-1)
        tau_B = jnp.maximum(tau_B, jnp.take_along_axis(vals_BC, n_keep_B[:, None] - 1, -1)[:, 0])
    # every logit outside the candidates is at most their last, so none of them is kept
    fits = c == v or jnp.all(vals_BC[:, -1] < tau_B)

    def among_candidates(_):
        kept_w_BC = jnp.where(vals_BC >= tau_B[:, None], w_BC, 0.0)
        # vocabulary order
        idx_s_BC, w_s_BC, x_s_BC = jax.lax.sort((idx_BC, kept_w_BC, vals_BC), num_keys=1)
        cdf_BC = jnp.cumsum(w_s_BC, axis=-1)
        threshold_B = (1.0 - u_B) * cdf_BC[:, -1]
        r_B = _pick((w_s_BC > 0) & (cdf_BC >= threshold_B[:, None]), w_s_BC > 0)
        at = lambda a_BC: jnp.take_along_axis(a_BC, r_B[:, None], -1)[:, 0]
        return at(idx_s_BC), at(x_s_BC)

    def exact(_):
        token, _, _ = _inverse_cdf(u_B, filter_logits(x_BV, top_k, top_p), m_B)
        x_B = jnp.take_along_axis(x_BV, token[:, None], -1)[:, 0]
        return token.astype(idx_BC.dtype), x_B

    if fits is True:
        return *among_candidates(None), m_B, z_B
    return *jax.lax.cond(fits, among_candidates, exact, None), m_B, z_B
