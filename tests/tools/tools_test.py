"""Tests for jrl.tools: the calc tool, call formats, the tool host and multi-turn metrics.

Host-side only (no JAX compile). The HF path uses the tiny Qwen2-style tokenizer of
tests/helpers/tools_fixtures.py: byte level with no merges (one token per byte), Qwen's special
tokens, and a chat template written in Qwen's tool style (tool answers as `<tool_response>` blocks
in a user turn)."""

import json
import re
import shutil
import time

import numpy as np
import pytest

from helpers.tools_fixtures import QWEN_STYLE_TEMPLATE, TOOL_BLOCK, blocks, call_text, stat
from helpers.tools_fixtures import multi_turn_config, pause, qwen_style_tokenizer
from jrl import config, tools
from jrl.tokenizer import char_tokenizer
from jrl.tools import calc, python_tool, sandbox
from jrl.tools.host import STAT_NAMES, make_tool_host
from jrl.tools.metrics import multi_turn_metrics


# User tools, loaded by path as "tools_test:<name>".
def boom(expression: str) -> str:
    """Always fails."""
    raise RuntimeError("boom")


def sleepy(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "awake"


def rewarded(answer: str):
    """Returns a reward of 1 for the answer '42'."""
    return f"you said {answer}", float(answer == "42")


CALLS = []


def counted(x: int) -> str:
    """Counts its calls."""
    CALLS.append(x)
    return str(x)


@pytest.fixture(scope="module")
def qwen():
    return qwen_style_tokenizer()


@pytest.fixture(scope="module")
def char():
    return char_tokenizer()


# ----------------------------------------------------------------------------------------- calc


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*34", "408"),
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("10/4", "2.5"),
        ("1/3", "0.33333333"),
        ("2/3", "0.66666667"),
        ("-(3-5)*2", "4"),
        ("1.5*1.5", "2.25"),
        ("0.1+0.2", "0.3"),
        ("7-10", "-3"),
        (" 6 / ( 1 + 2 ) ", "2"),
        ("-1/8", "-0.125"),
        ("8-2-3", "3"),
        ("64/4/2", "8"),
        ("123456789*987654321", "121932631112635269"),
        (".5+1", "1.5"),
    ],
)
def test_calc_on_hand_computed_expressions(expression, value):
    assert calc.calc(expression) == value


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("1/0", "division by zero"),
        ("2+", "incomplete expression"),
        ("(1+2", "missing ')'"),
        ("1+2)", "unexpected ')'"),
        ("2**3", "unexpected '*'"),
        ("__import__('os')", "unexpected character '_'"),
        ("1..2", "bad number"),
        ("", "empty expression"),
        ("9" * 60 + "*" + "9" * 60, "more than 100 digits"),
    ],
)
def test_calc_refuses_what_is_not_arithmetic(expression, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        calc.calc(expression)


# ------------------------------------------------------------------------------------ truncation


@pytest.mark.parametrize(
    "side, expected",
    [
        ("left", [99, 5, 6, 7, 8, 9]),
        ("right", [0, 1, 2, 3, 4, 99]),
        ("middle", [0, 1, 2, 99, 8, 9]),
    ],
)
def test_truncation_sides(side, expected):
    ids = list(range(10))
    assert tools.truncate_tokens(ids, 6, side, [99]) == expected
    assert tools.truncate_tokens(ids, 10, side, [99]) == ids  # fits: unchanged
    assert len(tools.truncate_tokens(ids, 1, side, [99])) == 1  # no room for the marker: none


# ------------------------------------------------------------------------------------ hermes


def test_hermes_parses_one_several_and_malformed_calls(qwen):
    fmt = tools.FORMATS.get("hermes")(qwen, tools.resolve_tools("calc"))
    parse = lambda text: fmt.parse(qwen.encode(text, add_special_tokens=False))  # noqa: E731
    assert parse("The answer is 4.<|im_end|>") == []
    one = parse("Let me compute.\n" + call_text("calc", {"expression": "12*34"}))
    assert one == [tools.Call("calc", {"expression": "12*34"})]
    several = (
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>\n'
        "<tool_call>\n{bad json}\n</tool_call>\n"
        '<tool_call>\n["calc"]\n</tool_call><|im_end|>'
    )
    calls = parse(several)
    assert calls[:2] == [
        tools.Call("calc", {"expression": "1+1"}),
        tools.Call("search", {"q": "x"}),  # arguments given as a JSON string
    ]
    assert calls[2].name is None and calls[2].error.startswith("invalid JSON in tool call")
    assert calls[3].error == 'a tool call is {"name": ..., "arguments": {...}}'


def test_hermes_block_is_the_chat_template_diff(qwen):
    fmt = tools.FORMATS.get("hermes")(qwen, tools.resolve_tools("calc"))
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    assert fmt.stop_ids == (im_end,)
    expected = qwen.encode(TOOL_BLOCK.format("408"), add_special_tokens=False)
    assert fmt.render(["408"]) == expected
    # The same from the template directly: rendering with the message minus rendering without it,
    # cut after the assistant's <|im_end|> (the token the model emitted).
    conversation = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"expression": "1"}}}
            ],
        },
    ]
    schemas = [tools.TOOLS.get("calc").schema]
    without = qwen.apply_chat_template(conversation, tools=schemas, tokenize=False)
    with_msg = qwen.apply_chat_template(
        conversation + [{"role": "tool", "content": "408"}],
        tools=schemas,
        tokenize=False,
        add_generation_prompt=True,
    )
    prefix = without[: without.rindex("<|im_end|>") + len("<|im_end|>")]
    assert with_msg.startswith(prefix)
    assert fmt.render(["408"]) == qwen.encode(with_msg[len(prefix) :], add_special_tokens=False)
    full, head = (qwen.encode(t, add_special_tokens=False) for t in (with_msg, prefix))
    assert full[: len(head)] == head and fmt.render(["408"]) == full[len(head) :]  # in tokens
    # Two answers share one user turn, as Qwen renders consecutive tool messages.
    two = fmt.decode(fmt.render(["1", "2"]))
    assert two == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_thinking_template_is_accepted(qwen):
    # As Qwen3's: an assistant message shows its reasoning when it is the last message or has
    # reasoning of its own; the generation prompt opens a <think> block.
    thinking = QWEN_STYLE_TEMPLATE.replace(
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}",
        "{% else %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and (loop.last or m.reasoning_content) %}"
        "<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}{{ m.content }}",
    ).replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
    fmt = tools.FORMATS.get("hermes")(qwen_style_tokenizer(thinking), tools.resolve_tools("calc"))
    assert fmt.decode(fmt.render(["408"])) == TOOL_BLOCK.format("408") + "<think>\n"


