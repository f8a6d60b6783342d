"""Tier 1: what the README and docs/ point to exists, so a module split, a rename or a dropped
flag cannot leave readers a dead reference: every ``moeshard.<module>[.<name>]`` (in the code's
docstrings too), every repository path, link and anchor, every ``python -m benchmarks.X`` and
``moeshard X`` command with its flags (as the command's own ``--help`` lists them) and every
``make`` target. The README stays a user's page of at most 300 lines naming the two set-up
commands; dates, commit hashes and before/after figures live in benchmarks/results/ only."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
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


# --- README.md and docs/*.md: paths, links, commands, size, no dates or commit hashes ---------

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path as docs write it: from the root, or from src/moeshard (``models/ep.py``).
_PATH = re.compile(r"(?<![\w./<-])((?:src|tests|benchmarks|docs|\.ci)/[\w./-]*[\w/]"
                   r"|(?:io|models|plan|ops|eplb|integrations|cli|cluster)/[\w/]*\w\.py)")
_BENCH = re.compile(r"python3? -m benchmarks\.(\w+)([^;|&]*)")
# A `moeshard` command: a code line or span that starts with it, or `-m moeshard.cli` anywhere;
# `moeshard shared` / `node` / `single` are `moeshard plan`'s names of its strategies, not commands.
_MOESHARD = re.compile(r"(?:^\s*(?:\$\s*)?moeshard|-m moeshard\.cli)\s+(?!(?:shared|node|single)\b)([a-z]+)((?:\s+[a-z]+)?[^;|&]*)")
_MAKE = re.compile(r"(?:^|\s)make\s+([a-z][\w-]*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_RESULT_NAME = re.compile(r"\b(20\d\d-\d\d-\d\d-[a-z][\w.-]*?)(?=\.md\b|/|\b)")
_HASH = re.compile(r"\b[0-9a-f]{40}\b")
# A short commit hash: 7-12 hex digits with a letter and a digit (no word in these docs is one).
_SHORT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def _code(text: str) -> list[str]:
    """Code a doc shows: each line of its fenced blocks (``\\`` continuations joined) and each
    inline code span (which may wrap onto the next line)."""
    out = []
    for block in _FENCE.findall(text):
        out += block.replace("\\\n", " ").splitlines()[1:-1]
    out += [m.group(1).replace("\n", " ") for m in _SPAN.finditer(_FENCE.sub("", text))]
    return out


@functools.lru_cache(maxsize=None)
def _help_flags(*argv: str) -> frozenset[str]:
    """The flags a command's own ``--help`` lists: ``("benchmarks.bench_plan",)`` runs that
    module's ``main(["--help"])``, ``("moeshard", "bench", "relocate")`` the ``moeshard`` command's.
    Empty when the command does not exist."""
    if argv[0] == "moeshard":
        from moeshard import cli

        if argv[1] not in cli.COMMANDS:
            return frozenset()
        main, args = cli.main, [*argv[1:], "--help"]
    else:
        try:
            main, args = importlib.import_module(argv[0]).main, ["--help"]
        except ImportError:
            return frozenset()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(args)
        except SystemExit:
            pass
    return frozenset(_FLAG.findall(out.getvalue()))


def test_readme_is_a_short_users_page_with_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md is a user's page: details go to docs/"
    assert {m.group(1) for m in _MAKE.finditer(readme)} == {"demo", "test"}
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_paths_and_links_exist():
    dead = []
    for doc in _docs():
        text = doc.read_text()
        for m in _PATH.finditer(text):
            p = m.group(1).rstrip(".")
            if not any((base / p).exists() for base in (ROOT, ROOT / "src" / "moeshard")):
                dead.append(f"{doc.name}: {p}")
        for m in _LINK.finditer(_FENCE.sub("", text)):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"[a-z]+:", target):
                continue
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists():
                dead.append(f"{doc.name}: link {m.group(1)}")
            elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
                dead.append(f"{doc.name}: anchor {m.group(1)}")
    assert not dead, f"paths or links that do not exist: {dead}"


def test_commands_exist_with_their_flags():
    bad = []
    makefile = (ROOT / "Makefile").read_text()
    for doc in _docs():
        for code in _code(doc.read_text()):
            for m in _BENCH.finditer(code):
                known = _help_flags(f"benchmarks.{m.group(1)}")
                if not known:
                    bad.append(f"{doc.name}: python -m benchmarks.{m.group(1)}")
                bad += [f"{doc.name}: benchmarks.{m.group(1)} {f}" for f in _FLAG.findall(m.group(2)) if f not in known]
            for m in _MOESHARD.finditer(code):
                words = m.group(2).split()[:1] if m.group(1) == "bench" else []
                known = _help_flags("moeshard", m.group(1), *words)
                if not known:
                    bad.append(f"{doc.name}: moeshard {m.group(1)} {' '.join(words)}")
                bad += [f"{doc.name}: moeshard {m.group(1)} {f}" for f in _FLAG.findall(m.group(2)) if f not in known]
            for m in _MAKE.finditer(code):
                if not re.search(rf"^{re.escape(m.group(1))}:", makefile, re.M):
                    bad.append(f"{doc.name}: make {m.group(1)}")
    assert not bad, f"commands or flags that do not exist: {bad}"


def test_no_dates_or_commit_hashes_outside_benchmark_results():
    found = []
    results = ROOT / "benchmarks" / "results"
    for doc in _docs():
        text = doc.read_text()
        for m in _RESULT_NAME.finditer(text):  # a dated results file may be named: it must exist
            if not any(p.name.startswith(m.group(1)) for p in results.iterdir()):
                found.append(f"{doc.name}: no benchmarks/results/{m.group(1)}*")
        text = _RESULT_NAME.sub("", text)
        found += [f"{doc.name}: {m.group(0)}" for r in (_DATE, _HASH, _SHORT_HASH) for m in r.finditer(text)]
        found += [f"{doc.name}: {m.group(0)!r}" for m in re.finditer(r"\(was\b|\bwas \d", text)]
    assert not found, f"dates, commit hashes or before/after figures belong in benchmarks/results/: {found}"


def test_the_doc_checks_catch_what_they_look_for():
    assert _slug("`moeshard plan`: sizing a job") == "moeshard-plan-sizing-a-job"
    assert _slug("LoRA (peft)") == "lora-peft"
    assert [m.group(1) for m in _PATH.finditer("see `models/ep.py` and tests/test_cli.py.")] == [
        "models/ep.py", "tests/test_cli.py"]
    assert "--one-rank" in _help_flags("benchmarks.bench_plan") and "--steps" in _help_flags("moeshard", "bench", "relocate")
    assert not _help_flags("benchmarks.no_such_bench") and not _help_flags("moeshard", "no-such-command")
    assert _SHORT_HASH.search("against faf5e81") and not _SHORT_HASH.search("bf16 deadline 1024")
    assert _DATE.search("on 2026-11-24,") and not _DATE.search(_RESULT_NAME.sub("", "2026-11-24-load-planning.md"))
    assert [m.group(1) for m in _MOESHARD.finditer("torchrun -m moeshard.cli verify CKPT --ep 2")] == ["verify"]
    assert not list(_MOESHARD.finditer("| moeshard shared | 1.22 TiB |"))
    assert not list(_MOESHARD.finditer("moeshard node   1.22 TiB"))
    assert [m.group(1) for m in _MOESHARD.finditer("moeshard inpsect CKPT")] == ["inpsect"]
