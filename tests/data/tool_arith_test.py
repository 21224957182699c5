"""The tool_arith task (jrl/data/tool_arith.py): its warm-up demonstrations and their masks, the
final-answer reward on completions with tool blocks, and the tool_math config."""

import jax.numpy as jnp
import numpy as np
import pytest

from jrl import config as config_lib
from jrl import data
from jrl import shaping
from jrl.data.arithmetic import ArithmeticTask, Problems
from jrl.data.tool_arith import ToolArithTask
from jrl.rewards import arithmetic_final_answer, final_answer_match
from jrl.tokenizer import CHAR_VOCAB, EOS_ID, PAD_ID, char_tokenizer
from jrl.tools import TOOLS, FORMATS

from conftest import REPO


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def ids(text):
    """Character ids by hand from the vocabulary table (one token per character)."""
    return [CHAR_VOCAB.index(ch) for ch in text]


def test_demonstrations_by_hand(tok):
    task = ToolArithTask(tok, num_digits=3, ops=("*",), eval_size=4)
    # longest: "<999*999>" (9) + "=" ";" (2) + two 6-digit answers (12) + eos (1)
    assert task.max_response_length == 24
    problems = Problems(a=np.array([123, 7]), op=np.array(["*", "*"]), b=np.array([456, 8]))
    out = task.demonstrations(problems, np.array([True, False]))
    row0 = ids("<123*456>=56088;56088") + [EOS_ID]
    assert out["sft_ids"][0].tolist() == row0 + [PAD_ID] * (24 - 22)
    assert out["sft_mask"][0].tolist() == [1] * 22 + [0] * 2
    # trained: the call (9) and the final answer + eos (6), not the tool's "=56088;" (7)
    assert out["sft_loss_mask"][0].tolist() == [1] * 9 + [0] * 7 + [1] * 6 + [0] * 2
    assert out["sft_ids"][1].tolist() == ids("56") + [EOS_ID] + [PAD_ID] * 21
    assert out["sft_mask"][1].tolist() == out["sft_loss_mask"][1].tolist() == [1] * 3 + [0] * 21
    # the choice to call not trained (a demonstration outside tool_call_share): the same row
    # with its opening "<" masked; a bare answer is unchanged
    copy = task.demonstrations(problems, np.array([True, False]), np.array([False, False]))
    np.testing.assert_array_equal(copy["sft_ids"], out["sft_ids"])
    assert copy["sft_loss_mask"][0].tolist() == [0] + [1] * 8 + [0] * 7 + [1] * 6 + [0] * 2
    assert copy["sft_loss_mask"][1].tolist() == out["sft_loss_mask"][1].tolist()


def test_tool_call_share_of_the_warm_up(tok):
    """tool_demos 0.5, tool_call_share 0.2 over 2000 rows: about half the rows are
    demonstrations, a fifth of those train their "<" (binomial bounds, 5 standard deviations)."""
    task = ToolArithTask(tok, num_digits=3, ops=("*",), tool_demos=0.5, tool_call_share=0.2)
    warm = task.train_batch(0, 2000, stream=1)
    demo = warm["sft_ids"][:, 0] == CHAR_VOCAB.index("<")
    trained = demo & (warm["sft_loss_mask"][:, 0] == 1)
    assert abs(demo.sum() - 1000) < 5 * np.sqrt(2000 * 0.25)
    assert abs(trained.sum() - 0.2 * demo.sum()) < 5 * np.sqrt(demo.sum() * 0.16)
    assert (warm["sft_loss_mask"][~demo, 0] == 1).all()  # bare answers train their first digit
    with pytest.raises(ValueError, match="tool_call_share=1.5"):
        ToolArithTask(tok, tool_call_share=1.5)


def test_demonstration_matches_the_real_tool_and_format(tok):
    """The block the warm-up shows is the one the compact host appends for calc's answer, and the
    call parses as that calc call."""
    calc = TOOLS.get("calc")
    fmt = FORMATS.get("compact")(tok, [calc])
    (call,) = fmt.parse(ids("<123*456>"))
    assert (call.name, call.arguments, call.error) == ("calc", {"expression": "123*456"}, None)
    answer = calc.fn(**call.arguments)
    assert fmt.render([answer]) == ids("=56088;")


