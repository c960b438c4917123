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

A plan is made after a whole forward that ran layer by layer at a layout the
previous whole forward ran at too (shapes that change at every forward get
none), so every reshape has run and every choice is made for the shapes the
plan binds; it
is used while Layout.epoch (cct.core.blob) is the one it was made at, the
net's settings are those it read, and nothing was subscribed since. A
reshape in the middle of a forward (a Python layer's, a data layer's new
batch) changes the epoch: the rest of that forward then runs layer by
layer, as Caffe's does, and the next one makes a new plan. Layers whose
reshape reads more than their blobs' layout (reshape_reads_layout False:
Python and data layers) reshape in their step, as Caffe's do at every
forward.
"""
from typing import Any, Callable, FrozenSet, List, Optional, Tuple

from cct.core.blob import Layout
from cct.core.errors import MemoryLimitError
from cct.runtime.fusion import ParamWatch

Step = Callable[[], Any]
Group = Tuple[int, int]               # (first, last) layer of a fused run or a convolution + output ReLU


def _nothing() -> None:
    """The step of a layer its group's first step runs (a fused run, an output ReLU)."""


class Plan:
    """The steps of one executor's net at one layout and settings version.

    forward_steps[i]: a callable running layer i's forward (its reshape where
    it must), None where the executor's per-layer path runs it;
    backward_steps[i]: a callable running layer i's backward, None where the
    net skips it; blas[i]: the BLAS threads step i runs with; losses: the
    layers whose forward leaves a loss to read; groups: (first, last) of each
    fused run and convolution + output ReLU; starts_inside and ends_inside:
    the layers a forward may not start at (a group's second and later) or
    end at (a group's all but last); params: the fused passes' ParamWatch.
    """

    def __init__(self, executor: Any) -> None:
        net = executor.net
        self.epoch = Layout.epoch
        self.settings_version = executor.settings.version
        self.layers, self.tops = net.layers, net.top_vecs
        self.shape_key = executor.shape_key()      # computed: the executor holds no plan while this is made
        self.forward_steps: List[Optional[Step]] = []
        self.backward_steps: List[Optional[Step]] = []
        self.blas: List[int] = []
        for index, layer in enumerate(net.layers):
            bottoms, tops = net.bottom_vecs[index], net.top_vecs[index]
            partitions = executor.partitions(index)
            self.blas.append(executor.blas_count(partitions))
            self.forward_steps.append(_forward_step(executor, index, partitions))
            self.backward_steps.append(_backward_step(executor, index, partitions, layer, bottoms, tops)
                                       if net.layer_need_backward[index] else None)
        self.losses = frozenset(index for index, layer in enumerate(net.layers) if any(layer.loss_weights))
        self.groups = _fuse(executor, self.forward_steps, self.blas)
        self.params = ParamWatch(executor.fusion) if executor.fusion is not None else None
        self.starts_inside: FrozenSet[int] = frozenset(i for first, last in self.groups for i in range(first + 1, last + 1))
        self.ends_inside = frozenset(i for first, last in self.groups for i in range(first, last))
        # after these steps the BLAS count is set again: a loss was read, or a group may have run layer by layer
        self.resets = self.losses | {first for first, _ in self.groups}

    def current(self, executor: Any) -> bool:
        """Whether this plan still describes the executor's net."""
        return Layout.epoch == self.epoch and executor.settings.version == self.settings_version

    def covers(self, start: int, end: int) -> bool:
        """Whether a forward of layers start..end may run the steps: it cuts no
        group, and no parameter a fused run's kept pass folded in has changed
        (pycaffe writes them through numpy views: the next plan folds them again)."""
        return (start not in self.starts_inside and end not in self.ends_inside
                and (self.params is None or not self.params.changed()))

    def forward(self, executor: Any, start: int, end: int) -> float:
        """Layers start..end forward; their summed loss. Where a reshape
        changes the layout on the way, the rest runs layer by layer."""
        steps, blas, epoch, losses, resets = self.forward_steps, self.blas, self.epoch, self.losses, self.resets
        layers, tops = self.layers, self.tops
        per_layer, set_blas = executor.forward, executor.blas.set
        count = None
        loss = 0.0
        index = start
        try:
            while index <= end:
                if Layout.epoch != epoch:
                    for rest in range(index, end + 1):
                        loss += per_layer(rest)
                    return loss
                step = steps[index]
                if step is None:              # the executor's path: it sets the BLAS count and reads the loss
                    loss += per_layer(index)
                    count = None
                else:
                    if blas[index] != count:
                        count = blas[index]
                        set_blas(count)
                    step()
                    if index in resets:
                        if index in losses:
                            loss += layers[index].weighted_loss(tops[index])
                        count = None
                index += 1
        except MemoryLimitError as error:
            raise self._named(error, index) from None
        return loss

    def backward(self, executor: Any, start: int, end: int) -> None:
        """Layers start..end backward (start > end), those the net runs."""
        steps, blas = self.backward_steps, self.blas
        set_blas = executor.blas.set
        count = None
        index = start
        try:
            while index >= end:
                step = steps[index]
                if step is not None:
                    if blas[index] != count:
                        count = blas[index]
                        set_blas(count)
                    step()
                index -= 1
        except MemoryLimitError as error:
            raise self._named(error, index) from None

    def _named(self, error: MemoryLimitError, index: int) -> MemoryLimitError:
        """The error under the layer's name (Layer.naming_allocations's, for a whole pass)."""
        return error if error.named else self.layers[index].named_allocation_error(error, self.tops[index])


