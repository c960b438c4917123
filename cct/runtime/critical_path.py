"""Critical-path priorities of a net's backward (TurboDL's Algorithm 1).

The layers that run backward form a graph: layer a -> layer b when b reads a
blob a wrote last and b's gradient flows back into it. The graph is cut into
blocks, each from a fork layer (several successors: the Split before an
inception unit or a residual block) to its merge layer (the Concat or
Eltwise every path from the fork meets again: the fork's immediate
post-dominator; for a trunk forking into several loss heads, the end of the
net). Each successor of the fork starts a branch: the layers between it and
the merge; a branch's distance is its longest chain of data-gradient times.

Priorities: a layer outside every block has priority 0; inside a block the
longest branch keeps the fork's priority p and the others get p - 1, p - 2,
... by falling distance; a block nested in a branch splits that branch's
priority the same way. A layer's data-gradient sub-task keeps the layer's
priority; its weight gradient gets p - alpha and every other parameter
gradient p - beta (cct.runtime.scheduler). So on a chain every data gradient
shares one priority and the stream's order is the sequential one.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

Net = Any                         # cct.core.net.Net, whose executor imports this module: not imported back
Successors = Dict[int, List[int]]  # backward_graph's: layer -> the layers its gradient comes from

END = None          # the merge of a fork whose branches end in different losses


@dataclass(frozen=True)
class Branch:
    """The layers (forward order) from one successor of a fork up to, not
    including, the merge; `distance`: the longest chain of their data-gradient
    times. Empty for a shortcut straight from the fork to the merge."""
    layers: Tuple[int, ...]
    distance: float


@dataclass(frozen=True)
class Block:
    fork: int
    merge: Optional[int]    # a layer index, or END
    branches: Tuple[Branch, ...]   # longest first

    def layers(self) -> Set[int]:
        return {layer for branch in self.branches for layer in branch.layers}


def backward_graph(net: Net) -> Successors:
    """successors[a] = the layers b (in order) that a's gradient comes from:
    b reads a blob a wrote last, b needs backward and propagates into it.
    Only layers that run backward are nodes."""
    nodes = [i for i in range(len(net.layers)) if net.layer_need_backward[i]]
    successors: Successors = {i: [] for i in nodes}
    last_writer: Dict[int, int] = {}
    for i in range(len(net.layers)):
        for blob, down in zip(net.bottom_vecs[i], net.bottom_need_backward[i]):
            writer = last_writer.get(id(blob))
            if (down and i in successors and writer is not None and writer in successors
                    and i not in successors[writer]):
                successors[writer].append(i)
        for blob in net.top_vecs[i]:
            last_writer[id(blob)] = i
    return successors


def _post_dominators(successors: Successors) -> Dict[int, Set[int]]:
    """pdom[n]: the layers every path from n to the end of the net passes
    through (n included); the layer order is topological."""
    pdom: Dict[int, Set[int]] = {}
    for node in sorted(successors, reverse=True):
        after = [pdom[s] for s in successors[node]]
        pdom[node] = {node} | (set.intersection(*after) if after else set())
    return pdom


def _reachable(successors: Successors, start: int, stop: Optional[int]) -> Set[int]:
    """The layers reachable from `start` without passing `stop`."""
    seen: Set[int] = set()
    todo = [start]
    while todo:
        node = todo.pop()
        if node in seen or node == stop:
            continue
        seen.add(node)
        todo.extend(successors[node])
    return seen


def _branch(successors: Successors, start: int, merge: Optional[int], times: Mapping[int, float]) -> Branch:
    if start == merge:
        return Branch((), 0.0)
    members = _reachable(successors, start, merge)
    longest: Dict[int, float] = {}
    for node in sorted(members, reverse=True):
        later = [longest[s] for s in successors[node] if s in members]
        longest[node] = times.get(node, 0.0) + max(later, default=0.0)
    return Branch(tuple(sorted(members)), longest[start])


def blocks(net: Net, times: Mapping[int, float]) -> List[Block]:
    """The net's fork-to-merge blocks, outermost first, each with its branches
    longest first. `times[layer]`: the layer's data-gradient seconds (a layer
    without an entry counts 0)."""
    successors = backward_graph(net)
    pdom = _post_dominators(successors)
    found = []
    for fork in sorted(successors):
        if len(successors[fork]) < 2:
            continue
        # the nearest strict post-dominator: the one all the others post-dominate
        strict = pdom[fork] - {fork}
        merge = min(strict) if strict else END
        branches = [_branch(successors, start, merge, times) for start in successors[fork]]
        branches.sort(key=lambda branch: (-branch.distance, branch.layers[:1]))
        found.append(Block(fork, merge, tuple(branches)))
    found.sort(key=lambda block: -len(block.layers()))
    return found


def layer_priorities(net: Net, times: Mapping[int, float]) -> Dict[int, float]:
    """Algorithm 1: each backward layer's priority (module docstring)."""
    priority = {layer: 0.0 for layer in backward_graph(net)}
    for block in blocks(net, times):
        placed: Set[int] = set()
        for rank, branch in enumerate(block.branches):
            for layer in branch.layers:
                if layer not in placed:             # a layer on two branches keeps the higher
                    priority[layer] = priority[block.fork] - rank
                    placed.add(layer)
    return priority
