"""Checkpoints (orbax; local directories and gs://), resume, and preemption.

Layout under the run's workdir (any `etils.epath` path, e.g. `gs://bucket/run`):

    checkpoints/<step>/state   the train state WITHOUT the reference params (orbax, OCDBT)
    checkpoints/<step>/extra   small JSON: data position, the config it ran with, ...
    checkpoints/<step>/meta    JSON written by this module (PRNG key implementations)
    reference/0/params         the frozen reference params, saved once per run

The state is any pytree, typically the `TrainState` flax struct dataclass. It is stored as a
nested dict named by the pytree paths (`params/layers/attn/q_proj`, `opt_state/1/0/mu/...`),
typed PRNG keys as their raw key data (`jax.random.key_data`), `None` fields as nothing. Restoring
needs a target with the run's structure: a concrete state or `jax.eval_shape` of its init; the
result has the target's pytree structure, dtypes and, where the target carries them, shardings.

Saves are asynchronous by default: `save` returns once the arrays are copied to host memory, so
the next (donating) step may reuse their device buffers; the files are written in the background.
Orbax writes each step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only once
everything is written (on gs:// it writes `commit_success.txt` last instead), so a process killed
mid-save leaves an unfinished directory next to the intact earlier checkpoints.
Each checkpoint of a local workdir (single process) also holds `jrl_checksums.json`, the size and
CRC-32 of every file of its items, written after orbax wrote them and before it commits the
directory (in orbax's background thread for an asynchronous save); a restore checks every file
against it first, and a mismatch (bytes changed on disk) makes the checkpoint unreadable.
`gs://` and multi-process checkpoints have none (GCS checks each object's CRC-32C on upload;
reading a large checkpoint back from the bucket to hash it would cost a download per save).
`restore_latest` skips unfinished, unreadable and damaged checkpoints (with a warning naming
each) and restores the newest one that reads back. It deletes nothing: unreadable checkpoints
newer than the one restored are renamed to `<step>.invalid`, so that the resumed run can save
those steps.

A finished run's config and policy (for evaluation and export) are read back without its
trainer: `load_config(workdir, step)` (the config a checkpoint was written with),
`restore_params` (the policy; a LoRA run's merged), `restore_lora` (frozen base and adapters).

Preemption: `PreemptionGuard` turns the first SIGTERM / SIGINT into a request the loop polls
after each step (it then saves, waits and exits with `PREEMPTED_EXIT_CODE`); a second signal
exits at once with `FORCED_EXIT_CODE`. On multi-process runs (TPU pods) it also honours JAX's
preemption sync point, so that every process stops at the same step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import signal
import threading
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from jrl import config as config_lib
from jrl import models
from jrl import train_state
from jrl.models import lora as lora_lib
from jrl.models import transformer

# Exit status of a run that stopped on a signal or preemption notice AFTER saving a checkpoint:
# the launcher may requeue it with the same --workdir and it resumes where it stopped.
PREEMPTED_EXIT_CODE = 42
# Exit status after a SECOND signal: the process left at once without saving. Checkpoints that
# had already committed are intact (a save in flight stays an unfinished tmp directory, which
# resuming skips), so requeueing resumes from the last committed checkpoint.
FORCED_EXIT_CODE = 43

CHECKPOINTS_DIR = "checkpoints"
REFERENCE_DIR = "reference"
CHECKSUMS_FILE = "jrl_checksums.json"  # in each local checkpoint: every item file's CRC-32
_FORMAT = 1  # version of this module's layout, stored in each checkpoint's meta item
_STEP_DIR = re.compile(r"^(0|[1-9][0-9]*)(\.orbax-checkpoint-tmp.*)?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot resume this run; the message names the problem and the fix."""


class DamagedCheckpoint(Exception):
    """A checkpoint's files differ from what was written (its checksums do not match)."""


class Preempted(SystemExit):
    """Raised by the training loop once it has saved after a preemption request.

    A `SystemExit` whose code is `PREEMPTED_EXIT_CODE`: uncaught, the process exits with it.
    """

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step


# ----------------------------------------------------------------------------- pytree <-> dict


def nbytes(tree) -> int:
    """Bytes of the arrays of `tree` (arrays or `jax.ShapeDtypeStruct`s; `None` fields hold
    none): about what a checkpoint of it takes on disk (orbax compresses a little)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _key_name(k) -> str:
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def _is_prng_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _flatten(tree) -> tuple[list[tuple[tuple[str, ...], Any]], Any]:
    """[(path names, leaf)] in pytree order, and the treedef (`None` fields have no leaves)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = [(tuple(_key_name(k) for k in path), leaf) for path, leaf in leaves]
    seen = set()
    for names, _ in named:
        if names in seen:
            raise ValueError(f"two leaves of the state share the path {'/'.join(names)}.")
        seen.add(names)
    return named, treedef


