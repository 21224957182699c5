"""Stop strings inside the decode loop (`rollout.decode_step`, jrl/stop_strings.py): a row's turn
ends at the token whose bytes complete a stop string, however many tokens spell it, and not at a
token that holds only part of it; in the one-turn rollout (rollout.stop's strings) the row ends,
in the multi-turn one (the tags format's `</calc>` and rollout.stop's newline, with the real
tool host) the host is called.

The model's tokens are scripted (`force_ids`) on a tiny random model with the tiny byte-level
BPE of tests/helpers/text_tokenizers.py. Where each turn must end is worked out by decoding the
tokens with the tokenizer itself and searching the text; the tool's answers are written by hand;
the log-probs of model tokens are compared with one full forward over the same sequence. Where
the Gemma 3 270M package is installed, one greedy multi-turn rollout of the real model is checked
the same way."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gemma_tools_cpu
from jrl import models, multi_turn, rollout
from jrl import tokenizer as tokenizer_lib
from jrl.data import calc_products
from jrl.data.calc_products import EXAMPLES, example_text
from jrl.models import transformer as tfm
from jrl.stop_strings import StopStrings
from jrl.tools.host import make_tool_host
from conftest import tiny_model
from helpers.text_tokenizers import byte_bpe, real_gemma_path
from helpers.tools_fixtures import multi_turn_config

TOK = byte_bpe()
PAD, EOS = TOK.pad_token_id, TOK.eos_token_id
CFG = tiny_model(len(TOK))
PROMPT_TEXTS = ["Q: 12*3\nA:", "Q: 7*5\nA:", "Q:", "A: 1\nQ: 2"]


def ids_of(*pieces) -> list[int]:
    """Token ids of `pieces`, each the decoded text of one token (EOS as None)."""
    by_text = {TOK.decode([i]): i for i in range(len(TOK))}
    return [EOS if p is None else by_text[p] for p in pieces]


def left_padded(texts):
    rows = [TOK.encode(t, add_special_tokens=False) for t in texts]
    p = max(map(len, rows))
    ids = np.full((len(rows), p), PAD, np.int32)
    mask = np.zeros((len(rows), p), np.int32)
    for i, row in enumerate(rows):
        ids[i, p - len(row) :], mask[i, p - len(row) :] = row, 1
    return ids, mask


PROMPTS, PMASK = left_padded(PROMPT_TEXTS)


def reference_end(ids, strings, stop_ids=(EOS,), tok=TOK) -> int:
    """The index of the first token at which the decoded text of `ids` holds one of `strings`,
    or which is a stop id; -1 for none."""
    for k in range(len(ids)):
        text = tok.decode(list(ids[: k + 1]), skip_special_tokens=False)
        if ids[k] in stop_ids or any(s in text for s in strings):
            return k
    return -1


def full_forward_logprobs(params, prompts, pmask, ids_BR, valid_BR):
    """log pi(y_t | prompt, y_<t) (temperature 1) from one full forward over prompt + response,
    attending to every valid response token."""
    ids = jnp.concatenate([jnp.asarray(prompts), jnp.asarray(ids_BR)], 1)
    mask = jnp.concatenate([jnp.asarray(pmask), jnp.asarray(valid_BR)], 1)
    p = prompts.shape[1]
    logits = tfm.forward(CFG, params, ids, mask)[:, p - 1 : -1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids_BR)[..., None], -1)[..., 0])


@pytest.fixture(scope="module")
def params():
    return tfm.init_params(CFG, jax.random.key(3))


# -------------------------------------------------------------------------- one turn

R1 = 16
ONE_TURN = [
    # `</calc>` over six tokens: ends at `>` (index 10), not at `<`, `/`, `ca`, `l` or `c`
    [" ", "<calc>", "12", "*", "3", "<", "/", "ca", "l", "c", ">", " = ", "3", "6"],
    # `</ca` then `x`: no stop; `<` + `/calc>`: ends at index 6
    ["<", "/", "ca", "x", " ", "<", "/calc>", "y", "5"],
    # inside one token, with text after it: ends at `2</calc> = ` (index 2), kept whole
    ["1", "*", "2</calc> = ", "5", "5"],
    # `</b>`, `</calc` + ` >`: never a stop string; EOS at index 11 ends the row
    ["<", "/", "b", ">", "<", "/", "ca", "l", "c", " ", ">", None],
]
ONE_TURN_ENDS = [10, 6, 2, 11]  # by hand; the reference decoding must agree


@pytest.mark.parametrize("compact_min_rows", [0, 2])
def test_one_turn_rows_end_at_the_token_that_completes_a_stop_string(params, compact_min_rows):
    """rollout.stop's strings in the one-turn decode, plain and compacted (stages of 4 and 2
    rows: the rows' byte tails move with them): each row ends exactly where the decoded text
    first holds `</calc>`, kept with mask 1; pad and mask 0 after; tokens and log-probs up to
    there are those the full forward gives."""
    scripts = [ids_of(*row) for row in ONE_TURN]
    ends = [reference_end(s, ("</calc>",)) for s in scripts]
    assert ends == ONE_TURN_ENDS
    force = np.full((len(scripts), R1), -1, np.int32)
    for b, s in enumerate(scripts):
        force[b, : len(s)] = s
    stops = StopStrings.build(TOK, ("</calc>",))
    gen = jax.jit(
        lambda p, m, key, f: rollout.generate(
            CFG, params, p, m, key, max_new_tokens=R1, eos_id=EOS, pad_id=PAD,
            stop_strings=stops, force_ids=f, compact_min_rows=compact_min_rows,
        )
    )  # fmt: skip
    out = gen(PROMPTS, PMASK, jax.random.key(0), force)
    ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
    for b, (s, end) in enumerate(zip(scripts, ends)):
        np.testing.assert_array_equal(mask[b], np.arange(R1) <= end)
        np.testing.assert_array_equal(ids[b, : end + 1], s[: end + 1])
        assert (ids[b, end + 1 :] == PAD).all()
    ref = full_forward_logprobs(params, PROMPTS, PMASK, ids, mask)
    logps = np.asarray(out.log_probs)
    np.testing.assert_allclose(logps[mask == 1], ref[mask == 1], atol=1e-5, rtol=0)
    assert (logps[mask == 0] == 0).all()


def test_rollout_stop_reaches_the_rollouts():
    """rollout.stop's ids and strings as the run hands them on (`trainer.sampling_ids` ->
    `StepSpec.sampling_ids` -> the rollout's keywords): one-turn, the tables of its strings
    (of any number of tokens); with tools none, as the host's stops take them in."""
    from conftest import tiny_config
    from jrl import step as step_lib
    from jrl.run import trainer

    cfg = tiny_config(**{"rollout.stop": ("5=", 7, ";")})
    built = trainer.build(cfg)
    tok, task, reward_fn, model_cfg = built.tokenizer, built.task, built.reward_fn, built.model_cfg
    ids = trainer.sampling_ids(tok, task, cfg)
    assert ids["stop_ids"] == (7,) and ids["stop_strings"].strings == (b"5=", b";")
    spec = step_lib.make_spec(cfg, model_cfg, reward_fn, **ids)
    assert spec.sampling_ids == {**ids, "tool_host": None}
    cfg.rollout.multi_turn.enable, cfg.rollout.multi_turn.format = True, "compact"
    cfg.rollout.multi_turn.max_tool_response_length = 8
    ids = trainer.sampling_ids(tok, types.SimpleNamespace(max_response_length=64), cfg)
    assert ids["stop_strings"] is None and ids["tool_host"].stop_strings == ("5=", ";")
    assert ids["tool_host"].stop_ids == (tok.eos_token_id, tok.convert_tokens_to_ids(">"), 7)