def _forward_step(executor: Any, index: int, partitions: int) -> Optional[Step]:
    """Layer `index`'s forward as one call, or None for the executor's path."""
    net = executor.net
    layer, bottoms, tops = net.layers[index], net.bottom_vecs[index], net.top_vecs[index]
    if partitions > 1 and not layer.reshape_reads_layout:
        return None                   # the executor's per-layer path (Executor.forward)
    if partitions > 1:
        runner, workers = executor._runner(index, partitions), executor.workers(partitions)
        return lambda: runner.forward(workers, bottoms, tops)
    if layer.reshape_reads_layout:
        return layer.bind_forward(bottoms, tops)

    def reshaped() -> None:
        layer.reshape(bottoms, tops)
        layer.forward(bottoms, tops)
    return reshaped


def _backward_step(executor: Any, index: int, partitions: int, layer: Any, bottoms: list, tops: list) -> Step:
    propagate_down = executor.net.bottom_need_backward[index]
    if partitions > 1:
        runner, workers = executor._runner(index, partitions), executor.workers(partitions)
        return lambda: runner.backward(workers, tops, propagate_down, bottoms)
    return layer.bind_backward(tops, propagate_down, bottoms)


def _fuse(executor: Any, steps: List[Optional[Step]], blas: List[int]) -> List[Group]:
    """Rewrite the forward steps for inference fusion; returns the groups,
    (first, last) layer of each fused run and convolution + output ReLU."""
    fusion = executor.fusion
    if fusion is None:
        return []
    net, groups = executor.net, []  # type: Any, List[Group]
    for number, run in enumerate(fusion.runs):
        steps[run[0]] = _fused_run(executor, fusion, number, run)
        for index in run[1:]:
            steps[index] = _nothing
        groups.append((run[0], run[-1]))
    for index, (relu_index, slope) in fusion.output_relus.items():
        bound = None
        if steps[index] is not None and blas[index] == executor.threads:
            bound = net.layers[index].bind_forward(net.bottom_vecs[index], net.top_vecs[index], output_relu=slope)
        if bound is None:             # both on the executor's path, which folds the ReLU as it does
            steps[index] = steps[relu_index] = None
        else:
            steps[index], steps[relu_index] = bound, _nothing
        groups.append((index, relu_index))
    return groups


def _fused_run(executor: Any, fusion: Any, number: int, run: List[int]) -> Step:
    """Run `number`'s step: its kept pass (Fusion.replay), else its layers on
    the executor's path, which compose the pass and keep it for the next plan."""
    forward, threads = executor.forward, executor.threads

    def step() -> None:
        if not fusion.replay(number, threads):
            for index in run:
                forward(index)
            executor.drop_plan()      # the pass these kept is not in this plan's ParamWatch
    return step
