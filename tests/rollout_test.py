"""Sampler: greedy determinism, top-k / top-p support, EOS masking, log-probs == full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import rollout
from jrl.models import transformer as tfm
from jrl.logprobs import response_outputs
from conftest import sample, tiny_model

CFG = tiny_model(11)
EOS, PAD, R = 2, 0, 6
IDS = dict(max_new_tokens=R, eos_id=EOS, pad_id=PAD)
PROMPTS = np.array([[0, 0, 1, 5, 6], [1, 7, 8, 9, 4], [0, 1, 3, 3, 3]], np.int32)
PMASK = (np.arange(5)[None] >= np.array([[2], [0], [1]])).astype(np.int32)


@pytest.fixture(scope="module")
def params():
    # A small random model: close to uniform over 11 tokens, so EOS comes up often enough.
    return tfm.init_params(CFG, jax.random.key(1))


@pytest.fixture(scope="module")
def gen(params):
    def run(key, **options):  # greedy, temperature, top_k, top_p, forced_length
        return sample(rollout.generate, CFG, params, PROMPTS, PMASK, key, **IDS, **options)

    return jax.jit(run, static_argnames=("greedy", "temperature", "top_k", "top_p"))


def test_greedy_is_deterministic_and_matches_argmax_of_full_forward(gen, params):
    a = gen(jax.random.key(0), greedy=True)
    b = gen(jax.random.key(123), greedy=True)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    ids = np.concatenate([PROMPTS, np.asarray(a.response_ids)], 1)
    mask = np.concatenate([PMASK, np.asarray(a.response_mask)], 1)
    logits = tfm.forward(CFG, params, jnp.asarray(ids), jnp.asarray(mask))[:, 4:-1]
    m = np.asarray(a.response_mask).astype(bool)
    np.testing.assert_array_equal(np.argmax(logits, -1)[m], np.asarray(a.response_ids)[m])


def test_mask_is_one_through_first_eos_and_zero_after(gen):
    hits = 0
    for seed in range(6):
        out = gen(jax.random.key(seed))
        ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
        for row_ids, row_mask in zip(ids, mask):
            eos = np.flatnonzero(row_ids == EOS)
            end = eos[0] + 1 if len(eos) else R
            hits += bool(len(eos)) and end < R
            np.testing.assert_array_equal(row_mask, np.arange(R) < end)
            assert np.all(row_ids[end:] == PAD)
        assert np.all(np.asarray(out.log_probs)[mask == 0] == 0)
    assert hits > 0  # some row stopped early, so the after-EOS case was exercised


def test_sampled_log_probs_equal_recomputed_ones(gen, params):
    assert_log_probs_recomputed(params, gen(jax.random.key(3), temperature=0.7), 0.7)


def assert_log_probs_recomputed(params, out, temperature):
    """The rollout's log-probs equal those of a full forward over prompt + response."""
    logp = response_outputs(
        CFG,
        params,
        jnp.asarray(PROMPTS),
        jnp.asarray(PMASK),
        out.response_ids,
        out.response_mask,
        temperature=temperature,
    )["log_prob"]
    m = np.asarray(out.response_mask).astype(bool)
    np.testing.assert_allclose(np.asarray(out.log_probs)[m], np.asarray(logp)[m], atol=1e-4)


def test_filter_logits_support():
    logits = jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    top2 = np.asarray(rollout.filter_logits(logits, top_k=2)) > -1e30
    np.testing.assert_array_equal(top2[0], [False, True, False, True, False])
    # Nucleus 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.15 is needed too; 0.1 and 0.05 are out.
    nuc = np.asarray(rollout.filter_logits(logits, top_p=0.75)) > -1e30
    np.testing.assert_array_equal(nuc[0], [False, True, False, True, True])
    nuc = np.asarray(rollout.filter_logits(logits, top_p=0.3)) > -1e30
    np.testing.assert_array_equal(nuc[0], [False, True, False, False, False])


def test_top_k_and_top_p_never_sample_outside_support():
    logits = jnp.tile(jnp.log(jnp.array([0.05, 0.4, 0.1, 0.3, 0.15])), (4096, 1))
    u = jax.random.uniform(jax.random.key(0), (4096,))
    for kw, allowed in (({"top_k": 2}, {1, 3}), ({"top_p": 0.75}, {1, 3, 4}), ({}, set(range(5)))):
        tok, _ = rollout.sample_token(
            u, logits, temperature=1.0, greedy=False, **{"top_k": 0, "top_p": 1.0, **kw}
        )
        assert set(np.unique(np.asarray(tok)).tolist()) == allowed