def _nest(named: list[tuple[tuple[str, ...], Any]]) -> dict:
    out: dict = {}
    for names, value in named:
        node = out
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = value
    return out


def _walk(nested: Mapping, prefix: tuple[str, ...] = ()):
    """Yields (path names, leaf) of a nested dict (the layout a checkpoint holds)."""
    for name, value in nested.items():
        if isinstance(value, Mapping):
            yield from _walk(value, prefix + (name,))
        else:
            yield prefix + (name,), value


def _lookup(nested: Mapping, names: tuple[str, ...]):
    node = nested
    for name in names:
        node = node[name]
    return node


def _savable(tree) -> tuple[dict, dict]:
    """(nested dict of arrays, {path: PRNG impl name}); typed keys become their key data."""
    named, _ = _flatten(tree)
    impls, out = {}, []
    multi_process = jax.process_count() > 1
    for names, leaf in named:
        if multi_process and isinstance(leaf, jax.Array) and leaf.is_fully_addressable:
            raise CheckpointError(
                f"{'/'.join(names)} is a host-local array, which cannot be checkpointed on a "
                "multi-process run; create the state under jax.jit with out_shardings (global "
                "arrays)."
            )
        if _is_prng_key(leaf):
            impls["/".join(names)] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        out.append((names, leaf))
    return _nest(out), impls


def _abstract_leaf(x):
    """What orbax restores a leaf into: shape, dtype and (when the target has one) sharding."""
    if _is_prng_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x  # numpy arrays and Python scalars: orbax restores them as such


def _shape_dtype(x) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(x, (jax.ShapeDtypeStruct, jax.Array, np.ndarray, np.generic)):
        return tuple(x.shape), np.dtype(x.dtype)
    return (), np.result_type(x)


def _fmt(shape, dtype) -> str:
    return f"{tuple(shape)} {np.dtype(dtype).name}"


def _check_matches(where: str, saved_meta: Mapping, abstract: Mapping) -> None:
    """Raises CheckpointError naming the first path whose presence, shape or dtype differs."""
    fix = "resume with the config the checkpoint was written with, or start a fresh --workdir"
    saved = dict(_walk(saved_meta))
    wanted = dict(_walk(abstract))
    if any("layers_0" in names for names in saved) and any("layers" in n for n in wanted):
        raise CheckpointError(
            f"checkpoint {where} stores the decoder layers one by one (params/layers_0/...), as "
            f"jrl did before it stacked them (params/layers/...); export it with the jrl version "
            f"that wrote it (python -m jrl.export) and start from that directory with "
            f"--config.model.hf_path, or start a fresh --workdir."
        )
    for names, target in wanted.items():
        path = "/".join(names)
        if names not in saved:
            raise CheckpointError(
                f"checkpoint {where} does not match this run: it has no {path} (the state layout "
                f"changed, e.g. a critic was added); {fix}."
            )
        got_shape, got_dtype = tuple(saved[names].shape), np.dtype(saved[names].dtype)
        shape, dtype = _shape_dtype(target)
        if got_shape != shape or got_dtype != dtype:
            raise CheckpointError(
                f"checkpoint {where} does not match this run: {path} is "
                f"{_fmt(got_shape, got_dtype)} in the checkpoint but {_fmt(shape, dtype)} here "
                f"(e.g. the model size or dtype changed); {fix}."
            )
    extra = [names for names in saved if names not in wanted]
    if extra:
        raise CheckpointError(
            f"checkpoint {where} does not match this run: it has {'/'.join(extra[0])}, which "
            f"this run's state lacks (the state layout changed); {fix}."
        )


def _rebuild(target, restored: Mapping, impls: Mapping[str, str], where: str):
    """The restored nested dict put back into the target's pytree (keys re-wrapped)."""
    named, treedef = _flatten(target)
    leaves = []
    for names, want in named:
        value = _lookup(restored, names)
        if _is_prng_key(want):
            path = "/".join(names)
            if path not in impls:
                raise CheckpointError(
                    f"checkpoint {where} stores {path} as plain data, but this run's state holds "
                    f"a PRNG key there; resume with the matching config or a fresh --workdir."
                )
            value = jax.random.wrap_key_data(value, impl=impls[path])
            if value.dtype != want.dtype:
                raise CheckpointError(
                    f"checkpoint {where} holds a {value.dtype} PRNG key at {path} but this run "
                    f"uses {want.dtype}; resume with the same PRNG implementation "
                    f"(jax_default_prng_impl) or a fresh --workdir."
                )
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ------------------------------------------------------------------------------- multi-process


