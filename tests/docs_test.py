"""The docs name what is there: every repository path README.md and docs/*.md mention exists,
and README's Layout section names every module and sub-package of jrl/."""

import glob
import os
import re

from conftest import REPO

# a path inside the repository: a known top folder, then a file name with an extension
PATH = re.compile(
    r"(?<![\w/.-])((?:jrl|tests|configs|scripts|launch|notebooks|docs)/[\w/.\-]*\w"
    r"\.(?:py|md|ipynb|sh|sbatch|json|jsonl|toml))"
)


def _docs():
    names = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO))]
    return {name: open(os.path.join(REPO, name)).read() for name in names}


def test_every_path_the_docs_name_exists():
    missing = [
        f"{name}: {path}"
        for name, text in _docs().items()
        for path in sorted(set(PATH.findall(text)))
        if not os.path.exists(os.path.join(REPO, path))
    ]
    assert not missing, missing


def test_readme_layout_names_every_module_of_the_package():
    readme = _docs()["README.md"]
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    package = os.path.join(REPO, "jrl")
    parts = [f"jrl/{n}" for n in os.listdir(package) if n.endswith(".py") and n != "__init__.py"]
    subpackages = [n for n in os.listdir(package) if os.path.isfile(f"{package}/{n}/__init__.py")]
    parts += [f"jrl/{n}/" for n in subpackages]
    unnamed = sorted(p for p in parts if p not in layout)
    assert not unnamed, f"README's Layout misses {unnamed}"
