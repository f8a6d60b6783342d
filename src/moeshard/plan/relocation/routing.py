"""Routing of a relocation: how each needed (layer, column, expert) reaches its needers (module
docstring of :mod:`moeshard.plan.relocation`: a local copy, a same-node send from the
least-loaded holder, one cross-node send per node relayed on, or a checkpoint read), as
:class:`~.records.Move` rows of a :class:`~.records.MoveTable`, with the plan's traffic
counters. Pure; Python ints and lists in the per-move loop (numpy scalars cost more than they
save there).
"""

from __future__ import annotations

from .layouts import Layout
from .needs import LayerNeeds
from .records import CLASSES, CROSS_NODE, DISK, LOCAL, SAME_NODE, GroupOps, Keys, Move, MoveTable

__all__ = ["Router", "Fanout"]


class Fanout:
    """The transfers of one (layer, column, expert) to its needers that hold no copy: sends
    from its sources (``held_by``: ``{rank: old slot}``, slot -1 for the rank that reads it)
    and relays, with the buffers staged and ops posted per rank, and the loads they add to
    the router's per-rank ``sent`` / ``recv`` counters (``total`` bytes each)."""

    __slots__ = ("router", "total", "base", "held_by", "reads", "stage", "sends", "relays", "ops_a", "ops_b")

    def __init__(
        self, router: Router, total: int, base: int, held_by: dict[int, int], reads: list[int], stage: dict[int, int]
    ):
        self.router, self.total, self.base, self.held_by = router, total, base, held_by
        self.reads, self.stage = reads, stage  # keys of old slot contents read; rank -> buffers
        self.sends: list[tuple[int, int, int]] = []
        self.relays: list[tuple[int, int]] = []
        self.ops_a: dict[int, int] = {}
        self.ops_b: dict[int, int] = {}

    def send(self, h: int, r: int) -> None:
        """Source ``h`` sends its copy (old slot ``held_by[h]``; -1: its read) to ``r``, a
        needer that holds no source (needers are distinct)."""
        s = self.held_by[h]
        self.sends.append((h, s, r))
        if s >= 0:
            self.reads.append(self.base + h * self.router.num_physical + s)
        self.router.sent[h] += self.total
        self.router.recv[r] += self.total
        self.stage[r] = 1
        ops = self.ops_a
        ops[h] = ops.get(h, 0) + 1
        ops[r] = ops.get(r, 0) + 1

    def relay(self, src: int, r: int) -> None:
        """``src`` forwards the buffer it received in phase A to ``r`` (phase B)."""
        self.relays.append((src, r))
        self.router.sent[src] += self.total
        self.router.recv[r] += self.total
        self.stage[r] = 1
        self.ops_b[src] = self.ops_b.get(src, 0) + 1
        self.ops_b[r] = 1

    def fan_out(self, remote: list[int], srcs: list[int], read: int, node: list[int]) -> set[int]:
        """Send to every needer of ``remote`` (ascending): on a node with a source from the
        least-sending one there, else one needer per node receives across from the least-sending
        source and relays it on. Returns the nodes of the sources."""
        router = self.router
        src_nodes = {node[h] for h in srcs}
        # Sources and needers ascending: min() by load alone picks the lowest rank among the least loaded.
        for nd in sorted({node[r] for r in remote}) if len(remote) > 1 else (node[remote[0]],):
            on_node = [r for r in remote if node[r] == nd] if len(remote) > 1 else remote
            if nd in src_nodes:
                here = [h for h in srcs if node[h] == nd] if len(srcs) > 1 else srcs
                for r in on_node:
                    if r == read:
                        continue  # the reader needs it itself: no transfer
                    self.send(min(here, key=router.sent.__getitem__) if len(here) > 1 else here[0], r)
                continue
            relay = min(on_node, key=router.recv.__getitem__) if len(on_node) > 1 else on_node[0]
            self.send(min(srcs, key=router.sent.__getitem__) if len(srcs) > 1 else srcs[0], relay)
            router.cross += self.total
            for r in on_node:
                if r != relay:
                    self.relay(relay, r)
        return src_nodes


