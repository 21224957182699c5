"""Compile targets: a jitted function compiled for a TPU slice that is not attached, by the TPU
compiler itself (libtpu), on any machine; and the XLA flags jrl sets for a GPU backend.

TPU targets. `python -m jrl.bench --memory --target=v5p-64` compiles the fused step for the 32
chips of a v5p-64 from abstract inputs: nothing is allocated, nothing runs, no TPU is needed,
and the memory analysis is the TPU compiler's (its layouts, its fusion and scheduling, bfloat16
kept as bfloat16), not XLA:CPU's. libtpu must be installed (`pip install -e '.[tpu-compile]'`:
the libtpu release that matches the installed jax).

A target is named by

  * a Cloud TPU slice: `v4-8`, `v5p-64`, `v5e-16` (or `v5litepod-16`), `v6e-8`. v4 and v5p
    names count TensorCores, two per chip (a v5p-64 is 32 chips); v5e and v6e names count chips.
    The slice's topology is Cloud TPU's default one for that many chips (v5p-64: 2x4x4);
  * a topology: `v5p:2x4x4`, `v5e:4x4` (generation, then chips along each axis);
  * `tpu`: the slice of the config's `mesh=` preset (`--config=configs/grpo_math.py:mesh=v5p-64`;
    `mesh=v5p-64-ep`, with an expert axis, is the same slice).

Use from code (a report that compiles another function does the same as `memory_report`):

    target = targets.parse("v5p-8")
    targets.host_only()                          # before the first device use of the process
    mesh = targets.mesh_for(target, cfg)         # cfg.mesh's axes and shape over the chips
    compiled = targets.compile(jitted_fn, abstract_args, target, mesh)
    compiled.memory_analysis(), compiled.cost_analysis()

`abstract_args` are `jax.ShapeDtypeStruct`s (`abstract(tree, shardings)` makes them from arrays
or structs and shardings of the mesh); a leaf without a sharding is replicated. A program that
does not fit the chip's memory raises `DoesNotFit` with the compiler's own message.

GPU flags. `use_gpu_flags()` adds to `XLA_FLAGS`, before the first device use, the flags of
`GPU_XLA_FLAGS` that the user has not set (docs/performance.md, "GPU flags").
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
import os
import re
from collections.abc import Mapping, MutableMapping
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl import sharding

INSTALL = "pip install -e '.[tpu-compile]'"

# generation -> (libtpu's name, TensorCores per chip counted by a slice name, axes of its torus,
# libtpu options). v4 and v5p chips run their two TensorCores as one device ("megacore"), as a
# TPU VM does; libtpu's own default for v4 is one device per core.
_GENERATIONS = {
    "v4": ("v4", 2, 3, {"chip_config_name": "megacore"}),
    "v5p": ("v5p", 2, 3, {}),
    "v5e": ("v5e", 1, 2, {}),
    "v6e": ("v6e", 1, 2, {}),
}
_ALIASES = {"v5litepod": "v5e", "v5": "v5p"}


class TargetError(ValueError):
    """A target that cannot be compiled for; the message names it and the fix."""


class DoesNotFit(TargetError):
    """The TPU compiler found the program larger than a chip's memory (its message says how
    much it needs and how much there is)."""


class Target(NamedTuple):
    """A TPU slice to compile for."""

    name: str  # as given: "v5p-64" or "v5p:2x4x4"
    generation: str  # "v4" | "v5p" | "v5e" | "v6e"
    topology: str  # libtpu's topology name: "v5p:2x4x4"
    chips: int  # devices of the slice (one per chip)

    def describe(self) -> str:
        return f"{self.name} (topology {self.topology}, {self.chips} chips)"


def _default_shape(chips: int, axes: int) -> tuple[int, ...] | None:
    """Cloud TPU's default topology for `chips` chips: 2x2(x1) for 4, then each doubling doubles
    the last of the smallest axes (2x2x2, 2x2x4, 2x4x4, 4x4x4, ...; 2x4, 4x4, 4x8, ...).
    None for a count that is not a power of two of at least 4 (or 1 on a 2-D generation)."""
    if axes == 2 and chips == 1:
        return (1, 1)
    if chips < 4 or chips & (chips - 1):
        return None
    shape = [2, 2] + [1] * (axes - 2)
    while math.prod(shape) < chips:
        smallest = min(shape)
        shape[max(i for i, s in enumerate(shape) if s == smallest)] *= 2
    return tuple(shape)


def parse(name: str, presets: str = "") -> Target:
    """The target `name` names (see the module doc); `presets` are the config's presets (what
    follows ':' in --config), read for `tpu`. TargetError (one line) for a name that is neither
    a known slice nor a topology."""
    name = name.strip()
    if name == "tpu":
        meshes = [p.split("=", 1)[1] for p in presets.split(",") if p.startswith("mesh=")]
        if not meshes:
            raise TargetError(
                "--target=tpu compiles for the TPU slice of the config's mesh= preset, and the "
                "config has none; add one (e.g. :mesh=v5p-64) or name a slice (--target=v5p-8)."
            )
        try:  # an expert-parallel preset (v5p-64-ep) runs on its slice (v5p-64)
            return parse(meshes[-1].removesuffix("-ep"))
        except TargetError:
            raise TargetError(
                f"--target=tpu: mesh={meshes[-1]} is not a TPU slice; name one (--target=v5p-8)."
            ) from None
    slice_ = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    topology = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", name)
    match = slice_ or topology
    gen = match and _ALIASES.get(match[1], match[1])
    if gen not in _GENERATIONS:
        raise TargetError(
            f"unknown target '{name}': name a slice (v4-8, v5p-64, v5e-16, v6e-8), a topology "
            f"(v5p:2x4x4) or 'tpu'; generations: {', '.join(_GENERATIONS)}."
        )
    tpu_name, cores, axes, _ = _GENERATIONS[gen]
    example = "2x2x1" if axes == 3 else "2x2"
    if topology:
        dims = tuple(int(d) for d in topology[2].split("x"))
        if len(dims) != axes or 0 in dims:
            raise TargetError(f"topology '{name}': a {gen} topology has {axes} sizes ({example}).")
        return Target(name, gen, f"{tpu_name}:{topology[2]}", math.prod(dims))
    count = int(slice_[2])
    shape = _default_shape(count // cores, axes) if count % cores == 0 else None
    if shape is None:
        sizes = "8, 16, 32, ... (two cores a chip)" if cores == 2 else "1, 4, 8, 16, ..."
        raise TargetError(
            f"unknown slice '{name}': {gen} slices are {gen}-N for N = {sizes}; for another "
            f"shape name its topology ({gen}:{example})."
        )
    return Target(name, gen, f"{tpu_name}:{'x'.join(map(str, shape))}", math.prod(shape))


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None when it is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def compiler_name() -> str:
    """What compiles for a target: 'XLA:TPU (libtpu X), ahead of time'."""
    return f"XLA:TPU (libtpu {libtpu_version()}), ahead of time"


def require_libtpu() -> None:
    """TargetError (one line) naming the install command when libtpu is not installed."""
    if libtpu_version() is None:
        raise TargetError(
            f"compiling for a TPU target needs libtpu (the TPU compiler), which is not "
            f"installed; install the release that matches jax {jax.__version__}: {INSTALL}"
        )


def _libtpu_environment(target: Target, environ: MutableMapping[str, str] = os.environ) -> None:
    """What libtpu reads from the environment when it starts, set unless the user set it: no
    metadata-server query (off a TPU VM there is none), an accelerator type and worker list
    (without them it prints warnings and an error trace; the values do not change the program),
    and leave to load it while another process holds /tmp/libtpu_lockfile (a run on this TPU
    VM, another compile): compiling opens no chip."""
    cores = _GENERATIONS[target.generation][1]
    environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    environ.setdefault("TPU_ACCELERATOR_TYPE", f"{target.generation}-{target.chips * cores}")
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def host_only() -> None:
    """Before the first device use of a process that only compiles for a target: JAX's own
    backend is the CPU (a TPU VM's chips stay free and libtpu does not try to open them), unless
    JAX_PLATFORMS says otherwise. Without effect once a backend is up."""
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")


@functools.cache
def devices(target: Target) -> tuple[jax.Device, ...]:
    """The compile-only devices of the target's chips (libtpu's topology; no TPU attached)."""
    require_libtpu()
    _libtpu_environment(target)
    from jax.experimental import topologies

    options = dict(_GENERATIONS[target.generation][3])
    if target.chips == 1:
        options["chips_per_host_bounds"] = (1, 1, 1)
    try:
        topology = topologies.get_topology_desc(target.topology, "tpu", **options)
    except Exception as e:  # libtpu's errors are JaxRuntimeErrors of several lines
        raise TargetError(
            f"libtpu {libtpu_version()} refused topology {target.topology}: "
            f"{str(e).splitlines()[0]}"
        ) from e
    return tuple(topology.devices)


def mesh_for(target: Target, cfg) -> Mesh:
    """`cfg.mesh` (axes, shape; -1 takes the chips the others leave) over the target's chips,
    built by `jrl.sharding.make_mesh` as a run builds it over its devices."""
    try:
        return sharding.make_mesh(cfg.mesh.axes, cfg.mesh.shape, devices(target))
    except TargetError:
        raise
    except ValueError as e:
        raise TargetError(f"target {target.describe()}: {e}") from None


def abstract(tree, shardings):
    """`jax.ShapeDtypeStruct`s of `tree`'s leaves (arrays or structs) with `shardings` (a tree
    of the same structure, or one sharding for every leaf)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
        )
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings), tree)


