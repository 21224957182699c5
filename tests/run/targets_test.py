"""jrl.run.targets: TPU target names and their one-line errors (before any compile), the tiny
step compiled by the TPU compiler where libtpu is installed, and the XLA flags set for a GPU
backend (the string built, a user's value kept, XLA accepting it)."""

import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, tiny_config
from jrl.run import benchmark, decode_report, targets

NO_LIBTPU = targets.libtpu_version() is None
needs_libtpu = pytest.mark.skipif(
    NO_LIBTPU,
    reason=f"libtpu is not installed ({targets.INSTALL}): no TPU compiler to compile with",
)


# Cloud TPU's documented slices: name -> (topology, chips). v4 / v5p names count TensorCores
# (two per chip), v5e / v6e names count chips.
SLICES = {
    "v4-8": ("v4:2x2x1", 4),
    "v4-32": ("v4:2x2x4", 16),
    "v5p-8": ("v5p:2x2x1", 4),
    "v5p-64": ("v5p:2x4x4", 32),
    "v5p-128": ("v5p:4x4x4", 64),
    "v5p-256": ("v5p:4x4x8", 128),
    "v5e-1": ("v5e:1x1", 1),
    "v5litepod-16": ("v5e:4x4", 16),
    "v5e-8": ("v5e:2x4", 8),
    "v6e-64": ("v6e:8x8", 64),
}


@pytest.mark.parametrize("name", SLICES)
def test_slice_names_give_cloud_tpu_topologies(name):
    target = targets.parse(name)
    assert (target.topology, target.chips) == SLICES[name]


def test_a_topology_is_taken_as_given_and_tpu_reads_the_mesh_preset():
    assert targets.parse("v5p:2x2x2") == ("v5p:2x2x2", "v5p", "v5p:2x2x2", 8)
    assert targets.parse("tpu", "model=qwen2.5-7b,mesh=v5p-64").topology == "v5p:2x4x4"
    assert targets.parse("tpu", "model=qwen3-30b-a3b,mesh=v5p-64-ep") == targets.parse("v5p-64")


@pytest.mark.parametrize(
    "name, presets, expected",
    [
        ("v9-8", "", "unknown target 'v9-8'"),
        ("h100", "", "unknown target 'h100'"),
        ("v5p-12", "", "unknown slice 'v5p-12'"),
        ("v5p:2x2", "", "a v5p topology has 3 sizes"),
        ("tpu", "model=qwen2.5-7b", "has none; add one (e.g. :mesh=v5p-64)"),
        ("tpu", "mesh=gpu8", "mesh=gpu8 is not a TPU slice"),
    ],
)
def test_bad_targets_are_one_line_errors(name, presets, expected):
    with pytest.raises(targets.TargetError) as e:
        targets.parse(name, presets)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_without_libtpu_the_error_names_the_install_command(monkeypatch):
    monkeypatch.setattr(targets, "libtpu_version", lambda: None)
    with pytest.raises(targets.TargetError, match=r"pip install -e '\.\[tpu-compile\]'"):
        targets.require_libtpu()


def _bench(args, prelude=""):
    """`python -m jrl.bench ARGS` on CPU with compiles logged; `prelude` runs first."""
    code = f"{prelude or 0}; import runpy; runpy.run_module('jrl.bench', run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, prelude, expected",
    [
        (["--target=v9-8"], "", "error: unknown target 'v9-8'"),
        # libtpu hidden: sys.modules["libtpu"] = None makes it unimportable
        (["--target=v5p-8"], "import sys; sys.modules['libtpu'] = None", ".[tpu-compile]'"),
    ],
)
def test_bench_stops_before_any_compile(args, prelude, expected):
    run = _bench(["--memory", "--config=configs/grpo_math.py:tiny", *args], prelude)
    assert run.returncode == 2, run.stderr[-2000:]
    assert expected in run.stderr.strip().splitlines()[-1]
    assert "Compiling" not in run.stderr


@needs_libtpu
def test_devices_of_a_slice():
    v5p = targets.devices(targets.parse("v5p-64"))
    assert len(v5p) == 32 and v5p[0].device_kind == "TPU v5"
    assert len({d.process_index for d in v5p}) == 8  # 8 hosts of 4 chips
    v4 = targets.devices(targets.parse("v4-8"))  # one device per chip (megacore), as on a VM
    assert len(v4) == 4 and v4[0].device_kind == "TPU v4"


@needs_libtpu
def test_compiled_by_the_tpu_compiler_with_its_layouts():
    """float32[1000] takes 4000 bytes on CPU; the TPU keeps it in whole tiles of 8 x 128
    elements, 4096 bytes: the figure is the TPU compiler's."""
    x = jax.ShapeDtypeStruct((1000,), np.float32)
    compiled = targets.compile(jax.jit(lambda x: x * 2), (x,), targets.parse("v5p-8"))
    assert compiled.memory_analysis().argument_size_in_bytes == 4096
    on_cpu = targets.compile(jax.jit(lambda x: x * 2), (x,))
    assert on_cpu.memory_analysis().argument_size_in_bytes == 4000