def test_warmup_batches_carry_demonstrations_and_rl_batches_do_not(tok):
    kw = dict(num_digits=3, ops=("*",), eval_size=4, seed=5)
    plain, half = ArithmeticTask(tok, max_response_length=24, **kw), ToolArithTask(tok, **kw)
    rl = half.train_batch(3, 64)
    assert "sft_ids" not in rl
    for key, value in plain.train_batch(3, 64).items():  # the arithmetic task's problems
        np.testing.assert_array_equal(rl[key], value)
    warm = half.train_batch(3, 64, stream=1)
    np.testing.assert_array_equal(
        warm["answer_ids"], plain.train_batch(3, 64, stream=1)["answer_ids"]
    )
    calls = warm["sft_ids"][:, 0] == CHAR_VOCAB.index("<")
    assert 0 < calls.sum() < 64  # a share, drawn per row
    again = ToolArithTask(tok, **kw).train_batch(3, 64, stream=1)
    np.testing.assert_array_equal(again["sft_ids"], warm["sft_ids"])  # a function of the step
    none = ToolArithTask(tok, tool_demos=0.0, **kw).train_batch(3, 64, stream=1)
    np.testing.assert_array_equal(none["sft_ids"], warm["answer_ids"])  # bare answers only
    np.testing.assert_array_equal(none["sft_loss_mask"], warm["answer_mask"])
    every = ToolArithTask(tok, tool_demos=1.0, **kw).train_batch(3, 64, stream=1)
    assert (every["sft_ids"][:, 0] == CHAR_VOCAB.index("<")).all()


def _row(parts, width=24):
    """(ids, reward mask) of a response: the text up to "|", then padding; "$" is eos; a block
    "=...;" is the tool's (response_mask 0, valid 1), the rest the model's. The reward mask is
    what the step hands the reward: `shaping.final_turn_mask` of the two."""
    text, _, pad = parts.partition("|")
    row = [EOS_ID if ch == "$" else CHAR_VOCAB.index(ch) for ch in text + pad]
    model, in_block = [], False
    for ch in text:
        in_block = in_block or ch == "="
        model.append(0 if in_block else 1)
        in_block = in_block and ch != ";"
    valid = [1] * len(text) + [0] * (width - len(text))
    model = model + [0] * (width - len(text))
    mask = shaping.final_turn_mask(jnp.asarray([model]), jnp.asarray([valid]))[0]
    return row + [PAD_ID] * (width - len(row)), np.asarray(mask).tolist()


@pytest.mark.parametrize(
    "text, score",
    [
        ("<123*456>=56088;56088$", 1.0),
        ("<123*456>=56088;56089$", 0.0),  # a wrong final answer
        ("56088$", 1.0),  # no tool: the bare answer
        ("56088$|7", 1.0),  # padding after the end is ignored
        ("56088$7", 1.0),  # as is anything after the first eos
        ("<123*456>=56088;$", 0.0),  # no final answer
        ("<123*456>=56088;", 0.0),  # the tool's answer alone, the row cut after it
        ("<123*456>=56088;56088", 0.0),  # no eos (the row was cut)
        ("<123*456>=56088;5608$", 0.0),
        ("<123*456>=56088;056088$", 0.0),
        ("<1*2>=2;<123*456>=56088;56088$", 1.0),  # the answer after the last block
        ("<123*456>=56088;56088;$", 0.0),
        ("<123*456>=56088;56088$;", 1.0),  # a ";" after the eos is not read
        ("<123*456>=1;56088$", 1.0),  # the final answer counts, not the block's
        ("5608856088$", 0.0),
    ],
)
def test_final_answer_reward_on_hand_made_completions(text, score):
    row, mask = _row(text)
    batch = {"answer_ids": np.array([ids("56088") + [EOS_ID]]), "answer_len": np.array([5])}
    got = arithmetic_final_answer(batch, np.array([row]), np.array([mask]), eos_id=EOS_ID)
    assert got.tolist() == [score]


