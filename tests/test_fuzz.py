"""Tier 1: a seeded fuzz of the inputs moeshard reads from disk, as a hostile or careless user
would hand them over: truncated files, flipped header bytes, and JSON mutations (wrong types,
deep nesting, duplicate keys, huge numbers, unicode, NaN / Infinity, swapped offsets) of a
safetensors header, the index and ``config.json`` of a small real checkpoint (3 shards + index +
config, :mod:`tiny_moe`).

Each case runs every reader of that input (``CheckpointIndex.open`` + ``CheckpointReader.read``
of every key, ``moeshard.load`` into the tiny model, ``moeshard inspect``, ``moeshard plan``)
and checks: the values read are right (the original tensors, or for a header safetensors still
accepts, exactly what safetensors itself reads from it), or the error is a ``CheckpointError``
naming a file (a CLI: exit 2 with one line on stderr). Never another exception type, never
more than a few seconds (SIGALRM), never more than 1 GiB of memory (RLIMIT_DATA: an
allocation past it is a MemoryError, and any "out of memory" is a failure here).

``MOESHARD_FUZZ_CASES`` / ``MOESHARD_FUZZ_SEED`` run more cases or another seed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import resource
import signal
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import moeshard
import tiny_moe
from moeshard import CheckpointError, CheckpointIndex, CheckpointReader
from moeshard.cli.inspect import main as inspect_main
from moeshard.cli.plan import main as plan_main

INDEX = "model.safetensors.index.json"
CONFIG = {  # a Qwen3-MoE-shaped config.json (what `moeshard plan` reads beside the checkpoint)
    "model_type": "qwen3_moe",
    "hidden_size": 8,
    "vocab_size": 13,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "num_experts": 8,
    "moe_intermediate_size": 6,
    "intermediate_size": 24,
    "mlp_only_layers": [1],
    "torch_dtype": "bfloat16",
}
NUM_CASES = int(os.environ.get("MOESHARD_FUZZ_CASES", "320"))
SEED = int(os.environ.get("MOESHARD_FUZZ_SEED", "20240611"))
CASE_SECONDS = 15  # generous for a loaded 2-core host; a hang is minutes
MEMORY_BYTES = 2**30
# Where moeshard is deliberately stricter than the safetensors library (module docstring of
# moeshard.checkpoint): a repeated key, a dtype torch has no type for; or the index names a
# key the (valid) file no longer has.
STRICTER = ("appears twice", "unsupported dtype", "has no such tensor")


# -- the pristine checkpoint --------------------------------------------------------------------


@dataclass
class Pristine:
    files: dict[str, bytes]  # every file of the checkpoint directory
    values: dict[str, torch.Tensor]  # every tensor, read with safetensors itself
    shards: list[str]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    d = tmp_path_factory.mktemp("fuzz_pristine")
    tiny_moe.write(d)
    (d / "config.json").write_text(json.dumps(CONFIG, indent=2))
    files = {p.name: p.read_bytes() for p in sorted(d.iterdir())}
    return Pristine(files, tiny_moe.read_all(d), sorted(n for n in files if n.endswith(".safetensors")))


def _split_header(raw: bytes) -> tuple[bytes, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n], raw[8 + n :]


# -- JSON mutations -----------------------------------------------------------------------------


class Raw(str):
    """Text written into the JSON as is: NaN, 1e400, a 5,000-digit number, deep nesting."""


class Dup:
    """An object written with these (key, value) pairs, repeats included (a leaf for
    further mutations)."""

    def __init__(self, pairs: list):
        self.pairs = pairs


def dump(obj, rng: random.Random) -> str:
    """JSON text of ``obj`` (Raw and Dup as above), with random whitespace and escaping."""
    sep = rng.choice(([",", ":"], [", ", ": "], [" ,\n", " :\t"]))
    if isinstance(obj, Raw):
        return str(obj)
    if isinstance(obj, (dict, Dup)):
        pairs = obj.items() if isinstance(obj, dict) else obj.pairs
        return "{" + sep[0].join(dump(str(k), rng) + sep[1] + dump(v, rng) for k, v in pairs) + "}"
    if isinstance(obj, list):
        return "[" + sep[0].join(dump(v, rng) for v in obj) + "]"
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5)


def _nested(rng: random.Random) -> Raw:
    depth = rng.choice((10, 500, 990, 5000, 60_000))
    open_, close = rng.choice((("[", "]"), ('{"a":', "}")))
    return Raw(open_ * depth + "0" + close * depth)


SCALARS = (
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -0.0,
    "",
    "x",
    "é\U0001f600\u202e",
    "BF16",
    "F8_E4M3",
    "U16",
    2**31,
    2**63,
    2**64,
    -(2**63),
    10**30,
    [],
    {},
    [0],
    [[1]],
)
RAW = (
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-0",
    "9" * 5000,
    "-" + "9" * 4400,
    '"\\ud800"',
    '"\\u0000"',
    "1.0e2",
    "0.5",
)


def random_value(rng: random.Random):
    r = rng.random()
    if r < 0.45:
        return rng.choice(SCALARS)
    if r < 0.8:
        return Raw(rng.choice(RAW))
    return _nested(rng)


def _paths(obj, prefix=()):
    """Every (path, value) in a parsed JSON document."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return doc


