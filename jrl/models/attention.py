"""Causal self-attention over whole sequences without a [L, L] score matrix per head.

`causal_attention(q, k, v, scale=...)` is the attention of the full forward of a decoder LM
(training, log-prob and value scoring): q [B, L, N, D], k and v [B, L, K, D], output [B, L, N, D]
in q's dtype. N query heads share K kv heads (grouped-query attention: N a multiple of K, query
head h uses kv head h // (N // K)); D is the head dim. Inputs come already in the compute dtype.
Per head it computes

    scores = softcap(q k^T * scale)      float32; softcap(x) = c * tanh(x / c), or identity
    probs  = softmax(masked scores)      float32, then cast to the compute dtype
    out    = probs v

Masking convention: rows are RIGHT-padded (each row's real tokens first, its padding after), so a
purely causal mask is exact for every real token: key s is visible to query l iff s <= l, and,
with `sliding_window=w`, also s > l - w (w counts the keys a query sees, itself included, as in
HF Mistral / Gemma). No padding mask is taken: padded queries come after every real token, their
outputs are garbage the caller ignores, and padded keys are never visible to a real query. Positions
are sequence indices 0..L-1 (the same slots as `transformer.sliding_window_mask` with
cache_index=None).

Implementations (`implementation=`; `resolve_implementation` says which one "auto" runs):
  * "xla": the materialised reference, one [B, K, N/K, L, L] float32 score array (mask built from
    iota). Exact and fastest at short lengths; memory O(N L^2).
  * "blockwise": pure JAX, for any backend. Queries are split into blocks of `block_size` (L padded
    up to a multiple, the padding sliced off after; padded keys sit after every real query, so the
    causal mask hides them). `lax.map` runs one block at a time, each under `jax.checkpoint`, so
    neither the forward nor the backward holds more than one block's scores: the backward
    recomputes a block's scores from its saved inputs (q block, and k, v) instead of storing every
    block's probabilities. Each block takes an exact softmax over the keys it may see: all L keys
    without a window, or a static-width slice of `block_size + window - 1` keys with one. Memory:
    besides O(B L N D) activations, about four [B, N, block_size, W] float32 arrays at a time in
    the backward (W = L, or the window slice), against several [B, N, L, L] for "xla"; at L = 20k,
    block 512, 16 heads, B = 1 that is 0.67 GB per array instead of 27 GB. Trade-offs:
    without a window about half the score FLOPs go to keys the causal mask hides (an online softmax
    over key blocks could skip those, at the price of a hand-written backward); the checkpoint
    costs one extra forward of the scores in the backward. Numerics follow "xla" (float32 scores
    and softmax, probs cast before the PV matmul): float32 results match to ~1e-6.
  * "cudnn": cuDNN's fused flash attention through `jax.nn.dot_product_attention` (causal, the
    window as local_window_size=(w - 1, 0), GQA handled by cuDNN). NVIDIA GPUs only, float16 /
    bfloat16 inputs, no softcap, head dim a multiple of 8 and <= 128 (256 from Hopper on).
  * "splash": the Pallas TPU splash-attention kernel (causal / local mask, softcap, GQA; square
    blocks of `block_size` rounded up to a multiple of 128, at most L rounded up, L padded to a
    multiple of the block; q pre-multiplied by `scale` in float32, cast back). Off TPU it runs in
    the Pallas interpreter (slow; for testing only). A Pallas call has no SPMD partitioning rule,
    so under a mesh it runs per shard (`jax.shard_map`): rows over the batch axes, heads over
    the tensor axis when both the query and the kv heads divide it.
  * "auto": "cudnn" on a GPU backend when the inputs allow it, else "splash" on TPU, else
    "blockwise" when L > block_size, else "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jrl import partitioning
from jrl.registry import Registry

# Full-forward attention implementations (`ModelConfig.attention`); names only, see the module doc.
IMPLEMENTATIONS = Registry(
    "attention implementation (model.attention)",
    dict.fromkeys(("auto", "xla", "blockwise", "cudnn", "splash")),
)

# Decode attention over a KV cache (`ModelConfig.decode_attention`): "blockwise" reads the
# filled blocks only (`decode_attention`), "xla" the whole cache in one materialised pass (the
# reference; docs/performance.md, "Decode", compares them).
DECODE_IMPLEMENTATIONS = Registry(
    "decode attention implementation (ModelConfig.decode_attention)",
    dict.fromkeys(("blockwise", "xla")),
)

_MASKED = float(np.finfo(np.float32).min)  # score of a hidden key, as in transformer.py
_CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def causal_attention(
    q_BLND: jax.Array,
    k_BLKD: jax.Array,
    v_BLKD: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
    implementation: str = "auto",
    block_size: int = 512,
) -> jax.Array:
    """Causal (optionally sliding-window) self-attention of right-padded rows; see the module doc.

    q [B, L, N, D], k / v [B, L, K, D] (N a multiple of K) -> [B, L, N, D] in q's dtype.
    `scale` multiplies q.k; `softcap` c maps scores to c * tanh(scores / c); `sliding_window` w
    lets query l see keys l - w < s <= l; `block_size` is the query block of "blockwise" and
    "splash" (there rounded up to a multiple of 128), and the length above which "auto" leaves
    "xla" for "blockwise"."""
    b, l, n, d = q_BLND.shape
    if k_BLKD.shape != v_BLKD.shape or k_BLKD.shape[:2] != (b, l) or k_BLKD.shape[3] != d:
        raise ValueError(
            f"k {k_BLKD.shape} and v {v_BLKD.shape} must be [B, L, K, D] of q {q_BLND.shape}"
        )
    if n % k_BLKD.shape[2]:
        raise ValueError(f"{n} query heads are not a multiple of {k_BLKD.shape[2]} kv heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 (or None)")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if sliding_window is not None and sliding_window >= l:
        sliding_window = None  # every causal key lies inside the window
    impl = resolve_implementation(
        implementation,
        seq_len=l,
        head_dim=d,
        dtype=q_BLND.dtype,
        softcap=softcap,
        block_size=block_size,
    )
    if impl == "xla":
        return _xla_attention(q_BLND, k_BLKD, v_BLKD, scale, softcap, sliding_window)
    if impl == "blockwise":
        return _blockwise_attention(
            q_BLND, k_BLKD, v_BLKD, scale, softcap, sliding_window, block_size
        )
    if impl == "cudnn":
        if softcap is not None:
            raise ValueError("implementation='cudnn' has no attention logit softcap")
        return _jax_dot_product_attention(q_BLND, k_BLKD, v_BLKD, scale, sliding_window, "cudnn")
    splash = functools.partial(
        _splash_attention,
        scale=scale,
        softcap=softcap,
        window=sliding_window,
        block_size=block_size,
        interpret=jax.default_backend() != "tpu",
    )
    return _per_shard(splash, q_BLND, k_BLKD, v_BLKD)


def _per_shard(fn, q, k, v):
    """fn(q, k, v) on each device's shard when traced under a mesh (`jax.shard_map`): rows over
    the batch mesh axes, heads over the tensor axis when both the query and the kv heads divide
    it (else whole). A Pallas kernel has no partitioning rule of its own; without this XLA
    would gather its inputs onto every device."""
    q_spec = partitioning.context_spec(P("batch", None, "heads", None), q.shape)
    if q_spec is None:
        return fn(q, k, v)
    kv_spec = partitioning.context_spec(P("batch", None, "kv_heads", None), k.shape)
    if q_spec[2] != kv_spec[2]:  # one of them does not divide: keep every head on each device
        q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
    return jax.shard_map(
        fn, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False
    )(q, k, v)


def resolve_implementation(
    implementation: str,
    *,
    seq_len: int,
    head_dim: int,
    dtype,
    softcap: float | None = None,
    block_size: int = 512,
    backend: str | None = None,
) -> str:
    """The implementation `causal_attention` runs for these inputs: `implementation` itself unless
    it is "auto" (then see the module doc). `backend` defaults to jax.default_backend()."""
    IMPLEMENTATIONS.get(implementation)  # an unknown name raises UnknownName (a ValueError)
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    if backend == "gpu" and _cudnn_supports(head_dim, dtype, softcap):
        return "cudnn"
    if backend == "tpu":
        return "splash"
    return "blockwise" if seq_len > block_size else "xla"


def _cudnn_supports(head_dim: int, dtype, softcap: float | None) -> bool:
    """cuDNN flash attention's limits (jax/_src/cudnn/fused_attention_stablehlo.py)."""
    if softcap is not None or jnp.dtype(dtype) not in _CUDNN_DTYPES or head_dim % 8:
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "8.0")  # "8.0" when unknown
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:  # not an NVIDIA device (no cuDNN)
        return False
    return head_dim <= (256 if major >= 9 else 128)


