"""The docs name what is there: every repository path README.md and docs/*.md mention exists,
every relative link of theirs reaches an existing file (and heading, where it names one), and the
Layout section of docs/design.md names every module and sub-package of jrl/."""

import glob
import os
import re

from conftest import REPO

# a path inside the repository: a known top folder, then a file name with an extension
PATH = re.compile(
    r"(?<![\w/.-])((?:jrl|tests|configs|scripts|launch|notebooks|docs)/[\w/.\-]*\w"
    r"\.(?:py|md|ipynb|sh|sbatch|json|jsonl|toml))"
)
# a Markdown link [text](target), and a fenced code block (neither links nor headings in it)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LAYOUT_PAGE = "docs/design.md"  # README's Layout section links to this page's "## Layout"


def _docs():
    names = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO))]
    return {name: open(os.path.join(REPO, name)).read() for name in names}


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_'
    dropped, spaces as '-', a repeated one numbered ('name', 'name-1', ...)."""
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_follow_github():
    page = "# A b\n## The TPU compiler's figures (`--target`)\n```\n# not a heading\n```\n## A b\n"
    assert anchors(page) == {"a-b", "the-tpu-compilers-figures---target", "a-b-1"}


def test_every_path_the_docs_name_exists():
    missing = [
        f"{name}: {path}"
        for name, text in _docs().items()
        for path in sorted(set(PATH.findall(text)))
        if not os.path.exists(os.path.join(REPO, path))
    ]
    assert not missing, missing


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for name, text in _docs().items():
        for target in sorted(set(LINK.findall(FENCE.sub("", text)))):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(REPO, os.path.dirname(name), path))
            file = file if path else os.path.join(REPO, name)
            if not os.path.exists(file):
                broken.append(f"{name}: {target} (no file)")
            elif anchor and file.endswith(".md") and anchor not in anchors(open(file).read()):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, broken


def test_layout_names_every_module_of_the_package():
    docs = _docs()
    assert f"({LAYOUT_PAGE}#layout)" in docs["README.md"].split("## Layout", 1)[1]
    layout = docs[LAYOUT_PAGE].split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    package = os.path.join(REPO, "jrl")
    parts = [f"jrl/{n}" for n in os.listdir(package) if n.endswith(".py") and n != "__init__.py"]
    subpackages = [n for n in os.listdir(package) if os.path.isfile(f"{package}/{n}/__init__.py")]
    parts += [f"jrl/{n}/" for n in subpackages]
    unnamed = sorted(p for p in parts if p not in layout)
    assert not unnamed, f"{LAYOUT_PAGE}'s Layout misses {unnamed}"
