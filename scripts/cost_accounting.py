"""How XLA's cost analysis counts the operations a decode step is made of (docs/performance.md,
"Decode: what the compilers count"). Each line compiles one small program (never runs it) and
prints XLA's `bytes accessed` beside the bytes the program must move at least:

    python scripts/cost_accounting.py            # XLA:CPU
    python scripts/cost_accounting.py --tpu      # the TPU compiler, one v5p chip (needs libtpu)

With --tpu each program is compiled twice: as the compiler does it, and with every buffer kept in
HBM (`jrl.run.targets.HBM_ONLY`, the "unstaged" columns), whose count has no on-chip copies in it.

The programs are a decode step's parts at Qwen2.5-0.5B's shapes, 128 rows: one token's keys
written into a [128, 2, 1536, 64] bfloat16 cache (in place, the cache donated; also with head size
128 and into a [128, 1536, 2 x 64] cache), 512 of its slots read by a product, and the products of
an MLP projection and of the LM head at M = 128 rows.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax

B, K, S, D = 128, 2, 1536, 64  # rows, kv heads, cache slots, head size
H, F, V = 896, 4864, 151936  # hidden, MLP, vocabulary


def programs():
    sd = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    cache, new = sd((B, K, S, D), bf16), sd((B, K, 1, D), bf16)
    slot = sd((), jnp.int32)
    q = sd((B, K, D), bf16)

    def write(c, x, t):
        return lax.dynamic_update_slice(c, x, (0, 0, t, 0))

    def read_512(c, x, t):
        return jnp.einsum("bksd,bkd->bks", c[:, :, :512], x, preferred_element_type=jnp.float32)

    def product(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    kv_bytes = lambda slots: B * K * slots * D * 2
    yield "cache write, 1 slot (in place)", write, (cache, new, slot), 2 * kv_bytes(1), (0,)
    # the same write with the head size 128 (Qwen2.5-1.5B's), and into a slot-major cache whose
    # minor dimension is the kv heads' 2 x 64: which layout the TPU compiler gives the cache
    wide, wide_new = sd((B, K, S, 2 * D), bf16), sd((B, K, 1, 2 * D), bf16)
    yield "cache write, 1 slot, head size 128", write, (wide, wide_new, slot), 4 * kv_bytes(1), (0,)
    flat, flat_new = sd((B, S, K * D), bf16), sd((B, 1, K * D), bf16)
    write_flat = lambda c, x, t: lax.dynamic_update_slice(c, x, (0, t, 0))
    yield (
        "cache write, 1 slot, [B, S, K x D]",
        write_flat,
        (flat, flat_new, slot),
        2 * kv_bytes(1),
        (0,),
    )
    yield "512 cache slots read by a product", read_512, (cache, q, slot), kv_bytes(512), ()
    for m in (1, 8, 128):
        x, w = sd((m, H), bf16), sd((H, F), bf16)
        need = (m * H + H * F) * 2 + m * F * 4
        yield f"[{m}, {H}] x [{H}, {F}] product", product, (x, w), need, ()
    x, w = sd((B, H), bf16), sd((H, V), bf16)
    need = (B * H + H * V) * 2 + B * V * 4
    yield f"[{B}, {H}] x [{H}, {V}] product (LM head)", product, (x, w), need, ()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tpu", action="store_true", help="compile for one TPU v5p chip")
    args = parser.parse_args()
    target = None
    if args.tpu:
        from jrl.run import targets

        targets.host_only()
        target = targets.parse("v5p-8")
    else:
        jax.config.update("jax_platforms", "cpu")
    head = f"{'program':48s} {'XLA bytes':>12s} {'needed':>12s} {'ratio':>7s}"
    print(head + (f" {'unstaged':>12s} {'ratio':>7s}" if target is not None else ""))
    for name, fn, args_, need, donate in programs():
        jitted = jax.jit(fn, donate_argnums=donate)
        if target is None:
            compiled = jitted.lower(*args_).compile()
        else:
            from jrl.run import targets

            compiled = targets.compile(jitted, args_, target)
        nbytes = compiled.cost_analysis()["bytes accessed"]
        line = f"{name:48s} {nbytes / 1e6:10.2f}MB {need / 1e6:10.2f}MB {nbytes / need:7.2f}"
        if target is not None:  # every buffer kept in HBM: nothing staged on chip
            plain = targets.compile(jitted, args_, target, None, targets.HBM_ONLY)
            plain_bytes = plain.cost_analysis()["bytes accessed"]
            line += f" {plain_bytes / 1e6:10.2f}MB {plain_bytes / need:7.2f}"
        print(line)


if __name__ == "__main__":
    main()
