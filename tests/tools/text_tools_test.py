"""Tool calls written in the text (format `tags`, jrl/tools/formats.py) with stop strings
(jrl/stop_strings.py), on tiny real BPE tokenizers (tests/helpers/text_tokenizers.py), and the task
and config built on them (jrl/data/calc_products.py, configs/gemma_tools_cpu.py).

`run_turns` plays the decode loop's part as docs/multi_turn.md states it (a byte tail per row,
stepped with each token; a row waits at a stop id or when the tail's text holds a stop string;
the host is called; its block appended and the tail emptied), with scripted model tokens: the
host and the tables are the real ones, so what the loop gets from them is checked end to end.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import data, rewards
from jrl.config import ConfigError
from jrl.data import calc_products
from jrl.shaping import final_turn_mask
from jrl.tools import TOOLS
from jrl.tools.formats import FORMATS, Call, FormatError
from jrl.tools.host import STAT_NAMES, make_tool_host
from helpers.text_tokenizers import byte_bpe, sentencepiece_bpe
from helpers.tools_fixtures import blocks, multi_turn_config, pause, qwen_style_tokenizer

TOKENIZERS = [byte_bpe, sentencepiece_bpe]


def tags_host(tok, r=128, **fields):
    fields = {"max_tool_response_length": 64, **fields}
    cfg = multi_turn_config(format="tags", tools="calc", **fields)
    return make_tool_host(cfg, tok, max_response_length=r)


# -------------------------------------------------------------------------- the format


@pytest.mark.parametrize("make", TOKENIZERS)
def test_tags_parse(make):
    tok = make()
    fmt = FORMATS.get("tags")(tok, tags_host(tok).tools.values())
    parse = lambda text: fmt.parse(tok.encode(text, add_special_tokens=False))
    assert parse(" <calc>37*48</calc>") == [Call("calc", {"expression": "37*48"})]
    assert parse("A: <calc> 12 * 3 </calc> = ") == [Call("calc", {"expression": "12 * 3"})]
    # the nearest opening before the first closing tag; text after it (same token) is left
    assert parse("<calc>1+<calc>2*3</calc>x</calc>") == [Call("calc", {"expression": "2*3"})]
    assert parse("Answer: 1776\n") == []  # no closing tag: no call
    assert parse("<calc>37*48") == []
    (call,) = parse("37*48</calc>")
    assert call.name is None and call.error == "'</calc>' closes no call: write <calc>...</calc>"


def test_tags_parse_with_two_tools_takes_the_first_closing_tag():
    calc = TOOLS.get("calc")
    tok = byte_bpe()
    tools = [calc, dataclasses.replace(calc, name="add.v2")]
    fmt = FORMATS.get("tags")(tok, tools)
    assert fmt.stop_strings == ("</calc>", "</add.v2>")
    ids = tok.encode("<add.v2>1+1</add.v2><calc>2</calc>", add_special_tokens=False)
    assert fmt.parse(ids) == [Call("add.v2", {"expression": "1+1"})]
    with pytest.raises(FormatError, match="'a b' is not one"):
        FORMATS.get("tags")(tok, [dataclasses.replace(calc, name="a b")])


@pytest.mark.parametrize("make", TOKENIZERS)
def test_tags_render_is_text(make):
    tok = make()
    fmt = FORMATS.get("tags")(tok, tags_host(tok).tools.values())
    assert tok.decode(fmt.render(["1776"])) == " = 1776"
    # special-token strings in an answer stay text; its lines join into one
    block = fmt.render([f"a{tok.eos_token}\nb"])
    assert tok.decode(block, skip_special_tokens=False) == f" = a{tok.eos_token} b"
    assert tok.eos_token_id not in block
    assert fmt.overhead(1) == len(tok.encode(" = ", add_special_tokens=False))


# -------------------------------------------------------------------------- the host


@pytest.mark.parametrize("make", TOKENIZERS)
def test_host_advertises_the_stop_strings(make):
    tok = make()
    host = tags_host(tok)
    assert host.stop_ids == (tok.eos_token_id,)
    assert host.stop_strings == ("</calc>",)
    assert host.stop_tables.strings == (b"</calc>",) and host.stop_tables.width == 6
    cfg = multi_turn_config(format="tags", max_tool_response_length=16)
    cfg.rollout.stop = ("\n", 7)  # set past validate: rollout.stop joins the host's stops
    host = make_tool_host(cfg, tok, max_response_length=64)
    assert host.stop_strings == ("</calc>", "\n") and host.stop_ids == (tok.eos_token_id, 7)
    # the other formats have none
    assert FORMATS.get("hermes").stop_strings == () == FORMATS.get("compact").stop_strings


def test_a_stop_inside_a_call_is_refused():
    """rollout.stop joins the host's stops, except a stop whose text lies in a format's call
    before its end: every turn would end before its call closes (one line, before any
    compile)."""
    tok = byte_bpe()
    for stop, fmt, make in [
        (("<",), "tags", byte_bpe),
        (("</calc",), "tags", byte_bpe),
        (("\n",), "hermes", qwen_style_tokenizer),
        ((tok.convert_tokens_to_ids("/"),), "tags", byte_bpe),
    ]:
        cfg = multi_turn_config(format=fmt, max_tool_response_length=8)
        cfg.rollout.stop = stop
        with pytest.raises(ConfigError, match="occurs inside a call of format=") as e:
            make_tool_host(cfg, make(), max_response_length=64)
        assert "\n" not in str(e.value) and "leave it out of rollout.stop" in str(e.value)
    for stop in [("\n", "</calc>"), ("/calc>",), (tok.eos_token_id,)]:  # at the call's end: fine
        cfg = multi_turn_config(format="tags", max_tool_response_length=8)
        cfg.rollout.stop = stop
        make_tool_host(cfg, tok, max_response_length=64)


@pytest.mark.parametrize("make", TOKENIZERS)
def test_host_answers_tag_calls(make):
    tok = make()
    host = tags_host(tok)
    result = pause(
        host,
        tok,
        [" <calc>123*45</calc>", " <calc>1/0</calc>", ". Answer: 5535\n", "5</calc>"],
        r=128,
        before=["A:", "A:", "A: <calc>123*45</calc> = 5535", ""],
    )
    assert blocks(result, tok) == [" = 5535", " = error: division by zero", "", " = error: "
                                   "'</calc>' closes no call: write <calc>...</calc>"]  # fmt: skip
    assert result.finished.tolist() == [False, False, True, False]
    assert result.stats[:, STAT_NAMES.index("tool_errors")].tolist() == [0, 1, 0, 1]


def test_the_host_never_raises_on_random_turns():
    tok = byte_bpe()
    host = tags_host(tok, r=48, max_tool_response_length=16)
    rng = np.random.default_rng(0)
    pieces = [i for t, i in tok.get_vocab().items() if "calc" in t or "<" in t or ">" in t]
    for _ in range(20):
        ids = rng.choice(pieces + list(range(len(tok))), (8, 48)).astype(np.int32)
        length = rng.integers(1, 49, 8).astype(np.int32)
        result = host(ids, length, np.zeros(8, np.int32), np.ones(8, bool), np.ones(8, np.int32))
        assert (result.block_len <= 48 - length).all()


# -------------------------------------------------------------------------- the loop's part


def run_turns(host, tok, prompt_text, script, r=48):
    """Decodes one row as the loop must: `script` [texts] are the model's turns (each encoded
    as the tokenizer spells it; a turn's tokens stop feeding once the row waits). Returns the
    row's (response ids, response mask, number of host calls)."""
    stops = host.stop_tables
    step = jax.jit(stops.step)
    tail = stops.init(1)
    ids, mask, calls = [], [], 0
    turn_start, turns = 0, 1
    for text in script:
        for token in tok.encode(text, add_special_tokens=False):
            ids.append(token)
            mask.append(1)
            tail, hit = step(tail, jnp.asarray([token], jnp.int32))
            if bool(hit[0]) or token in host.stop_ids or len(ids) >= r:
                break
        if len(ids) >= r:
            break
        row = np.full((1, r), tok.pad_token_id, np.int32)
        row[0, : len(ids)] = ids
        one = lambda x: np.asarray([x], np.int32)
        res = host(row, one(len(ids)), one(turn_start), np.ones(1, bool), one(turns))
        calls += 1
        n = int(res.block_len[0])
        ids += res.block_ids[0, :n].tolist()
        mask += [0] * n
        if res.finished[0]:
            break
        tail = stops.reset(tail, jnp.asarray([n > 0]))
        turn_start, turns = len(ids), turns + 1
    del prompt_text
    return np.asarray(ids), np.asarray(mask), calls