def _all_processes_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a no-op on a single process)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------------- checksums
# A local checkpoint's files are read back and their CRC-32s written to CHECKSUMS_FILE inside the
# step directory after orbax has written everything and before it commits the directory (orbax's
# post-finalization callback, in its background save thread), so the list commits with the
# checkpoint. A restore checks every file against it first.


def _crc32(path: str) -> int:
    crc, buffer = 0, bytearray(1 << 22)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(memoryview(buffer)[:n], crc)
    return crc


def _item_files(step_dir: str) -> list[str]:
    """The files of a checkpoint's items (its subdirectories), relative to `step_dir`; the
    top-level files orbax writes at and after its commit are not among them."""
    out = []
    for item in sorted(os.listdir(step_dir)):
        top = os.path.join(step_dir, item)
        if os.path.isdir(top):
            for root, _, names in os.walk(top):
                out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
    return sorted(out)


def write_checksums(step_dir: str) -> None:
    """Writes `step_dir/CHECKSUMS_FILE`: {relative path: {"size", "crc32"}} of its item files."""
    files = {}
    for rel in _item_files(step_dir):
        path = os.path.join(step_dir, rel)
        files[rel] = {"size": os.path.getsize(path), "crc32": _crc32(path)}
    with open(os.path.join(step_dir, CHECKSUMS_FILE), "w") as f:
        json.dump({"algorithm": "crc32", "files": files}, f)


