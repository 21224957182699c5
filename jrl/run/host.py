"""The host process's set-up before JAX loads: glibc's malloc asked to back its memory with
transparent huge pages.

XLA:CPU allocates each program's buffers afresh at every call: with 4 KiB pages, the kernel
zeroes and maps every page of them again each time (a 10-step run of
configs/gemma_tools_cpu.py took 56 million page faults). glibc 2.35 and later madvise their
heap and mmapped chunks for transparent huge pages when the tunable `glibc.malloc.hugetlb=1` is
set, which it reads only when the process starts: `use_huge_pages` sets it and starts the same
command again, once. On a 2-core CPU this cut a 3-step run of that config's page faults 13x
(19.3 M to 1.4 M) and its steps from 63 s to 51-54 s (docs/performance.md, "Host memory").

Nothing is changed where the system does not support it (not Linux, not glibc 2.35+, or
transparent huge pages set to "never"), where `GLIBC_TUNABLES` is already set (the user's own
choice wins), or with JRL_HUGE_PAGES=0. Results are the same either way: only where the host's
memory comes from changes."""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def supported() -> bool:
    """Whether glibc's huge-page tunable would take effect here."""
    if not sys.platform.startswith("linux"):
        return False
    libc, version = platform.libc_ver()
    try:
        if libc != "glibc" or tuple(int(p) for p in version.split(".")[:2]) < (2, 35):
            return False
        with open(_THP) as f:
            return "[never]" not in f.read()
    except (OSError, ValueError):
        return False


def use_huge_pages() -> None:
    """Restarts this command once with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` where that takes
    effect and nothing set it (see the module doc); returns at once otherwise. Call it first in
    a command line's `__main__`, before JAX loads."""
    if "GLIBC_TUNABLES" in os.environ or os.environ.get("JRL_HUGE_PAGES", "1") == "0":
        return
    if not sys.executable or not supported():
        return
    os.environ["GLIBC_TUNABLES"] = TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