@pytest.mark.parametrize("make", TOKENIZERS)
def test_a_call_answered_and_the_answer_restated(make):
    """The model's turn stops at `</calc>` (for the trained BPE, inside the token `5</calc>Ġ=Ġ`,
    whose ` = ` stays in the turn); the host's ` = 5535` follows; the next turn ends at the
    newline (rollout.stop); the reward reads only the last turn."""
    tok = make()
    cfg = multi_turn_config(format="tags", max_assistant_turns=3, max_tool_response_length=8)
    cfg.rollout.stop = ("\n",)
    host = make_tool_host(cfg, tok, max_response_length=48)
    script = [" <calc>123*45</calc> = and more", ". Answer: 5535\nQ: 1*1"]
    ids, mask, calls = run_turns(host, tok, "", script)
    text = tok.decode(ids.tolist())
    close = "</calc> = " if make is byte_bpe else "</calc>"  # a token that holds more text
    assert text == f" <calc>123*45{close} = 5535. Answer: 5535\n"
    assert calls == 2
    tool = tok.decode(ids[mask == 0].tolist())
    assert tool == " = 5535"
    final = np.asarray(final_turn_mask(jnp.asarray(mask[None]), jnp.ones((1, len(ids)), int)))
    assert tok.decode(ids[final[0] > 0].tolist()) == ". Answer: 5535\n"
    assert calc_products.final_answer([tok.decode(ids[final[0] > 0].tolist())], ["5535"]) == [1.0]


