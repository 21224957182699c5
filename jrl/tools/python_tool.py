"""The `python` tool: runs a Python program in a bubblewrap sandbox (jrl/tools/sandbox.py).

The program runs as `python -I -S` (the trainer's interpreter: isolated mode, the standard
library only) in the sandbox's scratch dir /tmp, with an empty environment but PATH, LANG,
HOME=/tmp and one thread per math library. Its launcher (`_BOOT`) first drops to uid 65534
where it starts as root of its user namespace (the trainer is root), then sets the limits that
hold per process:
  - CPU time: RLIMIT_CPU (`cpu_s`; SIGXCPU, then SIGKILL a second later);
  - memory: RLIMIT_AS (`memory_mb` of address space: the program sees MemoryError);
  - tasks: RLIMIT_NPROC (`max_processes` processes and threads, counted in the call's own user
    namespace), and no core files.
The sandbox adds the wall-clock limit (`wall_s`, the whole tree killed), the output cap
(`output_chars` per stream, the tree killed there), a `scratch_mb` tmpfs, and where cgroups are
writable the tree's memory (`memory_mb` in all) and tasks. `site_packages=True` shows the
trainer's environment (its site-packages: numpy, if installed) read-only as well, and runs with
`site` (slower to start).

The answer is the program's stdout, then the last line of its stderr (a traceback's error),
then "(exit status N)" / "(killed ...)" when it failed. `check()` (run when the tool host is
built) refuses a machine where the sandbox does not start or does not isolate, with one line
naming the fix: the tool never runs code in a weaker mode.

`make_python_tool(cpu_s=..., ...)` makes the same tool with other limits; name it in the config
as "package.module:attribute" to use it.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from jrl.tools import sandbox
from jrl.tools.base import Tool

# Drops to uid 65534 (when started as root of the namespace), sets the limits, runs prog.py as
# __main__. Limits come as argv.
_BOOT = """\
import os, resource, sys
cpu, mem, nproc = (int(a) for a in sys.argv[1:4])
if os.getuid() == 0:
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
if 0 in os.getresuid() or 0 in os.getresgid():
    os._exit(125)
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
del os, resource, cpu, mem, nproc
sys.argv = ["prog.py"]
with open("prog.py") as f:
    source = f.read()
exec(compile(source, "prog.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    # One thread per math library: threads count against max_processes.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class PythonLimits:
    """The python tool's limits (module docstring)."""

    cpu_s: int = 4
    wall_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 16
    output_chars: int = 4096
    scratch_mb: int = 16
    site_packages: bool = False


def _command(limits: PythonLimits) -> tuple[list[str], list[str]]:
    """(argv, host paths to show read-only) of the interpreter."""
    if limits.site_packages:
        exe, flags = sys.executable, ["-I"]
        binds = [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix]
    else:
        exe, flags = os.path.realpath(sys.executable), ["-I", "-S"]
        binds = [sys.base_prefix, sys.base_exec_prefix]
    args = [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.max_processes)]
    return [exe, *flags, "-c", _BOOT, *args], binds


def run_python(code: str, *, cgroups: bool = True, **limits) -> str:
    """Runs `code` in the sandbox under `PythonLimits(**limits)`; returns what it printed (see
    the module docstring). `cgroups=False` leaves the cgroups out where they are writable."""
    lim = PythonLimits(**limits)
    argv, binds = _command(lim)
    result = sandbox.run(
        argv,
        files={"prog.py": code.encode("utf-8", "surrogatepass")},
        env=_ENV,
        binds=binds,
        limits=sandbox.Limits(
            wall_s=lim.wall_s,
            memory_mb=lim.memory_mb,
            max_processes=lim.max_processes,
            output_bytes=lim.output_chars,
            scratch_mb=lim.scratch_mb,
        ),
        cgroups=cgroups,
    )
    return answer(result, lim)


def answer(result: sandbox.Result, limits: PythonLimits) -> str:
    """The model's answer for one run."""
    stdout = result.stdout.decode("utf-8", "replace").rstrip("\n")
    stderr = result.stderr.decode("utf-8", "replace").strip()
    parts = [stdout]
    if result.truncated and len(result.stdout) >= limits.output_chars:
        return "\n".join(p for p in (stdout, "(output truncated)") if p)
    if stderr:
        parts.append(stderr.splitlines()[-1])  # the error itself, not the whole trace
    status = result.status
    if result.truncated:
        parts.append("(output truncated)")
    elif result.timed_out:
        parts.append(f"(killed after {limits.wall_s:g} s)")
    elif result.out_of_memory:
        parts.append(f"(killed: over {limits.memory_mb} MiB of memory)")
    elif status == 128 + signal.SIGXCPU:
        parts.append(f"(killed: over {limits.cpu_s} s of CPU time)")
    elif status is not None and status > 128:
        parts.append(f"(killed by signal {status - 128})")
    elif status:
        parts.append(f"(exit status {status})")
    return "\n".join(p for p in parts if p)


_PROBE = """\
import os, socket
checks = {
    "uid": os.getuid() == 65534 and os.geteuid() == 65534,
    "capabilities": [int(line.split()[1], 16) for line in open("/proc/self/status")
                     if line.startswith(("CapPrm", "CapEff", "CapAmb", "NoNewPrivs"))]
    == [0, 0, 0, 1],
    "pid namespace": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())[:1] == [1],
    "network": [l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:]] == ["lo"],
    "read-only root": not os.access("/usr", os.W_OK),
    "scratch": os.access("/tmp", os.W_OK) and os.getcwd() == "/tmp",
}
print(",".join(k for k, ok in checks.items() if not ok) or "isolated")
"""
_HINTS = {
    "namespace": "enable user namespaces (sysctl kernel.unprivileged_userns_clone=1 and "
    "user.max_user_namespaces > 0; in a container, a seccomp / AppArmor profile allowing them)",
}


def check_sandbox(limits: PythonLimits = PythonLimits()) -> None:
    """ValueError (one line, naming the fix) when the sandbox cannot run programs here."""
    sandbox.check_installed()
    argv, binds = _command(limits)
    try:
        result = sandbox.run(argv, files={"prog.py": _PROBE.encode()}, env=_ENV, binds=binds)
    except (OSError, ValueError) as e:
        raise ValueError(f"the python tool's sandbox does not start here ({e}).") from None
    out = result.stdout.decode("utf-8", "replace").strip()
    if out == "isolated" and result.status == 0:
        return
    if out:
        raise ValueError(
            f"the python tool's sandbox does not isolate programs here ({out} failed): "
            f"run the trainer where bubblewrap's namespaces work, or leave the python tool out."
        )
    err = result.stderr.decode("utf-8", "replace").strip().splitlines()
    reason = err[-1] if err else f"exit status {result.status}"
    hint = next((h for k, h in _HINTS.items() if k in reason), "see docs/multi_turn.md")
    raise ValueError(f"the python tool's sandbox does not start here ({reason}): {hint}.")


SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python program and return what it prints (stdout, then the last line of "
            "stderr). Standard library only, no network, no files but its scratch dir; a few "
            "seconds of CPU time; print the result you need."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program to run"}},
            "required": ["code"],
        },
    },
}


def make_python_tool(**limits) -> Tool:
    """The python tool with the limits of `PythonLimits` (cpu_s, wall_s, memory_mb,
    max_processes, output_chars, scratch_mb, site_packages)."""
    lim = PythonLimits(**limits)

    def python(code: str) -> str:
        return run_python(code, **vars(lim))

    return Tool(name="python", fn=python, schema=SCHEMA, check=lambda: check_sandbox(lim))


PYTHON_TOOL = make_python_tool()
