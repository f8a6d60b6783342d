"""Tier 1: the routes between redundant expert copies (:class:`moeshard.models.copies.CopyRoutes`),
simulated for every EP rank of random placements without communication: summing along them
gives each redundant expert's first copy the sum of all its copies and every other copy zero,
copying back along them gives every copy the first copy's value, and both ends of each message
list the same slots in the same order."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import Placement
from moeshard.models.copies import CopyRoutes


def _placements(n: int = 40) -> list:
    rng, out = np.random.default_rng(0), []
    while len(out) < n:
        ep = int(rng.choice([1, 2, 3, 4, 8]))
        num_logical = int(rng.integers(1, 10))
        spr = int(rng.integers(1, 5))
        num_physical = ep * spr
        if num_physical < num_logical:
            continue
        row = np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_physical - num_logical)])
        row = rng.permutation(row)
        if rng.random() < 0.3 and num_physical > num_logical:  # an empty slot
            extra = np.flatnonzero(np.bincount(row, minlength=num_logical)[row] > 1)
            row[extra[0]] = -1
        out.append((Placement(row[None], num_logical=num_logical, num_ranks=ep), ep))
    return out


CASES = _placements()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_routes_sum_and_copy_back(case):
    pl, ep = CASES[case]
    phy2log, log2phy = pl.phy2log[0], pl.log2phy[0]
    spr = len(phy2log) // ep
    routes = [CopyRoutes.of(phy2log, log2phy, spr, r) for r in range(ep)]
    rng = np.random.default_rng(case)
    grads = rng.integers(1, 100, len(phy2log)).astype(np.int64)  # one value per slot
    got = grads.copy()
    # The messages of a pair name the same slots in the same order on both ends.
    for a in range(ep):
        for b, slots in routes[a].to_first.items():
            firsts = routes[b].from_copies[a]
            np.testing.assert_array_equal(log2phy[phy2log[slots + a * spr], 0], firsts + b * spr)
        for b, firsts in routes[a].from_copies.items():
            assert len(routes[b].to_first[a]) == len(firsts)
    # Sum: local pairs, then messages, then zero the other copies (as in backward).
    for r, rt in enumerate(routes):
        lo = r * spr
        np.add.at(got, rt.local_first + lo, grads[rt.local_copy + lo])
        for peer, firsts in rt.from_copies.items():
            np.add.at(got, firsts + lo, grads[routes[peer].to_first[r] + peer * spr])
    for r, rt in enumerate(routes):
        got[rt.others + r * spr] = 0
    want = grads.copy()
    for e in range(pl.num_logical):
        copies = log2phy[e][log2phy[e] >= 0]
        want[copies] = 0
        want[copies[0]] = grads[copies].sum()
    np.testing.assert_array_equal(got, want)
    # Copy back: every copy gets its first copy's value.
    back = got.copy()
    for r, rt in enumerate(routes):
        lo = r * spr
        back[rt.local_copy + lo] = back[rt.local_first + lo]
        for peer, slots in rt.to_first.items():
            back[slots + lo] = got[routes[peer].from_copies[r] + peer * spr]
    live = phy2log >= 0
    np.testing.assert_array_equal(back[live], got[log2phy[phy2log[live], 0]])
    # A placement without redundancy has no routes.
    if pl.logcnt.max() <= 1:
        assert all(rt.empty for rt in routes)