# -------------------------------------------------------------------------- multi-turn

R2 = 40
# Each row: its model turns, each (pieces, the tool's answer to the turn's call or None: the
# row's episode ends there). The pieces end exactly at the token that ends the turn.
MULTI_TURN = [
    [  # `</calc>` over six tokens; the next turn ends at the newline (rollout.stop)
        ([" ", "<calc>", "12", "*", "3", "<", "/", "ca", "l", "c", ">"], "36"),
        ([". ", "A", "n", "sw", "er", ": ", "3", "6", "\n"], None),
    ],
    [  # a partial `</ca` first; the close inside `5</calc> = `; a second call; EOS
        (["<", "/", "ca", "x", " ", "<calc>", "7", "*", "5</calc> = "], "35"),
        (["<calc>", "2", "*", "2", "<", "/calc>"], "4"),
        ([" ", "o", "k", None], None),
    ],
    [(["\n"], None)],  # the newline at once: no call, the row ends after one token
    [(["<", "/", "b", ">", "<", "/", "ca", "l", "c", " ", ">", None], None)],  # never a stop
]


def expected_rows(r):
    """(ids, response_mask, valid, force_ids, model turns) of MULTI_TURN laid out by hand:
    each turn's model tokens, then the tool's block ` = <answer>` as the tokenizer spells it."""
    b = len(MULTI_TURN)
    ids = np.full((b, r), PAD, np.int32)
    mask, valid = np.zeros((b, r), np.int32), np.zeros((b, r), np.int32)
    force = np.full((b, r), -1, np.int32)
    turns = []
    for row, script in enumerate(MULTI_TURN):
        at = 0
        for pieces, answer in script:
            model = ids_of(*pieces)
            assert reference_end(model, ("</calc>", "\n")) == len(model) - 1, pieces
            ids[row, at : at + len(model)] = force[row, at : at + len(model)] = model
            mask[row, at : at + len(model)] = 1
            at += len(model)
            if answer is not None:
                block = TOK.encode(f" = {answer}", add_special_tokens=False)
                ids[row, at : at + len(block)] = block
                at += len(block)
        valid[row, :at] = 1
        turns.append(len(script))
    return ids, mask, valid, force, turns