def test_templates_that_cannot_render_tools_are_refused(qwen):
    calc_tools = tools.resolve_tools("calc")
    # The message count in a header: the rendering with a tool message changes its prefix.
    shifting = "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n" + (
        QWEN_STYLE_TEMPLATE
    )
    with pytest.raises(tools.FormatError, match="does not start with its rendering without"):
        tools.FORMATS.get("hermes")(qwen_style_tokenizer(shifting), calc_tools)
    plain = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(tools.FormatError, match="does not render the tool list"):
        tools.FORMATS.get("hermes")(qwen_style_tokenizer(plain), calc_tools)
    no_tool_role = QWEN_STYLE_TEMPLATE.replace("{{ m.content }}{{ '\\n</tool_response>' }}", "")
    with pytest.raises(tools.FormatError, match="does not render role 'tool' messages"):
        tools.FORMATS.get("hermes")(qwen_style_tokenizer(no_tool_role), calc_tools)
    raising = "{% if messages[-1].role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    with pytest.raises(tools.FormatError, match="cannot render a conversation with tool calls"):
        tools.FORMATS.get("hermes")(qwen_style_tokenizer(raising + QWEN_STYLE_TEMPLATE), calc_tools)
    # make_tool_host turns the refusal into a one-line ConfigError before anything compiles.
    with pytest.raises(config.ConfigError, match="^rollout.multi_turn.format='hermes': "):
        make_tool_host(multi_turn_config(), char_tokenizer(), max_response_length=512)


