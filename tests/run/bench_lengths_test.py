"""W3's forced response lengths (jrl.run.benchmark): the drawn distribution, and the fused step of
a tiny workload honouring them."""

import jax
import numpy as np

from jrl import step as step_lib
from jrl import tokenizer
from jrl.run import benchmark
from conftest import tiny_model


def test_w3_lengths_are_fixed_long_tailed_with_mean_a_quarter_of_the_budget():
    a, b = benchmark.response_lengths("W3"), benchmark.response_lengths("W3")
    np.testing.assert_array_equal(a, b)  # the same lengths every run
    assert a.shape == (128,) and a.min() >= 1 and a.max() == 512
    assert 0.22 < a.mean() / 512 < 0.28 and np.median(a) < a.mean()  # long right tail
    np.testing.assert_array_equal(benchmark.response_lengths("W3", fixed_length=True), 512)
    assert benchmark.response_lengths("W2") is None


def test_token_shares_count_real_positions_per_phase():
    """Hand-counted: 2 prompts x 2 samples, P = 4 (3 and 2 real tokens), R = 8, lengths 2, 4, 8,
    2. decode: 16 real of 4 x 8. Full forwards: prompts twice each, (2 x 5 + 16) / (4 x 12);
    a shared-prompt forward: (5 + 16) / (2 x 4 + 4 x 8)."""
    cfg = benchmark.workload_config("W1")
    cfg.rollout.n = 2
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 2
    cfg.data.max_response_length = 8
    model_cfg = tiny_model(16)
    pmask = np.array([[0, 1, 1, 1], [0, 0, 1, 1]])
    lengths = np.array([2, 4, 8, 2])
    for shared, update in ((False, 26 / 48), (True, 21 / 40)):
        cfg.model.shared_prompt_forward = shared
        spec = step_lib.make_spec(cfg, model_cfg, None, eos_id=1, pad_id=0, max_new_tokens=8)
        shares = benchmark.token_shares(spec, pmask, lengths)
        assert shares["decode"] == 0.5
        assert shares["update"] == round(update, 4)
        assert shares["scoring"] is None  # on-policy GRPO: no scoring forward


def test_decode_row_steps_follow_the_compacted_stages():
    """Hand-counted, lengths 1, 1, 1, 1, 2, 2, 3, 8 under R = 8: stages 8, 4, 2 run 8 rows at
    t = 0 (8 live), 4 at t = 1 (4 live), 2 from t = 2 (2 live, then 1) to t = 7: 8 + 4 + 6 x 2;
    without compaction 8 rows x 8 steps."""
    lengths = np.array([1, 1, 1, 1, 2, 2, 3, 8])
    assert benchmark.decode_row_steps(lengths, 8, (8, 4, 2)) == 24
    assert benchmark.decode_row_steps(lengths, 8, (8,)) == 64
    # longest 2 tokens: 6 live at t = 0 (8 rows), 2 at t = 1 (the 4-row stage is skipped)
    assert benchmark.decode_row_steps(lengths[:6], 8, (8, 4, 2)) == 8 + 2


def test_token_shares_count_bucketed_micro_batches():
    """The counts of test_token_shares_count_real_positions_per_phase, with response buckets
    (2, 4) and 2 micro-batches of 2 rows, rows ordered by length: ends 2, 2 (width 2) and 4, 8
    (width 8); prompts once per row: (2 x 5 + 16) / (4 x 4 + 2 x 2 + 2 x 8)."""
    cfg = benchmark.workload_config("W1")
    cfg.rollout.n = 2
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 2
    cfg.data.max_response_length = 8
    cfg.actor.ppo_micro_batch_size_per_device = 2
    cfg.model.shared_prompt_forward = False
    cfg.model.response_buckets = (2, 4)
    spec = step_lib.make_spec(cfg, tiny_model(16), None, eos_id=1, pad_id=0, max_new_tokens=8)
    shares = benchmark.token_shares(spec, np.array([[0, 1, 1, 1], [0, 0, 1, 1]]), [2, 4, 8, 2])
    assert shares["update"] == round(26 / 36, 4)


def test_the_step_forces_the_workload_lengths():
    """The spec's `forced_length` reaches the rollout: W1's generate phase with lengths 1..16
    (EOS real, so the random model would stop rows at will) returns exactly those lengths, and
    the reward sees them (the step's response_length metrics)."""
    w = benchmark.setup("W1")
    rows = w.batch["input_ids"].shape[0] * w.cfg.rollout.n
    lengths = np.arange(rows) % 16 + 1
    eos = tokenizer.char_tokenizer().eos_token_id
    ids = {**w.ids, "eos_id": eos, "forced_length": lengths}
    generate, _, _ = step_lib.make_phases(w.cfg, w.model_cfg, w.reward_fn, **ids)
    exp, _ = jax.jit(generate)(w.state, w.batch, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(exp["response_mask"]).sum(-1), lengths)
    last = np.asarray(exp["response_ids"])[np.arange(rows), lengths - 1]
    np.testing.assert_array_equal(last, eos)
