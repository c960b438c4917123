"""The parts of pycaffe's Net that pycaffe writes in Python, attached to
cct.core.net.Net the way pycaffe attaches them to the C++ class (so nets made
anywhere, by a solver too, have them), plus pycaffe's Timer.

    net.forward_all(data=images)            any number of images, in batches
    net.forward_backward_all(data=..., prob=...)
    net.set_input_arrays(data, labels)      for a MemoryData first layer
    net.before_forward(fn) / after_forward / before_backward / after_backward
                                            fn(layer_index) around every layer
    has_nccl(), NCCL, set_solver_count/rank, set_multiprocess
                                            pycaffe's multi-process API, as a build without NCCL
    init_log(level, stderr), log(message)  pycaffe's logging (Caffe's python/train.py)
Importing this module is enough (cct/__init__.py does).
"""
import logging
import sys
import time
from itertools import zip_longest

import numpy as np

from cct.core.errors import ConfigError, ShapeError
from cct.core.net import Net
from cct.training import distributed


def _batch(self, blobs):
    """Split {blob name: array of N items} into the net's batch size; the last
    partial batch is padded with zeros. Yields {blob name: batch array}."""
    if not blobs:
        return
    num = len(next(iter(blobs.values())))
    for name, values in blobs.items():
        if len(values) != num:
            raise ShapeError(f"_batch: '{name}' has {len(values)} items, "
                             f"'{next(iter(blobs))}' has {num}; all must have the same length")
    batch_size = next(iter(self.blobs.values())).shape[0]
    remainder = num % batch_size
    for start in range(0, num - remainder, batch_size):
        yield {name: values[start:start + batch_size] for name, values in blobs.items()}
    if remainder:
        padded = {}
        for name, values in blobs.items():
            values = np.asarray(values)
            padding = np.zeros((batch_size - remainder,) + values.shape[1:], values.dtype)
            padded[name] = np.concatenate([values[-remainder:], padding])
        yield padded


def _forward_all(self, blobs=None, **kwargs):
    """Forward any number of inputs in batches: kwargs {input name: N x ...};
    returns {blob name: N x ...} for the outputs and `blobs`, padding dropped."""
    all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
    if not kwargs:
        outs = self.forward(blobs=blobs)
        return {out: np.array(value) for out, value in outs.items()}
    for batch in self._batch(kwargs):
        outs = self.forward(blobs=blobs, **batch)
        for out, value in outs.items():
            all_outs[out].append(np.atleast_1d(np.array(value)))    # a 0-d loss: one value per batch
    all_outs = {out: np.concatenate(chunks) for out, chunks in all_outs.items()}
    num = len(next(iter(kwargs.values())))
    return {out: values[:num] for out, values in all_outs.items()}


def _forward_backward_all(self, blobs=None, diffs=None, **kwargs):
    """Forward and backward in batches. kwargs: input arrays (for forward) and
    output diffs (for backward), N items each. Returns (blobs, diffs) dicts of
    N-item arrays: the outputs + `blobs`, the inputs' diffs + `diffs`."""
    all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
    all_diffs = {diff: [] for diff in set(self.inputs + list(diffs or []))}
    unknown = set(kwargs) - set(self.inputs) - set(self.outputs)
    if unknown:
        raise ConfigError(f"forward_backward_all(): {sorted(unknown)} are neither inputs "
                          f"{self.inputs} nor outputs {self.outputs} of the net")
    forward_batches = self._batch({name: kwargs[name] for name in self.inputs if name in kwargs})
    backward_batches = self._batch({name: kwargs[name] for name in self.outputs if name in kwargs})
    for forward_batch, backward_batch in zip_longest(forward_batches, backward_batches, fillvalue={}):
        batch_blobs = self.forward(blobs=blobs, **forward_batch)
        batch_diffs = self.backward(diffs=diffs, **backward_batch)
        for out, value in batch_blobs.items():
            all_outs[out].append(np.atleast_1d(np.array(value)))
        for diff, value in batch_diffs.items():
            all_diffs[diff].append(np.atleast_1d(np.array(value)))
    all_outs = {out: np.concatenate(chunks) for out, chunks in all_outs.items()}
    all_diffs = {diff: np.concatenate(chunks) for diff, chunks in all_diffs.items()}
    if kwargs:
        num = len(next(iter(kwargs.values())))
        all_outs = {out: values[:num] for out, values in all_outs.items()}
        all_diffs = {diff: values[:num] for diff, values in all_diffs.items()}
    return all_outs, all_diffs


def _set_input_arrays(self, data, labels):
    """Hand arrays to the net's first layer, which must be MemoryData: data
    N x C x H x W float32, labels N (or N x 1 x 1 x 1); N a multiple of its batch size."""
    if not self.layers or self.layers[0].type != "MemoryData":
        first = f"'{self.layers[0].name}' ({self.layers[0].type})" if self.layers else "none"
        raise ConfigError(f"set_input_arrays may only be called if the first layer is a MemoryData "
                          f"layer; net '{self.name}' starts with {first}")
    labels = np.asarray(labels)
    if labels.ndim == 1:
        labels = np.ascontiguousarray(labels[:, np.newaxis, np.newaxis, np.newaxis])
    return self.layers[0].set_input_arrays(data, labels)


