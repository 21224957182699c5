"""The shape of the package: no import cycles, entrypoints are leaves, the maths and the models
import nothing from the runtime, and importing a tool registers no trainer flags."""

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "jrl")
ENTRYPOINTS = {"jrl.train", "jrl.eval", "jrl.export", "jrl.bench"}
# Layers of pure maths / model code may not import these runtime modules (the models name logical
# axes and constrain activations through jrl.partitioning, which imports no jrl module).
RUNTIME = {
    "jrl.sharding",
    "jrl.step",
    "jrl.logprobs",
    "jrl.microbatch",
    "jrl.sft",
    "jrl.rollout",
    "jrl.trainer",
    "jrl.checkpoint",
    "jrl.workdir",
}
RUNTIME |= ENTRYPOINTS | {"jrl.cli", "jrl.evaluator", "jrl.exporter", "jrl.benchmark"}


def modules() -> dict[str, str]:
    """{dotted name: path} of every module of jrl."""
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), REPO)[: -len(".py")]
                name = rel.replace(os.sep, ".").removesuffix(".__init__")
                out[name] = os.path.join(root, f)
    return out


def imports(path: str, known: set[str]) -> set[str]:
    """The jrl modules a file imports (anywhere in it, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jrl"}
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jrl"
        ):
            for a in node.names:  # `from jrl import x`: the module jrl.x if there is one
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_nothing_imports_an_entrypoint():
    bad = {m: sorted(deps & ENTRYPOINTS) for m, deps in graph().items() if deps & ENTRYPOINTS}
    assert bad == {}


@pytest.mark.parametrize("layer", ["jrl.models", "jrl.algos"])
def test_models_and_maths_import_no_runtime_module(layer):
    g = graph()
    bad = {
        m: sorted(deps & RUNTIME)
        for m, deps in g.items()
        if (m == layer or m.startswith(layer + ".")) and deps & RUNTIME
    }
    assert bad == {}


def test_partitioning_imports_no_jrl_module_and_sharding_no_model():
    g = graph()
    assert g["jrl.partitioning"] == set()
    assert g["jrl.sharding"] <= {"jrl.partitioning"}


def test_importing_a_tool_registers_no_trainer_flags():
    code = (
        "import jrl.eval, jrl.export, jrl.evaluator, jrl.exporter, jrl.benchmark, jrl.trainer\n"
        "from absl import flags\n"
        "print(sorted(flags.FLAGS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    registered = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    trainer_flags = {"config", "workdir", "fresh", "allow_changes", "distributed", "process_id"}
    assert registered & trainer_flags == set()