# ------------------------------------------------------------------------------------ the host


def test_host_answers_calls_and_ends_rows_without_one(qwen):
    cfg = multi_turn_config(max_assistant_turns=3, tools="calc,tools_test:rewarded")
    host = make_tool_host(cfg, qwen, max_response_length=400)
    assert host.stop_ids == (qwen.eos_token_id,)
    assert host.block_size == 24 + 256 + 2  # template tokens + answer + edge slack
    result = pause(
        host,
        qwen,
        [
            "Let me compute.\n" + call_text("calc", {"expression": "12*34"}),
            "It is 408.<|im_end|>",  # no call: the episode ends
            call_text("calc", {"expression": "1+1"}),  # third assistant turn: the limit
            call_text("calc", {"expression": "1+1"}),  # not waiting: untouched
            call_text("rewarded", {"answer": "42"}),
        ],
        r=400,
        before=["", "", "x" * 30, "", ""],
        waiting=[True, True, True, False, True],
        turns=[1, 2, 3, 1, 2],
    )
    out = blocks(result, qwen)
    assert out == [TOOL_BLOCK.format("408"), "", "", "", TOOL_BLOCK.format("you said 42")]
    assert result.block_len.tolist() == [len(qwen.encode(t)) for t in out]
    assert (result.block_ids[1:4] == qwen.pad_token_id).all()
    assert result.finished.tolist() == [False, True, True, False, False]
    assert result.reward.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert stat(result, "tool_calls") == [1, 0, 0, 0, 1]
    assert stat(result, "tool_turns") == [1, 0, 0, 0, 1]
    assert stat(result, "tool_tokens") == result.block_len.tolist()
    assert stat(result, "tool_reward") == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert result.block_ids.dtype == np.int32 and result.stats.dtype == np.float32
    assert result.block_ids.shape == (5, host.block_size)


def test_faults_answer_the_model_and_count(qwen):
    cfg = multi_turn_config(
        tools="calc,tools_test:boom,tools_test:sleepy", tool_timeout=0.3, max_parallel_calls=2
    )
    host = make_tool_host(cfg, qwen, max_response_length=1200)
    t0 = time.perf_counter()
    result = pause(
        host,
        qwen,
        [
            call_text("boom", {"expression": "1"}),
            call_text("sleepy", {"seconds": 5}),
            '<tool_call>{"name": "calc", "arguments": {"expression": "1"}</tool_call><|im_end|>',
            call_text("nope", {}),
            call_text("calc", {"expr": "1"}) + call_text("calc", {"expression": "1/0"}),
            call_text("sleepy", {"seconds": "long"}),
        ],
        r=1200,
    )
    assert time.perf_counter() - t0 < 3.0  # the sleeper is not waited for
    out = blocks(result, qwen)
    assert out[0] == TOOL_BLOCK.format("error: RuntimeError: boom")
    assert out[1] == TOOL_BLOCK.format("error: sleepy timed out after 0.3 s")
    assert out[2].startswith(TOOL_BLOCK.split("{}")[0] + "error: invalid JSON in tool call: ")
    assert out[3] == TOOL_BLOCK.format(
        "error: unknown tool 'nope'; the tools are calc, boom, sleepy"
    )
    assert out[4] == (
        "\n<|im_start|>user\n<tool_response>\nerror: calc is missing argument(s) expression\n"
        "</tool_response>\n<tool_response>\nerror: division by zero\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out[5] == TOOL_BLOCK.format(
        'error: argument seconds of sleepy must be of type number, got "long"'
    )
    assert result.finished.tolist() == [False] * 6  # every row goes on
    assert stat(result, "tool_calls") == [1, 1, 1, 1, 2, 1]
    assert stat(result, "tool_errors") == [1, 0, 1, 1, 2, 1]
    assert stat(result, "tool_timeouts") == [0, 1, 0, 0, 0, 0]
    assert stat(result, "tool_seconds")[1] == pytest.approx(0.3)