def damage(step_dir) -> str | None:
    """What differs between `step_dir`'s files and its CHECKSUMS_FILE (None when they match or
    when it has none: a gs:// or multi-process checkpoint, or one of an older jrl)."""
    step_dir = os.fspath(step_dir)
    if "://" in step_dir:
        return None
    path = os.path.join(step_dir, CHECKSUMS_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"its {CHECKSUMS_FILE} does not read ({e})"
    for rel, want in files.items():
        file = os.path.join(step_dir, rel)
        if not os.path.isfile(file):
            return f"{rel} is missing"
        if os.path.getsize(file) != want["size"]:
            return f"{rel} has {os.path.getsize(file)} bytes, {want['size']} were written"
        if _crc32(file) != want["crc32"]:
            return f"{rel} differs from what was written (CRC-32 mismatch)"
    return None


def _uncommitted_dir(directory: epath.Path, step: int) -> str | None:
    """The directory orbax is writing `step` into, before its commit (local workdirs)."""
    found = [p for p in directory.glob(f"{step}.orbax-checkpoint-tmp*") if p.is_dir()]
    found = found or [p for p in (directory / str(step),) if p.is_dir()]
    return os.fspath(max(found, key=lambda p: p.stat().mtime)) if found else None


# -------------------------------------------------------------------------------- Checkpointer


def _registry(arrays: tuple[str, ...], json: tuple[str, ...]):
    """Orbax handlers of a checkpoint's items (pytrees of arrays; small JSON documents)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name in arrays:
        registry.add(name, ocp.args.StandardSave)
        registry.add(name, ocp.args.StandardRestore)
    for name in json:
        registry.add(name, ocp.args.JsonSave)
        registry.add(name, ocp.args.JsonRestore)
    return registry


class Checkpointer:
    """Periodic asynchronous checkpoints of a train state under `<workdir>/checkpoints`.

    Args:
      workdir: the run's directory, local or `gs://...`.
      every_steps: `maybe_save(step, ...)` saves when `step % every_steps == 0`; 0: never (only
        the final / preemption `save`).
      max_to_keep: newest checkpoints to keep (older ones are deleted once a newer one commits);
        0: keep all.
      async_save: write in the background (True) or block in `save` until committed (False).
      reference_field: the state field holding the frozen reference params; it is saved once
        (`save_reference`, or automatically at the first `save`) instead of in every checkpoint.
    """

    def __init__(
        self,
        workdir,
        *,
        every_steps: int,
        max_to_keep: int,
        async_save: bool = True,
        reference_field: str = "ref_params",
    ):
        if every_steps < 0:
            raise ValueError(
                f"every_steps={every_steps} must be >= 0 (0: save only at the end and on "
                "preemption)."
            )
        if max_to_keep < 0:
            raise ValueError(f"max_to_keep={max_to_keep} must be >= 0 (0: keep all).")
        self.every_steps = every_steps
        self.reference_field = reference_field
        root = epath.Path(workdir)
        self.directory = root / CHECKPOINTS_DIR
        self.reference_directory = root / REFERENCE_DIR
        self._async = async_save
        # checksums of local single-process checkpoints (see `write_checksums`)
        self.checksums = "://" not in os.fspath(workdir) and jax.process_count() == 1
        # the steps whose saves have started and not committed, oldest first (orbax commits
        # them in order; a save waits for the one before)
        self._saving: collections.deque[int] = collections.deque()
        policy = ocp.checkpoint_managers.LatestN(n=max_to_keep or None)
        # Orbax's asynchronous checkpointer always (a synchronous save waits for it at once): its
        # post-finalization callback writes the checksums before the commit.
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True,
                preservation_policy=policy,
                async_options=ocp.AsyncOptions(
                    post_finalization_callback=lambda: self._checksum(self.directory)
                ),
            ),
            handler_registry=_registry(arrays=("state",), json=("extra", "meta")),
        )
        self._ref_manager = ocp.CheckpointManager(
            self.reference_directory,
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True,
                async_options=ocp.AsyncOptions(
                    post_finalization_callback=lambda: self._checksum(self.reference_directory)
                ),
            ),
            handler_registry=_registry(arrays=("params",), json=("meta",)),
        )
        # A reference without any state checkpoint is left from a run that died before its first
        # save: it does not count (the first save replaces it).
        self._reference_saved = bool(self._ref_manager.all_steps() and self._manager.all_steps())
        self._in_flight = False  # a save started since the last wait()

    # ------------------------------------------------------------------------ saving

    def _split(self, state):
        """(state with the reference field set to None, the reference or None)."""
        field = self.reference_field
        if dataclasses.is_dataclass(state) and any(
            f.name == field for f in dataclasses.fields(state)
        ):
            return dataclasses.replace(state, **{field: None}), getattr(state, field)
        if isinstance(state, Mapping) and field in state:
            return {k: (None if k == field else v) for k, v in state.items()}, state[field]
        return state, None

    def all_steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def maybe_save(self, step: int, state, extra: Mapping | None = None) -> bool:
        """Saves when `step` is a multiple of `every_steps`; returns whether it started a save."""
        return self.save(step, state, extra, force=False)

    def save(self, step: int, state, extra: Mapping | None = None, *, force: bool = True) -> bool:
        """Starts saving `state` and the JSON `extra` as checkpoint `step` (asynchronously unless
        `async_save=False`); `force=False` saves only on multiples of `every_steps`. A step that
        is already saved is not saved again. Returns whether a save was started."""
        step = int(step)
        if not force and (self.every_steps == 0 or step % self.every_steps):
            return False
        if step in self._manager.all_steps():
            return False
        try:
            extra = json.loads(json.dumps(dict(extra or {})))
        except TypeError as e:
            raise TypeError(f"checkpoint extra must be JSON-serialisable: {e}") from None
        state, ref = self._split(state)
        if ref is not None and not self._reference_saved:
            self.save_reference(ref)
        # A state checkpoint must never commit before the reference it needs.
        self._ref_manager.wait_until_finished()
        tree, impls = _savable(state)
        meta = {
            "format": _FORMAT,
            "prng_impls": impls,
            "reference_field": self.reference_field,
            "checksums": self.checksums,
        }
        self._in_flight = True
        self._saving.append(step)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree),
                extra=ocp.args.JsonSave(extra),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        if not self._async:
            self.wait()
        return True

    def _checksum(self, directory: epath.Path) -> None:
        """Orbax's post-finalization callback: the checksums of the step being committed."""
        step = 0 if directory == self.reference_directory else self._saving.popleft()
        if not self.checksums:
            return
        step_dir = _uncommitted_dir(directory, step)
        if step_dir is None:
            raise FileNotFoundError(f"no directory of checkpoint {step} under {directory}")
        write_checksums(step_dir)

    def save_reference(self, params) -> None:
        """Saves the frozen reference params once, to `<workdir>/reference`.

        Kept as is when the workdir already holds a reference and state checkpoints (which were
        written against it); replaced when it holds a reference but no state checkpoint (a run
        that died before its first save)."""
        if self._ref_manager.all_steps():
            if self._manager.all_steps():
                logging.info(
                    "Keeping the reference params in %s (the checkpoints were written with it).",
                    self.reference_directory,
                )
                self._reference_saved = True
                return
            self._ref_manager.delete(0)
        tree, impls = _savable(params)
        meta = {"format": _FORMAT, "prng_impls": impls, "checksums": self.checksums}
        self._ref_manager.save(
            0,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self._in_flight = True
        self._reference_saved = True
        if not self._async:
            self.wait()

    def wait(self) -> None:
        """Blocks until every save in flight has committed (raises a failed save's error); at
        once when no save was started since the last call."""
        if not self._in_flight:
            return
        self._ref_manager.wait_until_finished()
        self._manager.wait_until_finished()
        self._in_flight = False

    def close(self) -> None:
        """Waits for the saves in flight and releases orbax's resources."""
        self.wait()
        self._ref_manager.close()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------ restoring

    def _restore_step(self, manager, step: int, item: str, target, where: str):
        """Restores item `item` (and the JSON items) of `step` into the structure of `target`;
        DamagedCheckpoint when its files do not match their checksums."""
        step_dir = manager.directory / str(step)
        problem = damage(step_dir)
        if problem:
            raise DamagedCheckpoint(f"checksums do not match: {problem}")
        named, _ = _flatten(target)
        abstract = _nest([(names, _abstract_leaf(leaf)) for names, leaf in named])
        saved = manager.item_metadata(step)[item]
        _check_matches(where, saved.tree if hasattr(saved, "tree") else saved, abstract)
        json_items = {"meta": ocp.args.JsonRestore()}
        if item == "state":
            json_items["extra"] = ocp.args.JsonRestore()
        restored = manager.restore(
            step,
            args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract)}, **json_items),
        )
        meta = restored["meta"] or {}
        if meta.get("checksums") and not (step_dir / CHECKSUMS_FILE).exists():
            raise DamagedCheckpoint(f"its {CHECKSUMS_FILE} is missing")
        value = _rebuild(target, restored[item], meta.get("prng_impls", {}), where)
        return value, (restored["extra"] if item == "state" else None)

    def restore_reference(self, abstract):
        """The saved reference params, restored into the structure of `abstract` (a pytree of
        arrays or `jax.ShapeDtypeStruct`s, with shardings where wanted)."""
        self._ref_manager.reload()
        if not self._ref_manager.all_steps():
            raise CheckpointError(
                f"no reference params in {self.reference_directory} (the run that wrote the "
                "checkpoints had no reference policy); resume with the config the checkpoints "
                "were written with, or start a fresh --workdir."
            )
        where = str(self.reference_directory / "0")
        try:
            params, _ = self._restore_step(self._ref_manager, 0, "params", abstract, where)
        except DamagedCheckpoint as e:
            raise CheckpointError(
                f"the reference params {where} are damaged ({e}); every checkpoint of this run "
                "needs them: start a fresh --workdir (or --fresh)."
            ) from None
        return params

    def _warn_unfinished(self, steps: list[int]) -> None:
        if not self.directory.exists():
            return
        committed = set(steps)
        for child in sorted(self.directory.iterdir(), key=lambda p: p.name):
            m = _STEP_DIR.match(child.name)
            if m and (m.group(2) or int(m.group(1)) not in committed):
                logging.warning(
                    "Skipping incomplete checkpoint %s: a save that did not finish (e.g. the "
                    "process was killed while saving); it is ignored and may be deleted.",
                    child,
                )

    def _set_aside(self, steps: list[int]) -> None:
        """Renames unreadable checkpoints newer than the one restored to `<step>.invalid[-k]`, so
        that the resumed run can save those steps again; nothing is deleted."""
        if jax.process_index() == 0:
            for step in steps:
                src = self.directory / str(step)
                dst = self.directory / f"{step}.invalid"
                k = 1
                while dst.exists():
                    dst, k = self.directory / f"{step}.invalid-{k}", k + 1
                try:
                    src.rename(dst)
                    logging.warning("Moved unreadable checkpoint %s to %s.", src, dst)
                except Exception as e:  # noqa: BLE001 - e.g. a store without directory renames
                    logging.warning("Could not move unreadable checkpoint %s aside: %s", src, e)
        _sync("jrl_checkpoint_set_aside")
        self._manager.reload()

    def restore(self, step: int, target_state):
        """Restores checkpoint `step` into the structure of `target_state` (as `restore_latest`,
        the reference field filled from `<workdir>/reference` when not None). Returns (state,
        extra). A checkpoint whose shapes / dtypes differ from the target raises
        CheckpointError; one that does not read back raises the storage's error."""
        self._manager.reload()
        target, target_ref = self._split(target_state)
        where = str(self.directory / str(step))
        state, extra = self._restore_step(self._manager, step, "state", target, where)
        if target_ref is not None:
            state = self._join(state, self.restore_reference(target_ref))
        return state, extra

    def restore_latest(self, target_state):
        """Restores the newest readable checkpoint into the structure of `target_state`.

        `target_state` is a concrete state or its `jax.eval_shape`; its reference field (if not
        None) is filled from `<workdir>/reference`. Returns (state, extra, step), or None when
        the workdir has no committed checkpoint. Unfinished and unreadable checkpoints are
        skipped with a warning naming each; a checkpoint whose shapes / dtypes differ from the
        target raises CheckpointError; so does a workdir none of whose checkpoints reads back.
        """
        self._manager.reload()
        steps = self.all_steps()
        self._warn_unfinished(steps)
        target, target_ref = self._split(target_state)
        unreadable, first_error = [], None
        for step in reversed(steps):
            where = str(self.directory / str(step))
            try:
                state, extra = self._restore_step(self._manager, step, "state", target, where)
                ok = True
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - any read failure means: try an older one
                ok, first_error = False, first_error or f"{where}: {type(e).__name__}: {e}"
                logging.warning(
                    "Skipping unreadable checkpoint %s (%s: %s); trying the one before.",
                    where,
                    type(e).__name__,
                    str(e).splitlines()[0][:300] if str(e) else "",
                )
            if not _all_processes_agree(ok):
                unreadable.append(step)
                continue
            if unreadable:
                self._set_aside(unreadable)
            if target_ref is not None:
                ref = self.restore_reference(target_ref)
                state = self._join(state, ref)
            logging.info("Restored checkpoint %s.", where)
            return state, extra, step
        if steps:
            raise CheckpointError(
                f"none of the checkpoints in {self.directory} reads back (newest error: "
                f"{first_error}); fix the storage, or start a fresh --workdir."
            )
        return None

    def _join(self, state, ref):
        if dataclasses.is_dataclass(state):
            return dataclasses.replace(state, **{self.reference_field: ref})
        return {**state, self.reference_field: ref}