def _visible(q_pos, k_pos, window: int | None):
    """Bool mask: key position k_pos visible to query position q_pos (broadcasting)."""
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask


def _softcap(x, cap: float | None):
    return x if cap is None else cap * jnp.tanh(x / cap)


def mask_bias(visible):
    """The additive form of a boolean mask: 0 where a key is visible, the float32 minimum where
    not (so the key's probability underflows to 0)."""
    return jnp.where(visible, 0.0, _MASKED).astype(jnp.float32)


def attend(q_BLKGD, k_BSKD, v_BSKD, bias, scale: float, softcap: float | None = None):
    """softmax(softcap(q . k * scale) + bias) . v over keys: [B, L, K, G, D], q's dtype.

    q [B, L, K, G, D] (the G query heads of each kv head), k / v [B, S, K, D], `bias` float32
    broadcastable to [B, K, G, L, S] (`mask_bias`). Keys and values are put head-major and go to
    `attend_head_major`."""
    dt = q_BLKGD.dtype
    to_head_major = lambda x: x.astype(dt).transpose(0, 2, 1, 3)  # [B, K, S, D]
    return attend_head_major(
        q_BLKGD, to_head_major(k_BSKD), to_head_major(v_BSKD), bias, scale, softcap
    )


def attend_head_major(q_BLKGD, k_BKSD, v_BKSD, bias, scale: float, softcap: float | None = None):
    """`attend` with keys / values already head-major [B, K, S, D] (the KV cache's layout).
    Scores (the q.k product taken in float32, not rounded to the compute dtype) and softmax in
    float32, the probabilities cast to the compute dtype before the product with v. The
    products run head-major ([B, K, G*L, D] x [B, K, D, S]) and the mask is added rather than
    selected: on XLA:CPU this layout and the additive mask made attention 1.6x faster
    than the einsum over [B, L, ...], and a head-major cache spares the decode loop a transpose
    of every layer's cache at every step (decode attention 2.8x faster)."""
    dt = q_BLKGD.dtype
    q = q_BLKGD.transpose(0, 2, 3, 1, 4)  # [B, K, G, L, D]
    k, v = k_BKSD.astype(dt), v_BKSD.astype(dt)
    scores = jnp.einsum("bkgld,bksd->bkgls", q, k, preferred_element_type=jnp.float32)
    scores = _softcap(scores * scale, softcap) + bias
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bkgls,bksd->bkgld", probs, v).transpose(0, 3, 1, 2, 4)


