"""The package's import graph as docs/layout.md draws it: no cycle, imports only down the page's module
list, and the trainer never imports hvdtrain.bench. Read from the source with ast, every import statement
counted wherever it is (a function-local import makes a cycle at run time as well), so this runs in a
second and imports neither TensorFlow nor hvdtrain."""
import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # not jobs.ROOT: importing jobs starts TensorFlow in a child
PACKAGE = ROOT / "hvdtrain"
LAYOUT = ROOT / "docs" / "layout.md"


def modules(package: Path) -> dict:
    """Dotted name -> file of the package and of every module and subpackage under it."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@functools.lru_cache(maxsize=None)  # three tests read the package's graph: parse it once
def import_graph(package: Path) -> dict:
    """Module -> {module of the same package it imports: "file:line" of the first such import}.
    `from . import x` names the module x where x is one, else the package it imports a name from;
    `importlib.import_module("...")` with a literal name counts too."""
    mods = modules(package)
    top = package.name

    def module_of(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [module_of(a.name) for a in node.names if a.name.split(".")[0] == top]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    if node.level - 1 >= len(parts):
                        continue
                    base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == top:
                    base = node.module
                else:
                    continue
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else module_of(base) for a in node.names]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str) and node.args[0].value.split(".")[0] == top
                  and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("import_module", "__import__")):
                targets = [module_of(node.args[0].value)]
            for target in targets:
                if target and target != name:
                    edges.setdefault(target, f"{path.relative_to(package.parent)}:{node.lineno}")
    return graph


def find_cycle(graph: dict) -> list:
    """One import cycle as [a, b, ..., a], or [] where there is none."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def describe(cycle: list, graph: dict) -> str:
    return "\n".join(f"  {a} imports {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def listed_order(doc: str, top: str = "hvdtrain") -> list:
    """The package's entries of docs/layout.md's fenced list, top to bottom ("hvdtrain/x.py",
    "hvdtrain/data/"): the first word of each line of a fenced block that names a path in the package."""
    entries, fenced = [], False
    for line in doc.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith(f"{top}/"):
            entries.append(line.split()[0])
    return entries


def entry_of(module: str, path: Path, package: Path, entries: list):
    """The entry of the list a module belongs to: its own file, or the subpackage it is in."""
    rel = path.relative_to(package.parent).as_posix()
    return next((e for e in entries if rel == e or e.endswith("/") and rel.startswith(e)), None)


def upward_imports(package: Path, entries: list) -> list:
    """Each import of a module listed above the importer; a package's __init__.py importing its own
    modules is a re-export, not a layer's import."""
    mods, graph = modules(package), import_graph(package)
    where = {m: entry_of(m, p, package, entries) for m, p in mods.items()}
    found = []
    for a, edges in graph.items():
        for b, at in edges.items():
            if mods[a].name == "__init__.py" and b.startswith(a + "."):
                continue
            if where[a] and where[b] and entries.index(where[a]) > entries.index(where[b]):
                found.append(f"  {at}: {a} ({where[a]}) imports {b}, listed above it ({where[b]})")
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle " + " -> ".join(cycle) + ":\n" + describe(cycle, graph)


def test_every_import_goes_down_the_module_list_of_docs_layout():
    entries = listed_order(LAYOUT.read_text())
    assert entries, "docs/layout.md has no fenced list of hvdtrain/ modules"
    assert len(entries) == len(set(entries)), f"docs/layout.md lists a module twice: {entries}"
    missing = [e for e in entries if not (ROOT / e).exists()]
    assert not missing, f"docs/layout.md lists what the package does not have: {missing}"
    unlisted = [m for m, p in modules(PACKAGE).items()
                if m != PACKAGE.name and entry_of(m, p, PACKAGE, entries) is None]
    assert not unlisted, f"modules docs/layout.md does not list (add each where it belongs): {unlisted}"
    upward = upward_imports(PACKAGE, entries)
    assert not upward, "imports up docs/layout.md's list (move the code, or the module in the list):\n" + "\n".join(upward)


def test_the_trainer_never_imports_bench():
    found = [f"  {at}: {a} imports {b}" for a, edges in import_graph(PACKAGE).items() for b, at in edges.items()
             if not re.match(r"hvdtrain\.bench(\.|$)", a) and re.match(r"hvdtrain\.bench(\.|$)", b)]
    assert not found, "the trainer imports hvdtrain.bench:\n" + "\n".join(found)


def write(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / next(iter(files)).split("/")[0]


def test_a_cycle_through_a_function_local_import_is_found(tmp_path):
    package = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/runtime.py": "import os\n\n\ndef rank():\n    from . import preemption\n    return preemption\n",
        "pkg/preemption.py": "from .runtime import rank\n",
    })
    graph = import_graph(package)
    assert find_cycle(graph) == ["pkg.preemption", "pkg.runtime", "pkg.preemption"]
    assert describe(find_cycle(graph), graph) == ("  pkg.preemption imports pkg.runtime (pkg/preemption.py:1)\n"
                                                  "  pkg.runtime imports pkg.preemption (pkg/runtime.py:5)")


def test_every_form_of_import_is_an_edge_to_the_module_it_names(tmp_path):
    package = write(tmp_path, {
        "pkg/__init__.py": "from .train import fit\n",
        "pkg/train.py": "import json\nimport pkg.config\nfrom pkg import compat\nfrom . import sub\n",
        "pkg/config.py": "",
        "pkg/compat.py": "import importlib\nmod = importlib.import_module('pkg.config')\n",
        "pkg/sub/__init__.py": "from .a import thing\n",
        "pkg/sub/a.py": "from .. import config\nfrom ..compat import mod\nfrom . import b\nfrom .b import *\n",
        "pkg/sub/b.py": "def f():\n    from .. import train\n",
    })
    assert {m: sorted(e) for m, e in import_graph(package).items()} == {
        "pkg": ["pkg.train"],
        "pkg.train": ["pkg.compat", "pkg.config", "pkg.sub"],
        "pkg.config": [],
        "pkg.compat": ["pkg.config"],
        "pkg.sub": ["pkg.sub.a"],
        "pkg.sub.a": ["pkg.compat", "pkg.config", "pkg.sub.b"],
        "pkg.sub.b": ["pkg.train"],
    }


def test_an_import_up_the_list_is_found_and_a_packages_reexport_is_not(tmp_path):
    package = write(tmp_path, {
        "pkg/__init__.py": "from .sub import thing\nfrom .train import fit\n",
        "pkg/train.py": "from . import config\n",
        "pkg/config.py": "def f():\n    from . import train\n",
        "pkg/sub/__init__.py": "from .a import thing\n",
        "pkg/sub/a.py": "from .. import config\n",
    })
    entries = listed_order("```text\npkg/train.py     the recipe\npkg/sub/         a subpackage\n"
                           "                 its second line\npkg/config.py    the config\n"
                           "pkg/__init__.py  listed last, and still free to re-export\n```\n", top="pkg")
    assert entries == ["pkg/train.py", "pkg/sub/", "pkg/config.py", "pkg/__init__.py"]
    assert upward_imports(package, entries) == ["  pkg/config.py:2: pkg.config (pkg/config.py) imports pkg.train, "
                                                "listed above it (pkg/train.py)"]
