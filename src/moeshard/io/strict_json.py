"""Strict JSON for untrusted files: what serde_json (safetensors' parser) accepts, no more.

Python's json module accepts more than other readers do. Here JSON is UTF-8 and JSON as
serde_json reads it: no NaN / Infinity, no number beyond float range, no unpaired UTF-16
surrogate escape, at most 127 levels of nesting; no object repeats a key (readers disagree on
which value wins, so that is an error here). Every failure, JSON nested too deeply or holding a
number too long to parse included, is a :class:`~moeshard.io.errors.CheckpointError`
``"{where}: {what}: why"``. JSON read from checkpoint directories (an index, ``config.json``)
goes through :func:`load_json`; a safetensors header is parsed member by member
(:func:`object_items`) by :mod:`moeshard.io.header`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import reprlib
from collections.abc import Iterator
from json.decoder import WHITESPACE, JSONDecodeError, scanstring

import numpy as np

from .errors import CheckpointError

__all__ = [
    "JsonRejected",
    "brief",
    "check_depth",
    "check_surrogates",
    "decode_utf8",
    "strict_decoder",
    "json_errors",
    "load_json",
    "object_items",
    "parse_json",
    "serde_int",
    "unique_keys",
]


class JsonRejected(ValueError):
    """Valid for Python's json module, not for a strict JSON reader (serde_json, as
    safetensors uses): NaN / Infinity, 1e400, an unpaired surrogate, deep nesting; or
    ambiguous: a repeated key."""


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook``: the object as a dict; a key given twice is an error, since
    readers disagree on which value wins."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonRejected(f"key {brief(dup)} appears twice in one object")
    return obj


def _reject_constant(name: str) -> None:
    raise JsonRejected(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """``parse_float``: 1e400 is out of range for every reader but Python's (which makes it inf)."""
    value = float(text)
    if math.isinf(value):
        raise JsonRejected(f"number {brief(text)} is out of range")
    return value


def serde_int(text: str) -> int | float:
    """``parse_int`` of a safetensors header: serde reads ``-0`` as the float -0.0, so it is
    no shape dim or offset (and harmless in a field nobody reads)."""
    return -0.0 if text == "-0" else int(text)


# A UTF-16 surrogate escape (\uD800-\uDFFF) that really is an escape: not preceded by an odd
# run of backslashes (outside strings, valid JSON has none).
_SURROGATE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u[dD]([89a-fA-F])[0-9a-fA-F]{2}")


def check_surrogates(text: str) -> None:
    """An unpaired surrogate escape decodes (in Python only) to a str no encoder accepts:
    printing such a key ends ``moeshard inspect`` with a traceback; serde refuses the file."""
    if "\\u" not in text:  # the common case: one fast scan
        return
    low_at = None  # where the low half of a pair must start
    for m in _SURROGATE_ESCAPE.finditer(text):
        start, high = m.end() - 6, m.group(1) in "89abAB"
        if high and low_at is None:
            low_at = m.end()
        elif not high and start == low_at:
            low_at = None
        else:
            break
    else:
        if low_at is None:
            return
    raise JsonRejected("an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF) is not a character")


# serde_json's recursion limit, which safetensors parses with: 127 levels (the header object
# itself is one) parse, 128 do not.
_MAX_DEPTH = 127
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def check_depth(text: str) -> None:
    """Nesting deeper than safetensors reads (only an entry's unknown fields can nest)."""
    skeleton = np.frombuffer(_JSON_STRING.sub("", text).encode("latin-1", "replace"), dtype=np.uint8)
    step = np.isin(skeleton, (ord("["), ord("{"))).astype(np.int64) - np.isin(skeleton, (ord("]"), ord("}")))
    depth = int(np.cumsum(step).max()) if step.size else 0
    if depth > _MAX_DEPTH:
        raise JsonRejected(f"JSON nested {depth} levels deep; safetensors reads at most {_MAX_DEPTH}")