def _block_attention(q_BLKGD, k_BSKD, v_BSKD, q_pos, k_pos, scale, softcap, window):
    """Attention of queries at `q_pos` [L] over keys at `k_pos` [S]: [B, L, K, G, D]."""
    bias = mask_bias(_visible(q_pos[:, None], k_pos[None, :], window))
    return attend(q_BLKGD, k_BSKD, v_BSKD, bias, scale, softcap)


def _xla_attention(q, k, v, scale, softcap, window):
    """The materialised reference: one [B, K, G, L, L] float32 score array."""
    b, l, n, d = q.shape
    kh = k.shape[2]
    pos = lax.iota(jnp.int32, l)
    out = _block_attention(q.reshape(b, l, kh, n // kh, d), k, v, pos, pos, scale, softcap, window)
    return out.reshape(b, l, n, d)


def _blockwise_attention(q, k, v, scale, softcap, window, block_size):
    """Query blocks of `block_size`, one at a time (`lax.map`), each rematerialised in the
    backward (`jax.checkpoint`); per block an exact softmax over the keys it may see."""
    b, l, n, d = q.shape
    kh = k.shape[2]
    bq = min(block_size, l)
    nb = -(-l // bq)
    lp = nb * bq
    if lp != l:  # right-pad: padded keys follow every real query, so the causal mask hides them
        pad = ((0, 0), (0, lp - l), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    # Keys a block may see: all of them, or with a window the bq + window - 1 before its end.
    width = lp if window is None else min(lp, bq + window - 1)
    q_blocks = q.reshape(b, nb, bq, kh, n // kh, d).swapaxes(0, 1)  # [nb, B, bq, K, G, D]

    def one_block(i, q_blk):
        q_start = i * bq
        if width == lp:
            k_start, k_blk, v_blk = 0, k, v
        else:  # a static-width slice of keys, clipped into [0, lp)
            k_start = jnp.clip(q_start - window + 1, 0, lp - width)
            k_blk = lax.dynamic_slice_in_dim(k, k_start, width, axis=1)
            v_blk = lax.dynamic_slice_in_dim(v, k_start, width, axis=1)
        q_pos = q_start + lax.iota(jnp.int32, bq)
        k_pos = k_start + lax.iota(jnp.int32, width)
        return _block_attention(q_blk, k_blk, v_blk, q_pos, k_pos, scale, softcap, window)

    one_block = jax.checkpoint(one_block, prevent_cse=False)
    out = lax.map(lambda xs: one_block(*xs), (jnp.arange(nb, dtype=jnp.int32), q_blocks))
    return out.swapaxes(0, 1).reshape(b, lp, n, d)[:, :l]


def _jax_dot_product_attention(q, k, v, scale, window, implementation: str):
    """`jax.nn.dot_product_attention` with this module's causal / window convention; with
    implementation="cudnn" the "cudnn" path, with "xla" its CPU-testable twin."""
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )


def _splash_attention(q, k, v, *, scale, softcap, window, block_size, interpret: bool):
    """The Pallas TPU splash kernel (`interpret=True`: the Pallas interpreter, any backend), with
    square blocks of min(block_size, L) rounded up to a multiple of 128 (the TPU lane width)."""
    _, l, n, _ = q.shape
    block = -(-min(block_size, l) // 128) * 128
    lp = -(-l // block) * block
    if lp != l:  # right-pad, as in blockwise: the causal mask hides the padded keys
        pad = ((0, 0), (0, lp - l), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    kernel = _splash_kernel(n, lp, window, softcap, block, interpret)
    q_BNLD = (q.astype(jnp.float32) * scale).astype(q.dtype).transpose(0, 2, 1, 3)
    out = jax.vmap(kernel)(q_BNLD, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
    return out.transpose(0, 2, 1, 3)[:, :l].astype(q.dtype)


@functools.lru_cache(maxsize=64)
def _splash_kernel(num_heads, seq_len, window, softcap, block, interpret):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (seq_len, seq_len)
    if window is None:
        mask = splash.CausalMask(shape)
    else:
        mask = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    # every block of the forward, dK/dV and dQ kernels is `block` long
    blocks = "q kv kv_compute q_dkv kv_dkv kv_dkv_compute q_dq kv_dq".split()
    sizes = splash.BlockSizes(**{f"block_{name}": block for name in blocks})
    with jax.ensure_compile_time_eval():  # mask tables as constants, also when built in a trace
        return splash.make_splash_mha_single_device(
            splash.MultiHeadMask([mask] * num_heads),
            block_sizes=sizes,
            attn_logits_soft_cap=softcap,
            interpret=interpret,
        )


# ---------------------------------------------------------------------------------------------
# Decode attention: new queries over a KV cache, reading only the blocks of keys they can see.


def _slots(x, start, size: int, layer=None):
    """Slots start .. start + size - 1 of a cache [B, K, S, D], or of layer `layer`'s of a
    stack [layers, B, K, S, D] (one slice, so no copy of the layer's cache)."""
    if layer is None:
        return lax.dynamic_slice_in_dim(x, start, size, axis=2)
    _, b, k, _, d = x.shape
    return lax.dynamic_slice(x, (layer, 0, 0, start, 0), (1, b, k, size, d))[0]


def one_pass_slots(block_size: int) -> int:
    """The most slots `decode_attention` reads in one pass, without a loop: a quarter block."""
    return max(block_size // 4, 1)


def decode_attention(
    q_BLKGD,
    k_BKSD,
    v_BKSD,
    key_valid_BS,
    q_slot_BL,
    end,
    *,
    first_slot=0,
    prompt=None,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    block_size: int = 512,
    layer=None,
):
    """Attention of L new queries per row over a head-major KV cache, reading only the key
    blocks some query sees. [B, L, K, G, D] in q's dtype.

    q [B, L, K, G, D] (the G query heads of each kv head) sits at cache slots q_slot [B, L];
    keys / values [B, K, S, D]. Key slot s is visible to query (b, l) when key_valid[b, s],
    s <= q_slot[b, l] and, with `window` w, s > q_slot[b, l] - w. `end` bounds the visible
    slots (max q_slot + 1 or more): a Python int, or a traced scalar (then the blocks run in
    `while_loop`s that stop there); with a window the blocks start at the one that holds slot
    `first_slot` - w + 1 (`first_slot`: min q_slot or less, an int or traced); without one at
    slot 0. The cache is read from there in whole blocks of `block_size` slots, then in blocks
    a quarter as long up to `end` (fewer than a quarter block is read past it: the cache's
    slots there must hold finite values, as the rollout's zeros do until written). When the
    slots from the first one read (0 when that is traced) to S are at most a quarter block,
    they are read in one pass, no loop (so no more than the loop's last block would read
    past `end`); without `prompt` that pass is `attend_head_major`'s, the training forward's
    attention, which on XLA:CPU ran W2's rollout 1.2x faster than the online softmax over
    the same slots. Every block of a loop goes through an online softmax: a running max, sum
    and float32 output per query, scores and sums in float32, the products taken with
    `preferred_element_type=float32`. No [.., S] score array is formed. The probabilities are
    cast to the values' dtype before their product with v, as in `attend_head_major`. A query
    that sees no key gets 0.

    `prompt` = (k [P', K, P, D], v, key_valid [P', P]): the first P slots of every row's
    keys / values once per group of B / P' consecutive rows (a GRPO group's samples share
    their prompt): those slots are read from here, once per group, and the rows' own cache
    only from slot P on. Every query must sit at slot P or later.

    `layer` (an int, traced in a scan over layers): the keys / values (and `prompt`'s) are a
    stack of every layer's, [layers, B, K, S, D], and layer `layer`'s are read, each block
    sliced from the stack directly (`ModelConfig.scan_cached_layers`: a slice of the layer's
    whole cache first would be a copy of it at every step)."""
    b, l, kh, g, d = q_BLKGD.shape
    s = k_BKSD.shape[-2]
    q = q_BLKGD.transpose(0, 2, 3, 1, 4)  # [B, K, G, L, D]
    dt = v_BKSD.dtype
    start = 0
    if window is not None:
        lowest = first_slot - window + 1
        start = max(lowest, 0) if isinstance(lowest, int) else jnp.maximum(lowest, 0)
    big = min(block_size, s)
    small = max(big // 4, 1)
    one_pass = one_pass_slots(block_size)  # slots read in one pass rather than a loop

    def segment(carry, q_KGLD, k, v, valid, q_slot, lo, hi):
        """The online softmax (`carry`) over slots [lo, hi) of keys / values k, v [R', K, S', D]
        for queries q_KGLD [R', K, G, L', D] at slots q_slot [R', L']."""
        s_seg = k.shape[-2]
        seg_big = min(big, s_seg)
        seg_small = max(min(small, seg_big), 1)

        def block(blk, first_of):
            def attend_block(j, carry):
                first = first_of(j)
                at = jnp.minimum(first, s_seg - blk)  # past S' - blk: read from S' - blk
                k_blk, v_blk = _slots(k, at, blk, layer), _slots(v, at, blk, layer)
                slot = at + lax.iota(jnp.int32, blk)  # [blk]
                seen = lax.dynamic_slice_in_dim(valid, at, blk, axis=1)  # [R', blk]
                q_at = q_slot[..., None]  # [R', L', 1]
                visible = seen[:, None, :] & (slot <= q_at) & (slot >= first)  # none twice
                if window is not None:
                    visible = visible & (slot > q_at - window)
                scores = jnp.einsum(
                    "bkgld,bksd->bkgls", q_KGLD, k_blk, preferred_element_type=jnp.float32
                )
                scores = _softcap(scores * scale, softcap)
                scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
                m_new = jnp.max(scores, axis=-1)
                if carry is not None:  # [R', K, G', L'] x 2, [R', K, G', L', D] (float32)
                    m_new = jnp.maximum(carry[0], m_new)
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # none seen yet: no rescale
                probs = jnp.exp(scores - m_safe[..., None])
                total = jnp.sum(probs, axis=-1)
                pv = jnp.einsum(
                    "bkgls,bksd->bkgld", probs.astype(dt), v_blk, preferred_element_type=jnp.float32
                )
                if carry is None:  # the first block read: nothing to rescale
                    return m_new, total, pv
                m, total_before, acc = carry
                rescale = jnp.exp(m - m_safe)
                return m_new, total_before * rescale + total, acc * rescale[..., None] + pv

            return attend_block

        def blocks(carry, blk, lo, n):
            """`n` blocks of `blk` slots from slot `lo` on."""
            fn = block(blk, lambda j: lo + j * blk)
            if isinstance(n, int):
                for j in range(n):
                    carry = fn(j, carry)
                return carry
            return lax.fori_loop(0, n, fn, carry)

        lo_read = lo if isinstance(lo, int) else 0
        if s_seg - lo_read <= one_pass:  # few slots left: one pass, no loop
            return block(s_seg - lo_read, lambda j: lo)(0, carry)
        if carry is None:  # nothing read yet: an empty running softmax for the loops
            shape = q_KGLD.shape[:-1]
            carry = (
                jnp.full(shape, -jnp.inf, jnp.float32),
                jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, d), jnp.float32),
            )
        # Whole blocks of `block_size` from `lo`, then the rest up to `hi` in blocks a quarter
        # as long: the slots read past `hi` are fewer than a quarter block.
        maximum = max if isinstance(lo, int) and isinstance(hi, int) else jnp.maximum
        whole = maximum(hi - lo, 0) // seg_big
        carry = blocks(carry, seg_big, lo, whole)
        rest = lo + whole * seg_big
        return blocks(carry, seg_small, rest, (maximum(hi - rest, 0) + seg_small - 1) // seg_small)

    carry = None
    lo = 0
    if prompt is not None:  # the prompt's slots once per group, its n rows' queries together
        k_p, v_p, valid_p = prompt
        groups, p = k_p.shape[-4], k_p.shape[-2]
        n = b // groups

        def by_group(x):  # [B, K, G, L, ...] -> [P', K, G, n * L, ...]: rows ride on L
            x = x.reshape(groups, n, *x.shape[1:])
            x = jnp.moveaxis(x, 1, 3)  # [P', K, G, n, L, ...]
            return x.reshape(groups, kh, g, n * l, *x.shape[5:])

        def by_row(x):  # the inverse
            x = x.reshape(groups, kh, g, n, l, *x.shape[4:])
            return jnp.moveaxis(x, 3, 1).reshape(b, kh, g, l, *x.shape[5:])

        carry = segment(
            None,
            by_group(q),
            k_p,
            v_p,
            valid_p,
            q_slot_BL.reshape(groups, n * l),
            start,
            p,
        )
        carry = tuple(by_row(x) for x in carry)
        lo = p
    lo = max(start, lo) if isinstance(start, int) else jnp.maximum(start, lo)
    lo_read = lo if isinstance(lo, int) else 0
    if prompt is None and s - lo_read <= one_pass:  # a short cache: one materialised pass
        k, v = (_slots(x, lo_read, s - lo_read, layer) for x in (k_BKSD, v_BKSD))
        valid = key_valid_BS[:, lo_read:]
        slot = lo_read + jnp.arange(s - lo_read)
        q_at = q_slot_BL[..., None]  # [B, L, 1]
        visible = valid[:, None, :] & (slot <= q_at)  # [B, L, S - lo_read]; slots < lo: masked
        if window is not None:
            visible = visible & (slot > q_at - window)  # lo = max(first - w + 1, 0) or less
        out = attend_head_major(q_BLKGD, k, v, mask_bias(visible)[:, None, None], scale, softcap)
        sees = jnp.any(visible, axis=-1)[..., None, None, None]  # [B, L, 1, 1, 1]
        return jnp.where(sees, out, jnp.zeros((), out.dtype))
    carry = segment(carry, q, k_BKSD, v_BKSD, key_valid_BS, q_slot_BL, lo, end)
    _, total, acc = carry
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(q_BLKGD.dtype).transpose(0, 3, 1, 2, 4)
