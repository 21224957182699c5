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
- Top-k and top-p work on candidates, the c largest logits of each row (c = k + 1 with top-k,
  else `TOP_P_CANDIDATES`), found among the c blocks with the largest maxima (one reduction
  over the vocabulary, then `lax.top_k` over c blocks). The nucleus is looked for among them,
  and the kept candidates are sampled in vocabulary order. When some row's kept set may reach
  beyond its candidates (a tie with the last candidate, or a nucleus larger than the
  candidates), the batch takes the exact path instead (`lax.cond`): the top-p threshold from a
  sort of the whole vocabulary, then the two-level inverse CDF over the kept tokens.

The distribution is exactly the filtered softmax's, and the tokens are those of a single prefix
sum over the vocabulary except where float32 rounding, summing in another order, moves a
cumulative sum across the threshold by an ulp or so (docs/algorithms.md, "Sampling").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # tokens per block of the two-level cumulative sum and top-k (one TPU lane tile)
TOP_P_CANDIDATES = 64  # largest logits among which top-p looks for its nucleus first


def filter_logits(logits_BV, top_k: int = 0, top_p: float = 1.0):
    """Sets logits outside the top-k / nucleus (top-p) support to the dtype's minimum. 0 / 1.0
    switch a filter off.

    Top-k keeps every logit at least the k-th largest (ties with it are kept too). Top-p keeps
    the smallest set of most likely tokens whose probability reaches p (ties with the last kept
    token are kept too); the most likely token is always kept. It sorts the whole vocabulary
    for top-p: `sample_token` does so only when the nucleus is not among its candidates."""
    neg_inf = jnp.finfo(logits_BV.dtype).min
    if top_k and top_k < logits_BV.shape[-1]:
        kth = jax.lax.top_k(logits_BV, top_k)[0][..., -1:]
        logits_BV = jnp.where(logits_BV < kth, neg_inf, logits_BV)
    if top_p < 1.0:
        logits_BV = jnp.where(
            logits_BV < _nucleus_floor(logits_BV, top_p)[:, None], neg_inf, logits_BV
        )
    return logits_BV


def _nucleus_floor(logits_BV, top_p: float):
    """The smallest logit top-p keeps [B], from a sort of the whole vocabulary: the n-th largest,
    n the number of tokens whose mass before them (most likely first) is below p."""
    sorted_desc = jnp.sort(logits_BV, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)  # >= 1
    return jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)[:, 0]


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


