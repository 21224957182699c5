"""Host rewards: GSM8K / MATH answer checking, time limits, user functions, pure_callback in jit."""

import textwrap
import time

import jax
import numpy as np
import pytest

from helpers.reward_batches import TEXTS, char_gsm8k_task, jitted, response_arrays, rows_of
from jrl import rewards
from jrl.rewards import math as m
from jrl.tokenizer import EOS_ID, char_tokenizer

# ---------------------------------------------------------------------------------------- GSM8K

GSM8K_TRUTH = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72"


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        ("She sold 48+24 = 72 clips.\n#### 72", GSM8K_TRUTH, 1.0),
        ("#### 72.00", GSM8K_TRUTH, 1.0),  # compared as numbers
        ("#### 1,234", "#### 1234", 1.0),  # thousands commas
        ("#### $1,234.50 dollars", "1234.5", 1.0),  # $, units; an extracted ground truth
        ("He is left with -3 dollars.", "#### -3", 1.0),  # no ####: the last number
        ("10-2=8", "#### 8", 1.0),  # "-" after a digit is not a sign
        ("#### 5 or maybe 6", "#### 5", 1.0),  # the first number after ####
        ("I think 5 #### 6", "#### 5", 0.0),  # #### wins over the last number
        ("#### 71", GSM8K_TRUTH, 0.0),
        ("The answer is .5", "#### 0.5", 1.0),
        ("I do not know.", "#### 5", 0.0),  # no answer
        ("#### ", "#### 5", 0.0),
    ],
)
def test_gsm8k_score(response, truth, expected):
    assert m.Gsm8kScore()([response], [truth]) == [expected]


def test_gsm8k_strict_fallback_and_format_score():
    score = m.Gsm8kScore(fallback="none", format_score=0.1)
    responses = ["The answer is 72", "#### 70", "#### 72"]
    assert score(responses, [GSM8K_TRUTH] * 3) == [0.0, 0.1, 1.0]
    with pytest.raises(ValueError, match="fallback='first'"):
        m.Gsm8kScore(fallback="first")


# ----------------------------------------------------------------------------------------- MATH

