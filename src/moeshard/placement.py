"""Where each logical expert lives: phy2log / log2phy / logcnt, as deepseek-ai/EPLB defines them.

Vocabulary: a *logical expert* is an expert id of the checkpoint (0..num_logical-1); a
*physical slot* is a place for one expert copy. With ``num_ranks`` EP ranks and
``num_physical`` slots per layer, slot ``p`` lives on EP rank ``p // slots_per_rank`` at local
slot ``p % slots_per_rank``. Redundant experts: ``num_physical > num_logical``.

An *empty* slot (``phy2log == -1``) holds no expert: the slots of a dead rank, or of a rank
that has not joined yet. Slot ids stay those of the full job, so nothing else renumbers when
ranks leave or join (elastic EP).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ROW_RULE", "Placement", "slots_changed"]


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


# What a placement's row is, for messages.
ROW_RULE = "a placement has one row per MoE layer, i.e. per router: the expert tensors one router drives share it"


@dataclass(frozen=True, eq=False)
class Placement:
    """Expert placement of every MoE layer.

    Args:
        phy2log: ``int[num_layers, num_physical]``: logical expert held by each physical slot,
            ``-1`` for an empty slot. The layer index counts MoE layers only, one per router,
            in module order (dense layers are skipped; the experts modules one router drives,
            JetMoE's ``input_linear`` and ``output_linear``, share a row).
        num_logical: number of logical experts per layer; inferred as ``phy2log.max() + 1``
            when omitted (pass it to catch a trailing expert with no copy).
        num_ranks: EP size, when known. ``num_physical`` must be a multiple of it.

    Raises:
        ValueError: an expert id out of range, a logical expert with no copy, slot count not
            divisible by ``num_ranks``.
    """

    phy2log: np.ndarray
    num_logical: int | None = None
    num_ranks: int | None = None
    # Derived tables (computed in __post_init__; not constructor arguments).
    log2phy: np.ndarray = field(init=False, repr=False)
    logcnt: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p2l = np.asarray(self.phy2log)
        if p2l.ndim != 2 or p2l.shape[1] == 0:
            raise ValueError(f"phy2log must be int[num_layers, num_physical], got shape {p2l.shape}")
        if not np.issubdtype(p2l.dtype, np.integer):
            raise ValueError(f"phy2log must hold integer expert ids, got dtype {p2l.dtype}")
        num_logical = int(p2l.max()) + 1 if self.num_logical is None else int(self.num_logical)
        bad = np.argwhere((p2l < -1) | (p2l >= num_logical))
        if len(bad):
            layer, slot = bad[0]
            raise ValueError(
                f"phy2log[{layer}, {slot}] = {p2l[layer, slot]} is not a logical expert id in "
                f"[0, {num_logical}) nor -1 (empty slot)"
            )
        num_layers, num_physical = p2l.shape
        if self.num_ranks is not None and (self.num_ranks < 1 or num_physical % self.num_ranks):
            raise ValueError(
                f"num_physical={num_physical} slots per layer is not divisible by the EP size "
                f"num_ranks={self.num_ranks}"
            )
        # Empty slots are counted in an extra column, then dropped.
        ids = np.where(p2l < 0, num_logical, p2l) + (np.arange(num_layers) * (num_logical + 1))[:, None]
        logcnt = np.bincount(ids.ravel(), minlength=num_layers * (num_logical + 1))
        logcnt = np.ascontiguousarray(logcnt.reshape(num_layers, num_logical + 1)[:, :num_logical])
        missing = np.argwhere(logcnt == 0)
        if len(missing):
            layer, expert = missing[0]
            raise ValueError(
                f"logical expert {expert} of layer {layer} has no physical slot "
                f"({len(missing)} expert(s) without a copy in all)"
            )
        max_copies = int(logcnt.max())
        log2phy = np.full((num_layers, num_logical, max_copies), -1, dtype=np.int64)
        # Copies of an expert in slot order: a stable sort groups slots by logical expert
        # (empty slots sort first and are skipped).
        small = p2l.astype(np.int16) if num_logical < 2**15 else p2l  # a radix sort
        order = np.argsort(small, axis=1, kind="stable")
        sorted_log = np.take_along_axis(p2l, order, axis=1)
        num_empty = (p2l < 0).sum(axis=1, keepdims=True)
        starts = np.cumsum(logcnt, axis=1) - logcnt + num_empty
        full = sorted_log >= 0
        rank_in_expert = np.arange(num_physical)[None, :] - np.take_along_axis(
            starts, np.maximum(sorted_log, 0), axis=1
        )
        layer_idx = np.broadcast_to(np.arange(num_layers)[:, None], p2l.shape)
        log2phy[layer_idx[full], sorted_log[full], rank_in_expert[full]] = order[full]
        object.__setattr__(self, "phy2log", _frozen(p2l))
        object.__setattr__(self, "num_logical", num_logical)
        object.__setattr__(self, "log2phy", _frozen(log2phy))
        object.__setattr__(self, "logcnt", _frozen(logcnt))

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_layers: int, num_logical: int, num_ranks: int, num_redundant: int = 0) -> Placement:
        """Slot ``p`` holds logical expert ``p % num_logical``: experts in order, redundant
        copies of experts 0..num_redundant-1 in the last slots."""
        if num_layers < 1 or num_logical < 1 or num_redundant < 0:
            raise ValueError(
                f"need num_layers >= 1, num_logical >= 1, num_redundant >= 0; got "
                f"{num_layers}, {num_logical}, {num_redundant}"
            )
        num_physical = num_logical + num_redundant
        row = np.arange(num_physical) % num_logical
        return cls(np.tile(row, (num_layers, 1)), num_logical=num_logical, num_ranks=num_ranks)

    @classmethod
    def from_log2phy(cls, log2phy: np.ndarray, num_physical: int, num_ranks: int | None = None) -> Placement:
        """Inverse of :attr:`log2phy` (``-1`` pads); every slot must be named exactly once."""
        l2p = np.asarray(log2phy)
        num_layers, num_logical, _ = l2p.shape
        p2l = np.full((num_layers, num_physical), -1, dtype=np.int64)
        for layer, expert, copy in np.argwhere(l2p >= 0):
            slot = l2p[layer, expert, copy]
            if not 0 <= slot < num_physical or p2l[layer, slot] != -1:
                raise ValueError(f"log2phy[{layer}, {expert}, {copy}] = {slot}: slot out of range or used twice")
            p2l[layer, slot] = expert
        if (p2l < 0).any():
            layer, slot = np.argwhere(p2l < 0)[0]
            raise ValueError(f"log2phy leaves slot {slot} of layer {layer} empty")
        return cls(p2l, num_logical=num_logical, num_ranks=num_ranks)

    @classmethod
    def by_rank(cls, old: Placement, new: Placement, take_new) -> Placement:
        """The placement EP ranks hold when some took ``new`` and the others kept ``old``
        (each rank's slots from one of them): after a relocation whose closing agreement a
        dying peer cut short (:func:`moeshard.relocate`, "Failures").

        ``take_new``: ``bool[num_ranks]``, one per EP rank (dead ranks' entries do not matter
        to a recovery that passes ``active_ranks``).

        Raises:
            ValueError: placements of different shapes, or an expert that no rank holds in
                the result (its only copies moved from ranks that took ``new`` to ranks that
                kept ``old``): refill those from the checkpoint (``relocate`` with ``old=None``
                for the ranks concerned, or ``from_checkpoint=True``).
        """
        if old.phy2log.shape != new.phy2log.shape or old.num_logical != new.num_logical:
            raise ValueError(
                f"placements of different shapes: {old.phy2log.shape} with {old.num_logical} experts, "
                f"{new.phy2log.shape} with {new.num_logical}"
            )
        take = np.asarray(take_new, dtype=bool).reshape(-1)
        spr = old.slots_per_rank(len(take))
        rows = np.where(np.repeat(take, spr)[None, :], new.phy2log, old.phy2log)
        try:
            return cls(rows, num_logical=old.num_logical, num_ranks=len(take))
        except ValueError as e:
            raise ValueError(f"the ranks' slots hold no placement: {e}") from None

    # -- queries ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def empty(self) -> np.ndarray:
        """``bool[num_layers, num_physical]``: slots that hold no expert."""
        return self.phy2log < 0

    def rank_empty(self, num_ranks: int | None = None) -> np.ndarray:
        """``bool[num_ranks]``: EP ranks all of whose slots are empty in every layer."""
        n = self.num_ranks if num_ranks is None else num_ranks
        spr = self.slots_per_rank(n)
        return self.empty.reshape(self.num_layers, n, spr).all(axis=(0, 2))

    def slots_per_rank(self, num_ranks: int | None = None) -> int:
        """Physical slots per EP rank; ``num_ranks`` defaults to the placement's own."""
        n = self.num_ranks if num_ranks is None else num_ranks
        if n is None:
            raise ValueError("the EP size is unknown: pass num_ranks")
        if n < 1 or self.num_physical % n:
            raise ValueError(f"num_physical={self.num_physical} slots per layer is not divisible by the EP size {n}")
        if self.num_ranks is not None and n != self.num_ranks:
            raise ValueError(f"placement was made for EP size {self.num_ranks}, the model has EP size {n}")
        return self.num_physical // n

    def is_identity(self, layer: int) -> bool:
        """Whether MoE layer ``layer`` holds every logical expert once, slot p = expert p (its
        slots are in logical order, as a checkpoint's experts are)."""
        row = self.phy2log[layer]
        return len(row) == self.num_logical and bool(np.array_equal(row, np.arange(len(row))))

    def check_layers(self, num_layers: int) -> None:
        """ValueError unless the placement has ``num_layers`` rows (a model's MoE layers)."""
        if num_layers != self.num_layers:
            raise ValueError(
                f"the model has {num_layers} MoE layers, the placement describes {self.num_layers} ({ROW_RULE})"
            )

    def fingerprint(self) -> str:
        import hashlib

        h = hashlib.sha256(self.phy2log.tobytes())
        h.update(f"{self.phy2log.shape}/{self.num_logical}/{self.num_ranks}".encode())
        return h.hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Placement)
            and self.num_logical == other.num_logical
            and np.array_equal(self.phy2log, other.phy2log)
        )

    def __hash__(self) -> int:
        return hash(self.fingerprint())


def slots_changed(old: Placement, new: Placement, per_layer: bool = False) -> int | np.ndarray:
    """Non-empty slots of ``new`` that hold another expert than in ``old`` (local copies
    between slots of one rank included): what a relocation writes. ``per_layer``: as
    ``int64[num_layers]`` (chunked relocation sizes its chunks by it)."""
    if old.phy2log.shape != new.phy2log.shape:
        raise ValueError(f"placements differ in shape: {old.phy2log.shape} vs {new.phy2log.shape}")
    changed = ((new.phy2log >= 0) & (new.phy2log != old.phy2log)).sum(axis=1)
    return changed if per_layer else int(changed.sum())
