"""The `python` tool: runs a Python program in a subprocess with limits and no network.

The program runs as `unshare -rn python -I boot.py` in a fresh temporary directory with an
empty environment:
  - no network: a new (empty) network namespace, entered as an unprivileged user namespace;
  - CPU time: RLIMIT_CPU (`cpu_s`), wall time: killed after `wall_s`;
  - memory: RLIMIT_AS (`memory_mb` of address space);
  - output: stdout and stderr go to files capped by RLIMIT_FSIZE (`output_chars`), and the
    answer is cut there with "(output truncated)";
  - files: only the temporary directory, removed afterwards, is the program's own (the rest of
    the file system is as readable as it is to the trainer: this is a guard against accidents and
    runaway programs, not a security boundary against hostile code).
The answer is the program's stdout, then its stderr (a traceback's last line, say), then
"(exit status N)" when it failed. `check()` refuses, when the run is built, a machine where
`unshare -rn` is not allowed (no network cannot be guaranteed there).

`make_python_tool(cpu_s=..., ...)` makes the same tool with other limits; name it in the config
as "package.module:attribute" to use it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from jrl.tools.base import Tool

# Sets the limits, then runs the program in prog.py as __main__ (limits come as argv).
_BOOT = """\
import resource, signal, sys
cpu, mem, out = (int(a) for a in sys.argv[1:4])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the output cap: a write error, not a kill
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (out, out))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["prog.py"]
source = open("prog.py").read()
exec(compile(source, "prog.py", "exec"), {"__name__": "__main__"})
"""

SANDBOX = ("unshare", "-rn")  # new user + network namespaces: no network, no privilege


def _read(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def run_python(
    code: str,
    *,
    cpu_s: int = 4,
    wall_s: float = 5.0,
    memory_mb: int = 512,
    output_chars: int = 4096,
) -> str:
    """Runs `code` under the limits (see the module docstring); returns what it printed."""
    with tempfile.TemporaryDirectory(prefix="jrl-python-tool-") as tmp:
        with open(os.path.join(tmp, "prog.py"), "w") as f:
            f.write(code)
        with open(os.path.join(tmp, "boot.py"), "w") as f:
            f.write(_BOOT)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        limits = [str(cpu_s), str(memory_mb << 20), str(output_chars + 1)]
        command = [*SANDBOX, sys.executable, "-I", "boot.py", *limits]
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                command,
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, killed as a whole
            )
            try:
                status = proc.wait(timeout=wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                status, timed_out = proc.wait(), True
        stdout, cut_out = _read(out_path, output_chars)
        stderr, cut_err = _read(err_path, output_chars)
    parts = [stdout.rstrip("\n")]
    if cut_out:  # what failed after that is the cut itself (a write, a flush at exit)
        return "\n".join(p for p in (*parts, "(output truncated)") if p)
    if stderr.strip():
        parts.append(stderr.strip().splitlines()[-1])  # the error itself, not the whole trace
    if cut_err:
        parts.append("(output truncated)")
    if timed_out:
        parts.append(f"(killed after {wall_s:g} s)")
    elif status == -signal.SIGXCPU:
        parts.append(f"(killed: over {cpu_s} s of CPU time)")
    elif status < 0:
        parts.append(f"(killed by signal {-status})")
    elif status:
        parts.append(f"(exit status {status})")
    return "\n".join(p for p in parts if p)


def check_sandbox() -> None:
    """ValueError when this machine does not allow `unshare -rn` (no network namespace)."""
    try:
        ok = subprocess.run([*SANDBOX, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise ValueError(
            "the python tool runs code without network through `unshare -rn` (unprivileged user "
            "namespaces), which this machine does not allow: enable them "
            "(sysctl kernel.unprivileged_userns_clone=1) or leave the python tool out."
        )


SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python program and return what it prints (stdout, then the last line of "
            "stderr). No network; a few seconds of CPU time; print the result you need."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program to run"}},
            "required": ["code"],
        },
    },
}


def make_python_tool(**limits) -> Tool:
    """The python tool with the limits of `run_python` (cpu_s, wall_s, memory_mb, output_chars)."""

    def python(code: str) -> str:
        return run_python(code, **limits)

    return Tool(name="python", fn=python, schema=SCHEMA, check=check_sandbox)


PYTHON_TOOL = make_python_tool()