def test_sample_token_inverts_the_cdf():
    """probs [0.05, 0.4, 0.1, 0.3, 0.15] have the CDF [0.05, 0.45, 0.55, 0.85, 1.0]; a row with
    uniform u draws the first token whose CDF exceeds 1 - u (by hand below). With top-k 2 the
    renormalised support is {1: 4/7, 3: 3/7}, CDF 4/7 at token 1."""
    logits = jnp.tile(jnp.log(jnp.array([0.05, 0.4, 0.1, 0.3, 0.15])), (6, 1))
    u = jnp.array([0.99, 0.9, 0.6, 0.5, 0.2, 0.0])  # 1 - u = 0.01, 0.1, 0.4, 0.5, 0.8, 1.0
    kw = dict(temperature=1.0, top_p=1.0, greedy=False)
    tok, logp = rollout.sample_token(u, logits, top_k=0, **kw)
    np.testing.assert_array_equal(tok, [0, 1, 1, 2, 3, 4])
    np.testing.assert_allclose(logp, np.log([0.05, 0.4, 0.4, 0.1, 0.3, 0.15]), rtol=1e-5)
    tok, _ = rollout.sample_token(u, logits, top_k=2, **kw)  # 1 - u < 4/7 -> 1, else 3
    np.testing.assert_array_equal(tok, [1, 1, 1, 1, 3, 3])


def test_sample_token_never_draws_a_filtered_token_where_the_float32_cdf_dips():
    """A float32 prefix sum need not be monotone; two rows where counting `cdf < threshold`
    drew a zero-probability token. (a) top-k 4 of 8 logits, u = 0: the threshold is the total,
    which the scan puts one ulp above the cumulative sum at the last kept token (6), so the
    filtered token 7 was drawn. (b) top-k 12 of 16 (tokens 5, 7, 12, 14 filtered), u below: the
    filtered token 7 adds 0, yet its cumulative sum comes out one ulp below token 6's, and the
    threshold falls between the two, so 7 was drawn. The threshold lies at token 6's cumulative
    sum in both rows (a: the total, to one ulp; b: u = 1 - cdf_6 / total), and 6 is drawn."""
    kw = dict(temperature=1.0, top_p=1.0, greedy=False)
    a = jnp.array([[1.1, -2.0, 3.2, -0.2, -2.6, 1.5, 5.3, 0.3]])
    b = [5.9, 3.4, 0.8, -1.3, -0.8, -4.1, -0.7, -1.6, 0.4, 1.1, 1.4, -0.5, -2.5, 3.6, -2.7, 2.6]
    b = jnp.array([b])
    for logits, k, u in ((a, 4, 0.0), (b, 12, float.fromhex("0x1.09005p-3"))):
        tok, logp = rollout.sample_token(jnp.array([u]), logits, top_k=k, **kw)
        kept = np.asarray(rollout.filter_logits(logits, top_k=k))[0] > -1e30
        assert kept[int(tok[0])] and int(tok[0]) == 6
        np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[:, 6], rtol=1e-6)


def test_sampled_frequencies_follow_the_tempered_softmax():
    """20k draws at temperature 2 of logits log p: frequencies ~ p^(1/2), normalised."""
    p = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    n = 20000
    logits = jnp.tile(jnp.log(jnp.asarray(p)), (n, 1))
    u = jax.random.uniform(jax.random.key(3), (n,))
    tok, _ = rollout.sample_token(u, logits, temperature=2.0, top_k=0, top_p=1.0, greedy=False)
    want = np.sqrt(p) / np.sqrt(p).sum()
    got = np.bincount(np.asarray(tok), minlength=5) / n
    np.testing.assert_allclose(got, want, atol=0.015)  # ~4 standard errors


