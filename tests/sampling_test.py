"""The token sampler (`jrl.sampling`): the same tokens and log-probs as one prefix sum over the
whole vocabulary (the sampler it replaced, copied below as the reference), and the exact
filtered softmax as its distribution (chi-square over fixed-seed draws)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jrl import sampling

F32_MIN = float(np.finfo(np.float32).min)


def reference_filter_logits(logits_BV, top_k: int = 0, top_p: float = 1.0):
    """The previous `jrl.rollout.filter_logits`, as it was."""
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


def reference_sample_token(u_B, logits_BV, *, temperature=1.0, top_k=0, top_p=1.0, greedy=False):
    """The previous `jrl.rollout.sample_token`, as it was: one associative scan over the whole
    vocabulary."""
    logits_BV = logits_BV / temperature
    if greedy:
        token = jnp.argmax(logits_BV, axis=-1)
    else:
        kept = reference_filter_logits(logits_BV, top_k, top_p)
        probs = jnp.exp(kept - jnp.max(kept, axis=-1, keepdims=True))  # unnormalised
        cdf = jax.lax.associative_scan(jnp.add, probs, axis=-1)
        threshold = (1.0 - u_B) * cdf[:, -1]  # in (0, total]
        positive = probs > 0
        reached = positive & (cdf >= threshold[:, None])
        last = probs.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], axis=-1)
        token = jnp.where(jnp.any(reached, axis=-1), jnp.argmax(reached, axis=-1), last)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits_BV, -1), token[:, None], -1)[:, 0]
    return token.astype(jnp.int32), logp


def special_rows(v: int, scale: float, rng) -> np.ndarray:
    """Rows every case carries: ties (two, and all equal), -inf and float32-minimum (masked)
    logits, one unmasked token, large logits."""
    rows = (rng.normal(size=(8, v)) * scale).astype(np.float32)
    rows[0] = np.round(rows[0])  # many ties
    rows[1] = 1.0  # all equal
    rows[2, 1::3] = -np.inf
    rows[3, ::2] = F32_MIN  # masked, as the rollout masks EOS
    rows[4] = F32_MIN
    rows[4, v // 2] = 0.5  # a single token left
    rows[5] = rows[5] * 30.0  # large logits: one token holds nearly all the mass
    rows[6, : v // 2] = np.round(rows[6, : v // 2] * 2) / 2
    rows[7, v // 3] = rows[7].max()  # the max tied twice
    return rows


def logits_and_uniforms(v: int, rows: int, scale: float, seed: int, special=range(8)):
    """Normal logits times `scale`, the first rows replaced by those of `special_rows` listed in
    `special`, and uniforms (the first three 0, the largest float32 below 1, 0.5)."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(rows, v)) * scale).astype(np.float32)
    special = list(special)[:rows]
    logits[: len(special)] = special_rows(v, scale, rng)[special]
    u = rng.uniform(size=rows).astype(np.float32)
    u[:3] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5]  # the ends of [0, 1)
    return jnp.asarray(logits), jnp.asarray(u)


def close_to_a_boundary(x_V, support_V, u: float, a: int, b: int, tol: float = 1e-6) -> bool:
    """Whether two different draws a, b for threshold (1 - u) * total are both within float32
    rounding of right: in float64, the threshold lies within tol * total of the cumulative sum
    at every token from the smaller up to (not including) the larger."""
    w = np.where(support_V, np.exp(x_V.astype(np.float64) - x_V[support_V].max()), 0.0)
    cdf = np.cumsum(w)
    t = (1.0 - np.float64(u)) * cdf[-1]
    lo, hi = min(a, b), max(a, b)
    return bool(np.all(np.abs(cdf[lo:hi] - t) <= tol * cdf[-1]))


def among_candidates(x_BV, top_k=0, top_p=1.0, **_) -> bool:
    """Whether every row's kept set lies among the sampler's candidates (the k + 1 largest
    logits with top-k, else the TOP_P_CANDIDATES largest), so no row takes the exact path."""
    v = x_BV.shape[-1]
    c = min(v, top_k + 1 if top_k else sampling.TOP_P_CANDIDATES)
    kept = [np.sum(exact_probabilities(x, 1.0, top_k, top_p) > 0) for x in x_BV]
    ties = [np.sum(x >= np.sort(x)[::-1][top_k - 1]) > top_k for x in x_BV] if top_k else [0]
    return c == v or (max(kept) < c and not any(ties))