# ---------------------------------------------------------------------------- PreemptionGuard


def _reached_preemption_sync_point(step: int) -> bool:
    """JAX's preemption notice (multi-process runs with the distributed service); else False."""
    if jax.process_count() == 1:
        return False
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # the preemption service is disabled (jax_enable_preemption_service)
        return False


class PreemptionGuard:
    """Context manager turning SIGTERM / SIGINT into a stop request the training loop polls.

    The first signal sets `requested`; the loop checks `should_stop(step)` after each step and
    then saves (force), waits for the save, and exits with `PREEMPTED_EXIT_CODE` (`raise
    Preempted(step)`). A second signal exits at once, even in the middle of a long step, with
    `FORCED_EXIT_CODE` (`os._exit` from a watcher thread woken through `signal.set_wakeup_fd`;
    no cleanup): checkpoints that had committed stay intact, and a save in flight stays an
    unfinished tmp directory that resuming skips.

    With `at_once` (the trainer's start-up: nothing done since the run started needs saving) the
    first signal exits at once with `PREEMPTED_EXIT_CODE`, after the `writing()` block in progress
    (a start-up write) and the `on_exit` callbacks; the loop calls `defer()` once its first step
    is done, and from then on the first signal is a request (the `on_request` callbacks run: the
    trainer's stops the user reward of a step in progress after a grace period).

    On multi-process runs (TPU pods) `should_stop` agrees the requests across processes (one
    small all-gather per step), so that all stop at the same step even when the signal reaches
    only some of them or reaches them during different steps; it also returns True at JAX's
    preemption sync point (`multihost_utils.reached_preemption_sync_point`), which fires when
    the distributed service's own SIGTERM notifier got the signal (it is installed by
    `jax.distributed.initialize`; whichever of the two handlers was installed last receives
    SIGTERM, and either way the run stops at an agreed step). The previous handlers are restored
    on exit. Handlers can only be installed from the main thread; elsewhere the guard only polls
    JAX's notice.
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), *, at_once: bool = False):
        self._signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self._previous_wakeup_fd: int | None = None
        self._wakeup_write_fd: int | None = None
        self.requested = False
        self.signal_name: str | None = None
        self._at_once = at_once
        self._writing = threading.RLock()  # held by `writing()`; an exit at once waits for it
        self.on_request: list = []  # called at the first signal once deferred
        self.on_exit: list = []  # called before an exit at once (e.g. releasing the workdir)

    def _handle(self, signum, frame) -> None:
        """The Python-level handler: it only keeps the default action (termination) away. It
        runs when the main thread next executes Python code, which can be a whole step later (a
        long XLA call, or a sleep when the kernel delivered the signal to another thread), so the
        watcher thread acts instead, woken at once through the wakeup fd (see `__enter__`)."""

    def _watch(self, read_fd: int) -> None:
        """Reads the signal numbers CPython's C-level handler writes to the wakeup fd the moment
        a signal arrives; ends when `__exit__` closes the write end."""
        wanted = {int(s) for s in self._signals}
        try:
            while data := os.read(read_fd, 64):
                for signum in data:
                    if signum in wanted:
                        self._on_signal(signum)
        finally:
            os.close(read_fd)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            os.write(2, f"\n{name} again: exiting now (code {FORCED_EXIT_CODE}).\n".encode())
            os._exit(FORCED_EXIT_CODE)
        with self._writing:  # a write in progress ends first
            if self._at_once:
                for fn in self.on_exit:
                    try:
                        fn()
                    except Exception:  # noqa: BLE001 - leaving anyway
                        pass
                os.write(
                    2,
                    f"\n{name} while starting: exiting now with code {PREEMPTED_EXIT_CODE} "
                    "(nothing new to save); rerun the same command to resume.\n".encode(),
                )
                os._exit(PREEMPTED_EXIT_CODE)
            self.requested, self.signal_name = True, name
        logging.warning(
            "Received %s: finishing this step, saving a checkpoint and exiting with code %d; "
            "send it again to exit at once.",
            name,
            PREEMPTED_EXIT_CODE,
        )
        for fn in self.on_request:
            fn()

    def defer(self) -> None:
        """From now on the first signal asks the loop to stop after its step (until now, with
        `at_once`, it exited at once: nothing since the run started needs saving)."""
        with self._writing:
            self._at_once = False

    @contextlib.contextmanager
    def writing(self):
        """A block that an exit at once waits for (a file being written during start-up)."""
        with self._writing:
            yield

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            logging.warning("PreemptionGuard outside the main thread: no signal handlers.")
            return self
        for sig in self._signals:
            previous = signal.getsignal(sig)
            if previous is None:  # installed outside Python before it started: not restorable
                logging.info("Leaving the non-Python %s handler in place.", sig.name)
                continue
            self._previous[sig] = previous
        self.reinstall()
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._wakeup_write_fd = write_fd
        threading.Thread(
            target=self._watch, args=(read_fd,), name="jrl-preemption-guard", daemon=True
        ).start()
        return self

    def reinstall(self) -> None:
        """Installs the handlers (again: after `jax.distributed.initialize`, whose preemption
        notifier takes SIGTERM, so that this guard receives it as it did before)."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous.clear()
        if self._wakeup_write_fd is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            os.close(self._wakeup_write_fd)  # the watcher reads EOF and ends
            self._wakeup_write_fd = None

    def should_stop(self, step: int) -> bool:
        """True once a stop was requested (on any process) or JAX's preemption sync point is
        reached at `step`; call it once per step, on every process, after the step."""
        if jax.process_count() == 1:
            return self.requested
        requested = not _all_processes_agree(not self.requested)
        return _reached_preemption_sync_point(step) or requested