def test_multi_turn_turns_end_at_stop_strings_and_tool_answers_follow(params):
    """The tags format's `</calc>` (the host's) and rollout.stop's newline pause rows in the
    multi-turn decode exactly where the decoded turn first holds them; the host parses the call
    and its answer is appended as text (mask 0); a turn with no call ends the row. Tokens,
    masks and log-probs of model tokens equal a full forward of the same sequence."""
    cfg = multi_turn_config(format="tags", max_assistant_turns=3, max_tool_response_length=8)
    cfg.rollout.stop = ("\n",)
    host = make_tool_host(cfg, TOK, max_response_length=R2)
    assert host.stop_strings == ("</calc>", "\n")
    ids_want, mask_want, valid_want, force, turns = expected_rows(R2)
    gen = jax.jit(
        lambda p, m, key, f: multi_turn.generate(
            CFG, params, p, m, key, host=host, max_new_tokens=R2, eos_id=EOS, pad_id=PAD,
            force_ids=f,
        )
    )  # fmt: skip
    out = gen(PROMPTS, PMASK, jax.random.key(0), force)
    ids, mask = np.asarray(out.response_ids), np.asarray(out.response_mask)
    np.testing.assert_array_equal(ids, ids_want)
    np.testing.assert_array_equal(mask, mask_want)
    np.testing.assert_array_equal(np.asarray(out.valid), valid_want)
    np.testing.assert_array_equal(np.asarray(out.assistant_turns), turns)
    tool_text = [TOK.decode(ids[b][(mask[b] == 0) & (valid_want[b] == 1)]) for b in range(4)]
    assert tool_text == [" = 36", " = 35 = 4", "", ""]
    ref = full_forward_logprobs(params, PROMPTS, PMASK, ids, valid_want)
    logps = np.asarray(out.log_probs)
    np.testing.assert_allclose(logps[mask == 1], ref[mask == 1], atol=1e-5, rtol=0)
    assert (logps[mask == 0] == 0).all()