class Router:
    """Routes every need of a relocation and counts its traffic.

    ``node``, ``readers``: per rank (lists); ``comp_readers``: ``{component: [its live
    readers, ascending]}``; ``keys``: :class:`~.records.Keys` of the job. Counters: per rank
    ``read_load`` / ``sent`` / ``recv`` bytes; per class (:data:`~.records.CLASSES`)
    ``copies`` / ``bytes`` of slot boxes written; ``net``, ``cross`` and their lower bounds
    ``min_net``, ``min_cross``. ``table``: the moves, in routing order.
    """

    def __init__(
        self,
        world: int,
        node: list[int],
        readers: list[bool],
        comp_readers: dict[int, list[int]],
        keys: Keys,
        num_experts: int,
    ):
        self.node, self.readers, self.comp_readers = node, readers, comp_readers
        self.keys, self.num_physical, self.num_experts = keys, keys.num_physical, num_experts
        self.read_load, self.sent, self.recv = [0] * world, [0] * world, [0] * world
        self.copies = dict.fromkeys(CLASSES, 0)
        self.bytes = dict.fromkeys(CLASSES, 0)
        self.net = self.cross = self.min_net = self.min_cross = 0
        self.table = MoveTable()

    def route_layer(self, layer: int, lay: Layout, needs: LayerNeeds, col_comp: list[int]) -> None:
        """Route the needs of ``layer`` (of layout ``lay``; ``col_comp``: each column's component)."""
        nk, nr, ns_ = needs.key, needs.rank, needs.slot
        hrank = needs.holder_rank
        if lay.rank_objs is not None:
            nr = [lay.rank_objs[r] for r in nr]
            hrank = [lay.rank_objs[r] for r in hrank]
        if not nk:
            return
        base = self.keys.key(int(layer), 0, 0)  # int: numpy layer ids would make every key a numpy int
        # Live holders of the needed (column, expert)s: key -> {rank: its first slot}, ranks ascending.
        holders: dict[int, dict[int, int]] = {}
        for k, r, s in zip(needs.holder_key, hrank, needs.holder_slot):
            hb = holders.get(k)
            if hb is None:
                holders[k] = {r: s}
            elif r not in hb:
                hb[r] = s
        wk = needs.write
        i, n = 0, len(nk)
        while i < n:
            # One (column, expert): its needers (ascending) and their slots (ascending).
            key, i0 = nk[i], i
            ranks, slots = [nr[i]], [[ns_[i]]]
            i += 1
            while i < n and nk[i] == key:
                if nr[i] == ranks[-1]:
                    slots[-1].append(ns_[i])
                else:
                    ranks.append(nr[i])
                    slots.append([ns_[i]])
                i += 1
            c, e = divmod(key, self.num_experts)
            self.route_expert(layer, lay, c, e, base, ranks, slots, holders.get(key), wk[i0:i], col_comp[c])

    def route_expert(
        self,
        layer: int,
        lay: Layout,
        c: int,
        e: int,
        base: int,
        ranks: list[int],
        slots: list[list[int]],
        held_by: dict[int, int] | None,
        writes0: list[int],
        comp: int,
    ) -> None:
        """Route logical expert ``e`` of column ``c`` to ``ranks`` (ascending; ``slots``: the
        slots each writes, ``writes0`` their keys), from its live holders ``held_by`` (None:
        none, it is read), and add its moves (one per part group)."""
        sizes, total = lay.sizes[c], lay.totals[c]
        num_groups = len(sizes)
        local: list[tuple[int, int]] = []
        reads0: list[int] = []  # keys of the old slot contents read
        stage: dict[int, int] = {}
        if held_by:
            remote, remote_n = [], []  # needers without a local copy, the slots they write
            for r, sl in zip(ranks, slots):
                s = held_by.get(r)
                if s is None:
                    remote.append(r)
                    remote_n.append(len(sl))
                else:
                    local.append((r, s))
                    reads0.append(base + r * self.num_physical + s)
                    stage[r] = 1  # ranks are distinct
                    self.copies[LOCAL] += len(sl) * num_groups
                    self.bytes[LOCAL] += len(sl) * total
            srcs = list(held_by)  # ascending
        else:
            remote, remote_n, srcs = ranks, [len(sl) for sl in slots], []
        read = -1
        if remote and not srcs:
            read = self.pick_reader(remote, comp, total)
            srcs = [read]
            held_by = {read: -1}
            stage[read] = 1
        fan = Fanout(self, total, base, held_by, reads0, stage)
        if remote:
            src_nodes = fan.fan_out(remote, srcs, read, self.node)
            self.count_remote(remote, remote_n, read, src_nodes, total, num_groups, len(fan.sends) + len(fan.relays))
        writes = tuple(zip(ranks, map(tuple, slots)))
        local_t, sends_t, relays_t = tuple(local), tuple(fan.sends), tuple(fan.relays)
        t = self.table
        g = len(t.group_stage)
        t.group_stage.append(stage)
        t.group_ops.append(GroupOps(fan.ops_a, fan.ops_b, len(fan.sends) + len(fan.relays)))
        for k, size in enumerate(sizes):
            t.moves.append(Move(layer, c, k, e, size, read, local_t, sends_t, relays_t, writes))
            t.component.append(comp)
            if k:
                off = k * self.keys.per_part
                t.read_keys.append([x + off for x in reads0])
                t.write_keys.append([x + off for x in writes0])
            else:
                t.read_keys.append(reads0)
                t.write_keys.append(writes0)
            t.group.append(g)
            t.num_parts.append(len(lay.groups[c][k]))

    def pick_reader(self, remote: list[int], comp: int, total: int) -> int:
        """The rank that reads an expert no live rank holds (one checkpoint read per job), near
        its needers ``remote``: a needer that can read, else a reader of the component on a
        needer's node, else any reader of the component (``comp``; :func:`~.layouts.components`
        makes sure there is one); the first least-loaded."""
        cands = [r for r in remote if self.readers[r]]
        if not cands:
            rem_nodes = {self.node[r] for r in remote}
            cands = [r for r in self.comp_readers[comp] if self.node[r] in rem_nodes]
        if not cands:
            cands = self.comp_readers[comp]
        read = int(min(cands, key=self.read_load.__getitem__))  # cands ascending
        self.read_load[read] += total
        return read

    def count_remote(
        self,
        remote: list[int],
        remote_n: list[int],
        read: int,
        src_nodes: set[int],
        total: int,
        num_groups: int,
        links: int,
    ) -> None:
        """Count the transfers to the needers ``remote`` (writing ``remote_n`` slots each)."""
        self.net += total * links
        # Lower bounds: every remote needer receives once, except a needer that reads it itself;
        # every node with needers and without a source receives across once.
        self.min_net += total * (len(remote) - int(read in remote))
        for r, cnt in zip(remote, remote_n):
            k = DISK if read >= 0 else SAME_NODE if self.node[r] in src_nodes else CROSS_NODE
            self.copies[k] += cnt * num_groups
            self.bytes[k] += cnt * total
        self.min_cross += total * len({self.node[r] for r in remote} - src_nodes)