def _tweak_int(n: int, rng: random.Random):
    return rng.choice((n + 1, n - 1, -n, 2 * n, 0, n + 2**32, n * 2**40, bool(n), float(n), str(n)))


def mutate(doc, rng: random.Random):
    """One random structural mutation of a parsed JSON document (returns the new document)."""
    paths = list(_paths(doc))
    path, node = rng.choice(paths)
    op = rng.random()
    if isinstance(node, int) and not isinstance(node, bool) and op < 0.5:
        return _set(doc, path, _tweak_int(node, rng))
    if isinstance(node, dict) and node and op < 0.6:
        keys = list(node)
        k = rng.choice(keys)
        action = rng.choice(("drop", "add", "dup", "rename", "swap"))
        if action == "drop":
            del node[k]
        elif action == "add":
            node[rng.choice(("__metadata__", "zz", "é", k + "x", "data_offsets"))] = random_value(rng)
        elif action == "dup":  # the same key twice: same value or another
            pairs = list(node.items())
            pairs.insert(rng.randrange(len(pairs) + 1), (k, rng.choice((node[k], random_value(rng)))))
            return _set(doc, path, Dup(pairs))
        elif action == "rename":
            node[rng.choice(("", "é\U0001f600", "\u0000", k.upper(), k + "." * 3))] = node.pop(k)
        else:  # swap two members' values (swapped data_offsets make a valid, different file)
            k2 = rng.choice(keys)
            node[k], node[k2] = node[k2], node[k]
        return doc
    if isinstance(node, list) and op < 0.6:
        action = rng.choice(("append", "drop", "reverse", "repeat"))
        if action == "append":
            node.append(rng.choice((0, 1, node[-1] if node else 0, random_value(rng))))
        elif action == "drop" and node:
            node.pop(rng.randrange(len(node)))
        elif action == "reverse":
            node.reverse()
        elif node:
            node.append(node[0])
        return doc
    return _set(doc, path, random_value(rng))


def swap_offsets(header: dict, rng: random.Random) -> dict:
    """Exchange the data_offsets of two same-size tensors: a valid file whose values moved."""
    by_size: dict[int, list[str]] = {}
    for k, e in header.items() if isinstance(header, dict) else ():
        offs = e.get("data_offsets") if isinstance(e, dict) else None
        if isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs):
            by_size.setdefault(offs[1] - offs[0], []).append(k)
    groups = [g for g in by_size.values() if len(g) > 1]
    if not groups:  # an earlier mutation left no two such entries
        return header
    a, b = rng.sample(rng.choice(groups), 2)
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    return header


def mutated_json(text: bytes, rng: random.Random, header: bool) -> bytes:
    doc = json.loads(text)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        doc = swap_offsets(doc, rng) if header and rng.random() < 0.15 else mutate(doc, rng)
    out = dump(doc, rng).encode("utf-8", "surrogatepass")
    if header and rng.random() < 0.5:
        out += b" " * (-len(out) % 8)  # safetensors' own padding
    return out


# -- cases -----------------------------------------------------------------------------------


def make_case(p: Pristine, rng: random.Random) -> tuple[str, str, bytes]:
    """``(kind, file name, its new bytes)`` for one random case."""
    r = rng.random()
    if r < 0.12:  # truncation of any file
        name = rng.choice(sorted(p.files))
        raw = p.files[name]
        return "truncate", name, raw[: rng.randrange(len(raw))]
    name = rng.choice(p.shards)
    raw = p.files[name]
    head, data = _split_header(raw)
    if r < 0.27:  # bytes flipped in the length prefix or the header
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(8 + len(head))
            buf[i] = rng.randrange(256) if rng.random() < 0.5 else buf[i] ^ (1 << rng.randrange(8))
        return "flip", name, bytes(buf)
    if r < 0.32:  # bytes appended (a concatenated or grown file)
        return "append", name, raw + bytes(rng.randint(1, 64))
    if r < 0.62:
        new = mutated_json(head, rng, header=True)
        return "header", name, struct.pack("<Q", len(new)) + new + data
    if r < 0.82:
        return "index", INDEX, mutated_json(p.files[INDEX], rng, header=False)
    return "config", "config.json", mutated_json(p.files["config.json"], rng, header=False)


