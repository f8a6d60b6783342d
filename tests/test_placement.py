"""Tier 1: Placement tables (phy2log / log2phy / logcnt) and their validation."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import Placement


def _check_tables(pl: Placement) -> None:
    """log2phy and logcnt must be exactly the inverse of phy2log (checked by brute force)."""
    p2l = pl.phy2log
    num_layers, num_physical = p2l.shape
    assert pl.log2phy.shape[:2] == (num_layers, pl.num_logical)
    assert pl.logcnt.shape == (num_layers, pl.num_logical)
    assert pl.log2phy.shape[2] == pl.logcnt.max()
    for layer in range(num_layers):
        assert pl.logcnt[layer].sum() == num_physical
        for e in range(pl.num_logical):
            slots = [p for p in range(num_physical) if p2l[layer, p] == e]
            assert pl.logcnt[layer, e] == len(slots) >= 1
            row = pl.log2phy[layer, e].tolist()
            # Copies in slot order, then -1 padding.
            assert row[: len(slots)] == slots
            assert all(x == -1 for x in row[len(slots) :])
    # Round trip through log2phy.
    back = Placement.from_log2phy(pl.log2phy, num_physical, num_ranks=pl.num_ranks)
    assert back == pl
    assert back.fingerprint() == pl.fingerprint()


def test_contiguous_no_redundancy():
    pl = Placement.contiguous(num_layers=3, num_logical=8, num_ranks=4)
    assert pl.num_layers == 3 and pl.num_physical == 8 and pl.num_logical == 8
    assert pl.slots_per_rank() == 2
    assert (pl.phy2log == np.arange(8)).all()
    assert (pl.logcnt == 1).all()
    assert pl.log2phy.shape == (3, 8, 1)
    assert (pl.log2phy[:, :, 0] == np.arange(8)).all()
    # Slot p lives on EP rank p // slots_per_rank.
    spr = pl.slots_per_rank()
    assert [p // spr for p in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    _check_tables(pl)


def test_contiguous_redundant():
    pl = Placement.contiguous(num_layers=2, num_logical=6, num_ranks=4, num_redundant=2)
    assert pl.num_physical == 8 and pl.slots_per_rank() == 2
    assert pl.phy2log[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert pl.logcnt[0].tolist() == [2, 2, 1, 1, 1, 1]
    assert pl.log2phy[1, 0].tolist() == [0, 6]
    assert pl.log2phy[1, 1].tolist() == [1, 7]
    assert pl.log2phy[1, 5].tolist() == [5, -1]
    _check_tables(pl)


def test_arbitrary_shuffled_map():
    p2l = np.array([[3, 0, 2, 1, 3, 3], [1, 1, 0, 2, 3, 0]])
    pl = Placement(p2l, num_ranks=3)
    assert pl.num_logical == 4 and pl.num_physical == 6 and pl.slots_per_rank() == 2
    assert pl.logcnt.tolist() == [[1, 1, 1, 3], [2, 2, 1, 1]]
    assert pl.log2phy.shape == (2, 4, 3)
    assert pl.log2phy[0, 3].tolist() == [0, 4, 5]
    assert pl.log2phy[1, 0].tolist() == [2, 5, -1]
    assert pl.log2phy[1, 1].tolist() == [0, 1, -1]
    # Tables are frozen.
    with pytest.raises(ValueError):
        pl.phy2log[0, 0] = 1
    _check_tables(pl)


@pytest.mark.parametrize("seed", range(20))
def test_random_maps_tables_consistent(seed):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 5))
    num_logical = int(rng.integers(1, 17))
    num_ranks = int(rng.integers(1, 9))
    spr = int(rng.integers(1, 5))
    num_physical = num_ranks * spr
    if num_physical < num_logical:
        num_physical = num_ranks * -(-num_logical // num_ranks)
    rows = []
    for _ in range(num_layers):
        extra = rng.integers(0, num_logical, num_physical - num_logical)
        rows.append(rng.permutation(np.concatenate([np.arange(num_logical), extra])))
    pl = Placement(np.stack(rows), num_logical=num_logical, num_ranks=num_ranks)
    assert pl.num_physical == num_physical
    _check_tables(pl)


def test_equality_and_fingerprint():
    a = Placement.contiguous(2, 4, 2, 2)
    b = Placement(np.array([[0, 1, 2, 3, 0, 1]] * 2), num_logical=4, num_ranks=2)
    c = Placement(np.array([[1, 0, 2, 3, 0, 1]] * 2), num_logical=4, num_ranks=2)
    assert a == b and a.fingerprint() == b.fingerprint() and hash(a) == hash(b)
    assert a != c and a.fingerprint() != c.fingerprint()


# -- validation -----------------------------------------------------------------------------


def test_error_slots_not_divisible_by_ep_size():
    with pytest.raises(ValueError, match=r"num_physical=6 .*not divisible.*num_ranks=4"):
        Placement(np.array([[0, 1, 2, 3, 4, 5]]), num_ranks=4)
    with pytest.raises(ValueError, match="not divisible"):
        Placement.contiguous(num_layers=1, num_logical=8, num_ranks=3)
    pl = Placement.contiguous(num_layers=1, num_logical=8, num_ranks=None)
    with pytest.raises(ValueError, match="not divisible by the EP size 3"):
        pl.slots_per_rank(3)
    with pytest.raises(ValueError, match="EP size is unknown"):
        pl.slots_per_rank()
    pl4 = Placement.contiguous(num_layers=1, num_logical=8, num_ranks=4)
    with pytest.raises(ValueError, match="EP size 4, the model has EP size 2"):
        pl4.slots_per_rank(2)


def test_error_id_out_of_range():
    with pytest.raises(ValueError, match=r"phy2log\[1, 2\] = 7 is not a logical expert id in \[0, 4\)"):
        Placement(np.array([[0, 1, 2, 3], [0, 1, 7, 3]]), num_logical=4)
    with pytest.raises(ValueError, match=r"phy2log\[0, 1\] = -2 is not a logical expert id"):
        Placement(np.array([[0, -2, 2, 3]]))


def test_empty_slots():
    # Rank 1 of 3 is dead in layer 0 (slots 2, 3 empty); layer 1 is shuffled with its own gaps.
    p = Placement(np.array([[0, 1, -1, -1, 2, 0], [-1, -1, 2, 1, 0, 0]]), num_ranks=3)
    assert p.logcnt.tolist() == [[2, 1, 1], [2, 1, 1]]
    assert p.log2phy[0].tolist() == [[0, 5], [1, -1], [4, -1]]
    assert p.log2phy[1].tolist() == [[4, 5], [3, -1], [2, -1]]
    assert p.empty.sum() == 4
    assert p.rank_empty().tolist() == [False, False, False]
    dead = Placement(np.array([[0, 1, -1, -1, 2, 0]]), num_ranks=3)
    assert dead.rank_empty().tolist() == [False, True, False]
    with pytest.raises(ValueError, match="logical expert 1 of layer 0 has no physical slot"):
        Placement(np.array([[0, -1, 2, 3]]), num_logical=4)


def test_error_logical_expert_without_copy():
    with pytest.raises(ValueError, match="logical expert 2 of layer 0 has no physical slot"):
        Placement(np.array([[0, 1, 3, 3]]), num_logical=4)
    # A trailing expert with no copy is only caught when num_logical is given.
    with pytest.raises(ValueError, match="logical expert 4 of layer 1 has no physical slot"):
        Placement(np.array([[0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 3, 0]]), num_logical=5)


def test_error_layers_mismatch():
    pl = Placement.contiguous(num_layers=2, num_logical=4, num_ranks=2)
    pl.check_layers(2)
    with pytest.raises(ValueError, match="the model has 3 MoE layers, the placement describes 2"):
        pl.check_layers(3)


def test_error_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="int\\[num_layers, num_physical\\]"):
        Placement(np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="integer expert ids"):
        Placement(np.array([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="num_redundant >= 0"):
        Placement.contiguous(1, 4, 2, num_redundant=-1)


def test_error_from_log2phy():
    l2p = np.array([[[0], [0]]])  # slot 0 used twice
    with pytest.raises(ValueError, match="used twice"):
        Placement.from_log2phy(l2p, num_physical=2)
    l2p = np.array([[[0], [1]]])
    with pytest.raises(ValueError, match="leaves slot 2 of layer 0 empty"):
        Placement.from_log2phy(l2p, num_physical=3)


def test_by_rank_takes_each_ranks_slots_from_one_placement():
    old = Placement(np.array([[0, 1, 2, 3, 0, 1]]), num_ranks=3)
    new = Placement(np.array([[1, 0, 3, 2, 2, 3]]), num_ranks=3)
    mixed = Placement.by_rank(old, new, [True, False, False])
    assert mixed.phy2log.tolist() == [[1, 0, 2, 3, 0, 1]]
    assert Placement.by_rank(old, new, [True] * 3) == new
    assert Placement.by_rank(old, new, [False] * 3) == old
    # Expert 0 moves from rank 0 to rank 1: rank 0 took new, rank 1 kept old -> no copy left.
    with pytest.raises(ValueError, match="the ranks' slots hold no placement: logical expert 0"):
        Placement.by_rank(
            Placement(np.array([[0, 1, 2, 3]]), num_ranks=2),
            Placement(np.array([[1, 2, 0, 3]]), num_ranks=2),
            [True, False],
        )
    with pytest.raises(ValueError, match="different shapes"):
        Placement.by_rank(old, Placement(np.array([[0, 1, 2, 3]]), num_ranks=2), [True, False])


def test_is_identity():
    import moeshard

    ident = moeshard.Placement.contiguous(2, 4, 2)
    assert ident.is_identity(0) and ident.is_identity(1)
    shuffled = moeshard.Placement(np.array([[0, 1, 2, 3], [1, 0, 2, 3]]), num_logical=4, num_ranks=2)
    assert shuffled.is_identity(0) and not shuffled.is_identity(1)
    assert not moeshard.Placement.contiguous(1, 4, 2, num_redundant=2).is_identity(0)  # copies: more slots