# ----------------------------------------------------------------------------- a run's config


def _fill_defaults(cfg: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict) -> None:
    """Adds the fields of `defaults` that `cfg` lacks (configs saved before a field existed)."""
    for name, value in defaults.items():
        if name not in cfg:
            cfg[name] = value
        elif isinstance(value, ml_collections.ConfigDict) and isinstance(
            cfg[name], ml_collections.ConfigDict
        ):
            _fill_defaults(cfg[name], value)


def config_from_json(fields: dict) -> ml_collections.ConfigDict:
    """The ConfigDict of a saved config (`cfg.to_json_best_effort()`), with the fields added to
    jrl since it was saved at their defaults."""
    cfg = ml_collections.ConfigDict(fields)
    _fill_defaults(cfg, config_lib.base_config())
    return cfg


def _checkpoint_steps(workdir: str) -> list[int]:
    """Committed checkpoint steps under `workdir/checkpoints`, oldest first; [] when none."""
    directory = epath.Path(workdir) / CHECKPOINTS_DIR
    if not directory.exists():
        return []
    with _checkpointer(workdir) as ckpt:
        return ckpt.all_steps()


def _checkpointer(workdir: str) -> Checkpointer:
    """A Checkpointer that only reads (keeps every checkpoint, saves nothing by itself)."""
    return Checkpointer(workdir, every_steps=0, max_to_keep=0, async_save=False)