def _blocks(x_BV, block: int, reduce):
    """`reduce` (jnp.sum, jnp.max) over consecutive blocks of `block` entries: [B, V] ->
    [B, V / block].

    With rows in groups of 8, it runs over [B/8, V/block, 8, block]: on a TPU that view is the
    [B, V] array's own (8, 128)-tiled layout, so the reduction reads it in place, where the
    plain [B, V/block, block] view is a relayout copy of the whole array first."""
    b, v = x_BV.shape
    if b % 8:
        return reduce(x_BV.reshape(b, v // block, block), axis=-1)
    x = reduce(x_BV.reshape(b // 8, 8, v // block, block).transpose(0, 2, 1, 3), axis=-1)
    return x.transpose(0, 2, 1).reshape(b, v // block)


def _padded(x_BV, block: int):
    """x with -inf appended to a multiple of `block` tokens."""
    pad = -x_BV.shape[-1] % block
    return jnp.pad(x_BV, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x_BV


def _row_block(row_V, start, block: int = BLOCK):
    """row_V[start : start + block]."""
    return jax.lax.dynamic_slice_in_dim(row_V, start, block)


def _inverse_cdf(u_B, x_BV, m_B, floor_B=None, block: int = BLOCK):
    """(token [B], its x [B], total weight [B]) of the inverse CDF of the weights exp(x - m),
    0 below `floor` (when given), in two levels: the block of the threshold from the blocks'
    prefix sums, then the token inside it from that block's own."""
    v = x_BV.shape[-1]
    x_BV = _padded(x_BV, block)
    weight = lambda x: jnp.exp(x - m_B[:, None])
    if floor_B is not None:
        weight = lambda x: jnp.where(x >= floor_B[:, None], jnp.exp(x - m_B[:, None]), 0.0)
    sums_BN = _blocks(weight(x_BV), block, jnp.sum)
    cdf_BN = jnp.cumsum(sums_BN, axis=-1)
    threshold_B = (1.0 - u_B) * cdf_BN[:, -1]  # in (0, total]
    reached_BN = (sums_BN > 0) & (cdf_BN >= threshold_B[:, None])
    j_B = _pick(reached_BN, sums_BN > 0)
    before_B = jnp.where(j_B > 0, jnp.take_along_axis(cdf_BN, j_B[:, None] - 1, -1)[:, 0], 0.0)
    if x_BV.shape[-1] == block:  # a vocabulary of one block: the row is the block
        x_BC = x_BV
    else:
        x_BC = jax.vmap(_row_block, (0, 0, None))(x_BV, j_B * block, block)
    w_BC = weight(x_BC)
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
    vals_BC, idx_BC = _top_k(x_BV, c)
    m_B = vals_BC[:, 0]
    w_BC = jnp.exp(vals_BC - m_B[:, None])
    z_B = _sum_exp(x_BV, m_B)
    tau_k_B = vals_BC[:, top_k - 1] if top_k else jnp.full_like(m_B, -jnp.inf)  # exact
    tau_B = tau_k_B
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
        sort = (idx_BC, kept_w_BC, vals_BC)  # by token id: the inverse CDF in vocabulary order
        idx_s_BC, w_s_BC, x_s_BC = jax.lax.sort(sort, num_keys=1)
        cdf_BC = jnp.cumsum(w_s_BC, axis=-1)
        threshold_B = (1.0 - u_B) * cdf_BC[:, -1]
        r_B = _pick((w_s_BC > 0) & (cdf_BC >= threshold_B[:, None]), w_s_BC > 0)
        at = lambda a_BC: jnp.take_along_axis(a_BC, r_B[:, None], -1)[:, 0]
        return at(idx_s_BC), at(x_s_BC)

    def exact(_):
        floor_B = tau_k_B
        if top_p < 1.0:  # the nucleus of the top-k-filtered logits, from a sort
            top_k_BV = jnp.where(x_BV < tau_k_B[:, None], jnp.finfo(x_BV.dtype).min, x_BV)
            floor_B = jnp.maximum(floor_B, _nucleus_floor(top_k_BV, top_p))
        token, x_B, _ = _inverse_cdf(u_B, x_BV, m_B, floor_B)
        return token.astype(idx_BC.dtype), x_B

    if fits is True:
        return *among_candidates(None), m_B, z_B
    return *jax.lax.cond(fits, among_candidates, exact, None), m_B, z_B


def _top_k(x_BV, c: int, block: int = BLOCK):
    """(values, indices) [B, c] of the c largest logits per row, descending, found among the c
    blocks of `block` tokens with the largest maxima: every logit above the c-th largest sits in
    one of them, and they hold at least c logits at least the c-th (ties may stand for others,
    which `_filtered` detects). Plain `lax.top_k` when that is not fewer tokens."""
    b, v = x_BV.shape
    if c * block >= v:
        return jax.lax.top_k(x_BV, c)
    x_BV = _padded(x_BV, block)
    _, blocks_BC = jax.lax.top_k(_blocks(x_BV, block, jnp.max), c)
    starts_BC = blocks_BC * block
    x_BCK = jax.vmap(jax.vmap(_row_block, (None, 0)))(x_BV, starts_BC)  # [B, c, block]
    vals_BC, at_BC = jax.lax.top_k(x_BCK.reshape(b, c * block), c)
    at_block = jnp.take_along_axis(starts_BC, at_BC // block, axis=-1)
    return vals_BC, at_block + at_BC % block
