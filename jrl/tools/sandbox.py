"""A bubblewrap sandbox for programs a model wrote: namespaces, a private scratch dir, limits.

`run(argv, files, limits)` runs `argv` (an interpreter and its arguments) under `bwrap`
(bubblewrap, the sandbox Flatpak uses) and returns what it printed:
  - new user, PID, mount, network, IPC, UTS and cgroup namespaces: the program sees its own
    processes only, has no network but an unconnected loopback, and no abstract sockets of the host;
  - a root of its own: read-only binds of /usr (with /bin, /lib... as on the host), the dynamic
    loader's cache, and the paths given in `binds` (the interpreter's installation); a fresh
    /proc of its PID namespace, a minimal /dev, and two small tmpfs, /tmp (the working directory,
    where `files` are written) and /dev/shm, as the only writable places. Nothing else of the
    host is there: no workdir, no checkpoints, no home, no sockets of host services;
  - uid 65534 (nobody) with no effective, permitted or ambient capabilities, `no_new_privs`,
    `nosuid` mounts. Run by root, the processes are uid 65534 outside the namespaces too (see
    `_map_root_userns`; the program's launcher drops to 65534 itself, see `run`); run by another
    user, they are that user outside (the kernel allows no other mapping without privileges);
  - the whole process tree dies with the call: the namespace's init is killed at the wall-clock
    limit or when the output passes its cap (or when the trainer dies: `--die-with-parent`), and
    the kernel kills every process of a PID namespace whose init dies. The call returns after
    they are gone;
  - stdout and stderr are pipes read with a deadline and a size cap; the host opens no file the
    program could have replaced;
  - where cgroups are writable (`cgroup_mode()`), a cgroup per call caps the tree's memory
    (tmpfs pages included) and its number of tasks; the rlimits of the program's launcher apply
    in any case (see jrl/tools/python_tool.py).

`check_installed()` raises ValueError, one line naming the fix, when bwrap is missing; the
python tool's `check_sandbox` runs a probe here when the tool host is built. docs/multi_turn.md
states what is promised and what is not.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

BWRAP = "bwrap"  # looked up on PATH
INSTALL = "install bubblewrap: apt-get install bubblewrap (dnf / pacman / apk: bubblewrap)"
SANDBOX_UID = 65534  # nobody: the program's uid
_TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # symlinks into /usr, or dirs
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")
_READ_CHUNK = 1 << 16
_REAP_S = 10.0  # at most this long for a killed sandbox to be gone


@dataclass(frozen=True)
class Limits:
    """What a call may use. `memory_mb` and `max_processes` hold for the whole process tree
    where cgroups are writable, else per process (see the module docstring)."""

    wall_s: float = 5.0  # the namespace's init is killed after this
    memory_mb: int = 512  # the tree's memory (cgroup); each process's address space (rlimit)
    max_processes: int = 16  # tasks (processes and threads) of the program at once
    output_bytes: int = 4096  # per stream; past it the sandbox is killed
    scratch_mb: int = 16  # size of /tmp and of /dev/shm (tmpfs)


class Result(NamedTuple):
    """What became of one run. `status`: the exit status (128 + n for a program killed by
    signal n), None when the sandbox was killed from outside (`timed_out`, `truncated`)."""

    stdout: bytes
    stderr: bytes
    status: int | None
    timed_out: bool  # killed at limits.wall_s
    truncated: bool  # a stream passed limits.output_bytes (the sandbox was killed)
    out_of_memory: bool  # the cgroup's OOM killer killed a process of the tree


# ------------------------------------------------------------------------------------ cgroups


class _Cgroups:
    """Per-call cgroups under `base` dirs (one per hierarchy: cgroup v2 has one, v1 one per
    controller), each capping memory or tasks. Built by `cgroup_mode()`."""

    def __init__(self, version: int, bases: Mapping[str, str]):
        self.version, self.bases = version, dict(bases)  # controller -> base dir
        self._ids = itertools.count()

    def create(self, limits: Limits) -> list[str]:
        name = f"{os.getpid()}-{next(self._ids)}"
        dirs = []
        try:
            for controller, base in self.bases.items():
                path = os.path.join(base, name)
                os.makedirs(path)  # the base too, if a sweep of another process took it
                dirs.append(path)
                for file, value, required in self._limit_files(controller, limits):
                    if required or os.path.exists(os.path.join(path, file)):
                        _write(os.path.join(path, file), value)
        except OSError:
            self.remove(dirs)
            raise
        return dirs

    def _limit_files(self, controller: str, limits: Limits):
        """(file, value, required): swap accounting may be off (no file), the rest may not."""
        memory, tasks = str(limits.memory_mb << 20), str(limits.max_processes + 1)  # + init
        if self.version == 2:
            return [
                ("memory.max", memory, True),
                ("memory.swap.max", "0", False),
                ("pids.max", tasks, True),
            ]
        if controller == "memory":
            return [
                ("memory.limit_in_bytes", memory, True),
                ("memory.memsw.limit_in_bytes", memory, False),
            ]
        return [("pids.max", tasks, True)]

    @staticmethod
    def add(dirs: Sequence[str], pid: int) -> None:
        for path in dirs:
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def oom_killed(self, dirs: Sequence[str]) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for path in dirs:
            try:
                with open(os.path.join(path, name)) as f:
                    fields = dict(line.split()[:2] for line in f if line.strip())
            except OSError:
                continue
            if int(fields.get("oom_kill", 0)) > 0:
                return True
        return False

    @staticmethod
    def remove(dirs: Sequence[str]) -> None:
        for path in dirs:
            for _ in range(100):  # the last tasks of a killed tree may take a moment to leave
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _own_cgroups() -> tuple[dict[str, tuple[str, str]], str | None]:
    """({v1 controller: (mount point, own path in it)}, own v2 dir or None)."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                own[c] = path
    v1, v2 = {}, None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, (fstype, _, options) = left.split(), right.split()[:3]
            root, mount = fields[3], fields[4]
            opts = set(options.split(","))
            if fstype == "cgroup2" and "" in own:
                rel = os.path.relpath(own[""], root)
                v2 = None if rel.startswith("..") else os.path.normpath(os.path.join(mount, rel))
            elif fstype == "cgroup":
                for c in ("memory", "pids"):
                    if c in opts and c in own:
                        rel = os.path.relpath(own[c], root)
                        if not rel.startswith(".."):
                            v1[c] = os.path.normpath(os.path.join(mount, rel))
    return v1, v2