def check_step(workdir: str, step: int | None) -> list[int]:
    """The workdir's checkpoint steps; raises CheckpointError when there are none or `step` is
    not one of them."""
    steps = _checkpoint_steps(workdir)
    if not steps:
        raise CheckpointError(
            f"workdir {workdir} has no checkpoints (nothing committed under "
            f"{os.path.join(workdir, CHECKPOINTS_DIR)}); pass the --workdir of a run that saved "
            "one."
        )
    if step is not None and step not in steps:
        raise CheckpointError(
            f"step {step} is not among the checkpoints of {workdir} (available: "
            f"{', '.join(map(str, steps))}); pass one of them, or leave --step out for the newest."
        )
    return steps


def load_config(workdir: str, step: int | None = None) -> ml_collections.ConfigDict:
    """The config checkpoint `step` (default: the newest) was written with: its
    `extra["config"]`, else `workdir/config.json` (the last run's config)."""
    steps = check_step(workdir, step)
    step = steps[-1] if step is None else step
    extra_dir = epath.Path(workdir) / CHECKPOINTS_DIR / str(step) / "extra"
    saved = None
    try:
        extra = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(extra_dir)
        saved = (extra or {}).get("config")
    except Exception as e:  # noqa: BLE001 - an unreadable extra item: fall back to config.json
        logging.warning("Could not read %s (%s); using config.json.", extra_dir, e)
    if saved is None:
        path = epath.Path(workdir) / "config.json"
        if not path.exists():
            raise CheckpointError(
                f"checkpoint {step} of {workdir} records no config and {path} is missing; pass "
                "the run's config with --config=configs/X.py."
            )
        saved = json.loads(path.read_text())
    return config_from_json(saved)


