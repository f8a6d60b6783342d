"""bench_gpu's rows for the public loaders (InstantTensor, fastsafetensors), on the CPU: which
rows run and which are skipped with a note, the command line, and the byte check that keeps a
fast but wrong loader out of the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ (a checkout, not an installed package)

from benchmarks.bench_gpu import external_load, parse_args  # noqa: E402
from benchmarks.external_loaders import (  # noqa: E402
    INSTALL,
    ExternalRow,
    check_sample,
    external_rows,
    parse_packages,
)


def _files(tmp_path) -> tuple[list[Path], dict]:
    g = torch.Generator().manual_seed(0)
    a = {f"a.{i}": torch.randn(3, 5, generator=g).to(torch.bfloat16) for i in range(4)}
    b = {"b.x": torch.arange(7, dtype=torch.int32), "b.y": torch.tensor(2.5), "b.z": torch.randn(2, 2, generator=g)}
    save_file(a, str(tmp_path / "m-1.safetensors"))
    save_file(b, str(tmp_path / "m-2.safetensors"))
    return [tmp_path / "m-1.safetensors", tmp_path / "m-2.safetensors"], {**a, **b}


def test_parse_packages_and_the_command_line():
    assert parse_packages("instanttensor, fastsafetensors") == ("instanttensor", "fastsafetensors")
    assert parse_packages("") == ()
    with pytest.raises(ValueError, match=r"unknown external loader\(s\) \['safetensors'\]"):
        parse_packages("fastsafetensors,safetensors")
    assert parse_args([]).external == ("instanttensor", "fastsafetensors")
    assert parse_args(["--external", ""]).external == ()
    with pytest.raises(SystemExit):
        parse_args(["--external", "instant"])


def test_rows_are_skipped_with_a_note():
    missing = external_rows(("instanttensor", "fastsafetensors"), "cuda", installed=lambda name: False)
    assert [r.label for r in missing] == [
        "instanttensor safe_open (buffered I/O)",
        "instanttensor safe_open (direct I/O)",
        "fastsafetensors (nogds)",
    ]
    assert all(r.load is None and INSTALL in r.skipped and r.package in r.skipped for r in missing)
    on_cpu = external_rows(("instanttensor", "fastsafetensors"), "cpu", installed=lambda name: True)
    assert [r.skipped for r in on_cpu[:2]] == ["instanttensor loads to CUDA devices only; the device is cpu"] * 2
    assert on_cpu[2].load is not None and on_cpu[2].skipped == ""
    on_cuda = external_rows(("instanttensor",), "cuda", installed=lambda name: True)
    assert len(on_cuda) == 2 and all(r.load is not None and not r.skipped for r in on_cuda)
    assert external_rows((), "cuda") == []


def test_check_sample_catches_a_wrong_loader(tmp_path):
    files, tensors = _files(tmp_path)
    assert check_sample(tensors, files) == 4 + 3  # m-1: first 2 and last 2; m-2: its 3
    seconds, info = external_load(ExternalRow("x", "x", lambda f, d: dict(tensors)), files, torch.device("cpu"), True)
    assert seconds >= 0 and info == {"tensors": 7, "checked_tensors": 7}
    bad = dict(tensors)
    bad["a.3"] = tensors["a.3"].clone()
    bad["a.3"][1, 2] += 1
    with pytest.raises(ValueError, match=r"m-1.safetensors: a.3's bytes differ"):
        external_load(ExternalRow("x", "x", lambda f, d: bad), files, torch.device("cpu"), True)
    with pytest.raises(
        ValueError, match=r"m-2.safetensors: b.y is torch.float32 \[1\], the file holds torch.float32 \[\]"
    ):
        check_sample({**tensors, "b.y": tensors["b.y"].reshape(1)}, files)
    with pytest.raises(ValueError, match=r"the loader returned no tensor b.x"):
        check_sample({k: v for k, v in tensors.items() if k != "b.x"}, files)


def test_fastsafetensors_row_on_the_cpu(tmp_path):
    pytest.importorskip("fastsafetensors", reason=f"fastsafetensors is not installed ({INSTALL})")
    files, tensors = _files(tmp_path)
    (row,) = external_rows(("fastsafetensors",), "cpu")
    _, info = external_load(row, files, torch.device("cpu"), True)
    assert info == {"tensors": len(tensors), "checked_tensors": 7}
