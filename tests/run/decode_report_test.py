"""The decode report (`python -m jrl.bench --decode`): the bytes a step needs, worked out by hand
for the tiny config, the ops counted in HLO text, and the report of the tiny config's step."""

import pytest

from jrl.run import decode_report
from conftest import tiny_config

# configs/grpo_math.py:tiny: hidden 32, 2 layers, 4 query / 2 kv heads of 8, MLP 64, tied
# embeddings of the 88-token character vocabulary, float32; 4 prompts x 4 samples, P = 7, R = 4.
PARAMS = 88 * 32 + 2 * (32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32 + 3 * 32 * 64 + 2 * 32) + 32
SLOT = 2 * 2 * 8 * 4  # keys and values of one layer, float32


def test_needed_bytes_by_hand():
    shape = decode_report.Shape(tiny_config())
    assert (shape.rows, shape.groups, shape.p, shape.r) == (16, 4, 7, 4)
    need = decode_report.needed_bytes(shape, fill=9)
    assert need["weights"] == PARAMS * 4 + 16 * 32 * 4  # the head once, the rows' lookups
    assert need["kv"] == 16 * 9 * 2 * SLOT  # 16 rows x 9 slots x 2 layers
    assert need["logits"] == 16 * 88 * 4
    assert need["total"] == need["weights"] + need["kv"] + need["logits"]
    # each prompt's 7 slots once per group of 4, the 2 response slots per row
    shared = (4 * 7 + 16 * 2) * 2 * SLOT
    assert need["total_shared_prompt"] == need["weights"] + shared + need["logits"]


def test_count_ops_leaves_out_parameters_tuples_and_bitcasts():
    hlo = """ENTRY %main (p0: f32[4], p1: f32[4]) -> (f32[4], f32[4]) {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %c = f32[] constant(1)
  %fusion = f32[4]{0} fusion(%p0, %p1), kind=kLoop, calls=%fused
  %b = f32[4]{0} bitcast(%fusion)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  %add = f32[4]{0} add(%b, %p1)
  ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(%add, %b)
}
"""
    assert decode_report.count_ops(hlo) == {"instructions": 3, "fusions": 1, "loops": 1}


@pytest.mark.parametrize("greedy, block", [(True, 512), (False, 2)])
def test_report_of_the_tiny_step(greedy, block):
    """The report compiles the tiny config's decode step (no parameter allocated) and, on CPU,
    the loop's body inside the compiled rollout; its ratios are its own bytes over the needed
    ones worked out above. The rows' own 4 response slots fit one block of 512 (read in one
    pass: no loop in the body), and take blocks of 2 in a loop with `attention_block_size=2`."""
    cfg = tiny_config(**{"model.attention_block_size": block})
    out = decode_report.decode_report(cfg, greedy=greedy, timing=False)
    assert out["fill"] == 7 + 4 // 2 and out["decode_attention"] == "blockwise"
    need = out["needed_bytes"]["total"]
    assert need == PARAMS * 4 + 16 * 32 * 4 + 16 * 9 * 2 * SLOT + 16 * 88 * 4
    assert out["bytes"] > 0 and out["ratio"] == round(out["bytes"] / need, 3)
    assert 0 < out["sampler_bytes"] < out["bytes"]
    assert out["ops"]["instructions"] >= out["ops"]["fusions"] > 0
    assert out["in_loop"]["bytes"] > 0 and (out["in_loop"]["ops"]["loops"] > 0) == (block == 2)
    assert set(out["roofline_tokens_per_s"]) == set(decode_report.CHIPS)


def test_a_scanned_model_is_reported_layer_by_layer():
    """With model.scan_cached_layers XLA's analysis would count one layer's body of the scan:
    the report compiles the layer-by-layer step instead (the same function), so its bytes are
    those of the plain config's, and it says so."""
    plain = decode_report.decode_report(tiny_config(), greedy=True, timing=False)
    cfg = tiny_config(**{"model.scan_cached_layers": True})
    scanned = decode_report.decode_report(cfg, greedy=True, timing=False)
    assert scanned["bytes"] == plain["bytes"] and scanned["ops"] == plain["ops"]
    assert plain["layers"] == "layer by layer"
    assert scanned["layers"].startswith("layer by layer (the rollout's scan")
    assert decode_report.Shape(cfg).run_cfg.scan_cached_layers  # a timed rollout: the config's