@pytest.mark.parametrize("shared", [True, False])
def test_prompt_prefilled_once_for_its_samples_matches_repeated_rows(params, shared):
    """samples=n (each prompt once, prefilled once, its cache copied into n rows; with `shared`
    the decode reads it once per group) samples what the same prompts repeated n times
    (samples=1) sample under the same key: the same tokens and masks, the same log-probs
    (float32 rounding apart)."""
    n = 4
    run = lambda ids, mask, samples: sample(
        rollout.generate,
        CFG,
        params,
        ids,
        mask,
        jax.random.key(7),
        **IDS,
        samples=samples,
        shared_prompt=shared,
    )
    once = jax.jit(run, static_argnums=2)(PROMPTS, PMASK, n)
    rows = jax.jit(run, static_argnums=2)(np.repeat(PROMPTS, n, 0), np.repeat(PMASK, n, 0), 1)
    assert once.response_ids.shape == (len(PROMPTS) * n, R)
    np.testing.assert_array_equal(once.response_ids, rows.response_ids)
    np.testing.assert_array_equal(once.response_mask, rows.response_mask)
    np.testing.assert_allclose(once.log_probs, rows.log_probs, rtol=1e-5, atol=1e-6)
    # the n samples of a prompt differ (they are samples, not copies)
    ids = np.asarray(once.response_ids).reshape(len(PROMPTS), n, R)
    assert any(len({tuple(r) for r in group}) > 1 for group in ids)


def test_the_prompt_is_shared_off_cpu_and_on_cpu_past_a_quarter_attention_block():
    quarter = CFG.attention_block_size // 4  # decode_attention's one materialised pass
    assert rollout.shares_prompt(CFG, 8, 16, backend="gpu")
    assert rollout.shares_prompt(CFG, 8, 16, backend="tpu")
    assert not rollout.shares_prompt(CFG, 8, 16, backend="cpu")
    assert not rollout.shares_prompt(CFG, quarter - 16, 16, backend="cpu")
    assert rollout.shares_prompt(CFG, quarter - 15, 16, backend="cpu")


def test_stop_ids_end_a_row_like_eos(params):
    """rollout.stop: a row ends at its first stop token (kept, mask 1), pad after; rows and
    log-probs up to there are those of the run without stop ids. eos_id=-1: only stops end."""
    key = jax.random.key(5)
    no_eos = {**IDS, "eos_id": -1}
    run = lambda stop_ids: sample(
        rollout.generate, CFG, params, PROMPTS, PMASK, key, **no_eos, stop_ids=stop_ids
    )
    free = run(())
    ids, logp = np.asarray(free.response_ids), np.asarray(free.log_probs)
    assert np.all(np.asarray(free.response_mask) == 1)
    stops = (int(ids[0, 1]), int(ids[1, 2]))  # tokens rows 0 and 1 draw early on
    out = run(stops)
    hits = 0
    for b in range(len(PROMPTS)):
        found = np.flatnonzero(np.isin(ids[b], stops))
        end = found[0] + 1 if len(found) else R
        hits += end < R
        np.testing.assert_array_equal(np.asarray(out.response_mask[b]), np.arange(R) < end)
        np.testing.assert_array_equal(np.asarray(out.response_ids[b, :end]), ids[b, :end])
        assert np.all(np.asarray(out.response_ids[b, end:]) == PAD)
        np.testing.assert_allclose(np.asarray(out.log_probs[b, :end]), logp[b, :end], atol=1e-6)
    assert hits >= 2


def test_forced_length_ends_each_row_at_its_length(gen, params):
    """`forced_length` (the benchmark's fixed lengths): row b's response is exactly L_b tokens,
    EOS last, no EOS before (this model samples EOS often unforced, see
    test_mask_is_one_through_first_eos_and_zero_after), pad after; its log-probs are the
    policy's own, as the full forward recomputes them."""
    lengths = np.array([1, 4, 6], np.int32)
    for seed in range(4):
        out = gen(jax.random.key(seed), temperature=0.7, forced_length=jnp.asarray(lengths))
        ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
        for row_ids, row_mask, length in zip(ids, mask, lengths):
            np.testing.assert_array_equal(row_mask, np.arange(R) < length)
            assert row_ids[length - 1] == EOS
            assert not np.any(row_ids[: length - 1] == EOS)
            assert np.all(row_ids[length:] == PAD)
        assert_log_probs_recomputed(params, out, 0.7)
        assert np.all(np.asarray(out.log_probs)[mask == 0] == 0)
