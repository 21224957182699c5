"""The decode report: what one decode step of a config's rollout reads and writes, against what
it needs to. `python -m jrl.bench --decode --config=...` (jrl/bench.py) prints it.

`decode_report(cfg)` compiles (never runs) one step of the rollout's decode loop at the config's
shape (B = data.train_batch_size x rollout.n rows, P prompt and R response slots, the model in
its compute dtype) from abstract inputs (`jax.ShapeDtypeStruct`: no parameter is allocated) and
reads XLA's cost analysis of it:

  * `bytes` / `flops`: XLA's figures for the step. XLA counts a while loop's body once, whatever
    its trip count, so the step is not measured inside the loop: `rollout.decode_body` (the
    loop's body, the same function) is compiled alone, its carry donated as the loop's is, at
    a fill given as a Python int (`fill`: the slots the step's token sees, its own included;
    default P + R / 2, the mean over a full-length response). At a static fill the decode
    attention's loops over key blocks run as Python loops (`attention.decode_attention`), so
    every block read at that fill is in the program, counted once. (The materialised
    reference, `decode_attention="xla"`, reads every slot of the cache at any fill, as in the
    loop.) The step is the first stage's: all B rows, each prompt's keys / values read once for
    its group (`rollout.start`). It runs the layers one by one: with `model.scan_cached_layers`
    (the layers as a scan over a stacked cache) the analysis would count one layer's body, so
    the report compiles the layer-by-layer step, which computes the same (`layers` says so).
  * `in_loop` (backends whose client can analyse a module: CPU): the body of the first decode
    loop as XLA compiled it inside the whole rollout (`rollout.generate` compiled, the loop's
    body taken out of its HLO and analysed alone), each attention loop inside it counted as
    many times as it runs at the fill (full-attention layers; a sliding layer's loops are
    counted as a full layer's). It differs from `bytes` by what XLA moves out of the loop
    (loop-invariant code motion).
  * `sampler_bytes`: the sampler (`rollout.sample_token`, or argmax with `greedy`) alone on
    [B, V] logits: its share of `bytes`.
  * `needed_bytes`: every weight once in the compute dtype (a tied embedding once, as the
    head), the filled keys and values (B rows x `fill` slots, a sliding layer at most its
    window), the logits once (B x V float32); `total_shared_prompt` counts each prompt's P
    slots once per group of rollout.n rows instead of once per row.
  * `ops`: the HLO instructions of the compiled step (its entry computation, without
    parameters, constants, tuples, get-tuple-element and bitcasts), and how many of them are
    fusions: roughly the kernels a GPU launches per step.
  * `roofline_tokens_per_s`: B tokens per step at a chip's memory bandwidth (`CHIPS`), for
    XLA's bytes and for the needed bytes; `xla_optimal_seconds`: the TPU compiler's own
    estimate of the step's time (TPU only).
  * `unstaged` (a TPU target): the same step and sampler compiled with every buffer in HBM
    (`jrl.run.targets.HBM_ONLY`). The TPU compiler stages operands in on-chip memory, and its
    analysis then counts a staged operand's bytes three or more times (the copy's read and
    output, the consumer's read); without staging each byte counted is an HBM access.

On a GPU or TPU the report also times the real rollout (random weights, every response forced to
R tokens) and gives tokens/s and its share of the device's roofline; on CPU it does not.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrl import config as config_lib
from jrl import rollout
from jrl import step as step_lib
from jrl.models import attention, transformer
from jrl.run import trainer

# Memory bandwidth per chip, bytes/s (docs/performance.md, "Decode" cites the sources).
CHIPS = {
    "H100": 3.35e12,  # H100 SXM5 80 GB, HBM3
    "H200": 4.8e12,  # H200 SXM 141 GB, HBM3e
    "v5e": 819e9,  # TPU v5e, 16 GB HBM2
    "v5p": 2.765e12,  # TPU v5p, 95 GB HBM2e
    "v6e": 1.64e12,  # TPU v6e (Trillium), 32 GB
}

# (jitted function, abstract arguments) -> compiled; the default compiles for the local device.
CompileFn = Callable[[Any, tuple], Any]


def local_compile(jitted, args):
    return jitted.lower(*args).compile()


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class Shape:
    """The rollout's shape and options from a config; `decode_attention` replaces the model's
    (`ModelConfig.decode_attention`); `backend` is the platform compiled for (None: the local
    one), which decides whether the prompt is read once per group (`rollout.shares_prompt`)."""

    def __init__(self, cfg, decode_attention: str | None = None, backend: str | None = None):
        config_lib.validate(cfg)
        built = trainer.build(cfg)
        task, model_cfg = built.task, built.model_cfg
        if decode_attention is not None:
            attention.DECODE_IMPLEMENTATIONS.get(decode_attention)
            model_cfg = dataclasses.replace(model_cfg, decode_attention=decode_attention)
        # layer by layer: the analysis counts a scan's body once (see the module doc); the
        # rollout timed on an accelerator is the config's own (`run_cfg`)
        self.run_cfg = model_cfg
        self.model_cfg = dataclasses.replace(model_cfg, scan_cached_layers=False)
        ids = trainer.sampling_ids(built.tokenizer, task, cfg)
        self.groups = step_lib.prompts_per_step(cfg)
        self.n = cfg.rollout.n
        self.rows = self.groups * self.n
        batch = task.train_batch(0, self.groups)  # host arrays: only the shapes are used
        self.p = int(batch["input_ids"].shape[1])
        self.r = int(task.max_response_length)
        self.opts = rollout.Options(
            self.p,
            self.r,
            ids["eos_id"],
            ids["pad_id"],
            tuple(ids["stop_ids"]),
            cfg.rollout.temperature,
            cfg.rollout.top_k,
            cfg.rollout.top_p,
            stop_strings=ids["stop_strings"],
            shared_prompt=rollout.shares_prompt(model_cfg, self.p, self.r, backend),
        )
        self.compact_min_rows = cfg.rollout.compact_min_rows if cfg.rollout.compact_decode else 0
        self.params = jax.eval_shape(lambda: transformer.init_params(self.model_cfg, _key()))


def _key():
    """The report's one PRNG key, made when first used (not at import: a device array made then
    would start JAX's backend before `--target` is checked)."""
    return jax.random.key(0)


