"""The scripted tool-calling model of the multi-turn `hermes` step tests
(multi_turn_hermes_step_test, hostile_tools_test).

The model is scripted: a tiny decoder whose next token depends on the current token only (each
token's embedding is a one-hot "slot", attention and MLP write nothing, an untied head maps a slot
to the next token's logits). With the tiny Qwen-style tokenizer of tools_fixtures.py plus one
token per tool-call JSON body (`BODIES`), every assistant turn is

    <tool_call> BODY </tool_call> <|im_end|>

with BODY sampled among `BODIES` (greedy: `good`). The host pauses the row at `<|im_end|>`, runs
or refuses the call, and appends the rendered tool message; the block's last token leads to
`<tool_call>` again, so each row makes `TURNS` assistant turns (the calls of the last one are not
run). A `Recorder` around the host keeps every pause's inputs and results."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jrl.run import trainer

BODIES = {  # each one token of the test tokenizer; "good" first: the greedy choice
    "good": '{"name": "calc", "arguments": {"expression": "12*34"}}',
    "bad_json": '{"name": "calc", "arguments": {"expression": "12*34"}',  # a brace short
    "unknown": '{"name": "nope", "arguments": {}}',
    "wrong_args": '{"name": "calc", "arguments": {"expr": "12*34"}}',
}
TURNS = 3  # assistant turns per row: two calls run, the third turn's is not
# Every row's turns fit (4 tokens each, blocks of at most 92: bad_json's) with room to spare: a
# row is never full, so each ends at a pause of its last turn.
R = TURNS * 4 + 2 * 92 + 4
HERMES = {
    "warmup.sft_steps": 0,
    "data.max_response_length": R,
    "rollout.multi_turn.enable": True,
    "rollout.multi_turn.format": "hermes",
    "rollout.multi_turn.tools": "calc",
    "rollout.multi_turn.max_assistant_turns": TURNS,
    "rollout.multi_turn.max_tool_response_length": 80,
}
LOGIT = 30.0  # of the scripted next token; every other token has 0 (exp(-30): never sampled)


def scripted_reward(batch, response_ids, response_mask, *, eos_id):
    """The sum of the token ids it reads (the model's final turn) mod 3, halved: it differs
    between rows (multi_turn_hermes_step_test's `score` recomputes it from the recorded
    responses)."""
    return (jnp.sum(response_ids * response_mask, -1) % 3).astype(jnp.float32) / 2


def ids_of(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def scripted_model(cfg, tok, bodies=BODIES):
    """(model config, params) of the scripted decoder (module docstring) over `bodies` (the
    first one a little likelier: greedy's choice)."""
    model_cfg = trainer.build(cfg).model_cfg
    model_cfg = dataclasses.replace(model_cfg, vocab_size=len(tok), tie_word_embeddings=False)
    params = jax.device_get(trainer.initial_params(cfg, model_cfg, jax.random.key(0)))
    h = model_cfg.hidden_size
    call, close, end = ids_of(tok, "<tool_call>", "</tool_call>", "<|im_end|>")
    bodies = ids_of(tok, *bodies.values())
    slots = [call, *bodies, close, end]  # slot 0: every other token
    embed = np.zeros((len(tok), h), np.float32)
    embed[:, 0] = 1.0
    for slot, token in enumerate(slots, start=1):
        embed[token] = 0.0
        embed[token, slot] = 1.0
    head = np.zeros((h, len(tok)), np.float32)
    head[0, call] = LOGIT  # anything (the prompt's end, a tool block's end) -> <tool_call>
    head[1, bodies] = LOGIT  # <tool_call> -> a body, "good" a little likelier (greedy's)
    head[1, bodies[0]] += 0.5
    head[2 : 2 + len(bodies), close] = LOGIT  # a body -> </tool_call>
    head[2 + len(bodies), end] = LOGIT  # </tool_call> -> <|im_end|>
    head[3 + len(bodies), end] = LOGIT
    head /= np.sqrt(h)  # the final norm scales a one-hot slot to sqrt(h)
    layers = dict(params["layers"])
    layers["attn"] = {**layers["attn"], "o_proj": np.zeros_like(layers["attn"]["o_proj"])}
    layers["mlp"] = {**layers["mlp"], "down_proj": np.zeros_like(layers["mlp"]["down_proj"])}
    final_norm = jax.tree.map(np.ones_like, params["final_norm"])
    params = {**params, "embed": embed, "lm_head": head, "layers": layers}
    params["final_norm"] = final_norm
    return model_cfg, jax.tree.map(jnp.asarray, params)


class Recorder:
    """The tool host, with every pause's inputs and result kept (numpy)."""

    def __init__(self, host):
        self.host, self.pauses = host, []

    def __getattr__(self, name):
        return getattr(self.host, name)

    def __call__(self, *args):
        result = self.host(*args)
        self.pauses.append(([np.array(a) for a in args], result))
        return result