MATH_CASES = [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "Hence $\\boxed{\\dfrac12}$.", 1.0),
    ("\\boxed{0.5}", "$\\boxed{\\frac{1}{2}}$", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\boxed{(3,\\frac{\\pi}{2})}", 1.0),
    ("\\boxed{10^\\circ}", "\\boxed{10}", 1.0),
    ("\\boxed{5\\text{ cm}}", "The side is $\\boxed{5}$.", 1.0),
    ("\\boxed{1,000}", "\\boxed{1000}", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),  # a bare ground truth (MATH-500 "answer")
    ("\\boxed{x = 7}", "\\boxed{7}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\boxed{\\frac{1}{2}\\sqrt{3}}", 1.0),  # symbolic
    ("\\boxed{x^2+2x+1}", "\\boxed{(x+1)^2}", 1.0),  # symbolic
    ("\\boxed{\\frac{2}{\\sqrt{\\frac{16}{1}}}}", "\\boxed{\\frac12}", 1.0),  # nested braces
    ("\\fbox{7}", "\\boxed{7}", 1.0),
    ("first \\boxed{3}, finally \\boxed{4}", "\\boxed{4}", 1.0),  # the last box
    ("\\boxed{\\sqrt{2}}", "\\boxed{2}", 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\boxed{0.333}", 0.0),
    ("\\boxed{[0,1)}", "\\boxed{[0,1]}", 0.0),
    ("\\boxed{\\frac{1}{2}", "\\boxed{\\frac12}", 0.0),  # unclosed box: no answer
    ("the answer is 4", "\\boxed{4}", 0.0),  # no box
]


def test_boxed_extraction():
    assert m.last_boxed("a \\boxed{\\frac{1}{\\{2\\}}} b") == "\\frac{1}{\\{2\\}}"
    assert m.last_boxed("\\boxed 5$ and more") == "5"
    assert m.last_boxed("\\boxed{1} then \\fbox{2}") == "2"
    assert m.last_boxed("nothing") is None
    assert m.ground_truth_answer("so $\\boxed{\\frac{3}{4}}$") == "\\frac{3}{4}"
    assert m.ground_truth_answer(" 3/4 ") == "3/4"
    assert (
        m.normalize_answer("\\left( \\dfrac12, \\tfrac{3}{4} \\right)")
        == "(\\frac{1}{2},\\frac{3}{4})"
    )
    assert m.normalize_answer("12\\text{ cm}^2") == "12"
    assert m.normalize_answer("y = \\sqrt2") == "\\sqrt{2}"
    assert m.normalize_answer("\\$1{,}000.") == "1000"


@pytest.mark.parametrize("response,truth,expected", MATH_CASES)
def test_sympy_equal_in_process(response, truth, expected):
    pred = m.last_boxed(response)
    ok = pred is not None and m.sympy_equal(pred, m.ground_truth_answer(truth))
    assert float(ok) == expected


@pytest.mark.parametrize("backend", ["sympy", "math_verify"])
def test_math_score_through_workers(backend):
    if backend == "math_verify":
        pytest.importorskip("math_verify")
    score = m.MathScore(backend=backend, format_score=0.25, timeout_s=30.0, num_workers=2)
    try:
        responses, truths, _ = zip(*MATH_CASES)
        got = score(list(responses), list(truths))
        # A boxed wrong answer scores format_score, a missing box 0.
        want = [e if e == 1.0 or m.last_boxed(r) is None else 0.25 for r, _, e in MATH_CASES]
        assert got == want
        assert score.stats["checked"] == 16 and score.stats["timeouts"] == 0
        assert score.stats["symbolic"] >= 3 and score.stats["errors"] == 0
    finally:
        score.checker.close()


def test_format_score():
    boxed = m.FormatScore(style="boxed")
    assert boxed(["\\boxed{x}", "x = 3", "\\boxed{"], ["", "", ""]) == [1.0, 0.0, 0.0]
    gsm = m.FormatScore(style="gsm8k")
    assert gsm(["#### 3", "3", "#### x"], ["", "", ""]) == [1.0, 0.0, 0.0]


# --------------------------------------------------------------------------------- time limits


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    """A module `jrltesthelpers` on sys.path (passed on to worker processes)."""
    (tmp_path / "jrltesthelpers.py").write_text(
        textwrap.dedent(
            """
            import time

            def hang(pred, gt):
                time.sleep(600)

            def boom(pred, gt):
                raise RuntimeError("parser exploded")

            def length(responses, truths):
                return [float(len(r)) for r in responses]

            def raises_on_3(responses, truths):
                for r in responses:
                    if "3" in r:
                        raise ValueError("cannot score " + r)
                return [0.0] * len(responses)

            def one_score(responses, truths):
                return [0.0]

            def nan(responses, truths):
                return [1.0, float("nan")] + [0.0] * (len(responses) - 2)

            def text(responses, truths):
                return ["1.0"] * len(responses)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "jrltesthelpers"


def test_hanging_check_times_out_and_is_counted(helpers):
    checker = m.AnswerChecker(equal_fn=f"{helpers}:hang", timeout_s=0.3, num_workers=1)
    try:
        checker.start()  # worker start-up is not part of the answer's time limit
        t = time.monotonic()
        # "x+1" vs "y" needs the (hanging) symbolic check; "2" vs "2.0" is decided in-process.
        assert checker.equal(["x+1", "2", "x+1"], ["y", "2.0", "y"]) == [False, True, False]
        assert time.monotonic() - t < 3.0
        assert checker.stats["timeouts"] == 1  # the duplicate pair is checked once
        assert checker.stats["symbolic"] == 1 and checker.stats["checked"] == 3
        score = m.MathScore(checker=checker)
        assert score(["\\boxed{z}", "\\boxed{7}"], ["\\boxed{w}", "7"]) == [0.0, 1.0]
        assert checker.stats["timeouts"] == 2
    finally:
        checker.close()


def test_failing_check_counts_an_error(helpers):
    checker = m.AnswerChecker(equal_fn=f"{helpers}:boom", timeout_s=30.0, num_workers=1)
    try:
        assert checker.equal(["x+1"], ["y"]) == [False]
        assert checker.stats["errors"] == 1 and checker.stats["timeouts"] == 0
    finally:
        checker.close()
    checker = m.AnswerChecker(equal_fn=f"{helpers}:missing", num_workers=1)
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        checker.start()


# ------------------------------------------------------------------------ rewards inside jit


@pytest.fixture
def task(tmp_path):
    return char_gsm8k_task(tmp_path)


def test_gsm8k_reward_inside_jit_and_vmap(task):
    reward = rewards.get_reward("gsm8k", task)
    batch, (r, mk) = rows_of(task), response_arrays()
    scores = jitted(reward)(batch, r, mk)
    assert scores.dtype == np.float32 and scores.shape == (4,)
    np.testing.assert_array_equal(np.asarray(scores), [1.0, 0.0, 0.0, 1.0])
    stacked = jax.tree_util.tree_map(lambda x: np.stack([x, x]), batch)
    vmapped = jax.jit(jax.vmap(lambda b, r, mk: reward(b, r, mk, eos_id=EOS_ID)))
    out = vmapped(stacked, np.stack([r, r]), np.stack([mk, 1 - mk]))
    # The second copy reads only the tokens outside the first mask.
    np.testing.assert_array_equal(np.asarray(out), [[1, 0, 0, 1], [0, 0, 0, 0]])
    fmt = rewards.get_reward("format", task, task.tokenizer)
    np.testing.assert_array_equal(np.asarray(jitted(fmt)(batch, r, mk)), [1, 0, 1, 0])


def test_user_reward_by_path(task, helpers):
    batch, (r, mk) = rows_of(task), response_arrays()
    length = rewards.get_reward(f"{helpers}:length", task)
    np.testing.assert_array_equal(np.asarray(jitted(length)(batch, r, mk)), list(map(len, TEXTS)))
    same = rewards.get_reward(f"user:{helpers}:length", task, task.tokenizer)
    np.testing.assert_array_equal(np.asarray(jitted(same)(batch, r, mk)), list(map(len, TEXTS)))


def test_user_reward_by_file_path(task, tmp_path, monkeypatch):
    # Not on sys.path: loaded from its file, relative to the current directory or absolute.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_reward.py").write_text(
        "def ends_in_digit(responses, truths):\n"
        "    return [float(r[-1:].isdigit()) for r in responses]\n"
    )
    monkeypatch.chdir(tmp_path)
    batch, (r, mk) = rows_of(task), response_arrays()
    for path in ("sub/my_reward.py", str(tmp_path / "sub" / "my_reward.py")):
        reward = rewards.get_reward(f"{path}:ends_in_digit", task)
        # TEXTS: "#### 2", "so 3", "#### 4", "the answer is 42xxxx"
        np.testing.assert_array_equal(np.asarray(jitted(reward)(batch, r, mk)), [1, 1, 1, 0])
    with pytest.raises(ValueError, match="reward function file 'sub/nope.py' .* does not exist"):
        rewards.get_reward("sub/nope.py:f", task)
    with pytest.raises(ValueError, match="module 'sub/my_reward.py' has no attribute 'g'"):
        rewards.get_reward("sub/my_reward.py:g", task)


@pytest.mark.parametrize(
    "fn,message",
    [
        (
            "raises_on_3",
            "failed on sample 1 \\(split eval, row_id 0, response 'so 3'\\): ValueError: "
            "cannot score so 3",
        ),
        ("one_score", "returned 1 scores for 4 responses"),
        ("nan", "returned nan for sample 1 \\(split eval, row_id 0"),
        ("text", "returned '1.0' \\(str\\) for sample 0 \\(split eval, row_id 0"),
    ],
)
def test_user_reward_errors_name_the_sample(task, helpers, fn, message):
    reward = rewards.get_reward(f"{helpers}:{fn}", task)
    batch, (r, mk) = rows_of(task), response_arrays()
    with pytest.raises(Exception, match=f"reward '{helpers}:{fn}' {message}"):
        jax.block_until_ready(jitted(reward)(batch, r, mk))
    with pytest.raises(rewards.RewardError, match=message):  # the same check outside jit
        rewards.python.checked_scores(
            reward.score_fn, TEXTS, ["2"] * 4, name=fn, splits=[1] * 4, rows=[0, 0, 1, 1]
        )


def test_get_reward_errors(task, helpers):
    assert rewards.get_reward("arithmetic_exact_match") is rewards.arithmetic_exact_match
    names = "arithmetic_exact_match, arithmetic_final_answer, first_line, format, gsm8k, math"
    with pytest.raises(ValueError, match=f"unknown reward 'gsm9k'.*{names}"):
        rewards.get_reward("gsm9k", task)
    with pytest.raises(ValueError, match="reward 'math' scores decoded text.*needs the task"):
        rewards.get_reward("math")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        rewards.get_reward("no_such_pkg.mod:fn", task)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        rewards.get_reward(f"{helpers}:nope", task)
    with pytest.raises(ValueError, match="is a int, not callable"):
        rewards.get_reward(f"{helpers}:NOT_CALLABLE", task)
    with pytest.raises(ValueError, match="needs a task with ground truths"):
        rewards.get_reward(f"{helpers}:length", None, char_tokenizer())
    reward = rewards.get_reward("gsm8k", task)
    with pytest.raises(KeyError, match="needs batch\\['row_id'\\]"):
        reward({"split": np.zeros(4, np.int32)}, *response_arrays(), eos_id=EOS_ID)
    math_reward = rewards.get_reward("math", task, backend="sympy", timeout_s=2.0)
    assert math_reward.score_fn.checker.backend == "sympy"


def test_reward_options_bind_the_task_section():
    from jrl import config as config_lib

    t = config_lib.base_config().task
    t.format_score, t.math_backend, t.math_timeout_s, t.math_workers = 0.1, "sympy", 2.0, 3
    t.gsm8k_fallback = "none"
    t.reward = "math"
    want = dict(format_score=0.1, backend="sympy", timeout_s=2.0, num_workers=3)
    assert rewards.reward_options(t) == want
    t.reward = "gsm8k"
    assert rewards.reward_options(t) == dict(fallback="none", format_score=0.1)
    for name in ("format", "arithmetic_exact_match", "my_pkg.mod:fn"):  # nothing from the config
        t.reward = name
        assert rewards.reward_options(t) == {}


def test_sympy_parser_sees_only_whitelisted_text():
    for attack in ["__import__('os').system('true')", "(1).real", "x.__class__", "\\exec{1}"]:
        with pytest.raises(ValueError, match="unsupported characters"):
            m.latex_to_sympy(attack)
        assert m.sympy_equal(attack, "1") is False
    # Unknown names are products of single-letter symbols, never looked up: "exec" = e*x*e*c.
    assert m.sympy_equal("exec", "e^2 x c") is True
