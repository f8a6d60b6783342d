"""Round packing of the relocation planner (:mod:`.relocation`): its moves -> rounds and stashes.

A move runs in a round; a move that reads a slot runs no later than the move that overwrites
it, and a cycle of such constraints (experts swapping slots) is broken by stashing a slot.
Every rank stages at most the budget per round and posts at most ``max_ops`` P2P ops per
phase. Pure; the moves are :class:`~moeshard.plan.relocation.Move` records.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .relocation import Move

__all__ = ["Stash", "Round", "Keys", "pack_rounds"]


@dataclass(frozen=True)
class Stash:
    """At the start of round ``round``, ``rank`` copies the old content of its ``slot`` (part
    group ``part`` of ``layer``) aside; later reads of that slot use the copy."""

    round: int
    rank: int
    layer: int
    slot: int
    part: int
    nbytes: int


@dataclass(frozen=True)
class Round:
    moves: tuple[int, ...]  # indices into the plan's moves
    stashes: tuple[int, ...] = ()  # indices into the plan's stashes created this round


class Keys:
    """Old slot contents ``(rank, layer, slot, part group)`` as one int (hashing an int is
    cheaper than a tuple): ``part * per_part + (layer * world + rank) * num_physical + slot``."""

    __slots__ = ("world", "num_physical", "per_part")

    def __init__(self, num_layers: int, world: int, num_physical: int):
        self.world, self.num_physical = world, num_physical
        self.per_part = num_layers * world * num_physical

    def key(self, layer: int, rank: int, slot: int) -> int:
        return (layer * self.world + rank) * self.num_physical + slot

    def rank(self, key: int) -> int:
        return key % self.per_part // self.num_physical % self.world


def pack_rounds(moves: list[Move], keys: Keys, read_keys: list[list[int]], write_keys: list[list[int]],
              group_of: list[int], num_parts: list[int], group_stage: list[dict[int, int]],
              group_ops: list[tuple[dict[int, int], dict[int, int], int]], world: int, budget: int, max_ops: int):
    """Pack moves into rounds (list scheduling in move order).

    A move becomes *ready* once every move reading the old content of a slot it overwrites
    is scheduled (in an earlier round or earlier in the same round: reads happen before the
    round's writes). If nothing is ready and nothing was scheduled in the round, the first
    blocked move's slots are stashed, which breaks the cycle it sits on.

    Per move ``i``: ``read_keys[i]`` / ``write_keys[i]`` the keys (:class:`Keys`) of the old
    slot contents it reads (once per read) / overwrites; ``num_parts[i]`` its parts. Per group
    ``g = group_of[i]`` (the moves of one expert's column): ``group_stage[g]`` ``{rank: buffers}``
    staged (of ``moves[i].nbytes`` each), ``group_ops[g]`` ``({rank: ops}`` in phase A, in phase B
    (per part), P2P links ``)``. Returns ``(rounds, stashes, int64[world] peak staged bytes, P2P ops)``.
    """
    n = len(moves)
    key_readers: dict[int, list[int]] = {}  # key -> moves reading it (once per read)
    for i, ks in enumerate(read_keys):
        for key in ks:
            lst = key_readers.get(key)
            if lst is None:
                key_readers[key] = [i]
            else:
                lst.append(i)
    readers_of = {k: len(v) for k, v in key_readers.items()}  # reads not yet scheduled
    writer_of = {k: i for i, ks in enumerate(write_keys) for k in ks}
    blocked = [0] * n  # per move: slots it overwrites whose old content is still to be read
    for key in key_readers:
        w = writer_of.get(key)
        if w is not None:
            blocked[w] += 1
    ready = [i for i, b in enumerate(blocked) if b == 0]  # ascending: a heap
    scheduled = bytearray(n)
    # Moves that did not fit a round wait in classes of equal demand (staging per rank, bytes,
    # ops per rank and phase, parts), one heap each, and only the head of a class is among the
    # ready moves. A round's usage only grows, so once a move does not fit, the rest of its
    # class do not either: the round drops the class at its first misfit. Popping every waiting
    # move in every round (and deferring it again) made many rounds quadratic. A move is
    # classed only when deferred a second time (most moves of a small plan fit the next round,
    # and classing costs more than one more look).
    class_ids: dict[tuple, int] = {}
    class_of = [-1] * n  # per move: its class once classed, else -1
    waiting: list[list[int]] = []  # per class: its deferred moves, a heap
    deferred_in: list[int] = []  # per class: the last round a move of it did not fit
    deferred: list[int] = []  # the classes deferred this round: all that have waiting moves
    retried = bytearray(n)  # per move: deferred once (and back among the ready moves)

    rounds: list[Round] = []
    stashes: list[Stash] = []
    stash_live = [0] * world  # rank -> bytes of stashes still needed
    stash_left: dict[int, int] = {}  # stashed key -> readers not yet scheduled
    # Readers of stashes, a heap pruned lazily: a move once scheduled or unblocked never
    # waits again (blocked counts only decrease), and a stash lives until its readers ran.
    stash_readers: list[int] = []
    peak = [0] * world
    total_ops = 0
    done = 0
    first_waiting = 0
    heappop, heappush = heapq.heappop, heapq.heappush
    while done < n:
        cur: list[int] = []
        new_stashes: list[int] = []
        staged = [0] * world
        posted_a = [0] * world
        posted_b = [0] * world
        # The heads of the waiting classes join the ready moves; a class's next head follows
        # once its head is scheduled, so the round ends with every class not deferred in it
        # empty (and no ready moves). A head that a smaller deferred move of its class displaced
        # this round stays among the ready moves: that class was deferred, so it does not fit.
        for c in deferred:
            heappush(ready, waiting[c][0])
        deferred = []
        retry: list[int] = []  # moves deferred for the first time this round
        rnd = len(rounds)
        released: list[int] = []
        while True:
            while ready:
                i = heappop(ready)
                g = group_of[i]
                add, size = group_stage[g], moves[i].nbytes
                a, b, links = group_ops[g]
                np_ = num_parts[i]
                if cur:  # the first move of a round always fits
                    fits = True
                    for r, v in add.items():
                        if staged[r] + v * size + stash_live[r] > budget:
                            fits = False
                            break
                    if fits:
                        for r, v in a.items():
                            if posted_a[r] + v * np_ > max_ops:
                                fits = False
                                break
                    if fits:
                        for r, v in b.items():
                            if posted_b[r] + v * np_ > max_ops:
                                fits = False
                                break
                    if not fits:
                        c = class_of[i]
                        if c < 0:
                            if not retried[i]:
                                retried[i] = 1
                                retry.append(i)
                                continue
                            a_, b_ = tuple(a.items()), tuple(b.items())
                            c = class_ids.setdefault((tuple(add.items()), size, a_, b_, np_), len(class_ids))
                            if c == len(waiting):
                                waiting.append([])
                                deferred_in.append(-1)
                            class_of[i] = c
                            heappush(waiting[c], i)
                        if deferred_in[c] != rnd:
                            deferred_in[c] = rnd
                            deferred.append(c)
                        continue
                c = class_of[i]
                if c >= 0:  # i is the class's head
                    q = waiting[c]
                    heappop(q)
                    if q:
                        heappush(ready, q[0])
                cur.append(i)
                scheduled[i] = 1
                done += 1
                for r, v in add.items():
                    staged[r] += v * size
                for r, v in a.items():
                    posted_a[r] += v * np_
                for r, v in b.items():
                    posted_b[r] += v * np_
                total_ops += links * np_
                for key in read_keys[i]:
                    left = stash_left.get(key)
                    if left is not None:
                        stash_left[key] = left - 1
                        if left == 1:
                            released.append(key)
                        continue
                    left = readers_of[key] - 1
                    readers_of[key] = left
                    if left == 0:
                        w = writer_of.get(key)
                        if w is not None:
                            blocked[w] -= 1
                            if blocked[w] == 0:
                                heappush(ready, w)
            if deferred or retry or done == n:
                break
            # Deadlock: every remaining move waits for a reader that is itself blocked. Walk
            # along "waits for" until a move repeats: that move sits on a cycle, and stashing
            # the slots it overwrites breaks the cycle. Start from a move that reads a live
            # stash (finishing it frees memory), else from the first blocked move.
            while stash_readers and (scheduled[stash_readers[0]] or blocked[stash_readers[0]] == 0):
                heappop(stash_readers)
            while blocked[first_waiting] == 0:  # blocked counts only decrease
                first_waiting += 1
            first = stash_readers[0] if stash_readers else first_waiting
            seen: set[int] = set()
            while first not in seen:
                seen.add(first)
                for key in write_keys[first]:  # a slot it overwrites that is still to be read
                    if readers_of.get(key, 0) > 0:
                        break
                for first in key_readers[key]:  # by a move not yet scheduled
                    if not scheduled[first]:
                        break
            m = moves[first]
            # The slots to stash, with their (rank, slot) as the move's writes give them.
            written = [(r, s) for r, slots in m.writes for s in slots]  # in write_keys[first] order
            over = [(k, r, s) for k, (r, s) in zip(write_keys[first], written) if readers_of.get(k, 0) > 0]
            extra: dict[int, int] = {}
            for _, r, _ in over:
                extra[r] = extra.get(r, 0) + m.nbytes
            if cur and any(staged[r] + stash_live[r] + v > budget for r, v in extra.items()):
                break  # no room for the stash in this round: next round
            for key, r, s in over:
                stashes.append(Stash(len(rounds), r, m.layer, s, m.part, m.nbytes))
                new_stashes.append(len(stashes) - 1)
                stash_left[key] = readers_of[key]
                stash_live[r] += m.nbytes
                readers_of[key] = 0
                for j in key_readers[key]:
                    if not scheduled[j]:
                        heappush(stash_readers, j)
            blocked[first] = 0
            heappush(ready, first)
        # Peak: this round's staging on top of the stashes alive in it (stashes alone at least).
        for r in range(world):
            v = staged[r] + stash_live[r]
            if v > peak[r]:
                peak[r] = v
        rounds.append(Round(tuple(sorted(cur)), tuple(new_stashes)))
        for key in released:
            stash_live[keys.rank(key)] -= moves[writer_of[key]].nbytes
            del stash_left[key]
        for i in retry:
            heappush(ready, i)
    return rounds, stashes, np.asarray(peak, dtype=np.int64), total_ops
