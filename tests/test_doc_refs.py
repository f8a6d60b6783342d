"""Tier 1: every ``moeshard.<module>[.<name>]`` that the code's docstrings, the README and docs/
point to exists, so a module split or a rename cannot leave readers a dead reference."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A dotted name after "moeshard."; not inside a bytes literal (fingerprint rule tags such as
# b"moeshard.relocation/components-1" are versioned strings, not references).
_REF = re.compile(r"(?<![A-Za-z0-9_\"'/])(?<!b[\"'])~?(moeshard(?:\.[A-Za-z_][A-Za-z_0-9]*)+)")


def _resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _sources() -> list[Path]:
    return sorted([*(ROOT / "src").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def test_references_resolve():
    seen: dict[str, list[str]] = {}
    for path in _sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in _REF.finditer(line):
                seen.setdefault(m.group(1), []).append(f"{path.relative_to(ROOT)}:{lineno}")
    assert len(seen) > 50, "the pattern finds the references"  # the sources name well over 50
    dead = {ref: where[:3] for ref, where in sorted(seen.items()) if not _resolves(ref)}
    assert not dead, f"references to names that do not exist: {dead}"


def test_a_dead_reference_is_caught():
    assert _resolves("moeshard.models.layout.need_table")
    assert not _resolves("moeshard.layout.need_table")  # the flat layout's name
    assert not _resolves("moeshard.models.layout.no_such_function")
    assert [m.group(1) for m in _REF.finditer('h = hashlib.sha256(b"moeshard.lora.needs/1")')] == []