def safetensors_reads(path: Path) -> dict[str, torch.Tensor] | None:
    """What the safetensors library reads from ``path``; None if it refuses the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # noqa: BLE001 - any refusal (its errors are not one type)
        return None


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout(f"a case ran over {CASE_SECONDS} s")


@contextlib.contextmanager
def bounded(seconds: int, memory: int):
    """At most ``seconds`` of wall time and ``memory`` more bytes of data segment than now."""
    with open("/proc/self/status") as f:
        vm_data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    old_limit = resource.getrlimit(resource.RLIMIT_DATA)
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data + memory, old_limit[1]))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_DATA, old_limit)


def _names_a_file(msg: str, case_dir: Path) -> bool:
    return str(case_dir) in msg or any(n in msg for n in os.listdir(case_dir))


def _expected(p: Pristine, case_dir: Path, name: str) -> dict[str, torch.Tensor] | None:
    """The values a correct reader returns: the originals, with the mutated shard's tensors
    as safetensors reads them (None: safetensors refuses the mutated shard)."""
    if not name.endswith(".safetensors"):
        return dict(p.values)
    got = safetensors_reads(case_dir / name)
    if got is None:
        return None
    values = {k: v for k, v in p.values.items() if k not in _keys_of(p, name)}
    values.update(got)
    return values


def _keys_of(p: Pristine, shard: str) -> set[str]:
    return {k for k, f in json.loads(p.files[INDEX])["weight_map"].items() if f == shard}


def check_index_and_reads(p: Pristine, case_dir: Path, name: str) -> CheckpointIndex | None:
    """Open + read every key: right values, or a CheckpointError naming a file."""
    expected = _expected(p, case_dir, name)
    try:
        idx = CheckpointIndex.open(case_dir)
        with CheckpointReader(idx) as r:
            got = {k: r.read(k) for k in idx.tensors}
    except CheckpointError as e:
        msg = str(e)
        assert "out of memory" not in msg, msg
        assert _names_a_file(msg, case_dir), f"error names no file: {msg}"
        if expected is not None and name.endswith(".safetensors") and not any(s in msg for s in STRICTER):
            raise AssertionError(f"refused a shard safetensors accepts: {msg}") from None
        return None
    assert expected is not None, f"accepted {name}, which safetensors refuses"
    for k, v in got.items():
        assert k in expected, f"read {k!r}, a key no correct reader sees"
        assert v.dtype == expected[k].dtype and torch.equal(v, expected[k]), f"wrong values for {k!r}"
    return idx


def check_load(p: Pristine, case_dir: Path, name: str, idx: CheckpointIndex) -> None:
    """``moeshard.load`` into the tiny model where the checkpoint still has its structure."""
    pristine = CheckpointIndex.open(case_dir.parent / "pristine") if (case_dir.parent / "pristine").is_dir() else None
    same = pristine is not None and {k: (t.dtype, t.shape) for k, t in idx.tensors.items()} == {
        k: (t.dtype, t.shape) for k, t in pristine.tensors.items()
    }
    if not same:
        return
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    moeshard.load(model, case_dir)
    values = _expected(p, case_dir, name)
    assert tiny_moe.compare(model, values, moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 1)) == []


def check_cli(argv: list[str], main, case_dir: Path) -> None:
    """A command on the case: exit 0 / 1 (inspect: problems) or 2 with one line naming a file."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    if rc == 2:
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and "error" in lines[0], err.getvalue()
        assert "out of memory" not in lines[0], lines[0]
    else:
        assert rc in (0, 1), (rc, err.getvalue())


def run_case(p: Pristine, case_dir: Path, kind: str, name: str, raw: bytes) -> None:
    for f, data in p.files.items():
        (case_dir / f).write_bytes(raw if f == name else data)
    idx = check_index_and_reads(p, case_dir, name)
    if idx is not None:
        check_load(p, case_dir, name, idx)
    check_cli([str(case_dir)], inspect_main, case_dir)
    cluster = ["--nodes", "1", "--ranks-per-node", "2", "--ep", "2"]
    check_cli([str(case_dir), *cluster], plan_main, case_dir)
    if kind in ("config", "truncate") and name == "config.json":
        check_cli(["--synthetic-from-config", str(case_dir / "config.json"), *cluster], plan_main, case_dir)


def test_fuzz_hostile_checkpoints(pristine, tmp_path):
    (tmp_path / "pristine").mkdir()
    for f, data in pristine.files.items():
        (tmp_path / "pristine" / f).write_bytes(data)
    rng = random.Random(SEED)
    kinds: dict[str, int] = {}
    for i in range(NUM_CASES):
        kind, name, raw = make_case(pristine, rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        case_dir = tmp_path / f"case{i:04d}"
        case_dir.mkdir()
        try:
            with bounded(CASE_SECONDS, MEMORY_BYTES):
                run_case(pristine, case_dir, kind, name, raw)
        except BaseException as e:
            shown = raw[:300] if kind != "truncate" else f"{len(raw)} bytes".encode()
            raise AssertionError(
                f"case {i} ({kind} of {name}, seed {SEED}): {type(e).__name__}: "
                f"{str(e)[:500]}\n{name} starts: {shown!r}"
            ) from e
        for f in case_dir.iterdir():
            f.unlink()
        case_dir.rmdir()
    assert min(kinds.values()) >= 5, kinds  # every kind of case ran