def test_a_row_without_a_call_ends_at_the_newline():
    tok = byte_bpe()
    cfg = multi_turn_config(format="tags", max_tool_response_length=8)
    cfg.rollout.stop = ("\n",)
    host = make_tool_host(cfg, tok, max_response_length=48)
    ids, mask, calls = run_turns(host, tok, "", [" Answer: 5535\nQ: 1*1"])
    assert tok.decode(ids.tolist()) == " Answer: 5535\n" and mask.all() and calls == 1


# -------------------------------------------------------------------------- the task


@pytest.fixture(scope="module")
def task():
    return calc_products.CalcProductsTask(byte_bpe(), eval_size=16, seed=3)


def test_task_batches(task):
    tok = byte_bpe()
    batch = task.train_batch(5, 6)
    assert batch["input_ids"].shape == (6, task.prompt_length)
    assert batch["split"].tolist() == [0] * 6
    assert task.train_batch(5, 6)["row_id"].tolist() == batch["row_id"].tolist()  # pure
    prompts = task.decode_responses(batch["input_ids"], batch["attention_mask"])
    truths = task.ground_truths_for(batch["split"], batch["row_id"])
    for text, truth in zip(prompts, truths):
        assert text.startswith(calc_products.TOOL_EXAMPLES + "Q: ") and text.endswith("\nA:")
        a, b = map(int, text.rsplit("Q: ", 1)[1][: -len("\nA:")].split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and str(a * b) == truth
    ev = task.eval_batch()
    assert ev["split"].tolist() == [1] * 16 and len(set(ev["row_id"].tolist())) == 16
    train_numbers = task.sample_train_numbers(0, 4096)
    assert not set(train_numbers.tolist()) & set(ev["row_id"].tolist())
    assert task.num_problems == 900 * 90
    assert task.max_response_length >= len(
        tok.encode(" <calc>999*99</calc> = 98901. Answer: 98901\n", add_special_tokens=False)
    )


def test_task_without_tools_shows_direct_answers():
    task = calc_products.CalcProductsTask(byte_bpe(), tools=False, eval_size=4)
    assert "<calc>" not in task.prefix and task.prefix.count("Answer:") == 4
    assert calc_products.TOOL_EXAMPLES.count("<calc>") == 3


@pytest.mark.parametrize(
    "response, score",
    [
        (". Answer: 37908\n", 1.0),
        (". Answer: 37,908", 1.0),
        (" <calc>729*52</calc> = 37908. Answer: 37908\nQ: 1*2", 1.0),  # a hallucinated call
        (". Answer: 37909\n37908", 0.0),  # the first line only
        ("\n37908", 0.0),
        (". Answer: 37908 or 1", 0.0),  # the last number
        ("", 0.0),
    ],
)
def test_final_answer_by_hand(response, score):
    assert calc_products.final_answer([response], ["37908"]) == [score]


def test_reward_reads_the_final_turn_in_the_step(task):
    """The task's reward as the step calls it (a host reward by path, on the final-turn mask):
    the tool's ` = 37908` never counts as the model's answer."""
    tok = byte_bpe()
    reward = rewards.get_reward("jrl.data.calc_products:final_answer", task, tok)
    (number,) = task.eval_batch()["row_id"][:1].tolist()
    a, b = task.operands([number])
    truth = str(int(a[0] * b[0]))
    parts = [
        [(" <calc>1*1</calc>", 1), (f" = {truth}", 0), (f". Answer: {truth}\n", 1)],
        [
            (" <calc>1*1</calc>", 1),
            (f" = {truth}", 0),
            (".\n", 1),
        ],  # the tool said it, not the model
        [(f" Answer: {truth}\n", 1)],
    ]
    r = 48
    ids = np.full((3, r), tok.pad_token_id, np.int32)
    mask, valid = np.zeros((3, r), np.int32), np.zeros((3, r), np.int32)
    for i, row in enumerate(parts):
        at = 0
        for text, model in row:
            piece = tok.encode(text, add_special_tokens=False)
            ids[i, at : at + len(piece)] = piece
            mask[i, at : at + len(piece)] = model
            valid[i, at : at + len(piece)] = 1
            at += len(piece)
    batch = {"row_id": np.full(3, number, np.int32), "split": np.ones(3, np.int32)}
    read = final_turn_mask(jnp.asarray(mask), jnp.asarray(valid))
    scores = jax.jit(lambda b, i, m: reward(b, i, m, eos_id=tok.eos_token_id))(
        batch, jnp.asarray(ids), read
    )
    assert np.asarray(scores).tolist() == [1.0, 0.0, 1.0]


def test_config_builds_its_task_and_host():
    """configs/gemma_tools_cpu.py with a tiny BPE tokenizer in place of Gemma's: the task and
    the host it names, and the same config without tools."""
    from configs import gemma_tools_cpu

    tok = byte_bpe()
    cfg = gemma_tools_cpu.get_config()
    task = data.make_task(cfg.task.name, tok, **data.task_options(cfg))
    assert task.tools and task.prefix == calc_products.TOOL_EXAMPLES
    host = make_tool_host(cfg, tok, max_response_length=cfg.data.max_response_length)
    assert host.stop_strings == ("</calc>", "\n")  # the tags' closing, rollout.stop's newline
    assert host.block_size < cfg.data.max_response_length
    cfg.rollout.multi_turn.enable = False
    plain = data.make_task(cfg.task.name, tok, **data.task_options(cfg))
    assert plain.prefix == calc_products.DIRECT_EXAMPLES