def _step_program(shape: Shape, fill: int, greedy: bool = False):
    """(decode step as a function of (variables, draws, carry), its abstract arguments): the
    step whose token sits in slot `fill` - 1 and sees `fill` slots."""
    cfg, opts = shape.model_cfg, shape.opts._replace(greedy=greedy)
    variables = jax.eval_shape(lambda p: rollout.prepare(cfg, p), shape.params)
    prompts = jax.ShapeDtypeStruct((shape.groups, shape.p), jnp.int32)
    carry = jax.eval_shape(
        lambda v, i, m: rollout.start(cfg, v, i, m, shape.n, opts), variables, prompts, prompts
    )
    draws = rollout.Draws(jax.ShapeDtypeStruct((shape.r, shape.rows), jnp.float32))
    t = fill - shape.p - 1  # a Python int: the step is compiled at this fill

    def step(variables, draws, carry):
        out = rollout.decode_body(cfg, variables, draws, opts, carry._replace(t=t))
        return out._replace(t=jnp.int32(t + 1))

    return step, (variables, draws, _abstract(carry))


def _sampler_program(shape: Shape, greedy: bool = False):
    opts = shape.opts
    sampling = dict(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
    sampling["greedy"] = greedy
    fn = lambda u, logits: rollout.sample_token(u, logits, **sampling)
    b, v = shape.rows, shape.model_cfg.vocab_size
    args = (jax.ShapeDtypeStruct((b,), jnp.float32), jax.ShapeDtypeStruct((b, v), jnp.float32))
    return fn, args


_SKIP = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*? ([a-z\-]+)\(", re.M)


def _computations(hlo: str) -> dict:
    """name -> text of each computation of an HLO module's text (the entry under "ENTRY")."""
    out = {}
    for m in re.finditer(r"^(ENTRY )?%([\w.\-]+) [^\n]*\{\n.*?\n\}\n", hlo, re.S | re.M):
        out["ENTRY" if m.group(1) else m.group(2)] = m.group(0)
    return out


def count_ops(computation: str) -> dict:
    """HLO instructions of one computation's text (parameters, constants, tuples,
    get-tuple-element and bitcasts left out) and how many of them are fusions / while loops."""
    ops = [op for op in _INSTRUCTION.findall(computation) if op not in _SKIP]
    return {"instructions": len(ops), "fusions": ops.count("fusion"), "loops": ops.count("while")}


def _module_cost(client, hlo: str, entry: str) -> dict:
    """XLA's cost analysis of computation `entry` of a compiled module's text, as the entry of a
    module of its own (the computations it calls kept)."""
    from jax._src.lib import _jax
    import jaxlib._hlo as hlo_lib

    comps = _computations(hlo)
    text = "HloModule extracted\n\n" + "\n".join(
        ("ENTRY " + body if name == entry else body)
        for name, body in comps.items()
        if name != "ENTRY"
    )
    text = re.sub(r",? ?stack_frame_id=\d+", "", text)
    return _jax.hlo_module_cost_analysis(client, hlo_lib.hlo_module_from_text(text))


def _loop_bodies(computation: str) -> list[str]:
    return re.findall(r"while\([^\n]*?body=%([\w.\-]+)", computation)


def in_loop_cost(shape: Shape, fill: int, block: int) -> dict | None:
    """The first decode loop's body inside the compiled rollout (see the module doc), or None
    where the backend's client cannot analyse a module of its own (compile-only clients)."""
    cfg = shape.model_cfg
    opts = shape.opts

    def gen(params, ids, mask, key):
        return rollout.generate(
            cfg,
            params,
            ids,
            mask,
            key,
            max_new_tokens=shape.r,
            eos_id=opts.eos_id,
            pad_id=opts.pad_id,
            temperature=opts.temperature,
            top_k=opts.top_k,
            top_p=opts.top_p,
            samples=shape.n,
            stop_ids=opts.stop_ids,
            stop_strings=opts.stop_strings,
            compact_min_rows=shape.compact_min_rows,
        )

    prompts = jax.ShapeDtypeStruct((shape.groups, shape.p), jnp.int32)
    compiled = jax.jit(gen).lower(shape.params, prompts, prompts, _key()).compile()
    hlo = compiled.as_text()
    comps = _computations(hlo)
    decode = [b for b in _loop_bodies(comps["ENTRY"]) if _is_decode(comps[b])]
    if not decode:
        return None
    client = jax.devices()[0].client
    try:
        body = _module_cost(client, hlo, decode[0])
    except Exception:  # a client without the analysis (compile-only)
        return None
    total = {k: body.get(k, 0.0) for k in ("bytes accessed", "flops")}
    # the attention's loops over the rows' own slots (from P on when each prompt is read once
    # for its group, else from 0): whole blocks of `block`, then quarter blocks up to the fill
    # (none when those slots fit one block: they are read in one pass)
    big = min(block, shape.p + shape.r)
    small = max(big // 4, 1)
    seen = fill - (shape.p if shape.n > 1 else 0)
    trips = {big: seen // big, small: -(-(seen % big) // small)}
    for inner in _loop_bodies(comps[decode[0]]):
        size = big if f",{big},{cfg.head_size}]" in comps[inner] else small
        extra = _module_cost(client, hlo, inner)
        for k in total:  # the body above counted each loop's body once
            total[k] += (trips[size] - 1) * extra.get(k, 0.0)
    return {
        "bytes": int(total["bytes accessed"]),
        "flops": int(total["flops"]),
        "ops": count_ops(comps[decode[0]]),
    }


def _is_decode(body: str) -> bool:
    """A decode loop's body: it runs the model (a layer's attention) on the cache."""
    return "Transformer/" in body


def needed_bytes(shape: Shape, fill: int) -> dict:
    """What one decode step needs to move (see the module doc): weights, filled keys / values,
    logits; and the keys / values with each prompt's slots once per group."""
    cfg = shape.model_cfg
    item = jnp.dtype(cfg.dtype).itemsize
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(shape.params))
    embed = cfg.vocab_size * cfg.hidden_size
    weights = (params - (0 if cfg.tie_word_embeddings else embed)) * item
    weights += shape.rows * cfg.hidden_size * item  # the rows' embedding lookups
    per_slot = 2 * cfg.num_kv_heads * cfg.head_size * item  # keys and values, one layer
    kv = kv_shared = 0
    for layer in range(cfg.num_layers):
        window = cfg.sliding_window if cfg.is_sliding(layer) else None
        seen = fill if window is None else min(fill, window)
        prompt = max(0, min(shape.p, seen - (fill - shape.p)))  # prompt slots in view
        kv += shape.rows * seen * per_slot
        kv_shared += (shape.groups * prompt + shape.rows * (seen - prompt)) * per_slot
    logits = shape.rows * cfg.vocab_size * 4
    return {
        "weights": int(weights),
        "kv": int(kv),
        "logits": int(logits),
        "total": int(weights + kv + logits),
        "total_shared_prompt": int(weights + kv_shared + logits),
    }


def roofline(tokens: int, nbytes: float) -> dict:
    """Tokens / s of a step of `tokens` tokens moving `nbytes` at each chip's bandwidth."""
    return {chip: round(tokens * bw / nbytes) for chip, bw in CHIPS.items()}


def _chip(device_kind: str) -> str | None:
    kind = device_kind.lower().replace(" ", "")
    for chip in CHIPS:
        if chip.lower() in kind or (chip == "v5e" and "v5lite" in kind):
            return chip
    return None


def time_rollout(shape: Shape, rounds: int = 3) -> dict:
    """Seconds of the real rollout on the local device (random weights in the compute dtype,
    every response forced to R tokens, so the fills are those of the report's mean), median of
    `rounds` after a first, compiling call."""
    cfg = shape.run_cfg
    opts = shape.opts
    params = jax.jit(lambda k: transformer.init_params(cfg, k))(_key())
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (shape.groups, shape.p)), jnp.int32)
    mask = jnp.ones_like(ids)
    lengths = jnp.full((shape.rows,), shape.r, jnp.int32)

    @jax.jit
    def gen(params, key):
        return rollout.generate(
            cfg,
            params,
            ids,
            mask,
            key,
            max_new_tokens=shape.r,
            eos_id=opts.eos_id,
            pad_id=opts.pad_id,
            temperature=opts.temperature,
            top_k=opts.top_k,
            top_p=opts.top_p,
            samples=shape.n,
            forced_length=lengths,
            compact_min_rows=shape.compact_min_rows,
        ).response_ids

    jax.block_until_ready(gen(params, _key()))
    times = []
    for i in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(gen(params, jax.random.key(i + 1)))
        times.append(time.perf_counter() - t)
    seconds = float(np.median(times))
    return {"rollout_s": round(seconds, 4), "tokens_per_s": round(shape.rows * shape.r / seconds)}


def decode_report(
    cfg,
    *,
    fill: int | None = None,
    greedy: bool = False,
    decode_attention: str | None = None,
    compile_fn: CompileFn | None = None,
    device: str | None = None,
    timing: bool = True,
    unstaged_compile_fn: CompileFn | None = None,
) -> dict:
    """The decode report of `cfg` (see the module doc). `fill`: the cache slots the step's token
    sees (its own included; default P + R / 2); `greedy`: the step samples by argmax instead of
    the config's sampler; `decode_attention`: the model's decode attention instead of its own
    ("blockwise"; "xla": the materialised reference); `compile_fn(jitted, abstract_args) ->
    compiled`: how to compile (default: for the local device; a TPU target's compile plugs in
    here: `jrl.run.targets.compile`) and `device` what it compiles for (default: the local
    device); `timing`: time the real rollout when the local device is a GPU or TPU;
    `unstaged_compile_fn`: a second compile of the step and the sampler with every buffer kept
    in HBM (a TPU target: `jrl.run.targets.HBM_ONLY`), reported as `unstaged`."""
    shape = Shape(cfg, decode_attention, None if compile_fn is None else "tpu")
    fill = shape.p + shape.r // 2 if fill is None else fill
    if not shape.p < fill <= shape.p + shape.r:
        raise config_lib.ConfigError(
            f"fill={fill} must lie in (P, P + R] = ({shape.p}, {shape.p + shape.r}]: the slots "
            "filled when a response token is decoded."
        )
    compile_fn = compile_fn or local_compile
    step, args = _step_program(shape, fill, greedy)
    t = time.perf_counter()
    compiled = compile_fn(jax.jit(step, donate_argnums=2), args)
    compile_s = time.perf_counter() - t
    cost = _cost(compiled)
    sampler_fn, sampler_args = _sampler_program(shape, greedy)
    sampler = _cost(compile_fn(jax.jit(sampler_fn), sampler_args))
    nbytes, flops = float(cost["bytes accessed"]), float(cost["flops"])
    need = needed_bytes(shape, fill)
    ops = count_ops(_computations(compiled.as_text())["ENTRY"])
    out = {
        "rows": shape.rows,
        "prompt_length": shape.p,
        "response_length": shape.r,
        "fill": fill,
        "dtype": shape.model_cfg.dtype,
        "decode_attention": shape.model_cfg.decode_attention,
        "layers": "layer by layer"
        + (
            " (the rollout's scan over layers unrolled for the report)"
            if shape.run_cfg.scan_cached_layers
            else ""
        ),
        "sampler": "greedy (argmax)" if greedy else "the config's (rollout.sample_token)",
        "device": device or _device_kind(args),
        "compile_s": round(compile_s, 1),
        "bytes": int(nbytes),
        "flops": int(flops),
        "sampler_bytes": int(sampler["bytes accessed"]),
        "bytes_without_sampler": int(nbytes - sampler["bytes accessed"]),
        "needed_bytes": need,
        "ratio": round(nbytes / need["total"], 3),
        "ratio_without_sampler": round((nbytes - sampler["bytes accessed"]) / need["total"], 3),
        "ratio_to_shared_prompt": round(nbytes / need["total_shared_prompt"], 3),
        "ops": ops,
        # the TPU compiler's own estimate of the step's time (absent on other backends)
        "xla_optimal_seconds": cost.get("optimal_seconds"),
        "roofline_tokens_per_s": roofline(shape.rows, nbytes),
        "roofline_tokens_per_s_needed": roofline(shape.rows, need["total"]),
    }
    if unstaged_compile_fn is not None:
        plain = _cost(unstaged_compile_fn(jax.jit(step, donate_argnums=2), args))
        plain_sampler = _cost(unstaged_compile_fn(jax.jit(sampler_fn), sampler_args))
        unstaged = float(plain["bytes accessed"])
        out["unstaged"] = {
            "bytes": int(unstaged),
            "sampler_bytes": int(plain_sampler["bytes accessed"]),
            "ratio": round(unstaged / need["total"], 3),
            "ratio_to_shared_prompt": round(unstaged / need["total_shared_prompt"], 3),
            "roofline_tokens_per_s": roofline(shape.rows, unstaged),
        }
    if compile_fn is local_compile and jax.default_backend() == "cpu":
        in_loop = in_loop_cost(shape, fill, shape.model_cfg.attention_block_size)
        if in_loop is not None:
            out["in_loop"] = in_loop
    chip = _chip(jax.devices()[0].device_kind)
    if timing and compile_fn is local_compile and jax.default_backend() != "cpu":
        timed = time_rollout(shape)
        out["timing"] = timed
        if chip is not None:  # the mean fill of a full-length response is the report's
            best = roofline(shape.rows, need["total"])[chip]
            out["timing"]["share_of_needed_roofline"] = round(timed["tokens_per_s"] / best, 3)
    return out


def _cost(compiled) -> dict:
    """A compiled program's cost analysis (some jax versions wrap it in a one-item list)."""
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, (list, tuple)) else cost


def _device_kind(args) -> str:
    """The kind of device the step was compiled for: its arguments' (a target's), else local."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return str(next(iter(sharding.device_set)).device_kind)
    return str(jax.devices()[0].device_kind)
