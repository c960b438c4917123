"""Diff sharing: blobs whose gradients are never live at the same time
keep their diffs in one buffer (an arena), as Caffe con Troll and MXNet do.

A blob's diff is live only during backward. Layers run backward from the last
to the first, so the diff of a blob made by layer p (the first of an in-place
chain) and read as a bottom by layers up to c is set by its consumers' backward
(bottom diffs are SET) and last read by layer p's: it is live over the layer
index interval [p, c]. Two blobs whose intervals do not overlap, endpoints
included, can hold their diffs in one arena: the later one's is set before it
is read, after the earlier one's last reader ran. A top and a bottom of one
layer always overlap (both intervals hold that layer's index), so a layer never
reads and writes one arena.

Never shared (`ShareSummary.excluded` gives the reason per blob):

- the net's inputs and outputs, and blobs with a loss weight (the net sets
  their diff in forward, and pycaffe users read or set them);
- blobs whose diff memory another blob aliases (Flatten and Reshape tops share
  their bottom's diff and re-link it on every reshape): the whole aliased group;
- blobs that some consumer does not set a gradient for (a layer without
  backward, or propagate_down false): a producer may still read that diff
  (Split sums all its tops' diffs) and must find Caffe's zeros, not another
  blob's gradient.

After sharing, only the parameters' diffs keep their meaning after backward:
an activation blob's diff may hold another blob's gradient, which is why the
solver applies it to its train net only, and by default only under `cct
train`, which shows no activation diff; a solver made from Python (pycaffe
scripts read any blob's diff) opts in. CCT_SHARE_DIFFS (1 or 0) or the run
configuration's "share_diffs" decide over both defaults
(cct.runtime.settings.share_diffs_enabled).

Reshaping the net to a larger batch afterwards stays correct but gives the
grown blobs diff storage of their own (Blob.reshape grows a copy); call
share_diffs(net) again to share them anew.
"""
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Set, Tuple

import numpy as np

if TYPE_CHECKING:                 # for annotations only: no import of the net at run time
    from cct.core.net import Net

Interval = Tuple[int, int]        # a diff's (first, last) layer index

_summaries: "weakref.WeakKeyDictionary[Net, ShareSummary]" = weakref.WeakKeyDictionary()   # for a later call
_lock = threading.Lock()


@dataclass
class ShareSummary:
    """What share_diffs did: arenas[k] lists the blob names sharing arena k."""
    arenas: List[List[str]] = field(default_factory=list)
    arena_bytes: int = 0                      # the arenas' memory
    unshared_bytes: int = 0                   # the same blobs' diffs, one store each
    excluded: Dict[str, str] = field(default_factory=dict)         # blob name -> why it keeps its own diff
    intervals: Dict[str, Interval] = field(default_factory=dict)   # shared blob name -> (first, last) layer index

    @property
    def saved_bytes(self) -> int:
        return self.unshared_bytes - self.arena_bytes

    def as_dict(self) -> Dict[str, Any]:
        return {"arenas": self.arenas, "arena_bytes": self.arena_bytes,
                "unshared_bytes": self.unshared_bytes, "saved_bytes": self.saved_bytes,
                "excluded": self.excluded}

    def __str__(self) -> str:
        return (f"{sum(len(a) for a in self.arenas)} blob diffs in {len(self.arenas)} arenas: "
                f"{self.arena_bytes / 2**20:.1f} MiB instead of {self.unshared_bytes / 2**20:.1f} MiB "
                f"({self.saved_bytes / 2**20:.1f} MiB saved)")


def summary(net: "Net") -> Optional[ShareSummary]:
    """The ShareSummary of the last share_diffs(net), or None."""
    return _summaries.get(net)


