"""The execution plan: what a net runs on the host, decided once per net
shape and settings, then walked step after step by Net.forward and
Net.backward (issue 35).

A step is one layer's forward (or backward) with everything the runtime
used to ask again at every call already answered: its batch partitions and
their runner, its BLAS thread count, whether its reshape may be skipped,
whether it has a loss to read, and the layer's own per-shape choices (a
convolution's lowering, chunk and kept matrix: Layer.bind_forward). A step
costs a call.

Inference fusion (cct.runtime.fusion) becomes steps too: a fused run is
one step at its first layer, replaying the run's kept pass (its other
layers' steps do nothing), and a convolution that absorbs the ReLU after it
is bound with that ReLU in its output store (the ReLU's step does nothing).
A forward that starts or stops inside such a group runs layer by layer.

Batch partitions become partition runs: consecutive layers split into the
same partitions of one batch run as one step, each partition's twins one
after the other on that partition's thread (cct.runtime.partition), bound
on views made once, and its backward likewise, the twins' private
parameter diffs summed after it. The partitions of a run meet once, at its
end, instead of at every layer: while one partition's Python holds the
GIL, the other's GEMMs and kernels run.

A plan is made after a whole forward that ran layer by layer at a layout the
previous whole forward ran at too (shapes that change at every forward get
none), so every reshape has run and every choice is made for the shapes the
plan binds. It is used while Layout.epoch and the net's own NetLayout epoch
(cct.core.blob: another net's reshape changes only that net's) are the ones
it was made at, the net's settings are those it read, and nothing was subscribed
since. A reshape in the middle of a forward (a Python layer's, a data
layer's new batch) changes the epoch: the plan then hands the rest of that
forward back to the executor, which runs it layer by layer, as Caffe's
does, and makes a new plan after the next one. Layers whose
reshape reads more than their blobs' layout (reshape_reads_layout False:
Python and data layers) reshape in their step, as Caffe's do at every
forward.
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from cct.core.blob import Layout
from cct.core.errors import MemoryLimitError
from cct.runtime.fusion import ParamWatch
from cct.runtime.threads import run_all

Step = Callable[[], Any]
Group = Tuple[int, int]               # (first, last) layer of a fused run or a convolution + output ReLU
Run = Tuple[int, Step]                # a partition run's other end (its last layer forward, first backward) and step


def _nothing() -> None:
    """The step of a layer its group's first step runs (a fused run, an output ReLU)."""


@dataclass
class Layers:
    """What the executor decided for each of a net's layers at its current
    shapes, handed to a Plan: partitions[i], blas[i] (the BLAS threads step i
    runs with) and, where partitions[i] > 1, runners[i] (PartitionedLayer)
    and workers[i] (the worker threads it runs on)."""
    partitions: List[int]
    blas: List[int]
    runners: Dict[int, Any]
    workers: Dict[int, list]