def test_turn_limit_runs_no_tool_and_extra_calls_are_ignored(qwen):
    CALLS.clear()
    cfg = multi_turn_config(tools="tools_test:counted", max_assistant_turns=2, max_parallel_calls=2)
    host = make_tool_host(cfg, qwen, max_response_length=800)
    three = "".join(call_text("counted", {"x": k}) for k in (1, 2, 3))
    result = pause(host, qwen, [three, call_text("counted", {"x": 9})], r=800, turns=[1, 2])
    assert CALLS == [1, 2]  # the third call of row 0 is ignored; row 1 is at its limit
    assert stat(result, "tool_calls") == [2, 0]
    assert result.finished.tolist() == [False, True]


def test_compact_format_round_trip_with_the_char_tokenizer(char):
    cfg = multi_turn_config(format="compact", max_tool_response_length=64, max_parallel_calls=4)
    host = make_tool_host(cfg, char, max_response_length=128)  # one call per turn: 4 is moot
    assert host.stop_ids == (2, char.convert_tokens_to_ids(">"))
    assert host.block_size == 2 + 64 + 2
    result = pause(
        host,
        char,
        ["<12*34>", "so <calc:2+2>", "<1/0>", "408<eos>", "oops>", "<12"],
        r=128,
        before=["", "", "", "<12*34>=408;", "", ""],
        waiting=[True, True, True, True, True, False],
    )
    assert blocks(result, char) == [
        "=408;",
        "=4;",
        "=error: division by zero;",
        "",
        "=error: '>' closes no call: write <expression>;",
        "",
    ]
    assert result.finished.tolist() == [False, False, False, True, False, False]
    assert stat(result, "tool_errors") == [0, 0, 1, 0, 1, 0]
    # The block is the characters themselves: decode(encode(block)) is the block.
    assert char.encode("=408;") == result.block_ids[0, :5].tolist()


@pytest.mark.parametrize(
    "side, cut, budget",
    [("middle", "=12..6;", "=1;"), ("right", "=123..;", "=1;"), ("left", "=..456;", "=6;")],
)
def test_answers_cut_to_their_limit_and_to_the_response_budget(char, side, cut, budget):
    cfg = multi_turn_config(
        format="compact", max_tool_response_length=5, tool_response_truncate_side=side
    )
    host = make_tool_host(cfg, char, max_response_length=20)
    # "123456" is 6 tokens: cut to 5 with the 2-token marker ".." (3 kept). Row 1 has 3 tokens of
    # room left (20 - 17): "=" + 1 answer token + ";" with no room for the marker.
    result = pause(host, char, ["<123455+1>", "<123455+1>"], r=20, before=["", "x" * 7])
    assert blocks(result, char) == [cut, budget]
    assert stat(result, "tool_truncated") == [1, 1]
    assert stat(result, "budget_truncated") == [0, 1]
    assert result.block_len.tolist() == [len(cut), 3]


def test_make_tool_host_refuses_what_cannot_run(qwen, char):
    with pytest.raises(config.ConfigError, match="not less than the response budget"):
        make_tool_host(multi_turn_config(format="compact"), char, max_response_length=200)
    with pytest.raises(config.ConfigError, match="cannot import module 'no_such_module'"):
        make_tool_host(multi_turn_config(tools="no_such_module:f"), qwen, max_response_length=999)
    with pytest.raises(config.ConfigError, match="made for the built-in character tokenizer"):
        make_tool_host(multi_turn_config(format="compact"), qwen, max_response_length=999)
    with pytest.raises(config.ConfigError, match="two tools are named 'calc'"):
        make_tool_host(multi_turn_config(tools="calc,calc"), qwen, max_response_length=999)