def _v2_base(own: str) -> str | None:
    """A dir for per-call cgroups next to the trainer's own v2 cgroup (a cgroup with processes
    cannot give controllers to children), with memory and pids delegated to its children."""
    parent = os.path.dirname(own)
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
    except OSError:
        return None
    if not {"memory", "pids"} <= enabled:
        return None
    base = _base(parent)
    _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
    return base


def _base(parent: str) -> str:
    """`parent`/jrl-sandbox-<pid>, made, after the ones of processes that are gone (left by a
    trainer that was killed) are removed."""
    prefix = "jrl-sandbox-"
    for name in os.listdir(parent):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            if not os.path.exists(f"/proc/{name[len(prefix) :]}"):
                stale = os.path.join(parent, name)
                _Cgroups.remove([e.path for e in os.scandir(stale) if e.is_dir()] + [stale])
    base = os.path.join(parent, f"{prefix}{os.getpid()}")
    os.makedirs(base, exist_ok=True)
    return base


@functools.lru_cache(maxsize=1)
def cgroup_mode() -> _Cgroups | None:
    """The per-call cgroups of this process, or None where cgroups are not writable (then the
    launcher's rlimits are the only memory and task limits)."""
    try:
        v1, v2 = _own_cgroups()
        if {"memory", "pids"} <= set(v1):
            cgroups = _Cgroups(1, {c: _base(v1[c]) for c in ("memory", "pids")})
        elif v2 is not None and (base := _v2_base(v2)) is not None:
            cgroups = _Cgroups(2, {"unified": base})
        else:
            return None
        atexit.register(cgroups.remove, list(cgroups.bases.values()))
        cgroups.remove(cgroups.create(Limits()))  # limits can be written here
        return cgroups
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------ the sandbox


