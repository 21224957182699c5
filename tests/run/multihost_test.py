"""Multi-host agreement: values each host computed on its own (the supervised warm-up runs on
every host) are made identical, process 0's, before `sharding.put` assumes they are."""

import json
import os
import socket
import subprocess
import sys

from conftest import REPO

AGREE = os.path.join(REPO, "tests", "helpers", "multihost_agree.py")  # one process


def test_hosts_end_with_process_0s_values():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "PYTHONPATH": REPO,  # this checkout's jrl, whatever jrl is installed
    }
    procs = [
        subprocess.Popen(
            [sys.executable, AGREE, str(port), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    want = {"embed": [[1.0] * 3] * 2, "layers": {"w": [0.0, 1.0, 2.0, 3.0]}}  # process 0's
    assert got == [want, want]
