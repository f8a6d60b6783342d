"""Tier 1: every import statement in the package names a module that exists, including the
imports inside functions (they run only on some paths: a worker rank, a subcommand)."""

import ast
import importlib.util
from pathlib import Path

import moeshard

SRC = Path(moeshard.__file__).parent


def _imports():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        package = ".".join(parts[:-1])  # a module's package; an __init__'s own package
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = package.split(".")
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                if base.startswith("moeshard"):
                    yield path, node.lineno, base, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("moeshard"):
                        yield path, node.lineno, a.name, []


def test_every_moeshard_import_resolves():
    missing = []
    for path, line, module, names in _imports():
        if importlib.util.find_spec(module) is None:
            missing.append(f"{path.name}:{line}: {module}")
            continue
        mod = importlib.import_module(module)
        for name in names:
            # `from pkg import sub`: a name the module defines, or a submodule of a package.
            sub = hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
            if not (hasattr(mod, name) or sub):
                missing.append(f"{path.name}:{line}: {module}.{name}")
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
                    found += [f"{path.relative_to(root)}:{node.lineno}: {a.name}" for a in node.names
                              if _is_private(a.name)]
    assert not found, found