@needs_libtpu
def test_without_staging_a_product_is_counted_once():
    """[128, 896] x [896, 4864] in bfloat16, float32 out: 229,376 + 8,716,288 bytes read and
    2,490,368 written. As compiled, the TPU compiler stages the weight in on-chip memory and its
    analysis counts it in the copy, the copy's outputs and the product (4x); with
    `targets.HBM_ONLY` each byte once."""
    x = jax.ShapeDtypeStruct((128, 896), jax.numpy.bfloat16)
    w = jax.ShapeDtypeStruct((896, 4864), jax.numpy.bfloat16)
    product = jax.jit(lambda x, w: jax.numpy.dot(x, w, preferred_element_type=np.float32))
    v5p = targets.parse("v5p-8")
    needed = 128 * 896 * 2 + 896 * 4864 * 2 + 128 * 4864 * 4
    staged = targets.compile(product, (x, w), v5p).cost_analysis()["bytes accessed"]
    plain = targets.compile(product, (x, w), v5p, None, targets.HBM_ONLY)
    assert plain.cost_analysis()["bytes accessed"] == needed
    assert staged > 3 * needed


@needs_libtpu
def test_decode_report_for_a_tpu_counts_the_step_staged_and_unstaged():
    v5p = targets.parse("v5p-8")
    report = decode_report.decode_report(
        tiny_config(),
        compile_fn=lambda fn, args: targets.compile(fn, args, v5p),
        unstaged_compile_fn=lambda fn, args: targets.compile(fn, args, v5p, None, targets.HBM_ONLY),
    )
    plain = report["unstaged"]
    need = report["needed_bytes"]
    assert 0 < plain["bytes"] <= report["bytes"]
    assert plain["ratio"] == round(plain["bytes"] / need["total"], 3)
    assert plain["ratio_to_shared_prompt"] == round(plain["bytes"] / need["total_shared_prompt"], 3)


@needs_libtpu
def test_a_program_larger_than_a_chip_does_not_fit():
    x = jax.ShapeDtypeStruct((5 * 2**30,), np.float32)  # 20 GiB: a v5e chip has 16 GiB
    with pytest.raises(targets.DoesNotFit) as e:
        targets.compile(jax.jit(lambda x: x + 1), (x,), targets.parse("v5e-1"))
    message = str(e.value)
    assert message.startswith("v5e-1 (topology v5e:1x1, 1 chips): ") and "HBM" in message
    assert "\n" not in message


@needs_libtpu
def test_memory_report_of_the_tiny_step_for_a_v5p_8():
    cfg = tiny_config(**{"mesh.shape": (-1, 1, 1)})
    report = benchmark.memory_report(cfg, targets.parse("v5p-8"))
    assert report["compiler"] == f"XLA:TPU (libtpu {targets.libtpu_version()}), ahead of time"
    assert report["target"] == "v5p-8 (topology v5p:2x2x1, 4 chips)" and report["fits"]
    assert (report["devices"], report["device"]) == (4, "TPU v5")
    assert report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert report["peak_bytes"] == (
        report["argument_bytes"]
        + report["output_bytes"]
        - report["alias_bytes"]
        + report["temp_bytes"]
    )
    # The train state (float32 params + Adam's two moments, replicated over data) is an
    # argument, in the TPU's tiles: at least its logical size.
    assert report["argument_bytes"] >= 3 * 4 * report["params"]
    print(json.dumps(report))


# --- GPU flags -----------------------------------------------------------------------------

OURS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"


def test_gpu_flags_are_added_after_the_users_own():
    assert targets.gpu_xla_flags("") == OURS
    assert targets.gpu_xla_flags(" --xla_dump_to=/tmp/d ") == f"--xla_dump_to=/tmp/d {OURS}"


@pytest.mark.parametrize(
    "users",
    [
        "--xla_gpu_enable_command_buffer=",  # command buffers off
        "--xla_gpu_enable_command_buffer=FUSION",
        "--xla_dump_to=/tmp/d -xla_gpu_enable_command_buffer=+COLLECTIVES",
    ],
)
def test_a_users_value_of_the_flag_wins(users):
    assert targets.gpu_xla_flags(users) == users
    environ = {"XLA_FLAGS": users}
    assert targets.use_gpu_flags(environ, gpu=True) is None and environ == {"XLA_FLAGS": users}


def test_flags_are_set_only_for_a_gpu_backend():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert targets.use_gpu_flags(environ, gpu=False) is None
    assert environ == {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert targets.use_gpu_flags(environ, gpu=True) == f"--xla_dump_to=/tmp/d {OURS}"
    assert environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/d {OURS}"
    cpu_only = {"JAX_PLATFORMS": "cpu"}
    assert targets.use_gpu_flags(cpu_only) is None and "XLA_FLAGS" not in cpu_only


def _xla(flags: str) -> subprocess.CompletedProcess:
    """A jitted function run on CPU with XLA_FLAGS=flags (XLA parses every flag, GPU ones too,
    and aborts on an unknown one or a bad value)."""
    return subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.jit(lambda x: x + 1)(1))"],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_xla_accepts_the_gpu_flags_and_adds_while_to_the_command_types(tmp_path):
    run = _xla(targets.gpu_xla_flags(f"--xla_dump_to={tmp_path}"))
    assert run.returncode == 0 and run.stdout.strip() == "2", run.stderr[-2000:]
    # XLA's dump of the options it compiled with (the fields that differ from its defaults)
    options = open(sorted(glob.glob(str(tmp_path / "*.debug_options")))[-1]).read().split("\n")
    types = {l.split(": ")[1] for l in options if l.startswith("xla_gpu_enable_command_buffer")}
    assert {"WHILE", "CONDITIONAL", "FUSION"} <= types
    # the check can fail: a misspelt value stops XLA
    assert _xla("--xla_gpu_enable_command_buffer=+WHILEE").returncode != 0
