"""Round packing of the relocation planner: its moves (a :class:`~.records.MoveTable`) ->
rounds and stashes.

A move runs in a round; a move that reads a slot runs no later than the move that overwrites
it, and a cycle of such constraints (experts swapping slots) is broken by stashing a slot.
Every rank stages at most the budget per round and posts at most ``max_ops`` P2P ops per
phase. Components (ranks that exchange data only among themselves) are packed on their own
and their rounds merged by number. Pure.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from .records import Keys, MoveTable, Round, Stash

__all__ = ["Packed", "pack_rounds", "pack_components"]


class Packed(NamedTuple):
    """Packed moves: ``rounds``, ``stashes`` (in round order), ``peak``: ``int64[world]`` peak
    staged bytes per rank, ``num_p2p_ops``: P2P ops of all rounds."""

    rounds: list[Round]
    stashes: list[Stash]
    peak: np.ndarray
    num_p2p_ops: int


def pack_components(table: MoveTable, keys: Keys, world: int, budget: int, max_ops: int) -> Packed:
    """:func:`pack_rounds` per component (``table.component``), its rounds merged by number
    (components share no rank: budgets per rank hold, and no op of one component waits for
    another's). One component: ``pack_rounds`` itself."""
    comps = sorted(set(table.component))
    if len(comps) <= 1:
        return pack_rounds(table, keys, world, budget, max_ops)
    by_comp: dict[int, list[int]] = {k: [] for k in comps}
    for i, k in enumerate(table.component):
        by_comp[k].append(i)
    round_moves: list[list[int]] = []
    round_stashes: list[list[Stash]] = []
    peak = np.zeros(world, dtype=np.int64)
    total_ops = 0
    for k in comps:
        sel = by_comp[k]
        part = pack_rounds(table.select(sel), keys, world, budget, max_ops)
        peak += part.peak  # ranks of other components stage nothing here
        total_ops += part.num_p2p_ops
        for t, rnd in enumerate(part.rounds):
            if t == len(round_moves):
                round_moves.append([])
                round_stashes.append([])
            round_moves[t].extend(sel[i] for i in rnd.moves)
            round_stashes[t].extend(part.stashes[j] for j in rnd.stashes)
    out_rounds: list[Round] = []
    out_stashes: list[Stash] = []
    for mv, st in zip(round_moves, round_stashes):
        out_rounds.append(Round(tuple(sorted(mv)), tuple(range(len(out_stashes), len(out_stashes) + len(st)))))
        out_stashes.extend(st)
    return Packed(out_rounds, out_stashes, peak, total_ops)


def pack_rounds(table: MoveTable, keys: Keys, world: int, budget: int, max_ops: int) -> Packed:
    """Pack the moves of ``table`` into rounds (list scheduling in move order).

    A move becomes *ready* once every move reading the old content of a slot it overwrites
    is scheduled (in an earlier round or earlier in the same round: reads happen before the
    round's writes). If nothing is ready and nothing was scheduled in the round, the first
    blocked move's slots are stashed, which breaks the cycle it sits on.
    """
    return _Packer(table, keys, world, budget, max_ops).run()


class _Packer:
    """The state of :func:`pack_rounds` between rounds.

    Moves that did not fit a round wait in classes of equal demand (staging per rank, bytes,
    ops per rank and phase, parts), one heap each, and only the head of a class is among the
    ready moves. A round's usage only grows, so once a move does not fit, the rest of its
    class do not either: the round drops the class at its first misfit (popping every waiting
    move in every round made many rounds quadratic). A move is classed only when deferred a
    second time (most moves of a small plan fit the next round, and classing costs more than
    one more look).
    """

    def __init__(self, table: MoveTable, keys: Keys, world: int, budget: int, max_ops: int):
        self.t, self.keys, self.world, self.budget, self.max_ops = table, keys, world, budget, max_ops
        n = self.n = len(table.moves)
        key_readers: dict[int, list[int]] = {}  # key -> moves reading it (once per read)
        for i, ks in enumerate(table.read_keys):
            for key in ks:
                lst = key_readers.get(key)
                if lst is None:
                    key_readers[key] = [i]
                else:
                    lst.append(i)
        self.key_readers = key_readers
        self.readers_of = {k: len(v) for k, v in key_readers.items()}  # reads not yet scheduled
        self.writer_of = writer_of = {k: i for i, ks in enumerate(table.write_keys) for k in ks}
        blocked = self.blocked = [0] * n  # per move: slots it overwrites whose old content is still to be read
        for key in key_readers:
            w = writer_of.get(key)
            if w is not None:
                blocked[w] += 1
        self.ready = [i for i, b in enumerate(blocked) if b == 0]  # ascending: a heap
        self.scheduled = bytearray(n)
        self.class_ids: dict[tuple, int] = {}
        self.class_of = [-1] * n  # per move: its class once classed, else -1
        self.waiting: list[list[int]] = []  # per class: its deferred moves, a heap
        self.deferred_in: list[int] = []  # per class: the last round a move of it did not fit
        self.deferred: list[int] = []  # the classes deferred this round: all that have waiting moves
        self.retried = bytearray(n)  # per move: deferred once (and back among the ready moves)
        self.rounds: list[Round] = []
        self.stashes: list[Stash] = []
        self.stash_live = [0] * world  # rank -> bytes of stashes still needed
        self.stash_left: dict[int, int] = {}  # stashed key -> readers not yet scheduled
        # Readers of stashes, a heap pruned lazily: a move once scheduled or unblocked never
        # waits again (blocked counts only decrease), and a stash lives until its readers ran.
        self.stash_readers: list[int] = []
        self.peak = [0] * world
        self.total_ops = 0
        self.done = 0
        self.first_waiting = 0

    def run(self) -> Packed:
        while self.done < self.n:
            self.pack_round()
        return Packed(self.rounds, self.stashes, np.asarray(self.peak, dtype=np.int64), self.total_ops)

    def pack_round(self) -> None:
        """Pack the next round: ready moves while they fit, then (nothing else ready) a stash
        that breaks a cycle, and again, until the round is full or every move is packed."""
        world = self.world
        cur: list[int] = []
        new_stashes: list[int] = []
        staged = [0] * world
        # The heads of the waiting classes join the ready moves; a class's next head follows
        # once its head is scheduled, so the round ends with every class not deferred in it
        # empty (and no ready moves). A head that a smaller deferred move of its class displaced
        # this round stays among the ready moves: that class was deferred, so it does not fit.
        for c in self.deferred:
            heapq.heappush(self.ready, self.waiting[c][0])
        self.deferred = []
        retry: list[int] = []  # moves deferred for the first time this round
        released: list[int] = []
        posted_a, posted_b = [0] * world, [0] * world
        while True:
            self.fill(cur, staged, posted_a, posted_b, retry, released)
            if self.deferred or retry or self.done == self.n:
                break
            if not self.break_cycle(cur, staged, new_stashes):
                break  # no room for the stash in this round: next round
        # Peak: this round's staging on top of the stashes alive in it (stashes alone at least).
        peak, stash_live = self.peak, self.stash_live
        for r in range(world):
            v = staged[r] + stash_live[r]
            if v > peak[r]:
                peak[r] = v
        self.rounds.append(Round(tuple(sorted(cur)), tuple(new_stashes)))
        for key in released:
            stash_live[self.keys.rank(key)] -= self.t.moves[self.writer_of[key]].nbytes
            del self.stash_left[key]
        for i in retry:
            heapq.heappush(self.ready, i)

    def fill(
        self,
        cur: list[int],
        staged: list[int],
        posted_a: list[int],
        posted_b: list[int],
        retry: list[int],
        released: list[int],
    ) -> None:
        """Schedule ready moves into the round (``cur``, with its per-rank ``staged`` bytes and
        ops posted per phase) while they fit; defer the others. The hot loop: locals only."""
        t = self.t
        moves, group_of, group_stage, group_ops, num_parts = t.moves, t.group, t.group_stage, t.group_ops, t.num_parts
        read_keys = t.read_keys
        ready, class_of, waiting, deferred_in, deferred = (
            self.ready,
            self.class_of,
            self.waiting,
            self.deferred_in,
            self.deferred,
        )
        retried, class_ids, scheduled, stash_live = self.retried, self.class_ids, self.scheduled, self.stash_live
        stash_left, readers_of, writer_of, blocked = self.stash_left, self.readers_of, self.writer_of, self.blocked
        budget, max_ops, rnd = self.budget, self.max_ops, len(self.rounds)
        heappop, heappush = heapq.heappop, heapq.heappush
        done, total_ops = self.done, self.total_ops
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
                        c = class_ids.setdefault(
                            (tuple(add.items()), size, tuple(a.items()), tuple(b.items()), np_), len(class_ids)
                        )
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
        self.done, self.total_ops = done, total_ops

    def break_cycle(self, cur: list[int], staged: list[int], new_stashes: list[int]) -> bool:
        """Deadlock: every remaining move waits for a reader that is itself blocked. Walk along
        "waits for" until a move repeats: that move sits on a cycle, and stashing the slots it
        overwrites breaks the cycle (it becomes ready). Start from a move that reads a live
        stash (finishing it frees memory), else from the first blocked move. False: no room
        for the stash in this round (``cur`` not empty)."""
        stash_readers, scheduled, blocked = self.stash_readers, self.scheduled, self.blocked
        readers_of, key_readers, write_keys = self.readers_of, self.key_readers, self.t.write_keys
        while stash_readers and (scheduled[stash_readers[0]] or blocked[stash_readers[0]] == 0):
            heapq.heappop(stash_readers)
        while blocked[self.first_waiting] == 0:  # blocked counts only decrease
            self.first_waiting += 1
        first = stash_readers[0] if stash_readers else self.first_waiting
        seen: set[int] = set()
        while first not in seen:
            seen.add(first)
            for key in write_keys[first]:  # a slot it overwrites that is still to be read
                if readers_of.get(key, 0) > 0:
                    break
            for first in key_readers[key]:  # by a move not yet scheduled
                if not scheduled[first]:
                    break
        m = self.t.moves[first]
        # The slots to stash, with their (rank, slot) as the move's writes give them.
        written = [(r, s) for r, slots in m.writes for s in slots]  # in write_keys[first] order
        over = [(k, r, s) for k, (r, s) in zip(write_keys[first], written) if readers_of.get(k, 0) > 0]
        extra: dict[int, int] = {}
        for _, r, _ in over:
            extra[r] = extra.get(r, 0) + m.nbytes
        stash_live = self.stash_live
        if cur and any(staged[r] + stash_live[r] + v > self.budget for r, v in extra.items()):
            return False
        for key, r, s in over:
            self.stashes.append(Stash(len(self.rounds), r, m.layer, s, m.part, m.nbytes))
            new_stashes.append(len(self.stashes) - 1)
            self.stash_left[key] = readers_of[key]
            stash_live[r] += m.nbytes
            readers_of[key] = 0
            for j in key_readers[key]:
                if not scheduled[j]:
                    heapq.heappush(stash_readers, j)
        blocked[first] = 0
        heapq.heappush(self.ready, first)
        return True
