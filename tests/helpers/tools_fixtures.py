"""The tool tests' shared pieces (tools_test, hostile_tools_test, text_tools_test,
stop_strings_test, stop_strings_loop_test, reward_input_test, multi_turn_hermes_step_test): a tiny
Qwen2-style tokenizer (byte level with no merges: one token per byte, Qwen's special tokens, and a
chat template written in Qwen's tool style: tool answers as `<tool_response>` blocks in a user
turn), the tool message it renders, a multi-turn config, and one call of a tool host with its
results read back."""

import json

import numpy as np
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jrl import config
from jrl.tools.host import STAT_NAMES

QWEN_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    '</tools>\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m.content }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' }}{{ c.function.name }}{{ \'", "arguments": \' }}'
    "{{ c.function.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# One tool message rendered after an assistant turn ended by <|im_end|>, written out by hand.
TOOL_BLOCK = (
    "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def qwen_style_tokenizer(template=QWEN_STYLE_TEMPLATE, extra_tokens=()):
    """The tiny Qwen-style tokenizer (module docstring), with `extra_tokens` added as whole
    tokens (tests/helpers/hermes_script.py: a tool call's JSON in one token)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.add_tokens(list(extra_tokens))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template
    return fast


def multi_turn_config(**fields):
    cfg = config.base_config()
    cfg.rollout.multi_turn.enable = True
    for k, v in fields.items():
        cfg.rollout.multi_turn[k] = v
    return cfg


def pause(host, tok, turns_text, *, r, before=None, waiting=None, turns=None):
    """One host call: row b holds `before[b]` then the turn `turns_text[b]` (a string, encoded)."""
    b = len(turns_text)
    before = before or [""] * b
    ids = np.full((b, r), tok.pad_token_id, np.int32)
    start, length = np.zeros(b, np.int32), np.zeros(b, np.int32)
    for i, (pre, turn) in enumerate(zip(before, turns_text)):
        pre_ids = tok.encode(pre, add_special_tokens=False)
        turn_ids = tok.encode(turn, add_special_tokens=False)
        row = pre_ids + turn_ids
        ids[i, : len(row)] = row
        start[i], length[i] = len(pre_ids), len(row)
    waiting = np.ones(b, bool) if waiting is None else np.asarray(waiting)
    turns = np.ones(b, np.int32) if turns is None else np.asarray(turns, np.int32)
    return host(ids, length, start, waiting, turns)


def blocks(result, tok):
    return [
        tok.decode(result.block_ids[i, : result.block_len[i]].tolist())
        for i in range(len(result.block_len))
    ]


def stat(result, name):
    return result.stats[:, STAT_NAMES.index(name)].tolist()


def call_text(name, arguments):
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call><|im_end|>"