def test_final_answer_reward_batched_and_at_the_row_end():
    """Rows scored independently; an answer whose eos fills the last slot counts."""
    rows = [_row(t, width=12) for t in ("<3*4>=12;12$", "12$", "<3*4>=12;1$", "<3*4>=12;12")]
    ids_, mask = (np.array(x) for x in zip(*rows))
    answers = np.array([ids("12") + [EOS_ID]] * 4)
    got = final_answer_match(ids_, mask, answers, np.full(4, 2), eos_id=EOS_ID)
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_tool_math_config_and_its_no_tools_run():
    c = config_lib.load_file(f"{REPO}/configs/tool_math.py").get_config()
    config_lib.validate(c)
    assert (data.task_options(c)["tool_demos"], data.task_options(c)["tool_call_share"]) == (
        0.5,
        0.2,
    )
    # without tools (--config.rollout.multi_turn.enable=False) the warm-up shows bare answers;
    # the file's other multi-turn settings go back to their defaults, as the command line does
    file_c = config_lib.load_file(f"{REPO}/configs/tool_math.py").get_config()
    c.rollout.multi_turn.enable = False
    config_lib.reset_switched_off(c, file_c, ["--config.rollout.multi_turn.enable=False"])
    assert c.rollout.multi_turn.format == "hermes"  # the default again
    config_lib.validate(c)
    assert data.task_options(c)["tool_demos"] == 0.0
    c.task.tool_demos = 1.5
    with pytest.raises(config_lib.ConfigError, match=r"task.tool_demos=1.5 must be a share"):
        config_lib.validate(c)
    c.task.tool_demos, c.task.tool_call_share = 0.5, -0.1
    with pytest.raises(config_lib.ConfigError, match=r"task.tool_call_share=-0.1 must be a share"):
        config_lib.validate(c)


def test_warmup_trains_the_models_tokens_not_the_tools(tok):
    """The warm-up loss on a demonstration is the mean negative log-likelihood of the call and the
    final answer only, computed here from a plain forward over prompt + demonstration."""
    import jax
    from conftest import tiny_config, tiny_model

    from jrl import sft
    from jrl.models import transformer

    task = ToolArithTask(tok, num_digits=3, ops=("*",), eval_size=4)
    problems = Problems(a=np.array([123, 905]), op=np.array(["*", "*"]), b=np.array([456, 311]))
    batch = {**task.encode(problems), **task.demonstrations(problems, np.array([True, False]))}
    model_cfg = tiny_model(len(tok))
    params = transformer.init_params(model_cfg, jax.random.key(0))
    tx, step = sft.make_sft_step(tiny_config(), model_cfg)
    _, _, loss = step(params, tx.init(params), batch)

    # Reference: both prompts have 3-digit operands, so no padding; a plain causal forward.
    seq = np.concatenate([batch["input_ids"], batch["sft_ids"]], axis=1)
    hidden, head, *_ = transformer.full_forward(model_cfg, params, seq, np.ones_like(seq))
    logp = jax.nn.log_softmax(transformer.lm_logits(model_cfg, hidden, head), axis=-1)
    p = batch["input_ids"].shape[1]
    target_logp = np.take_along_axis(
        np.asarray(logp[:, p - 1 : -1]), batch["sft_ids"][..., None], axis=-1
    )[..., 0]
    trained = np.zeros_like(batch["sft_ids"])
    trained[0, :9] = trained[0, 16:22] = 1  # "<123*456>", then "56088<eos>" after "=56088;"
    trained[1, :7] = 1  # "281455<eos>"
    assert batch["sft_ids"][1, :6].tolist() == ids("281455")
    expected = -np.sum(target_logp * trained) / trained.sum()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    all_tokens = -np.sum(target_logp * batch["sft_mask"]) / batch["sft_mask"].sum()
    assert abs(float(loss) - all_tokens) > 1e-3  # the tool's tokens would change it
