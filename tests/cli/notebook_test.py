"""notebooks/quickstart.ipynb runs top to bottom (headless, nbclient) on its quick setting.

`PYTHONPATH=tests python tests/cli/notebook_test.py --write` (tests/ on the path: conftest)
executes it on the full demo instead and saves it with its outputs (progress-bar redraws collapsed
to their last frame, so the outputs stay small).
"""

import os
import re
import sys

import nbformat
from nbclient import NotebookClient
from conftest import COMPILE_FLAGS, REPO

NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")


def execute(workdir, quick: bool, timeout: int = 600):
    """The executed notebook (run in notebooks/, like a user's Jupyter)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"JRL_NOTEBOOK_WORKDIR": str(workdir)}
    if quick:
        env["JRL_NOTEBOOK_QUICK"] = "1"
    # A user's devices (one CPU device, not the tests' 8), with the tests' compile settings
    # (tests/conftest.py: compiling is most of this test's time).
    saved = {k: os.environ.pop(k) for k in ("XLA_FLAGS",) if k in os.environ}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
        ).execute()
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)
    return nb


def text_of(cell) -> str:
    return "".join(
        o.get("text", "") + "".join(o.get("data", {}).get("text/plain", "")) for o in cell.outputs
    )


def test_quickstart_notebook_runs_top_to_bottom(tmp_path):
    nb = execute(tmp_path / "run", quick=True)
    nbformat.write(nb, tmp_path / "executed.ipynb")  # to look at when an assertion fails
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(o.output_type != "error" for c in code for o in c.outputs)
    assert not any("Warning" in o.get("text", "") for c in code for o in c.outputs)
    install, runtime, run, plots, answers, pass_at_k, memory, own = code
    assert "quick settings" in text_of(install)
    assert "backend: cpu" in text_of(runtime) and "[CpuDevice(id=0)]" in text_of(runtime)
    assert re.search(r"held-out accuracy \d\.\d{3} -> \d\.\d{3}", text_of(run))
    assert "step 0: val/accuracy" in text_of(run)  # the run's own eval lines
    assert any("image/png" in o.get("data", {}) for o in plots.outputs)
    shown = text_of(answers)
    assert "step 0:" in shown and "step 3:" in shown and shown.count("reward ") == 8  # 2 x 4
    assert '"eval/pass@2"' in text_of(pass_at_k) and '"step": 3' in text_of(pass_at_k)
    assert "'peak_gb'" in text_of(memory)
    assert "set MODEL" in text_of(own)


def collapse_redraws(nb) -> None:
    """Keeps what a terminal would show of the stream outputs: consecutive outputs of one stream
    merged, and of each line the text after its last \\r (tqdm redraws its bar in place)."""
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and merged and merged[-1].get("name") == out.name:
                merged[-1].text += out.text
            else:
                merged.append(out)
        for out in merged:
            if out.output_type == "stream":
                shown = [line.split("\r")[-1] for line in out.text.split("\n")]
                out.text = "\n".join(line for line in shown if line.strip()) + "\n"
        if "outputs" in cell:
            cell.outputs = merged


if __name__ == "__main__" and "--write" in sys.argv:
    executed = execute("/tmp/jrl_quickstart", quick=False, timeout=1200)
    collapse_redraws(executed)
    nbformat.write(executed, NOTEBOOK)
elif __name__ == "__main__" and "--collapse" in sys.argv:  # an executed notebook, saved again
    executed = nbformat.read(NOTEBOOK, as_version=4)
    collapse_redraws(executed)
    nbformat.write(executed, NOTEBOOK)