# ----------------------------------------------------------------------------- a run's policy
# LoRA on a Hugging Face checkpoint: the frozen base is not saved with the run; checkpoints hold
# the trainable state and the base's identity, and a restore reloads the base from
# model.hf_path.


def lora_base_from_hf(cfg) -> bool:
    """Whether the run's checkpoints leave out its frozen LoRA base (read from model.hf_path)."""
    return lora_lib.lora_on(cfg) and bool(cfg.model.hf_path)


def abstract_state(
    cfg, model_cfg: transformer.ModelConfig, with_base: bool = False
) -> train_state.TrainState:
    """The run's train state as shapes (as jrl.run.trainer.run makes it), without the reference
    params (they are not needed to export or evaluate the policy; `with_base`: with them, for
    LoRA's frozen base)."""
    key_init, key_state = jax.random.split(jax.random.key(cfg.seed))
    state = jax.eval_shape(
        lambda: train_state.init_state(
            cfg, model_cfg, transformer.init_params(model_cfg, key_init), key_state
        )
    )
    return state if with_base else state.replace(ref_params=None)


def restore_params(workdir: str, cfg, model_cfg: transformer.ModelConfig, step: int | None = None):
    """(policy params, step) of checkpoint `step` of `workdir`; default: the newest checkpoint
    that reads back (unreadable newer ones are skipped with a warning). A LoRA run's policy
    comes back merged: W + (alpha / r) A B, in float32."""
    if lora_lib.lora_on(cfg):
        base, trainable, step = restore_lora(workdir, cfg, model_cfg, step)
        return lora_lib.merge(base, trainable, lora_lib.scale(cfg.lora), "float32"), step
    state, _, step = _restore_state(workdir, cfg, model_cfg, step)
    return state.params, step


def restore_lora(workdir: str, cfg, model_cfg: transformer.ModelConfig, step: int | None = None):
    """(frozen base, trainable params, step) of a LoRA run's checkpoint: the base from
    model.hf_path (checked against the identity the checkpoint recorded) or, for a base made in
    the run (the demo's warm-up), from the workdir's reference/."""
    state, extra, step = _restore_state(workdir, cfg, model_cfg, step)
    if lora_base_from_hf(cfg):
        message = lora_lib.check_base(extra.get("lora_base") or {}, cfg.model.hf_path)
        if message:
            raise CheckpointError(message)
        loaded = models.load_pretrained(cfg.model.hf_path, dtype=model_cfg.param_dtype)[1]
        base, _ = lora_lib.split(loaded)
    else:
        with _checkpointer(workdir) as ckpt:
            base = ckpt.restore_reference(abstract_state(cfg, model_cfg, with_base=True).ref_params)
    return base, state.params, step


def _restore_state(workdir: str, cfg, model_cfg: transformer.ModelConfig, step: int | None):
    """(train state without its reference, extra, step) of checkpoint `step` (None: newest)."""
    check_step(workdir, step)
    target = abstract_state(cfg, model_cfg)
    with _checkpointer(workdir) as ckpt:
        if step is None:
            state, extra, step = ckpt.restore_latest(target)
        else:
            where = str(ckpt.directory / str(step))
            try:
                state, extra = ckpt.restore(step, target)
            except CheckpointError:
                raise
            except Exception as e:
                first = str(e).splitlines()[0][:300] if str(e) else ""
                raise CheckpointError(
                    f"checkpoint {where} does not read back ({type(e).__name__}: {first}); pick "
                    "another --step."
                ) from e
    return state, extra or {}, int(step)