# libtpu's compile options that keep every buffer in HBM: memory-space assignment off, so
# nothing is staged in the chip's on-chip memory (VMEM). The cost analysis counts a staged
# operand three times or more (the copy's read, the copy's output, the consumer's read of it):
# a [128, 896] x [896, 4864] product is charged 4.0x its bytes as compiled and 1.0x without
# staging (scripts/cost_accounting.py --tpu). Without staging every byte the analysis counts
# is read from or written to HBM; staging moves reads of HBM to a prefetch of the same bytes,
# so the unstaged count is close to the HBM traffic (docs/performance.md, "What the compilers
# count").
HBM_ONLY = {"xla_msa_enable": False}


def compile(
    fn,
    abstract_args,
    target: Target | None = None,
    mesh: Mesh | None = None,
    compiler_options: dict | None = None,
):
    """`fn` (a `jax.jit`-wrapped function) lowered for `abstract_args` and compiled: the
    `jax.stages.Compiled`, with `memory_analysis()` (per device) and `cost_analysis()`;
    `compiler_options` go to the compiler (e.g. `HBM_ONLY`).

    With `target`, leaves of `abstract_args` without a sharding are replicated over `mesh` (or,
    without one, the target's first chip), and a program larger than a chip's memory raises
    `DoesNotFit` with the compiler's message. `mesh` is set while tracing (`jax.set_mesh`), as
    the trainer does, so the model's activation constraints name its axes. Without `target`,
    the current backend compiles."""
    if target is not None:
        first_chip = Mesh(np.array(devices(target)[:1]), ("chip",))
        place = NamedSharding(mesh or first_chip, PartitionSpec())
        abstract_args = jax.tree.map(
            lambda a: (
                a
                if getattr(a, "sharding", None) is not None
                else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=place)
            ),
            abstract_args,
        )
    # A compile-only executable cannot be read back from the persistent compilation cache (no
    # client to load it into): none is written while compiling for a target (the cache itself
    # stays on: switching it off would keep it off for the process).
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    if target is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        if mesh is None:
            return fn.lower(*abstract_args).compile(compiler_options=compiler_options)
        with jax.set_mesh(mesh):
            return fn.lower(*abstract_args).compile(compiler_options=compiler_options)
    except jax.errors.JaxRuntimeError as e:
        if target is None or "RESOURCE_EXHAUSTED" not in str(e):
            raise
        first = str(e).splitlines()[0].replace("RESOURCE_EXHAUSTED: ", "")
        raise DoesNotFit(f"{target.describe()}: {first}") from e
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)