def test_user_tool_schema_from_its_signature():
    (t,) = tools.resolve_tools("tools_test:sleepy")
    assert t.schema == {
        "type": "function",
        "function": {
            "name": "sleepy",
            "description": "Sleeps.",
            "parameters": {
                "type": "object",
                "properties": {"seconds": {"type": "number"}},
                "required": ["seconds"],
            },
        },
    }
    assert tools.check_arguments(t, {"seconds": 1}) is None
    assert tools.check_arguments(t, {"seconds": True}) is not None  # a bool is not a number
    assert tools.check_arguments(t, {"seconds": 1, "x": 2}) == (
        "sleepy has no argument(s) x (valid: seconds)"
    )


# ------------------------------------------------------------------------------ config, metrics


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(tools="calc,calq"), "unknown tool 'calq' (did you mean 'calc'?)"),
        (dict(tools=""), "tools is empty"),
        (dict(tool_response_truncate_side="mid"), "truncate_side='mid' is unknown"),
        (dict(format="json"), "format='json' is unknown"),
        (dict(format="hermes"), "the character tokenizer has not"),
        (dict(max_tool_response_length=64), "do not fit in data.max_response_length=64"),
        (dict(tool_timeout=0.0), "tool_timeout=0.0 must be > 0"),
        (dict(max_parallel_calls=0), "max_parallel_calls=0 must be >= 1"),
    ],
)
def test_config_validation_names_the_field(fields, message):
    cfg = multi_turn_config(**{"format": "compact", "max_tool_response_length": 16, **fields})
    cfg.data.max_response_length = 64
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.validate(cfg)
    cfg.rollout.multi_turn.enable = False  # a switched-off block's settings are refused as such
    with pytest.raises(config.ConfigError, match=r"no effect while multi-turn tool use is off"):
        config.validate(cfg)


def test_multi_turn_metrics_by_hand():
    stats = np.zeros((2, len(STAT_NAMES)), np.float32)
    col = {n: i for i, n in enumerate(STAT_NAMES)}
    stats[0, [col["tool_turns"], col["tool_calls"], col["tool_errors"]]] = [2, 3, 1]
    stats[0, [col["tool_tokens"], col["tool_seconds"], col["host_seconds"]]] = [10, 0.5, 0.25]
    stats[1, [col["tool_timeouts"], col["tool_truncated"], col["tool_reward"]]] = [1, 1, 1.0]
    stats[1, [col["tool_calls"], col["tool_turns"], col["host_seconds"]]] = [1, 1, 0.25]
    stats[1, col["tool_seconds"]] = 2.0
    m = multi_turn_metrics(stats, np.array([3, 1]), np.array([30, 10]))
    expected = {
        "num_turns/mean": 4.5,  # row 0: 1 + 3 + 2 = 6; row 1: 1 + 1 + 1 = 3
        "num_turns/min": 3.0,
        "num_turns/max": 6.0,
        "tool_call_counts/mean": 2.0,
        "tool_call_counts/min": 1.0,
        "tool_call_counts/max": 3.0,
        "agent_loop/tool_calls/mean": 1.25,
        "agent_loop/tool_calls/min": 0.5,
        "agent_loop/tool_calls/max": 2.0,
        "tool_calls/errors": 1.0,
        "tool_calls/timeouts": 1.0,
        "tool_calls/truncated": 1.0,
        "tool_calls/budget_truncated": 0.0,
        "tool_calls/reward_mean": 0.5,
        "tool_calls/response_token_share": 0.25,  # 10 / 40
        "timing_s/tool_host": 0.5,
    }
    assert {k: float(v) for k, v in m.items()} == pytest.approx(expected)


