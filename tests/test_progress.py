"""Tier 1: progress reporting (quiet by default; a bar on a terminal; log lines otherwise)."""

from __future__ import annotations

import io
import logging
import re

import numpy as np
import torch

import moeshard
import tiny_moe
from moeshard.progress import Progress, progress_enabled


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_lines_otherwise(caplog):
    tty = _Tty()
    p = Progress("load", 3000, enabled=True, local_rank=0, node=1, stream=tty)
    for _ in range(3):
        p.update(1000)
    p.close()
    assert "moeshard load (node 1)" in tty.getvalue() and p.done == 3000
    with caplog.at_level(logging.INFO, logger="moeshard"):
        p = Progress("relocate", 100, enabled=True, local_rank=0, node=0, interval=0.0, stream=io.StringIO())
        p.update(40)
        p.update(60)
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert re.search(r"moeshard relocate node=0 bytes_done=40 bytes_total=100 percent=40.0 .* eta_s=", lines[0])
    assert re.search(r"bytes_done=100 bytes_total=100 percent=100.0 .* elapsed_s=", lines[-1])


def test_quiet_unless_asked_and_one_rank_per_node(caplog, monkeypatch):
    monkeypatch.delenv("MOESHARD_PROGRESS", raising=False)
    assert progress_enabled(None) is False
    monkeypatch.setenv("MOESHARD_PROGRESS", "1")
    assert progress_enabled(None) is True and progress_enabled(False) is False
    tty = _Tty()
    with caplog.at_level(logging.INFO, logger="moeshard"):
        for kw in (dict(enabled=False, local_rank=0), dict(enabled=True, local_rank=2)):
            p = Progress("load", 10, node=0, stream=tty, interval=0.0, **kw)
            p.update(10)
            p.close()
    assert tty.getvalue() == "" and caplog.records == []


def test_load_and_relocate_report_progress(tmp_path, caplog):
    tiny_moe.write(tmp_path / "ckpt")
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    E = tiny_moe.NUM_EXPERTS
    old = moeshard.Placement.contiguous(2, E, 1)
    with caplog.at_level(logging.INFO, logger="moeshard"):
        rep = moeshard.load(model, tmp_path / "ckpt", placement=old, progress=True)
        new = moeshard.Placement(np.stack([np.roll(np.arange(E), 1)] * 2), num_ranks=1)
        moeshard.relocate(model, old, new, progress=True)
    done = [r.getMessage() for r in caplog.records if "elapsed_s=" in r.getMessage()]
    assert len(done) == 2
    total = int(re.search(r"bytes_total=(\d+)", done[0]).group(1))
    assert total == rep.bytes_read_rank == rep.checkpoint_bytes
    assert "moeshard relocate" in done[1] and "percent=100.0" in done[1]