class Plan:
    """The steps of one net at one layout and settings version, made from
    what the executor decided (Layers) and walked by it; a plan never calls
    the executor back: where a step needs the executor's per-layer path,
    forward returns, and the executor goes on from that layer.

    forward_steps[i]: a callable running layer i's forward (its reshape where
    it must), None where the executor's per-layer path runs it (a fused
    run's first step returns False where it has no kept pass to replay);
    backward_steps[i]: a callable running layer i's backward, None where the
    net skips it; blas[i]: the BLAS threads step i runs with; losses: the
    layers whose forward leaves a loss to read; groups: (first, last) of each
    fused run and convolution + output ReLU; starts_inside and ends_inside:
    the layers a forward may not start at (a group's second and later) or
    end at (a group's all but last); group_end: each group's last layer by
    its first; run_starts: the fused runs' first layers; params: the fused
    passes' ParamWatch; forward_runs and backward_runs: the partition runs
    by the layer a pass enters them at (forward: first; backward: last),
    with the layer it leaves them at, taken where a pass covers the run.
    """

    def __init__(self, net: Any, decided: Layers, blas: Any, settings_version: int, shape_key: tuple,
                 fusion: Any = None) -> None:
        self.epoch = Layout.epoch
        self.layout = net.layout                     # the net's own part (cct.core.blob.NetLayout)
        self.net_epoch = net.layout.epoch
        self.settings_version = settings_version
        self.shape_key = shape_key
        self.layers, self.tops = net.layers, net.top_vecs
        self._blas_threads = blas                    # the process's BlasThreads (cct.devices.blas)
        self.blas = decided.blas
        self.partitioned = any(count > 1 for count in decided.partitions)     # some layer runs in batch partitions
        self.forward_steps: List[Optional[Step]] = []
        self.backward_steps: List[Optional[Step]] = []
        for index, layer in enumerate(net.layers):
            bottoms, tops = net.bottom_vecs[index], net.top_vecs[index]
            self.forward_steps.append(_forward_step(layer, bottoms, tops, index, decided))
            self.backward_steps.append(_backward_step(layer, bottoms, tops, net.bottom_need_backward[index],
                                                      index, decided)
                                       if net.layer_need_backward[index] else None)
        self.losses = frozenset(index for index, layer in enumerate(net.layers) if any(layer.loss_weights))
        self.groups = _fuse(net, fusion, self.forward_steps, decided.partitions)
        self.forward_runs, self.backward_runs = _partition_runs(net, decided, self.groups, self.backward_steps)
        self.params = ParamWatch(fusion) if fusion is not None else None
        self.starts_inside: FrozenSet[int] = frozenset(
            i for first, last in self.groups for i in range(first + 1, last + 1))
        self.ends_inside = frozenset(i for first, last in self.groups for i in range(first, last))
        self.group_end = {first: last for first, last in self.groups}
        self.run_starts = frozenset(run[0] for run in fusion.runs) if fusion is not None else frozenset()

    def current(self, settings_version: int) -> bool:
        """Whether this plan still describes its net: the layout it was bound
        to, and the settings version it read."""
        return (Layout.epoch == self.epoch and self.layout.epoch == self.net_epoch
                and settings_version == self.settings_version)

    def params_changed(self) -> bool:
        """Whether a parameter a fused run's kept pass folded in has changed
        (pycaffe writes them through numpy views): the next plan folds them again."""
        return self.params is not None and self.params.changed()

    def covers(self, start: int, end: int) -> bool:
        """Whether a forward of layers start..end may run the steps: it cuts no group."""
        return start not in self.starts_inside and end not in self.ends_inside

    def forward(self, start: int, end: int) -> Tuple[float, int]:
        """Layers start.. forward, up to `end` or the first layer the plan
        leaves to the executor: (their summed loss, the index of that layer,
        end + 1 when none). A layout changed on the way (a reshape) leaves the
        rest to the executor too (current() says so)."""
        steps, blas, epoch, losses = self.forward_steps, self.blas, self.epoch, self.losses
        layout, net_epoch = self.layout, self.net_epoch
        layers, tops, set_blas, runs = self.layers, self.tops, self._blas_threads.set, self.forward_runs
        count = None
        loss = 0.0
        index = start
        try:
            while index <= end:
                step = steps[index]
                if step is None or Layout.epoch != epoch or layout.epoch != net_epoch:
                    return loss, index
                if blas[index] != count:
                    count = blas[index]
                    set_blas(count)
                run = runs.get(index)
                if run is not None and run[0] <= end:
                    run[1]()
                    for ran in range(index, run[0] + 1):
                        if ran in losses:
                            loss += layers[ran].weighted_loss(tops[ran])
                    index = run[0] + 1
                    continue
                if step() is False:           # a fused run without a kept pass
                    return loss, index
                if index in losses:
                    loss += layers[index].weighted_loss(tops[index])
                index += 1
        except MemoryLimitError as error:
            raise self._named(error, index) from None
        return loss, index

    def backward(self, start: int, end: int) -> None:
        """Layers start..end backward (start > end), those the net runs."""
        steps, blas, set_blas, runs = self.backward_steps, self.blas, self._blas_threads.set, self.backward_runs
        count = None
        index = start
        try:
            while index >= end:
                step = steps[index]
                if step is not None:
                    if blas[index] != count:
                        count = blas[index]
                        set_blas(count)
                    run = runs.get(index)
                    if run is not None and run[0] >= end:
                        run[1]()
                        index = run[0]
                    else:
                        step()
                index -= 1
        except MemoryLimitError as error:
            raise self._named(error, index) from None

    def _named(self, error: MemoryLimitError, index: int) -> MemoryLimitError:
        """The error under the layer's name (Layer.naming_allocations's, for a whole pass)."""
        return error if error.named else self.layers[index].named_allocation_error(error, self.tops[index])


def _forward_step(layer: Any, bottoms: list, tops: list, index: int, decided: Layers) -> Optional[Step]:
    """Layer `index`'s forward as one call, or None for the executor's path."""
    if decided.partitions[index] > 1:
        if not layer.reshape_reads_layout:
            return None               # the executor's per-layer path reshapes it first
        runner, workers = decided.runners[index], decided.workers[index]
        return lambda: runner.forward(workers, bottoms, tops)
    if layer.reshape_reads_layout:
        return layer.bind_forward(bottoms, tops)

    def reshaped() -> None:
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
    return reshaped