def _mounts(binds: Sequence[str], limits: Limits) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _TOP_DIRS:
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    made = {"/"}
    for path in dict.fromkeys(os.path.realpath(p) for p in binds):
        if path == "/":
            raise ValueError("the sandbox cannot show the whole file system (a bind of '/')")
        if path == "/usr" or path.startswith("/usr/"):
            continue
        # Its parents as world-readable dirs (bwrap would make them 0700, as nobody can't read).
        parents = []
        parent = os.path.dirname(path)
        while parent not in made:
            parents.append(parent)
            made.add(parent)
            parent = os.path.dirname(parent)
        for parent in reversed(parents):
            args += ["--dir", parent]
        args += ["--ro-bind", path, path]
    size = str(limits.scratch_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    args += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--chdir", "/tmp"]
    return args


class _Run:
    """One sandboxed process: started by `__init__`, read and waited for by `finish`."""

    def __init__(self, argv, files, env, binds, limits, cgroups):
        self.limits, self.cgroups, self.cgroup_dirs = limits, cgroups, []
        self.root = os.geteuid() == 0
        self.start = time.monotonic()
        self.pidfd: int | None = None
        self.fds: list[int] = []  # ours, closed at the end
        passed: list[int] = []  # the child's ends, closed once it started
        args = [BWRAP, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
        args += ["--hostname", "sandbox", "--cap-drop", "ALL"]
        # The namespace's init waits on `release` until its maps and cgroup are set.
        self.release = self._pipe(passed, child_end=0)
        if self.root:
            # Maps written by us (`_map_root_userns`); the launcher drops to SANDBOX_UID.
            args += ["--userns-block-fd", str(passed[-1]), "--uid", "0", "--gid", "0"]
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--block-fd", str(passed[-1]), "--disable-userns"]
            args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        self.info = self._pipe(passed, child_end=1)
        args += ["--info-fd", str(passed[-1])]
        args += _mounts(binds, limits)
        for dest, data in files.items():
            fd = os.memfd_create("sandbox-file")
            os.write(fd, data)
            os.lseek(fd, 0, os.SEEK_SET)
            passed.append(fd)
            args += ["--perms", "0444", "--file", str(fd), os.path.join("/tmp", dest)]
        args += ["--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        args += ["--", *argv]
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=passed,
                start_new_session=True,  # bwrap's own process group
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        except BaseException:
            self.close()
            raise
        finally:
            for fd in passed:
                os.close(fd)

    def _pipe(self, passed: list[int], child_end: int) -> int:
        r, w = os.pipe()
        ours, theirs = (w, r) if child_end == 0 else (r, w)
        self.fds.append(ours)
        passed.append(theirs)
        return ours

    def _started(self, info: bytes) -> int | None:
        """The namespace's init, once bwrap said which it is: maps and cgroup set, released."""
        try:
            child = int(json.loads(info)["child-pid"])
        except (ValueError, KeyError, TypeError):
            return None
        # It waits for `release`: alive, so its pid is its own. A pidfd names it for good.
        self.pidfd = os.pidfd_open(child)
        if self.cgroups is not None:
            self.cgroup_dirs = self.cgroups.create(self.limits)
            self.cgroups.add(self.cgroup_dirs, child)
        if self.root:
            _map_root_userns(child)
        os.write(self.release, b"1")
        return child

    def finish(self) -> Result:
        limits, proc = self.limits, self.proc
        deadline = self.start + limits.wall_s
        out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        info = bytearray()
        timed_out = truncated = False
        with selectors.DefaultSelector() as sel:
            for fd in (*out, self.info):
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            while any(fd in sel.get_map() for fd in out):
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(left):
                    data = os.read(key.fd, _READ_CHUNK)
                    if not data:
                        sel.unregister(key.fd)
                        if key.fd == self.info and self.pidfd is None:
                            self._started(bytes(info))
                    elif key.fd == self.info:
                        info += data
                    else:
                        out[key.fd] += data
                        truncated |= len(out[key.fd]) > limits.output_bytes
                if truncated:
                    break
        status = None
        if not (timed_out or truncated):  # both streams closed: the program may run on
            try:
                status = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out or truncated:
            self._kill()
            try:
                status = proc.wait(timeout=_REAP_S)
            except subprocess.TimeoutExpired:  # bwrap itself stuck: its group, then wait
                os.killpg(proc.pid, signal.SIGKILL)
                status = proc.wait()
        oom = self.cgroups is not None and self.cgroups.oom_killed(self.cgroup_dirs)
        self.close()
        stdout, stderr = (bytes(out[f.fileno()]) for f in (proc.stdout, proc.stderr))
        proc.stdout.close()
        proc.stderr.close()
        killed = timed_out or truncated
        return Result(
            stdout[: limits.output_bytes],
            stderr[: limits.output_bytes],
            None if killed else status,
            timed_out,
            truncated,
            oom,
        )

    def _kill(self) -> None:
        """SIGKILL to the namespace's init (the kernel kills the rest of the namespace), or to
        bwrap itself before it said which process that is (`--die-with-parent` does the rest)."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # gone already
            pass

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.cgroup_dirs:
            self.cgroups.remove(self.cgroup_dirs)
            self.cgroup_dirs = []


def _map_root_userns(pid: int) -> None:
    """The uid / gid maps of the sandbox's user namespace when the trainer is root: 0 and 65534
    map to themselves, so bwrap (root in it) can read the interpreter wherever it is installed,
    and the launcher's drop to 65534 makes its processes uid 65534 on the host as well. Root
    owns the namespace: no other host user gets capabilities in it."""
    for name in ("uid_map", "gid_map"):
        _write(f"/proc/{pid}/{name}", f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n")


def run(
    argv: Sequence[str],
    *,
    files: Mapping[str, bytes] = {},  # noqa: B006 - read only
    env: Mapping[str, str] = {},  # noqa: B006 - read only
    binds: Sequence[str] = (),
    limits: Limits = Limits(),
    cgroups: bool = True,
) -> Result:
    """Runs `argv` in the sandbox (module docstring) with `files` (name -> bytes) in its /tmp,
    the environment `env` only, and `binds` (host paths) visible read-only; `cgroups=False`
    leaves the cgroups out even where they are writable. The program starts as uid 0 of its
    namespace with CAP_SETUID / CAP_SETGID alone when the trainer is root (its launcher must
    drop to SANDBOX_UID first thing), as SANDBOX_UID with nothing otherwise."""
    sandbox = _Run(argv, files, env, binds, limits, cgroup_mode() if cgroups else None)
    try:
        return sandbox.finish()
    except BaseException:
        sandbox._kill()
        sandbox.proc.wait()
        sandbox.close()
        raise


def check_installed() -> None:
    """ValueError when bwrap is not on PATH."""
    if shutil.which(BWRAP) is None:
        raise ValueError(
            f"programs run in a bubblewrap sandbox and `{BWRAP}` is not installed: {INSTALL}."
        )