# --- per-layer callbacks (Caffe's Net::add_before_forward & co.) -----------------------
# They subscribe to the net's executor events (cct.runtime.executor), which fire
# around every layer the executor runs.

def _register(kind):
    def add(self, callback):
        if isinstance(callback, NCCL):
            return                      # pycaffe's net.after_backward(nccl): a no-op without NCCL
        self.executor.subscribe(kind, callback)
    add.__name__ = kind
    add.__doc__ = (f"Call callback(layer_index) {kind.replace('_', ' ')} of every layer "
                   "(every layer in range, whether or not it needs backward).")
    return add


Net._batch = _batch
Net.forward_all = _forward_all
Net.forward_backward_all = _forward_backward_all
Net.set_input_arrays = _set_input_arrays
Net.before_forward = _register("before_forward")
Net.after_forward = _register("after_forward")
Net.before_backward = _register("before_backward")
Net.after_backward = _register("after_backward")


# --- multi-process training: pycaffe built without NCCL ----------------------------------
# Caffe's python/train.py asks has_nccl() and sets the solver count/rank. cct's processes
# train together over MPI instead (cct.training.distributed: a solver made under mpirun
# joins the others by itself), so solver_count and solver_rank are the MPI world's there;
# in one process they behave as in a Caffe build without NCCL: the settings are kept and
# read back, NCCL objects can be made and handed to solvers and nets, and do nothing.
_multiprocess = {"solver_count": 1, "solver_rank": 0, "multiprocess": False}


def has_nccl():
    """False: cct has no NCCL (pycaffe's test_nccl then checks nothing more)."""
    return False


class NCCL:
    """pycaffe's NCCL(solver, uid) in a build without NCCL: constructible, with no
    new_uid() or bcast(); as a solver callback (solver.add_callback(nccl)) it has
    nothing to exchange, and net.after_backward(nccl) ignores it."""

    def __init__(self, solver, uid):
        self.solver = solver
        self.uid = uid

    def on_start(self):
        """One process: no weights to broadcast."""

    def on_gradients_ready(self):
        """One process: no gradients to sum."""


def solver_count():
    world = distributed.world()
    return world.size if world is not None else _multiprocess["solver_count"]


def set_solver_count(count):
    _multiprocess["solver_count"] = int(count)


def solver_rank():
    world = distributed.world()
    return world.rank if world is not None else _multiprocess["solver_rank"]


def set_solver_rank(rank):
    _multiprocess["solver_rank"] = int(rank)


def set_multiprocess(multiprocess):
    _multiprocess["multiprocess"] = bool(multiprocess)


# --- logging: pycaffe's init_log and log ------------------------------------------------------
GLOG_LEVELS = (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)     # glog's 0..3
_log_handler = None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (pytest and
    notebooks swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def init_log(level=0, stderr=True):
    """pycaffe's init_log([level[, stderr]]): cct's log lines (glog's format, as
    `cct train` prints them) from glog level `level` up (0 INFO, 1 WARNING, 2
    ERROR, 3 FATAL) on standard error. glog without stderr writes log files;
    cct writes none, so `stderr` is accepted and standard error is used
    either way. Calling it again changes the level."""
    global _log_handler
    from cct.cli import GlogFormatter
    if not 0 <= int(level) < len(GLOG_LEVELS):
        raise ValueError(f"init_log: level must be 0 (INFO) to 3 (FATAL), got {level}")
    logger = logging.getLogger("cct")
    if _log_handler is None:
        _log_handler = _StderrHandler()
        _log_handler.setFormatter(GlogFormatter())
        logger.addHandler(_log_handler)
    logger.setLevel(GLOG_LEVELS[int(level)])


def log(message):
    """pycaffe's log(message): one INFO line in cct's log."""
    logging.getLogger("cct").info("%s", message)


class Timer:
    """pycaffe's Timer: start(), stop(), and the elapsed time of the last
    start..stop as `ms`, milliseconds() or seconds(). Reading a running timer stops it."""

    def __init__(self):
        self._start = None
        self._elapsed = 0.0
        self._running = False
        self._has_run = False

    def start(self):
        if not self._running:
            self._start = time.perf_counter()
            self._running = True
            self._has_run = True

    def stop(self):
        if self._running:
            self._elapsed = time.perf_counter() - self._start
            self._running = False

    def seconds(self):
        if self._running:
            self.stop()
        return self._elapsed

    def milliseconds(self):
        return self.seconds() * 1000.0

    def microseconds(self):
        return self.seconds() * 1e6

    @property
    def ms(self):
        return self.milliseconds()

    @property
    def running(self):
        return self._running
