"""The fastest public safetensors loaders, as bench_gpu rows: InstantTensor (``safe_open`` over
every file at once, with buffered and with direct I/O) and fastsafetensors
(``SafeTensorsFileLoader``, its bounce-buffer ``nogds`` path, the one that runs without GPUDirect
Storage).

Neither is a dependency: a row whose package is missing, or that cannot run on the device
(InstantTensor loads to CUDA devices only), is skipped with a note that says why and how to
install it. Each row returns every tensor of the checkpoint on the device; the caller times it
and compares a sample with safetensors' bytes (:func:`check_sample`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("instanttensor", "fastsafetensors")
# Their one runtime need is torch: --no-deps keeps the host's CUDA build of torch.
INSTALL = "pip install --no-deps instanttensor==0.2.2 fastsafetensors==0.5.0"


@dataclass(frozen=True)
class ExternalRow:
    """One loader row: ``label`` for the table; ``load(files, device) -> {key: tensor}`` when it
    can run here, else None and ``skipped`` says why."""

    package: str
    label: str
    load: Callable | None
    skipped: str = ""


def parse_packages(text: str) -> tuple[str, ...]:
    """``--external``'s comma list (``""``: none). Raises ValueError naming an unknown package."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PACKAGES]
    if unknown:
        raise ValueError(f"unknown external loader(s) {unknown}: choose from {', '.join(PACKAGES)}")
    return names


def instanttensor_load(files: Sequence[Path], device, buffered: bool) -> dict:
    """InstantTensor's ``safe_open`` over all files in one call (its fastest use), tensors
    copied out of its ring buffer (``copy=True``: each owns its memory, as a loader's must)."""
    from instanttensor import BackendPolicy, safe_open

    # None: its default for regular files, direct I/O (io_uring, else libaio)
    backend = BackendPolicy.BUFFERED if buffered else None
    with safe_open([str(f) for f in files], framework="pt", device=device.index or 0, backend=backend) as f:
        return dict(f.tensors())


def fastsafetensors_load(files: Sequence[Path], device) -> dict:
    """fastsafetensors' ``SafeTensorsFileLoader`` on one device: every file copied to device
    buffers, then every tensor taken out of them (each keeps its buffer alive)."""
    from fastsafetensors import SafeTensorsFileLoader

    loader = SafeTensorsFileLoader(None, str(device), nogds=True)
    try:
        loader.add_filenames({0: [str(f) for f in files]})
        buffers = loader.copy_files_to_device()
        try:
            return {k: buffers.get_tensor(k) for k in loader.get_keys()}
        finally:
            buffers.close()
    finally:
        loader.close()


def external_rows(
    packages: Sequence[str], device_type: str, installed: Callable[[str], bool] | None = None
) -> list[ExternalRow]:
    """The rows of ``packages`` on a device of ``device_type`` ("cuda" or "cpu"), in order;
    ``installed(name)`` defaults to "importable here"."""
    if installed is None:

        def installed(name: str) -> bool:
            return importlib.util.find_spec(name) is not None

    rows = []
    for pkg in packages:
        if pkg == "instanttensor":
            labels = [("instanttensor safe_open (buffered I/O)", True), ("instanttensor safe_open (direct I/O)", False)]
            if not installed(pkg):
                why = f"instanttensor is not installed ({INSTALL})"
            elif device_type != "cuda":
                why = f"instanttensor loads to CUDA devices only; the device is {device_type}"
            else:
                why = ""
            for label, buffered in labels:
                load = None if why else (lambda files, dev, b=buffered: instanttensor_load(files, dev, b))
                rows.append(ExternalRow(pkg, label, load, why))
        elif pkg == "fastsafetensors":
            why = "" if installed(pkg) else f"fastsafetensors is not installed ({INSTALL})"
            rows.append(ExternalRow(pkg, "fastsafetensors (nogds)", None if why else fastsafetensors_load, why))
        else:
            raise ValueError(f"unknown external loader {pkg!r}: choose from {', '.join(PACKAGES)}")
    return rows


def check_sample(tensors: dict, files: Sequence[Path], per_file: int = 2) -> int:
    """Compare the first and last ``per_file`` tensors of each file (by offset) in ``tensors``
    with safetensors' own read of them, byte for byte; returns how many were compared. Raises
    ValueError naming the first key that is missing, of another shape or dtype, or differs."""
    import torch
    from safetensors import safe_open

    checked = 0
    for f in files:
        with safe_open(str(f), framework="pt") as ref:
            keys = list(ref.keys())  # safetensors lists keys sorted by name; any sample will do
            for key in dict.fromkeys(keys[:per_file] + keys[-per_file:]):
                want = ref.get_tensor(key)
                got = tensors.get(key)
                if got is None:
                    raise ValueError(f"{f.name}: the loader returned no tensor {key}")
                got = got.detach().to("cpu")
                if got.shape != want.shape or got.dtype != want.dtype:
                    raise ValueError(
                        f"{f.name}: {key} is {got.dtype} {list(got.shape)}, the file holds "
                        f"{want.dtype} {list(want.shape)}"
                    )
                if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                    raise ValueError(f"{f.name}: {key}'s bytes differ from the file's")
                checked += 1
    return checked