def _backward_step(layer: Any, bottoms: list, tops: list, propagate_down: list, index: int,
                   decided: Layers) -> Step:
    if decided.partitions[index] > 1:
        runner, workers = decided.runners[index], decided.workers[index]
        return lambda: runner.backward(workers, tops, propagate_down, bottoms)
    return layer.bind_backward(tops, propagate_down, bottoms)


def _fuse(net: Any, fusion: Any, steps: List[Optional[Step]], partitions: List[int]) -> List[Group]:
    """Rewrite the forward steps for inference fusion; returns the groups,
    (first, last) layer of each fused run and convolution + output ReLU."""
    if fusion is None:
        return []
    groups: List[Group] = []
    for number, run in enumerate(fusion.runs):
        steps[run[0]] = _fused_run(fusion, number)
        for index in run[1:]:
            steps[index] = _nothing
        groups.append((run[0], run[-1]))
    for index, (relu_index, slope) in fusion.output_relus.items():
        bound = None
        if steps[index] is not None and partitions[index] == 1:
            bound = net.layers[index].bind_forward(net.bottom_vecs[index], net.top_vecs[index], output_relu=slope)
        if bound is None:             # both on the executor's path, which folds the ReLU as it does
            steps[index] = steps[relu_index] = None
        else:
            steps[index], steps[relu_index] = bound, _nothing
        groups.append((index, relu_index))
    return groups


def _fused_run(fusion: Any, number: int) -> Step:
    """Run `number`'s step: its kept pass (Fusion.replay); False where it
    has none (the executor then runs its layers, which compose and keep it)."""
    threads = fusion.threads
    return lambda: fusion.replay(number, threads)


def _partition_runs(net: Any, decided: Layers, groups: List[Group],
                    backward_steps: List[Optional[Step]]) -> Tuple[Dict[int, Run], Dict[int, Run]]:
    """The partition runs: maximal runs of consecutive layers split into the
    same partitions of one batch, outside fused groups, no parameter in two
    of their layers; each as a forward step (by its first layer) and a
    backward step (by its last layer that runs a backward)."""
    grouped = {i for first, last in groups for i in range(first, last + 1)}

    def key(index: int) -> Optional[tuple]:
        layer, tops = net.layers[index], net.top_vecs[index]
        if decided.partitions[index] < 2 or index in grouped or not layer.reshape_reads_layout or not tops:
            return None
        return decided.partitions[index], tops[0].shape[0]

    def params(index: int) -> set:
        # a parameter shared by name has its owner's storage
        return {blob.data.__array_interface__["data"][0] for blob in net.layers[index].blobs}

    forward_runs: Dict[int, Run] = {}
    backward_runs: Dict[int, Run] = {}
    index = 0
    while index < len(net.layers):
        run_key = key(index)
        last, held = index, params(index)
        # two layers sharing a parameter stay in separate runs: the run sums the
        # twins' diffs at its end, which would add theirs in another order
        while (run_key is not None and last + 1 < len(net.layers) and key(last + 1) == run_key
               and not held & params(last + 1)):
            last += 1
            held |= params(last)
        if run_key is not None:
            members = list(range(index, last + 1))
            backs = [i for i in members if backward_steps[i] is not None]
            forward, backward = _run_steps(net, decided, members, backs)
            forward_runs[index] = (last, forward)
            if backs:
                backward_runs[backs[-1]] = (backs[0], backward)
        index = last + 1
    return forward_runs, backward_runs


def _run_steps(net: Any, decided: Layers, members: List[int], backs: List[int]) -> Tuple[Step, Step]:
    """A partition run's forward and backward steps: each partition's bound
    twins in turn on its thread, the partitions at once."""
    runners = [decided.runners[i] for i in members]
    bound = {i: runner.bind(net.bottom_vecs[i], net.top_vecs[i], net.bottom_need_backward[i], i in backs)
             for i, runner in zip(members, runners)}
    parts = len(bound[members[0]])
    forwards = [([bound[i][part][0] for i in members],) for part in range(parts)]
    backwards = [([bound[i][part][1] for i in reversed(backs)],) for part in range(parts)]
    summed = [decided.runners[i] for i in backs]
    workers = decided.workers[members[0]]

    def forward() -> None:
        for runner in runners:
            runner.follow()
        run_all(workers, _in_turn, forwards)

    def backward() -> None:
        for runner in summed:
            runner.follow()
        run_all(workers, _in_turn, backwards)
        for runner in summed:
            runner.sum_private_diffs()
    return forward, backward


def _in_turn(steps: List[Step]) -> None:
    for step in steps:
        step()
