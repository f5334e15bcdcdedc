"""Chapter 18: which replica gets a request, so that its prompt's prefix is already cached there.

N replicas of the engine each keep their own prefix cache (Chapter 8). A router that ignores
prompts (power of two choices: the shorter queue of two replicas drawn at random) spreads a
tenant's system prompt over every replica, and each one prefills it again. This router remembers
the prompts it sent to each replica, as a tree of blocks, and sends a request to the replica
holding the longest prefix of its prompt, unless that replica's queue is longer than the
shortest by more than `imbalance`: then the least loaded one takes it (a warm cache is not worth
an idle replica). Ray Serve's PrefixCacheAffinityRouter and SGLang's cache-aware router keep the
same kind of tree.

A node of the tree is a chain hash, as in the prefix cache: the hash of its parent and one
block of token ids, so a key names its whole path from the root. The root is the tenant's salt
and adapter: two tenants with the same prompt share no node, and a router can never send one
tenant's prompt where another's is warm because of it. Pure Python, no Ray: the Ray Serve
router (kit/replica_server.py) calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

DEFAULT_BLOCK = 16          # tokens a node holds: the engine's block size, so a match is whole blocks
DEFAULT_MAX_NODES = 200_000   # every size capped: the oldest nodes go first
DEFAULT_IMBALANCE = 4       # requests a warm replica's queue may exceed the shortest by


def route_root(salt: str | None, adapter: str | None = None) -> int:
    """The root of a prompt's path: its tenant's salt and its adapter (both change the K/V)."""
    return hash(("route", salt, adapter))


# --8<-- [start:tree]
class PrefixTree:
    """The prompts sent to each replica, as chained block hashes with the replicas that hold each."""

    def __init__(self, block_size: int = DEFAULT_BLOCK, max_nodes: int = DEFAULT_MAX_NODES):
        if block_size < 1 or max_nodes < 1:
            raise ValueError("block_size and max_nodes must be at least 1")
        self.block_size, self.max_nodes = block_size, max_nodes
        self.nodes: OrderedDict[int, set[Hashable]] = OrderedDict()   # chain hash -> replicas; LRU order

    def _path(self, ids: Sequence[int], root: int) -> list[int]:
        keys, h, b = [], root, self.block_size
        for start in range(0, len(ids) - len(ids) % b, b):   # whole blocks only, as the cache keeps them
            h = hash((h, tuple(ids[start:start + b])))
            keys.append(h)
        return keys

    def matches(self, ids: Sequence[int], root: int) -> dict[Hashable, int]:
        """Each replica's longest cached-looking prefix of `ids`, in tokens (replicas with none left out)."""
        depth: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        for n, key in enumerate(self._path(ids, root), start=1):
            holders = self.nodes.get(key)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for replica in alive:
                depth[replica] = n * self.block_size
        return depth

    def insert(self, ids: Sequence[int], root: int, replica: Hashable) -> None:
        """Remember that `replica` was sent this prompt: its blocks will be cached there."""
        for key in self._path(ids, root):
            self.nodes.setdefault(key, set()).add(replica)
            self.nodes.move_to_end(key)
        while len(self.nodes) > self.max_nodes:
            self.nodes.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica that died or left: its cache is gone, so are its paths."""
        for key in [k for k, holders in self.nodes.items() if replica in holders]:
            holders = self.nodes[key]
            holders.discard(replica)
            if not holders:
                del self.nodes[key]
# --8<-- [end:tree]


# --8<-- [start:choose]
def choose(matches: dict[Hashable, int], loads: dict[Hashable, int], imbalance: int = DEFAULT_IMBALANCE) -> Hashable:
    """The replica for a request: the longest match among `loads`' replicas unless its queue is
    more than `imbalance` longer than the shortest, else the least loaded. Ties: the least loaded,
    then the order of `loads`."""
    if not loads:
        raise ValueError("no replica to choose from")
    least = min(loads, key=loads.__getitem__)
    best = max(loads, key=lambda r: (matches.get(r, 0), -loads[r]))
    if matches.get(best, 0) == 0 or loads[best] - loads[least] > imbalance:
        return least
    return best
# --8<-- [end:choose]


class PrefixRouter:
    """The tree and the rule together: `route` picks a replica and remembers the prompt there."""

    def __init__(self, block_size: int = DEFAULT_BLOCK, imbalance: int = DEFAULT_IMBALANCE,
                 max_nodes: int = DEFAULT_MAX_NODES):
        if imbalance < 0:
            raise ValueError("imbalance must be at least 0")
        self.tree, self.imbalance = PrefixTree(block_size, max_nodes), imbalance
        self.routed = self.warm = 0   # requests routed, and those sent where a prefix was held

    def route(self, ids: Sequence[int], loads: dict[Hashable, int], salt: str | None = None,
              adapter: str | None = None) -> Hashable:
        root = route_root(salt, adapter)
        matches = {r: n for r, n in self.tree.matches(ids, root).items() if r in loads}
        replica = choose(matches, loads, self.imbalance)
        self.routed += 1
        self.warm += matches.get(replica, 0) > 0
        self.tree.insert(ids, root, replica)
        return replica
