"""jrl.run.host: the restart with glibc's huge-page tunable, when and when not."""

import os
import subprocess
import sys

import pytest

from jrl.run import host


@pytest.fixture
def execs(monkeypatch):
    calls = []
    monkeypatch.setattr(host.os, "execv", lambda path, argv: calls.append((path, argv)))
    monkeypatch.setattr(host, "supported", lambda: True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("JRL_HUGE_PAGES", raising=False)
    monkeypatch.setattr(host.sys, "orig_argv", ["python3", "-m", "jrl.train", "--config=c.py"])
    return calls


def test_restarts_the_same_command_once_with_the_tunable(execs, monkeypatch):
    host.use_huge_pages()
    assert execs == [(sys.executable, [sys.executable, "-m", "jrl.train", "--config=c.py"])]
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    host.use_huge_pages()  # the restarted process: the tunable is set, no second restart
    assert len(execs) == 1


@pytest.mark.parametrize(
    "env, supported",
    [
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, True),
        ({"JRL_HUGE_PAGES": "0"}, True),
        ({}, False),
    ],
)
def test_leaves_the_process_alone(execs, monkeypatch, env, supported):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(host, "supported", lambda: supported)
    host.use_huge_pages()
    assert execs == []
    assert os.environ.get("GLIBC_TUNABLES") == env.get("GLIBC_TUNABLES")


def test_supported_reads_glibc_and_the_kernel_setting(monkeypatch, tmp_path):
    thp = tmp_path / "enabled"
    monkeypatch.setattr(host, "_THP", str(thp))
    monkeypatch.setattr(host.sys, "platform", "linux")
    monkeypatch.setattr(host.platform, "libc_ver", lambda: ("glibc", "2.36"))
    thp.write_text("always [madvise] never\n")
    assert host.supported()
    thp.write_text("always madvise [never]\n")
    assert not host.supported()
    thp.write_text("[always] madvise never\n")
    monkeypatch.setattr(host.platform, "libc_ver", lambda: ("glibc", "2.31"))
    assert not host.supported()
    monkeypatch.setattr(host.platform, "libc_ver", lambda: ("", ""))
    assert not host.supported()
    thp.unlink()
    monkeypatch.setattr(host.platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert not host.supported()  # no such setting: leave it
    monkeypatch.setattr(host.sys, "platform", "darwin")
    assert not host.supported()


@pytest.mark.skipif(not host.supported(), reason="glibc 2.35+ with transparent huge pages only")
def test_the_command_line_runs_under_the_tunable():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JRL_HUGE_PAGES")}
    code = "import os; print(os.environ.get('GLIBC_TUNABLES'))"
    # what `python -m jrl.bench` runs first, in a process of its own
    script = f"from jrl.run import host; host.use_huge_pages(); {code}"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "glibc.malloc.hugetlb=1"