CASES = [  # (vocabulary, rows, logit scale, options, path: candidates / exact / None)
    (1, 8, 1.0, {}, None),
    (5, 64, 1.0, {"temperature": 0.7}, None),  # the float32 minimum / 0.7 is -inf
    (1000, 40, 0.3, {"temperature": 2.0}, None),  # nearly flat: the threshold in any block
    (8000, 32, 3.0, {"top_k": 50}, "candidates"),  # among the 51 blocks of largest maxima
    (1000, 64, 3.0, {"top_k": 3, "temperature": 0.5}, "exact"),  # some rows tie at the 3rd
    (300, 64, 4.0, {"top_p": 0.9}, "candidates"),  # lax.top_k: 64 blocks hold all 300
    (8000, 32, 10.0, {"top_p": 0.8, "temperature": 1.5}, "candidates", 10),  # 10 blocks
    (300, 64, 0.2, {"top_p": 0.9}, "exact"),  # nuclei of ~270 tokens
    (8000, 32, 3.0, {"top_k": 50, "top_p": 0.8}, "candidates"),
    (300, 5, 3.0, {"top_k": 299, "top_p": 0.95}, "candidates"),  # k = V - 1; 5 rows
    (300, 64, 2.0, {"greedy": True, "temperature": 0.5}, None),
]
CASES = [case + (None,) * (6 - len(case)) for case in CASES]  # candidates: TOP_P_CANDIDATES


@pytest.mark.parametrize("v,rows,scale,options,path,candidates", CASES)
def test_tokens_and_log_probs_match_one_prefix_sum_over_the_vocabulary(
    monkeypatch, v, rows, scale, options, path, candidates
):
    """The reference's tokens for the same uniforms, but where the threshold lies within float32
    rounding of a cumulative sum (checked in float64 for each such row, and at most 2% of the
    rows); its log-probs within float32 rounding; never a token of probability 0."""
    if candidates is not None:
        monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    # rows whose kept set lies among the candidates: ties at the top, -inf and masked logits
    special = (2, 3, 5, 7) if path == "candidates" else range(8)
    logits, u = logits_and_uniforms(v, rows, scale, seed=v + rows, special=special)
    x = np.asarray(logits) / options.get("temperature", 1.0)
    filters = {k: options[k] for k in ("top_k", "top_p") if k in options}
    if path is not None:  # the case takes the path it is meant to test
        assert among_candidates(x, **filters) == (path == "candidates")
    want_tok, want_logp = jax.jit(functools.partial(reference_sample_token, **options))(u, logits)
    got_tok, got_logp = jax.jit(functools.partial(sampling.sample_token, **options))(u, logits)
    assert got_tok.dtype == jnp.int32 and got_logp.dtype == jnp.float32
    want_tok, got_tok = np.asarray(want_tok), np.asarray(got_tok)
    support = np.stack([exact_probabilities(row, 1.0, **filters) > 0 for row in x])
    differ = np.flatnonzero(want_tok != got_tok)
    assert len(differ) <= 0.02 * rows, (differ, want_tok[differ], got_tok[differ])
    for r in differ:
        assert close_to_a_boundary(x[r], support[r], float(u[r]), want_tok[r], got_tok[r]), r
    assert np.all(support[np.arange(rows), got_tok])
    same = want_tok == got_tok
    np.testing.assert_allclose(got_logp[same], np.asarray(want_logp)[same], rtol=1e-6, atol=2e-6)
    if options.get("greedy"):
        np.testing.assert_array_equal(got_tok, np.argmax(x, -1))  # the first of ties