# --- GPU ---------------------------------------------------------------------------------------

# XLA flags for a CUDA backend, each with the value jrl sets (flag names and values checked
# against jax 0.10.2's XLA by tests/run/targets_test.py). The rollout's decode is a lax.while_loop
# (and lax.cond / lax.switch); XLA:GPU records a while loop's body into a command buffer (a CUDA
# graph, looping on the device) only when WHILE is among the command types, which it is not by
# default (CONDITIONAL is; named so that it stays on). The '+' adds the types to XLA's default
# list instead of replacing it.
GPU_XLA_FLAGS = {"xla_gpu_enable_command_buffer": "+WHILE,+CONDITIONAL"}


def gpu_xla_flags(current: str = "", flags: Mapping[str, str] = GPU_XLA_FLAGS) -> str:
    """`current` (an XLA_FLAGS value) with each of `flags` appended that it does not set already
    (with any value, empty included: a user's setting wins)."""
    out = current.strip()
    for name, value in flags.items():
        if not re.search(rf"(^|\s)--?{name}(=|\s|$)", current):
            out = f"{out} --{name}={value}".strip()
    return out


def _cuda_possible(environ: Mapping[str, str]) -> bool:
    """Whether JAX may start a CUDA backend: a CUDA plugin is installed and JAX_PLATFORMS, if
    set, allows it. Checked without starting any backend."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.replace(" ", "").split(",")):
        return False
    return any(
        importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")
    )


def use_gpu_flags(
    environ: MutableMapping[str, str] = os.environ, gpu: bool | None = None
) -> str | None:
    """Adds `GPU_XLA_FLAGS` to `environ["XLA_FLAGS"]` (`gpu_xla_flags`) when the backend can be
    a GPU (`gpu`; default: a CUDA plugin is installed and JAX_PLATFORMS allows it). XLA reads
    XLA_FLAGS once, when the first backend starts: call this before any device use. Returns the
    XLA_FLAGS value set, or None when nothing was changed."""
    if not (_cuda_possible(environ) if gpu is None else gpu):
        return None
    current = environ.get("XLA_FLAGS", "")
    new = gpu_xla_flags(current)
    if new == current.strip():
        return None
    environ["XLA_FLAGS"] = new
    return new