def diff_intervals(net: "Net") -> Tuple[Dict[str, Interval], Dict[str, str]]:
    """({blob name: (first, last) layer index} for the blobs that may share,
    {blob name: reason} for the others). Call after the net is reshaped."""
    names = {id(blob): name for name, blob in net.blobs.items()}
    first: Dict[int, int] = {}
    last: Dict[int, int] = {}
    unset: Dict[int, str] = {}
    for index, (bottoms, tops) in enumerate(zip(net.bottom_vecs, net.top_vecs)):
        for blob in tops:
            first.setdefault(id(blob), index)
        for j, blob in enumerate(bottoms):
            last[id(blob)] = index
            in_place = any(top is blob for top in tops)
            sets_diff = net.layer_need_backward[index] and net.bottom_need_backward[index][j]
            if not in_place and not sets_diff:
                unset[id(blob)] = net.layers[index].name
    loss = {id(blob) for layer, tops in zip(net.layers, net.top_vecs)
            for blob, weight in zip(tops, layer.loss_weights) if weight}
    aliased = _aliased(net)
    inputs, outputs = set(net.inputs), set(net.outputs)
    intervals: Dict[str, Interval] = {}
    excluded: Dict[str, str] = {}
    for name, blob in net.blobs.items():
        key = id(blob)
        if names.get(key) != name:
            continue                          # a name given twice (automatic tops): one entry
        if name in inputs:
            excluded[name] = "net input"
        elif key in loss or net.blob_loss_weights.get(name, 0):
            excluded[name] = "loss weight (diff set in forward)"
        elif name in outputs:
            excluded[name] = "net output"
        elif key in aliased:
            excluded[name] = f"diff memory aliased with {', '.join(sorted(aliased[key]))}"
        elif key not in last:
            excluded[name] = "no consumer"
        elif key in unset:
            excluded[name] = f"layer '{unset[key]}' sets no gradient for it"
        else:
            intervals[name] = (first[key], last[key])
    return intervals, excluded


def _aliased(net: "Net") -> Dict[int, Set[str]]:
    """{id(blob): names of the other blobs in its group} for blobs whose diff
    storage another blob shares (checked over each layer's top/bottom pairs),
    groups merged transitively. Looks at allocated stores only: a diff that is
    not made yet is aliased with nothing."""
    names = {id(blob): name for name, blob in net.blobs.items()}
    parent: Dict[int, int] = {}

    def root(key: int) -> int:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    for bottoms, tops in zip(net.bottom_vecs, net.top_vecs):
        for top in tops:
            for bottom in bottoms:
                if top is bottom or top._diff_store is None or bottom._diff_store is None:
                    continue
                if np.shares_memory(top._diff_store, bottom._diff_store):
                    parent[root(id(top))] = root(id(bottom))
    groups: Dict[int, List[int]] = {}
    for key in list(parent):
        groups.setdefault(root(key), []).append(key)
    aliased: Dict[int, Set[str]] = {}
    for members in groups.values():
        for key in members:
            aliased[key] = {names.get(other, "?") for other in members if other != key}
    return aliased


def colour(intervals: Mapping[str, Interval], sizes: Mapping[str, int],
           dtypes: Mapping[str, np.dtype]) -> List[List[str]]:
    """Greedy interval colouring: blobs by first layer index, each into the
    first arena of its dtype none of whose members' intervals overlap its own
    (endpoints included). Returns [[blob name, ...], ...]."""
    arenas: List[Tuple[np.dtype, List[Interval], List[str]]] = []   # (dtype, [(first, last)], [names])
    for name in sorted(intervals, key=lambda n: (intervals[n], -sizes[n])):
        start, end = intervals[name]
        for dtype, spans, members in arenas:
            if dtype == dtypes[name] and all(end < a or b < start for a, b in spans):
                spans.append((start, end))
                members.append(name)
                break
        else:
            arenas.append((dtypes[name], [(start, end)], [name]))
    return [members for _, _, members in arenas]


def share_diffs(net: "Net") -> ShareSummary:
    """Give the blobs of `net` whose gradients are never live together shared
    diff arenas (see the module docstring). Safe to call again, after a reshape.
    Returns a ShareSummary."""
    with _lock:
        previous = _summaries.get(net)
        if previous is not None:              # start over from private (lazy) diffs
            for names in previous.arenas:
                for name in names:
                    net.blobs[name].use_diff_storage(None)
        net.reshape()                         # Flatten/Reshape re-link their diffs now
        intervals, excluded = diff_intervals(net)
        blobs = net.blobs
        # capacity, not count: Blob keeps its diff store as large as its data store
        sizes = {name: blobs[name]._data_store.size for name in intervals}
        dtypes = {name: blobs[name].dtype for name in intervals}
        result = ShareSummary(excluded=excluded, intervals=intervals)
        for names in colour(intervals, sizes, dtypes):
            dtype = dtypes[names[0]]
            arena = np.zeros(max(sizes[name] for name in names), dtype)
            for name in names:
                blobs[name].use_diff_storage(arena[:sizes[name]])
            result.arenas.append(names)
            result.arena_bytes += arena.nbytes
            result.unshared_bytes += sum(sizes[name] for name in names) * dtype.itemsize
        _summaries[net] = result
        return result