def test_qwen_vocabulary_and_near_uniform_rows_differ_by_an_ulp_at_most():
    """151,936 tokens (Qwen2.5's vocabulary): rows of spread logits, and near-uniform rows (each
    token ~7e-6 of the mass), where summation order shows most: a draw may differ from the
    reference's by one token, across a threshold within float32 rounding of the cumulative sum
    between them (about 0.7% of near-uniform draws over many seeds; none of the others here)."""
    logits, u = logits_and_uniforms(151936, 32, 3.0, seed=5)
    logits = logits.at[16:].multiply(0.05 / 3.0)
    want, want_logp = jax.jit(reference_sample_token)(u, logits)
    got, got_logp = jax.jit(sampling.sample_token)(u, logits)
    want, got = np.asarray(want), np.asarray(got)
    differ = np.flatnonzero(want != got)
    assert np.all(differ >= 16) and len(differ) <= 2, differ
    x = np.asarray(logits)
    for r in differ:
        assert abs(int(want[r]) - int(got[r])) == 1
        assert close_to_a_boundary(x[r], x[r] > -np.inf, float(u[r]), want[r], got[r])
    same = want == got
    np.testing.assert_allclose(got_logp[same], np.asarray(want_logp)[same], rtol=1e-6, atol=2e-6)


def exact_probabilities(logits, temperature=1.0, top_k=0, top_p=1.0):
    """The filtered, tempered softmax in float64 by the definitions: top-k keeps the logits at
    least the k-th largest; top-p the most likely tokens until the mass before one reaches p,
    and every token tied with the last kept."""
    x = np.asarray(logits, np.float64) / temperature
    keep = np.ones_like(x, bool)
    if top_k:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        threshold = p[order][np.sum(before < top_p) - 1]
        p = np.where(p >= threshold, p, 0.0)
        p /= p.sum()
    return p


P9 = np.log([0.3, 0.02, 0.2, 0.08, 0.15, 0.05, 0.1, 0.06, 0.04])
SPREAD = np.full(700, -np.inf)  # P9's logits in six of 128-token blocks, -inf elsewhere
SPREAD[[5, 130, 131, 260, 300, 420, 599, 640, 699]] = P9
TIED = np.array([2.0, 0.5, 1.0, 1.0, -1.0, 1.0, 0.0, 3.0, F32_MIN])  # three tie at the 3rd
STAT_CASES = [  # (logits, options, candidates for top-p or None)
    (P9, {"temperature": 2.0}, None),
    (TIED, {"top_k": 3}, None),  # the exact path
    (P9, {"top_k": 5, "top_p": 0.6}, None),
    (P9, {"top_p": 0.7}, 3),  # a nucleus of 4: the exact path
    (SPREAD, {"top_p": 0.7, "temperature": 0.9}, 5),  # among the 5 blocks of largest maxima
    (np.linspace(0.0, 1.0, 300), {"temperature": 0.5}, None),  # three blocks
]


@pytest.mark.parametrize("logits,options,candidates", STAT_CASES)
def test_draws_follow_the_filtered_softmax(monkeypatch, logits, options, candidates):
    """N = 40,000 draws (8,000 of the 700 tokens) with fixed-seed uniforms, counted per token.
    Tokens of probability 0 never come up; over the others, Pearson's chi-square statistic
    sum (n_i - N p_i)^2 / (N p_i) stays below its 1 - 1e-6 quantile with (tokens - 1) degrees of
    freedom, so a right sampler fails this with probability 1e-6 at a fresh seed. A sampler one
    token off fails every case (chi-square 8e3 to 2e6), one applying the temperature twice every
    case with a temperature (1e3 to 8e3)."""
    if candidates is not None:
        monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    n = 40_000 if len(logits) < 500 else 8_000  # fewer rows of the larger vocabulary
    p = exact_probabilities(logits, **options)
    tiled = jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1))
    u = jax.random.uniform(jax.random.key(17), (n,))
    tok, _ = jax.jit(functools.partial(sampling.sample_token, **options))(u, tiled)
    counts = np.bincount(np.asarray(tok), minlength=len(p))
    assert np.all(counts[p == 0] == 0)
    support = p > 0
    expected = n * p[support]
    chi2 = np.sum((counts[support] - expected) ** 2 / expected)
    assert chi2 < stats.chi2.ppf(1 - 1e-6, support.sum() - 1), (chi2, counts, expected)