# ------------------------------------------------------------------------------- the python tool


@pytest.mark.skipif(
    shutil.which(sandbox.BWRAP) is None,
    reason="the python tool's sandbox needs bwrap: apt-get install bubblewrap",
)
def test_python_tool_limits():
    python_tool.check_sandbox()  # bwrap is here: a sandbox that does not start is a failure
    run = python_tool.run_python
    assert run("print(6 * 7)") == "42"
    assert run("print(1)\n1/0") == "1\nZeroDivisionError: division by zero\n(exit status 1)"
    net = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=5)"
    assert run(net) == "OSError: [Errno 101] Network is unreachable\n(exit status 1)"
    assert run("while True: pass", cpu_s=1, wall_s=20) == "(killed: over 1 s of CPU time)"
    assert run("import time\ntime.sleep(30)", wall_s=0.5) == "(killed after 0.5 s)"
    assert run("x = bytearray(2 << 30)", memory_mb=256) == "MemoryError\n(exit status 1)"
    assert run("print('a' * 10000)", output_chars=8) == "aaaaaaaa\n(output truncated)"
    assert run("import os\nprint(os.getuid(), os.getcwd(), os.listdir('.'))") == (
        "65534 /tmp ['prog.py']"
    )


def test_python_tool_is_refused_without_a_sandbox(qwen, monkeypatch, tmp_path):
    """Checked when the host is built: no bwrap, or a bwrap that cannot make namespaces (what
    bwrap says where the kernel does not allow them), is one line naming the fix."""
    build = lambda: make_tool_host(  # noqa: E731
        multi_turn_config(tools="calc,python"), qwen, max_response_length=999
    )
    monkeypatch.setattr(sandbox, "BWRAP", "no-such-bwrap")
    with pytest.raises(
        config.ConfigError,
        match="^rollout.multi_turn.tools: python: .*install bubblewrap: apt-get install bubblewrap",
    ):
        build()
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create a new namespace, likely because the "
        "kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "BWRAP", str(fake))
    with pytest.raises(config.ConfigError, match=r"No permissions .*: enable user namespaces"):
        build()


def test_gsm8k_tools_config_lists_the_tools_in_its_chat_prompts(qwen, tmp_path):
    """configs/gsm8k_tools.py (tiny, with the Qwen-style tokenizer saved as a directory and three
    GSM8K records): it validates and builds, the chat prompts list calc as the template renders
    `tools=`, the hermes host accepts the template; with tools off the prompts list nothing."""
    from conftest import REPO

    from jrl.run import trainer

    qwen.save_pretrained(tmp_path / "tok")
    records = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    file_cfg = config.load_file(f"{REPO}/configs/gsm8k_tools.py").get_config("tiny")
    cfg = config.load_file(f"{REPO}/configs/gsm8k_tools.py").get_config("tiny")
    cfg.tokenizer, cfg.task.train_files = str(tmp_path / "tok"), str(tmp_path / "train.jsonl")
    cfg.task.eval_size, cfg.data.max_prompt_length = 1, 1024  # a byte per token here
    config.validate(cfg)
    built = trainer.build(cfg)
    tok, task = built.tokenizer, built.task
    listed = '<tools>\n{"type": "function", "function": {"name": "calc"'
    prompt = tok.decode(task.eval_batch()["input_ids"][0], skip_special_tokens=False)
    assert listed in prompt and prompt.endswith("<|im_start|>assistant\n")
    host = make_tool_host(cfg, tok, max_response_length=task.max_response_length)
    assert host.stop_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    cfg.rollout.multi_turn.enable = False
    config.reset_switched_off(cfg, file_cfg, ["--config.rollout.multi_turn.enable=False"])
    config.validate(cfg)
    prompt = tok.decode(trainer.build(cfg).task.eval_batch()["input_ids"][0])
    assert "<tools>" not in prompt and "What is" in prompt