# -------------------------------------------------------------------------- the real model


def test_real_gemma3_270m_multi_turn_rollout_token_for_token():
    """Gemma 3 270M (the GGUF package's weights), greedy, on a calc_products prompt whose worked
    examples all call: its first turn ends at the token that completes `</calc>` (Gemma writes
    `</` `calc` `>`), the call is parsed and the calculator's answer ` = <product>` follows as
    text (mask 0), the next turn ends at its newline; every model token is the full forward's
    argmax at its place and its log-prob the full forward's. About 90 s and 3.5 GB on 2 cores
    (loading the weights, compiling 18 layers); skipped without the package."""
    path = real_gemma_path()
    tok = tokenizer_lib.get_tokenizer(path)
    model_cfg = models.load_config(path)
    _, weights = models.load_pretrained(path)
    cfg = gemma_tools_cpu.get_config()
    r = cfg.data.max_response_length
    host = make_tool_host(cfg, tok, max_response_length=r)
    assert host.stop_strings == ("</calc>", "\n")
    prefix = "".join(example_text(a, b, True) for a, b, _ in EXAMPLES)
    task = calc_products.CalcProductsTask(tok, prefix=prefix, eval_size=1, seed=0)
    batch = task.eval_batch()
    prompts, pmask = batch["input_ids"], batch["attention_mask"]
    out = jax.jit(
        lambda w, p, m: multi_turn.generate(
            model_cfg, w, p, m, jax.random.key(0), host=host, max_new_tokens=r,
            eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, greedy=True,
        )
    )(weights, prompts, pmask)  # fmt: skip
    ids, mask = np.asarray(out.response_ids)[0], np.asarray(out.response_mask)[0]
    valid, logps = np.asarray(out.valid)[0], np.asarray(out.log_probs)[0]
    end = int(valid.sum())
    tool = np.flatnonzero((mask == 0) & (valid == 1))
    assert len(tool) and (np.diff(tool) == 1).all(), (mask, valid)  # one block
    start, stop = int(tool[0]), int(tool[-1]) + 1
    turn1, block, turn2 = ids[:start].tolist(), ids[start:stop].tolist(), ids[stop:end].tolist()
    ends = [reference_end(t, host.stop_strings, host.stop_ids, tok) for t in (turn1, turn2)]
    assert ends[0] == len(turn1) - 1  # at the token that completes `</calc>`
    assert ends[1] == len(turn2) - 1 or (ends[1] == -1 and end == r)  # its newline, or R full
    call = re.search(r"<calc>(.*?)</calc>", tok.decode(turn1)).group(1)
    a, b = map(int, call.strip().split("*"))
    assert block == tok.encode(f" = {a * b}", add_special_tokens=False)
    # (here: ` <calc>695*86</calc> = 59770. Answer: 59770\n`, the operands copied right)
    assert (a, b) == tuple(int(x[0]) for x in task.eval_problems)
    assert (mask[:end] == (np.arange(end) < start) | (np.arange(end) >= stop)).all()
    # the full forward of the same sequence (prompt, model and tool tokens)
    seq = jnp.concatenate([jnp.asarray(prompts), jnp.asarray(ids[None])], 1)
    att = jnp.concatenate([jnp.asarray(pmask), jnp.asarray(valid[None])], 1)
    p = prompts.shape[1]
    logits = jax.jit(lambda w, x, m: tfm.forward(model_cfg, w, x, m))(weights, seq, att)
    logits = np.asarray(logits[0, p - 1 : -1], np.float32)
    model = np.flatnonzero(mask == 1)
    top = logits[model].max(-1)
    chosen = logits[model, ids[model]]
    assert (chosen >= top - 1e-5).all()  # greedy: the argmax, up to float ties
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))[np.arange(r), ids]
    np.testing.assert_allclose(logps[model], ref[model], atol=1e-5, rtol=0)  # 1.3e-6 here
    assert (logps[mask == 0] == 0).all()
