"""Tier 1: the package's imports. Every import statement names a module that exists, including
the imports inside functions (they run only on some paths: a worker rank, a subcommand); no
module imports itself through others (an import circle), counting imports inside functions and
under ``TYPE_CHECKING``; and the pure planners (``moeshard.plan``) import only vocabulary and
the checkpoint index, never the layers above them."""

import ast
import importlib.util
from pathlib import Path

import moeshard

SRC = Path(moeshard.__file__).parent

# What moeshard.plan must not import: the layers above it (DESIGN.md, "Layers of the package").
PLAN_MAY_NOT_IMPORT = ("moeshard.models", "moeshard.ops", "moeshard.eplb", "moeshard.integrations", "moeshard.cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


# {module name: (its package, its source)}: an __init__'s package is its own name.
SOURCES = {
    _module_name(p): (".".join(p.relative_to(SRC.parent).with_suffix("").parts[:-1]), p.read_text())
    for p in sorted(SRC.rglob("*.py"))
}


def _imports(sources=SOURCES):
    """``(module, line, imported module, [names])`` of every moeshard import statement, at any
    depth (in functions, under ``if TYPE_CHECKING:``)."""
    for src, (package, text) in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = package.split(".")
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                if base.startswith("moeshard"):
                    yield src, node.lineno, base, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("moeshard"):
                        yield src, node.lineno, a.name, []


def _graph(sources=SOURCES) -> dict[str, dict[str, str]]:
    """``{module: {module it imports: "module:line" of the first such import}}``. ``from pkg
    import sub`` imports the submodule ``pkg.sub`` where there is one, else ``pkg`` itself."""
    out: dict[str, dict[str, str]] = {m: {} for m in sources}
    for src, line, module, names in _imports(sources):
        targets = [f"{module}.{n}" if f"{module}.{n}" in sources else module for n in names] or [module]
        for t in targets:
            if t in sources and t != src:
                out[src].setdefault(t, f"{src}:{line}")
    return out


def _plan_imports_above(graph: dict[str, dict[str, str]]) -> list[str]:
    return [
        f"{where}: {src} imports {dst}"
        for src, deps in graph.items()
        if src.startswith("moeshard.plan")
        for dst, where in deps.items()
        if dst.startswith(PLAN_MAY_NOT_IMPORT)
    ]


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_moeshard_import_resolves():
    missing = []
    for src, line, module, names in _imports():
        if importlib.util.find_spec(module) is None:
            missing.append(f"{src}:{line}: {module}")
            continue
        mod = importlib.import_module(module)
        for name in names:
            # `from pkg import sub`: a name the module defines, or a submodule of a package.
            sub = hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
            if not (hasattr(mod, name) or sub):
                missing.append(f"{src}:{line}: {module}.{name}")
    assert not missing, missing


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_imported_from_another_module():
    """House rule: a name with a leading underscore stays in its module; what modules share is
    public. Checked in the package, the benchmarks and the tests, imports inside functions
    included; other projects' private names (torch's) are theirs to keep."""
    root = SRC.parent.parent
    ours = ("moeshard", "benchmarks", *(p.stem for p in (root / "tests").glob("*.py")))
    found = []
    for folder in ("src", "benchmarks", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in ours):
                    found += [
                        f"{path.relative_to(root)}:{node.lineno}: {a.name}" for a in node.names if _is_private(a.name)
                    ]
    assert not found, found


def test_no_import_circle():
    graph = _graph()
    circles = []
    for comp in _cycles(graph):
        members = set(comp)
        edges = [f"{a} -> {b} ({where})" for a in comp for b, where in graph[a].items() if b in members]
        circles.append(f"{comp}: " + "; ".join(edges))
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_plan_imports_only_what_is_below_it():
    wrong = _plan_imports_above(_graph())
    assert not wrong, wrong


def test_the_checks_see_circles_and_wrong_imports():
    """The checks above fail where they should: on a made-up package whose circles and wrong
    imports hide in a function and under TYPE_CHECKING."""
    fake = {
        "moeshard": ("moeshard", ""),
        "moeshard.plan": ("moeshard.plan", "from .a import f\n"),
        "moeshard.plan.a": (
            "moeshard.plan",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\ndef f():\n    return 1\n",
        ),
        "moeshard.plan.b": ("moeshard.plan", "def g():\n    from . import a\n    from ..models import m\n"),
        "moeshard.models": ("moeshard.models", ""),
        "moeshard.models.m": ("moeshard.models", "import moeshard.plan.b\n"),
    }
    graph = _graph(fake)
    assert graph["moeshard.plan.b"] == {
        "moeshard.plan.a": "moeshard.plan.b:2",
        "moeshard.models.m": "moeshard.plan.b:3",
    }
    assert _cycles(graph) == [["moeshard.models.m", "moeshard.plan.a", "moeshard.plan.b"]]
    assert _plan_imports_above(graph) == ["moeshard.plan.b:3: moeshard.plan.b imports moeshard.models.m"]
    del fake["moeshard.models.m"]
    fake["moeshard.plan.b"] = ("moeshard.plan", "def g():\n    return 2\n")
    assert _cycles(_graph(fake)) == [] and _plan_imports_above(_graph(fake)) == []


def test_core_functions_fit_on_a_screen():
    """House rule: no function over 120 lines (``def`` to its last line, docstring included) in
    the planners, the operations and the runner: a longer one hides shared state that belongs in
    a small object or a named step."""
    long = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not (rel.startswith(("plan/", "ops/")) or rel == "execute.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 120:
                    long.append(f"{rel}:{node.lineno}: {node.name} ({n} lines)")
    assert not long, long