def decode_utf8(raw: bytes, where: object, what: str) -> str:
    """``raw`` as text; not UTF-8 (what JSON and safetensors require) is a CheckpointError."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: {what}: not UTF-8 ({e})") from None


@contextlib.contextmanager
def json_errors(where: object, what: str) -> Iterator[None]:
    """Turn every way parsing untrusted JSON can fail into a CheckpointError ``"{where}:
    {what}: why"``: nesting deeper than the recursion limit, an integer of more than 4,300
    digits (Python's int-conversion limit) and memory running out included."""
    try:
        yield
        return
    except CheckpointError:
        raise
    except json.JSONDecodeError as e:
        reason = str(e)
    except JsonRejected as e:
        reason = str(e)
    except ValueError as e:  # json raises int()'s own error for a number of > 4,300 digits
        reason = f"a number too long to parse ({e})"
    except RecursionError:
        reason = "JSON nested too deeply"
    except MemoryError:
        reason = "out of memory while parsing"
    raise CheckpointError(f"{where}: {what}: {reason}") from None


def strict_decoder(object_pairs_hook=unique_keys, parse_int=None) -> json.JSONDecoder:
    """Stricter than ``json.loads`` where other readers are: no duplicate keys, no NaN /
    Infinity, no number out of float range."""
    return json.JSONDecoder(
        object_pairs_hook=object_pairs_hook,
        parse_constant=_reject_constant,
        parse_float=_finite_float,
        parse_int=parse_int,
    )


def parse_json(text: str, where: object, what: str) -> object:
    """Parse untrusted JSON text (see :func:`strict_decoder`, :func:`json_errors`)."""
    with json_errors(where, what):
        check_surrogates(text)
        return strict_decoder().decode(text)


def load_json(path: str | os.PathLike, what: str) -> object:
    """Read and :func:`parse_json` the file at ``path`` (a config.json, an index): an error
    is a CheckpointError (a ValueError) ``"{path}: {what}: why"``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: {what}: {e}") from None
    except MemoryError:
        raise CheckpointError(f"{path}: {what}: out of memory reading the file") from None
    text = decode_utf8(raw, path, what)
    del raw
    return parse_json(text, path, what)


def object_items(text: str, decoder: json.JSONDecoder) -> Iterator[tuple[str, object]]:
    """The members of the JSON object ``text`` holds, one at a time, values decoded by
    ``decoder``: unlike ``json.loads``, never a list of all the members' pairs and a dict of
    all their keys besides the caller's own structure (about 110 MB for a maximal header).
    The grammar is ``json.decoder.JSONObject``'s, the errors its JSONDecodeErrors."""

    def skip(pos: int) -> int:  # past any whitespace at pos (compact JSON has none: no regex call)
        return ws(text, pos).end() if text[pos : pos + 1] in _WS_CHARS else pos

    ws, scan = WHITESPACE.match, decoder.scan_once
    end = skip(0)
    if text[end : end + 1] != "{":
        raise JSONDecodeError("Expecting '{' (a safetensors header is a JSON object)", text, end)
    end = skip(end + 1)
    if text[end : end + 1] == "}":
        end += 1
    else:
        while True:
            if text[end : end + 1] != '"':
                raise JSONDecodeError("Expecting property name enclosed in double quotes", text, end)
            key, end = scanstring(text, end + 1)
            end = skip(end)
            if text[end : end + 1] != ":":
                raise JSONDecodeError("Expecting ':' delimiter", text, end)
            try:  # scan_once is raw_decode's C core, without its Python frame
                value, end = scan(text, skip(end + 1))
            except StopIteration as e:
                raise JSONDecodeError("Expecting value", text, e.value) from None
            yield key, value
            end = skip(end)
            sep = text[end : end + 1]
            end = skip(end + 1)
            if sep == "}":
                break
            if sep != ",":
                raise JSONDecodeError("Expecting ',' delimiter", text, end - 1)
    end = skip(end)
    if end != len(text):
        raise JSONDecodeError("Extra data", text, end)


_WS_CHARS = frozenset(" \t\n\r")  # JSON's whitespace


def brief(value: object) -> str:
    """A short ``repr`` of ``value``: a hostile header's key or shape can be megabytes long,
    and an error message is one line (reprlib never builds the whole repr)."""
    return _BRIEF.repr(value)


_BRIEF = reprlib.Repr()
_BRIEF.maxstring, _BRIEF.maxlist, _BRIEF.maxlevel = 160, 8, 2
