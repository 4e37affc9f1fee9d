"""The prefix cache: KV cells of finished sequences kept by blocks of tokens and reused by later
requests with the same start (vLLM's automatic prefix caching, llama-server's cache_prompt).

A *block* is `block` (16) consecutive positions of a sequence, as in vLLM. When a request ends (finished, cancelled or preempted),
its whole blocks of written positions stay in the cache (`keep`), read-only (`KVCells.cache`),
each keyed by its cache namespace, its tokens and its parent block, so that a key names one whole
prefix as one tenant computed it (`Namespace`: a server's API-key tenant and vLLM's `cache_salt`;
a chain kept in one namespace is never found from another, so a tenant cannot time whether another
sent a prompt; within a namespace hits work across requests as before). A new
request looks up the longest chain of blocks that its prompt starts with (`lookup`), leaving at
least its last prompt token to compute (its logits are sampled), begins its sequence with those
cells and prefills only the rest. Blocks in use by a running sequence are pinned (`refs`); the
others are evicted least recently used first, a block only after its children, when the cache
needs cells (`evict_one`).

Placement keeps the bits where it can: a block is kept only where its cells are consecutive, at
the phase of its positions within a page of the cache, after its parent's, so a sequence
beginning with a chain meets attention's chunks at the phase and in the order it had when the
chain was computed; one whose chain ends inside a page continues in place (the cached blocks in
the way, unused, are evicted) or else reuses only its whole pages (`metatp.kv_demand`). Whether a reused prefix gives the
same bits as a recomputed one then depends on how its K/V were computed (README, "Prefix
cache"): a prefix computed in passes of different lengths may differ in the last bits.

Under MPI the followers mirror it through the cells themselves: `KVCells.cache` / `uncache` tell
the cache's listener (`metatp.lockstep.Leader`) ("cache", cells) for kept blocks and ("uncache",
cells) for evicted ones; a sequence taking cached cells is an ordinary "take".
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from metatp.kv_cells import KVCells, SeqCells

__all__ = ["PrefixCache", "Block", "Namespace", "ANONYMOUS"]


class Namespace(NamedTuple):
    """Who may reuse a cached block: the request's tenant (the server's API key; None: the
    anonymous one) and vLLM's `cache_salt` (None: unsalted)."""

    tenant: str | None = None
    salt: str | None = None


ANONYMOUS = Namespace()     # the Python API's requests without a salt, a keyless server's


@dataclass(eq=False)
class Block:
    """One cached block: its key (namespace, parent's uid, its tokens), its cells, who holds it."""

    uid: int
    key: tuple[Namespace, int, tuple[int, ...]]
    cells: np.ndarray
    parent: "Block | None"
    refs: int = 0                  # running sequences that begin with it
    kids: list["Block"] = field(default_factory=list)     # cached blocks that continue it


class PrefixCache:
    """Blocks of finished sequences' cells, found by their tokens (see the module doc)."""

    def __init__(self, cells: KVCells, block: int | None = None) -> None:
        self.cells = cells
        self.block = block or (16 if cells.page == 1 or cells.page % 16 == 0 else cells.page)
        self._uids = itertools.count(1)
        self.blocks: OrderedDict[tuple[Namespace, int, tuple[int, ...]], Block] = OrderedDict()  # least recent first
        self.held: dict[int, list[Block]] = {}       # sequence id -> the blocks it began with
        cells.reclaim = self.evict_one               # a sequence driven without the scheduler evicts too

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def lookup(self, ids: Sequence[int], namespace: Namespace = ANONYMOUS) -> list[Block]:
        """The longest chain of blocks cached in `namespace` that `ids` starts with, leaving its
        last token out."""
        chain: list[Block] = []
        parent = 0
        B = self.block
        for i in range((len(ids) - 1) // B):
            blk = self.blocks.get((namespace, parent, tuple(ids[i * B:(i + 1) * B])))
            if blk is None:
                break
            chain.append(blk)
            parent = blk.uid
        return chain

    def pin(self, chain: list[Block]) -> None:
        """Hold `chain` against eviction while a sequence is being placed or runs on it."""
        for blk in chain:
            blk.refs += 1
            self.blocks.move_to_end(blk.key)

    def unpin(self, chain: list[Block]) -> None:
        for blk in chain:
            blk.refs -= 1

    def attach(self, seq: SeqCells, chain: list[Block]) -> None:
        """`seq` began with `chain` (pinned): it stays pinned until the sequence is released."""
        self.held[seq.id] = chain

    def keep(self, seq: SeqCells, ids: Sequence[int], namespace: Namespace = ANONYMOUS) -> int:
        """Keep the whole blocks of `seq`'s written positions (`ids`: its tokens at those
        positions) in `namespace` before its cells are freed, and unpin what it began with. Returns the new
        blocks kept. A block stops the chain where its cells are not one page in order after
        its parent's (a placement that would not give the same bits)."""
        self.unpin(self.held.pop(seq.id, []))
        B = self.block
        n = min(seq.n_past, len(ids)) // B
        parent: Block | None = None
        new: list[np.ndarray] = []
        for i in range(n):
            key = (namespace, parent.uid if parent else 0, tuple(int(t) for t in ids[i * B:(i + 1) * B]))
            blk = self.blocks.get(key)
            if blk is None:
                cells = seq.cells[i * B:(i + 1) * B]
                if not self._in_order(cells, i * B, parent) or (self.cells.owner[cells] != seq.id).any():
                    break
                blk = Block(next(self._uids), key, cells.copy(), parent)
                self.blocks[key] = blk
                if parent is not None:
                    parent.kids.append(blk)
                new.append(blk.cells)
            else:
                self.blocks.move_to_end(key)
            parent = blk
        if new:
            cells = np.concatenate(new)
            self.cells.cache(cells)
        return len(new)

    def _in_order(self, cells: np.ndarray, pos: int, parent: Block | None) -> bool:
        page = self.cells.page
        if page > 1 and (int(cells[0]) % page != pos % page or (np.diff(cells) != 1).any()):
            return False
        return parent is None or int(cells[0]) > int(parent.cells[-1])

    def evict_one(self) -> bool:
        """Give back the least recently used block that nobody runs on and nothing continues;
        False when there is none."""
        for blk in self.blocks.values():
            if blk.refs == 0 and not blk.kids:
                self._evict(blk)
                return True
        return False

    def evict_range(self, lo: int, hi: int) -> bool:
        """Give back the blocks holding any cell in [lo, hi), each with the blocks that continue
        it (unreachable without it); False, evicting nothing, where one of them is in use."""
        hit = [b for b in self.blocks.values() if ((b.cells >= lo) & (b.cells < hi)).any()]
        if any(b.refs for b in hit):      # a block in use pins its whole chain: no kid of a free one is in use
            return False
        for blk in hit:
            if blk.key in self.blocks:
                self._evict(blk)
        return True

    def _evict(self, blk: Block) -> None:
        for kid in list(blk.kids):
            self._evict(kid)
        del self.blocks[blk.key]
        if blk.parent is not None:
            blk.parent.kids.remove(blk)
        self.cells.uncache(blk.cells)

    def clear(self) -> int:
        """Evict every block nobody runs on; returns how many went."""
        n = 0
        while self.evict_one():
            n += 1
        return n
