"""The shape of the package: no import cycles, and the folders are the tiers.

    command lines   jrl/train.py  eval.py  export.py  bench.py   (imported by nobody)
    run machinery   jrl/run/      (trainer, checkpoints, workdir, metric writers, ...; run.cli
                                   is imported only by the command lines)
    RL core         jrl/*.py      (step, rollout, sharding, tokenizer, ...; never jrl.run)
                    jrl/config/   (the config's schema, validation and files)
                    jrl/tools/    (the host side of multi-turn rollouts; the config reads its
                                   registries, its host is built from a config)
    maths           jrl/algos/  jrl/models/  jrl/rewards/  jrl/data/   (maths and base only)
    base            jrl/partitioning.py  jrl/registry.py             (import nothing from jrl)

Each tier imports only the tiers below it; importing a tool registers no trainer flags."""

import ast
import os
import subprocess
import sys

import pytest

from conftest import REPO

PACKAGE = os.path.join(REPO, "jrl")
ENTRYPOINTS = {"jrl.train", "jrl.eval", "jrl.export", "jrl.bench"}
BASE = {"jrl.partitioning", "jrl.registry"}
MATHS = ("jrl.algos", "jrl.models", "jrl.rewards", "jrl.data")
RUN = "jrl.run"
CORE_PACKAGES = ("jrl.config", "jrl.tools")


def under(module: str, *packages: str) -> bool:
    """Whether `module` is one of `packages` or inside one of them."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def tier(module: str) -> str | None:
    """The tier of a module of jrl (None: the package root `jrl`, or a module in no tier)."""
    if module in ENTRYPOINTS:
        return "command line"
    if under(module, RUN):
        return "run"
    if under(module, *MATHS):
        return "maths"
    if module in BASE:
        return "base"
    if module.count(".") == 1 or under(module, *CORE_PACKAGES):  # jrl/step.py, jrl/tools/host.py
        return "core"
    return None


# What each tier may import (besides itself).
MAY_IMPORT = {
    "command line": {"run", "core", "maths", "base"},
    "run": {"core", "maths", "base"},
    "core": {"maths", "base"},
    "maths": {"base"},
    "base": set(),
}


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


def test_every_module_has_a_tier():
    assert [m for m in graph() if m not in ("jrl", RUN) and tier(m) is None] == []


def test_tier_finder():
    assert tier("jrl.train") == "command line"
    assert tier("jrl.run.trainer") == tier("jrl.run.cli") == "run"
    assert tier("jrl.step") == tier("jrl.config") == tier("jrl.tokenizer") == "core"
    assert tier("jrl.config.schema") == tier("jrl.tools.host") == "core"
    assert tier("jrl.algos") == tier("jrl.models.lora") == tier("jrl.data.math_data") == "maths"
    assert tier("jrl.registry") == "base"
    assert tier("jrl.newfolder.module") is None


def test_each_tier_imports_only_the_tiers_below():
    bad = {}
    for m, deps in graph().items():
        if tier(m) is None:
            continue
        allowed = MAY_IMPORT[tier(m)] | {tier(m)}
        wrong = sorted(d for d in deps if tier(d) not in allowed)
        if wrong:
            bad[m] = wrong
    assert bad == {}


def test_package_root_imports_nothing_from_jrl():
    assert graph()["jrl"] == set()


def test_only_command_lines_import_the_cli():
    importers = {m for m, deps in graph().items() if "jrl.run.cli" in deps}
    assert importers and importers <= ENTRYPOINTS


def test_nothing_below_the_run_machinery_imports_it():
    g = graph()
    bad = {m: sorted(d for d in deps if under(d, RUN)) for m, deps in g.items()}
    bad = {m: deps for m, deps in bad.items() if deps and tier(m) in ("core", "maths", "base")}
    assert bad == {}


@pytest.mark.parametrize("layer", MATHS)
def test_maths_import_only_maths_and_base(layer):
    g = graph()
    bad = {
        m: sorted(d for d in deps if not (under(d, *MATHS) or d in BASE))
        for m, deps in g.items()
        if under(m, layer)
    }
    assert {m: deps for m, deps in bad.items() if deps} == {}


def test_algos_are_pure_maths():
    g = graph()
    bad = {
        m: sorted(d for d in deps if not (under(d, "jrl.algos") or d == "jrl.registry"))
        for m, deps in g.items()
        if under(m, "jrl.algos")
    }
    assert {m: deps for m, deps in bad.items() if deps} == {}


def test_partitioning_imports_no_jrl_module_and_sharding_no_model():
    g = graph()
    assert g["jrl.partitioning"] == set()
    assert g["jrl.sharding"] <= {"jrl.partitioning"}


def test_importing_a_tool_registers_no_trainer_flags():
    code = (
        "import jrl.eval, jrl.export\n"
        "from jrl.run import benchmark, evaluator, exporter, trainer\n"
        "from absl import flags\n"
        "print(sorted(flags.FLAGS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    registered = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    trainer_flags = {"config", "workdir", "fresh", "allow_changes", "distributed", "process_id"}
    assert registered & trainer_flags == set()
