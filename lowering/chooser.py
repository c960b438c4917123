"""Choosing a lowering type per convolution (Caffe con Troll, Sec. 3.1).

With input n x n x d, kernel k x k, output m x m x o and batch b, type 1 copies
k^2*d*m^2*b values and runs an o x k^2 d x m^2 b GEMM; type 3 copies only the
(padded) input but its GEMM is o k^2 x d x n^2 b and lifting sums k^2 slices of
o*m^2*b; type 2 sits in between. The ratio d/o drives the choice: type 1 for
few input channels and many outputs, type 3 for the reverse.

`estimate(geom, batch, lowering_type, machine)` models forward + backward
(data and weight gradients) as the implementation runs it (cct.lowering.type*),
or the forward alone (forward_only, for a layer whose net never runs its
backward: a deploy net):

    copies   elements * itemsize * streams / bandwidth + rows * row cost
             (numpy pays a fixed cost per inner row of a strided copy or add,
             which dominates for the short rows of small images; gathers,
             scatters and adds each have their measured row cost)
    GEMMs    2*m*n*k / flops + m*n*itemsize / out_bandwidth
             + (m*k + k*n)*itemsize / in_bandwidth, per group: a skinny GEMM
             (small k, or small m) is bound by writing its output or packing
             its inputs and runs far below the peak rate; the three constants
             are fitted to three timed GEMMs

`choose_forward` decides, for a forward that never runs backward, between the
lowering and Winograd (cct.lowering.winograd): by a model of both
(winograd_estimate), or by timing both on the shape.

`Machine` holds those constants, measured (0.13 to 0.22 s here) only where a
choice depends on them, merged, keeping each timing's fastest value, with the
ones cached in $CCT_CACHE_DIR/lowering.json (default ~/.cache/cct), one entry
per host and BLAS thread count (load_machine, known_machine); until then the
model runs on NOMINAL_MACHINE. `choose(geom, batch, machine, measure=False)` returns the
type the model says is fastest, or with measure=True times every type once on
the actual shape (batch reduced to keep it short) and caches the answer in the
same file.
"""
import contextlib
import dataclasses
import json
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, cast

import numpy as np
import numpy.typing as npt

from cct.core import settings
from cct.core.workspace import Arena
from cct.devices import pool
from cct.devices.blas import blas, blas_limited
from cct.formats.prototxt import atomic_write

from .geometry import ConvGeometry
from .type1 import batch_inner
from .chunking import DEFAULT_BUDGET_MB, cache_chunk, chunk_size, chunks, image_bytes

CACHE_FILE = "lowering.json"
CACHE_VERSION = 2                      # 2: calibrations keep their timed copies (Machine.copies)
TYPES = (1, 2, 3)
MEASURE_BYTES = 32 * 2 ** 20          # largest workspace matrix when timing a shape

_lock = threading.RLock()
_cache: Dict[Path, Dict[str, Any]] = {}      # cache path -> parsed file contents
_machines: Dict[Tuple[Path, str], "Machine"] = {}   # (cache path, machine key) -> Machine
_robust: Dict[Any, Any] = {}           # choose_by_model's arguments -> its choice on every NOMINAL machine, or None
_decided: Dict[Any, int] = {}          # choose's and choose_forward's untimed choices: the same all process long


# --- machine constants -------------------------------------------------------------------
# GEMMs timed to fit the GEMM model, (m, n, k): one compute bound, one bound by
# writing its output (k small), one by reading its inputs (m small).
GEMM_PROBES = ((256, 4096, 512), (1024, 8192, 8), (8, 8192, 1024))


@dataclass
class Machine:
    """Measured constants of this host (float32):

    bandwidth           bytes/s moved by a large contiguous copy (reads + writes)
    gather_row          seconds per inner row of a copy from a strided source (lowering, lifting)
    scatter_row         seconds per inner row of a copy into a strided target (padding, unlifting)
    add_row             seconds per inner row of a strided in-place add (lifting sums, col2im)
    gemm_flops          flop/s of a GEMM with every dimension large
    gemm_out_bandwidth  bytes/s of GEMM output written (what a GEMM with a small k is bound by)
    gemm_in_bandwidth   bytes/s of GEMM inputs read and packed (what a GEMM with a small m is bound by)
    probes              the timed GEMMs, [m, n, k, seconds]
    copies              the timed copies, {name: [elements, rows, streams, seconds]}
                        (COPY_PROBES), from which the first four constants come
    calibrations        how many measurements were merged into these (best_of)
    """
    bandwidth: float
    gather_row: float
    scatter_row: float
    add_row: float
    gemm_flops: float
    gemm_out_bandwidth: float
    gemm_in_bandwidth: float
    probes: List[List[float]] = field(default_factory=list)
    copies: Dict[str, List[float]] = field(default_factory=dict)
    calibrations: int = 1

    FIELDS = ("bandwidth", "gather_row", "scatter_row", "add_row", "gemm_flops", "gemm_out_bandwidth",
              "gemm_in_bandwidth")

    def gemm_seconds(self, m: int, n: int, k: int, itemsize: int = 4, count: int = 1) -> float:
        """An (m x k) by (k x n) GEMM: compute plus the memory traffic that makes
        small and skinny GEMMs run far below the peak rate."""
        return count * (2.0 * m * n * k * (itemsize / 4) / self.gemm_flops
                        + m * n * itemsize / self.gemm_out_bandwidth
                        + (m * k + k * n) * itemsize / self.gemm_in_bandwidth)

    def gather(self, elements: float, row: float, itemsize: int) -> float:
        return 2 * elements * itemsize / self.bandwidth + elements / max(row, 1) * self.gather_row

    def scatter(self, elements: float, row: float, itemsize: int) -> float:
        return 2 * elements * itemsize / self.bandwidth + elements / max(row, 1) * self.scatter_row

    def add(self, elements: float, row: float, itemsize: int) -> float:
        return 3 * elements * itemsize / self.bandwidth + elements / max(row, 1) * self.add_row

    def fill(self, elements: float, itemsize: int) -> float:
        return elements * itemsize / self.bandwidth

    def to_dict(self) -> Dict[str, Any]:
        return {name: float(getattr(self, name)) for name in self.FIELDS} | {
            "probes": self.probes, "copies": self.copies, "calibrations": self.calibrations}

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "Machine":
        # (mypy cannot count the arguments a starred generator gives)
        return cls(*(float(values[name]) for name in cls.FIELDS),  # type: ignore[call-arg, arg-type]
                   [list(p) for p in values.get("probes", [])],
                   {name: list(timing) for name, timing in values.get("copies", {}).items()},
                   int(values.get("calibrations", 1)))


def _best_time(function: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def fit_gemm(probes: Sequence[Sequence[float]]) -> Tuple[float, float, float]:
    """(flops, out_bandwidth, in_bandwidth) from [m, n, k, seconds] rows: solve
    Machine.gemm_seconds in relative error; a coefficient that comes out
    negative (noise) is dropped, its term then costs nothing."""
    terms = np.array([[2.0 * m * n * k, 4.0 * m * n, 4.0 * (m * k + k * n)] for m, n, k, _ in probes])
    terms /= np.array([p[3] for p in probes])[:, None]
    keep = np.ones(3, bool)
    while True:
        inverse = np.zeros(3)
        inverse[keep] = np.linalg.lstsq(terms[:, keep], np.ones(len(probes)), rcond=None)[0]
        if (inverse >= 0).all() or keep.sum() == 1:
            break
        keep &= inverse > 0
    return cast(Tuple[float, float, float], tuple(float(1.0 / c) if c > 0 else 1e18 for c in inverse))   # 3 terms


# The timed copies, Machine.copies: a contiguous one (the bandwidth), and the
# strided passes whose time beyond their traffic at that bandwidth, per inner
# row, is the row cost of gathers, scatters and adds.
COPY_PROBES = ("copy", "gather", "scatter", "add")


def copy_constants(copies: Dict[str, List[float]]) -> Tuple[float, float, float, float]:
    """(bandwidth, gather_row, scatter_row, add_row) from Machine.copies."""
    elements, _, streams, seconds = copies["copy"]
    bandwidth = streams * elements * 4 / seconds
    rows = {}
    for name in COPY_PROBES[1:]:
        elements, count, streams, seconds = copies[name]
        rows[name] = max(seconds - streams * elements * 4 / bandwidth, 0.0) / count
    return bandwidth, rows["gather"], rows["scatter"], rows["add"]


def measure_machine() -> Machine:
    """Measure a Machine (about 0.2 s)."""
    big = np.ones(8 * 2 ** 20, np.float32)                          # 32 MB: beyond most caches
    dst = np.empty_like(big)
    np.copyto(dst, big)
    copies = {"copy": [big.size, 1, 2, _best_time(lambda: np.copyto(dst, big), 3)]}
    # Rows of 13 in a frame of 15: a small image's rows inside its padded frame.
    frame = big[: 2 ** 21 // 15 * 15].reshape(-1, 15)
    inner, other = frame[:, 1:14], dst[: frame.size].reshape(frame.shape)[:, 1:14]
    rows = inner.shape[0]
    dense = np.empty(inner.shape, np.float32)
    for name, streams, function in (("gather", 2, lambda: np.copyto(dense, inner)),
                                    ("scatter", 2, lambda: np.copyto(other, dense)),
                                    ("add", 3, lambda: np.add(other, inner, out=other))):
        copies[name] = [inner.size, rows, streams, _best_time(function, 3)]
    probes = []
    for m, n, k in GEMM_PROBES:
        a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
        c = np.empty((m, n), np.float32)
        np.matmul(a, b, out=c)
        probes.append([m, n, k, _best_time(lambda: np.matmul(a, b, out=c), 3)])
    return Machine(*copy_constants(copies), *fit_gemm(probes), probes, copies)


def _blas_threads() -> int:
    return blas().reported()


def machine_key() -> str:
    return f"{platform.node()}|{platform.machine()}|blas_threads={_blas_threads()}"


# --- the cache file --------------------------------------------------------------------------
def cache_path() -> Path:
    return Path(settings.value("cache_dir")) / CACHE_FILE


def _load_cache(path: Path) -> Dict[str, Any]:
    contents = _cache.get(path)
    if contents is None:
        try:
            contents = json.loads(path.read_text())
            if contents.get("version") != CACHE_VERSION:
                contents = None
        except (OSError, ValueError, AttributeError):
            contents = None
        contents = contents or {"version": CACHE_VERSION, "machines": {}, "choices": {}}
        _cache[path] = contents
    return contents


def _save_cache(path: Path, contents: Dict[str, Any]) -> None:
    """Write atomically; a read-only cache directory only loses the caching."""
    try:
        atomic_write(path, json.dumps(contents, indent=1, sort_keys=True).encode())
    except OSError:
        pass


def load_machine(refresh: bool = False) -> Machine:
    """This host's Machine, measured once per process and merged with the
    cache file's (best_of): a calibration taken while other jobs held the
    cores reads slow, and one quiet run later corrects it for good.
    refresh=True drops what the file holds."""
    with _lock:
        path, key = cache_path(), machine_key()
        machine = None if refresh else _machines.get((path, key))
        if machine is not None:
            return machine
        contents = _load_cache(path)
        stored = None if refresh else contents["machines"].get(key)
        try:
            stored = Machine.from_dict(stored) if stored else None
        except (KeyError, TypeError, ValueError):
            stored = None
        measured = measure_machine()
        machine = measured if stored is None else best_of(stored, measured)
        contents["machines"][key] = machine.to_dict()
        _save_cache(path, contents)
        _machines[(path, key)] = machine
        return machine


def best_of(first: Machine, second: Machine) -> Machine:
    """The faster of two calibrations of one host: load only ever slows a
    measurement down, so each timed GEMM and copy keeps its best time, and
    the constants are derived again from those (fit_gemm, copy_constants).
    Taken constant by constant instead, the largest bandwidth of one
    calibration with the smallest row cost of another paired numbers that no
    run measured, and a row cost that came out 0 in one noisy run (its
    contiguous copy timed slow) stayed 0 for good."""
    fastest: Dict[Tuple[float, float, float], float] = {}
    for m, n, k, seconds in list(first.probes) + list(second.probes):
        fastest[m, n, k] = min(seconds, fastest.get((m, n, k), seconds))
    probes = [[m, n, k, seconds] for (m, n, k), seconds in sorted(fastest.items())]
    if len(probes) >= 3:
        gemm = fit_gemm(probes)
    else:                              # a calibration without its probes: the measured one's
        gemm = (second.gemm_flops, second.gemm_out_bandwidth, second.gemm_in_bandwidth)
    copies = dict(first.copies)
    for name, timing in second.copies.items():
        if name not in copies or timing[3] < copies[name][3]:
            copies[name] = list(timing)
    if all(name in copies for name in COPY_PROBES):
        constants = copy_constants(copies)
    else:                              # calibrations without their copies: constant by constant
        constants = (max(first.bandwidth, second.bandwidth), min(first.gather_row, second.gather_row),
                     min(first.scatter_row, second.scatter_row), min(first.add_row, second.add_row))
    return Machine(*constants, *gemm, probes, copies, first.calibrations + second.calibrations)


def known_machine():
    """This host's Machine without measuring anything: the one this process
    has, else the cache file's once it merges CALIBRATIONS measurements
    (fewer may still read slow from a loaded moment: load_machine measures
    again, where a choice needs it); None otherwise."""
    with _lock:
        path, key = cache_path(), machine_key()
        machine = _machines.get((path, key))
        if machine is not None:
            return machine
        stored = _load_cache(path)["machines"].get(key)
        try:
            stored = Machine.from_dict(stored) if stored else None
        except (KeyError, TypeError, ValueError):
            stored = None
        if stored is None or stored.calibrations < CALIBRATIONS:
            return None
        _machines[(path, key)] = stored
        return stored


def clear_memory_cache() -> None:
    """Forget what was read from cache files (tests switch CCT_CACHE_DIR)."""
    with _lock:
        _cache.clear()
        _machines.clear()
        _robust.clear()
        _decided.clear()


# --- the cost model ----------------------------------------------------------------------------
def _cost_parts(geom: ConvGeometry, b: int, lowering_type: int, mc: Machine, s: int,
                forward_only: bool = False) -> Dict[Tuple[str, str], float]:
    """{(pass, part): seconds} for one chunk of b images of itemsize s, step by
    step as cct.lowering.type1/2/3 run them; the forward's parts alone where
    `forward_only` (a deploy net's choice prices nothing else)."""
    g = geom
    grp, cg, og = g.group, g.channels_per_group, g.outputs_per_group
    kh, kw = g.kernel_h, g.kernel_w
    k2 = kh * kw
    c, o = g.channels, g.num_output
    m1 = b * g.out_h * g.out_w                       # output pixels of the batch
    frame = b * g.padded_h * g.padded_w              # padded input pixels of the batch
    pad = (mc.fill(c * (frame - b * g.in_h * g.in_w), s)           # border
           + mc.scatter(c * b * g.in_h * g.in_w, g.in_w, s))       # NCHW -> padded CNHW
    unpad = mc.gather(c * b * g.in_h * g.in_w, g.in_w, s)
    transpose = mc.gather(o * m1, g.out_h * g.out_w, s)            # (O, N, ..) <-> (N, O, ..)
    weights = o * cg * k2
    parts = {}
    if lowering_type == 1:
        row = g.out_w
        if batch_inner(g, b):
            # Columns (oh, ow, n): rows of b (or b*OW at stride 1) values, and
            # the input, output and gradients move to and from batch-innermost.
            row = b * g.out_w if g.stride_w == 1 else b
            pad = mc.fill(c * (frame - b * g.in_h * g.in_w), s) + mc.gather(c * b * g.in_h * g.in_w, b, s)
            unpad = mc.gather(c * b * g.in_h * g.in_w, b, s)
            transpose = mc.gather(o * m1, b, s)
        elif not g.has_border:
            pad = 0.0                                  # lowered straight from the input
        lower = pad + mc.gather(c * k2 * m1, row, s)
        parts["forward", "lower"] = lower
        parts["forward", "gemm"] = mc.gemm_seconds(og, m1, cg * k2, s, grp)
        parts["forward", "lift"] = transpose
        if forward_only:
            return parts
        parts["backward", "unlift"] = transpose
        parts["backward", "lower"] = lower
        parts["backward", "gemm"] = mc.gemm_seconds(og, cg * k2, m1, s, grp) + mc.gemm_seconds(cg * k2, m1, og, s, grp)
        # (batch-inner col2im is a compiled loop now, cheaper than these KH*KW
        # strided adds; modelled as before, the totals still match the timings
        # of bench/bench_lowering.py better, as the lowering copies of the
        # batch-inner layout run slower than the modelled bandwidth)
        parts["backward", "unlower"] = mc.fill(c * frame, s) + k2 * mc.add(c * m1, row, s) + unpad
    elif lowering_type == 2:
        m2 = b * g.padded_h * g.out_w
        lower = pad + mc.gather(c * kw * m2, g.out_w, s)
        parts["forward", "lower"] = lower
        parts["forward", "gemm"] = mc.gemm_seconds(og * kh, m2, cg * kw, s, grp)
        parts["forward", "lift"] = mc.gather(o * m1, g.out_w, s) + (kh - 1) * mc.add(o * m1, g.out_w, s) + transpose
        if forward_only:
            if kh > 1:
                parts["forward", "kernel"] = mc.gather(weights, kw, s)
            return parts
        parts["backward", "unlift"] = transpose + mc.fill(o * kh * m2, s) + kh * mc.scatter(o * m1, g.out_w, s)
        parts["backward", "lower"] = lower
        parts["backward", "gemm"] = (mc.gemm_seconds(og * kh, cg * kw, m2, s, grp)
                                     + mc.gemm_seconds(cg * kw, m2, og * kh, s, grp))
        parts["backward", "unlower"] = mc.fill(c * frame, s) + kw * mc.add(c * m2, g.out_w, s) + unpad
        # K2 is the weights transposed, copied in rows of KW at every call; the
        # backward copies it again for the data gradient, and dK2 back into dw
        if kh > 1:                     # (one kernel row: K2 is the weights as they are)
            parts["forward", "kernel"] = mc.gather(weights, kw, s)
            parts["backward", "kernel"] = 2 * mc.gather(weights, kw, s)
    else:
        parts["forward", "lower"] = pad
        parts["forward", "gemm"] = mc.gemm_seconds(og * k2, frame, cg, s, grp)
        parts["forward", "lift"] = mc.gather(o * m1, g.out_w, s) + (k2 - 1) * mc.add(o * m1, g.out_w, s) + transpose
        if forward_only:
            if k2 > 1:
                parts["forward", "kernel"] = mc.gather(weights, 1, s)
            return parts
        parts["backward", "unlift"] = transpose + mc.fill(o * k2 * frame, s) + k2 * mc.scatter(o * m1, g.out_w, s)
        parts["backward", "lower"] = pad
        parts["backward", "gemm"] = (mc.gemm_seconds(og * k2, cg, frame, s, grp)
                                     + mc.gemm_seconds(cg, frame, og * k2, s, grp))
        parts["backward", "unlower"] = unpad
        # K3 moves Cg innermost: a copy that reads the weights at a stride of KH*KW
        if k2 > 1:                     # (a 1 x 1 kernel: K3 is the weights as they are)
            parts["forward", "kernel"] = mc.gather(weights, 1, s)
            parts["backward", "kernel"] = 2 * mc.gather(weights, 1, s)
    return parts


def estimate_parts(geom: ConvGeometry, batch: int, lowering_type: int, machine: Machine, itemsize: int = 4,
                   budget: Optional[int] = None, forward_only: bool = False) -> Dict[Tuple[str, str], float]:
    """The model's seconds per (pass, part) for the whole batch, processed in
    chunks when `budget` (bytes) is given, as the layers run it; the
    forward's parts alone where `forward_only`."""
    chunk = batch if budget is None else chunk_size(geom, lowering_type, batch, itemsize, budget)
    total: Dict[Tuple[str, str], float] = {}
    for start, stop in chunks(batch, chunk):
        for key, seconds in _cost_parts(geom, stop - start, lowering_type, machine, itemsize, forward_only).items():
            total[key] = total.get(key, 0.0) + seconds
    return total


def estimate(geom: ConvGeometry, batch: int, lowering_type: int, machine: Machine, itemsize: int = 4,
             budget: Optional[int] = None, forward_only: bool = False) -> float:
    """Modelled seconds of forward + backward (data and weight gradients), or
    of the forward alone."""
    parts = estimate_parts(geom, batch, lowering_type, machine, itemsize, budget, forward_only)
    return sum(parts.values())


# --- choosing ------------------------------------------------------------------------------------
def choose_by_model(geom: ConvGeometry, batch: int, machine: Machine, itemsize: int = 4, budget: Optional[int] = None,
                    forward_only: bool = False) -> int:
    costs = {t: estimate(geom, batch, t, machine, itemsize, budget, forward_only) for t in TYPES}
    return min(TYPES, key=lambda t: (costs[t], t))


def shape_key(geom: ConvGeometry, batch: int, itemsize: int = 4, forward_only: bool = False) -> str:
    g = geom
    return (f"{machine_key()}|c{g.channels}o{g.num_output}|{g.in_h}x{g.in_w}|k{g.kernel_h}x{g.kernel_w}"
            f"|s{g.stride_h}x{g.stride_w}|p{g.pad_h}x{g.pad_w}|d{g.dilation_h}x{g.dilation_w}|g{g.group}"
            f"|b{batch}|f{8 * itemsize}" + ("|forward" if forward_only else ""))


def measure_types(geom: ConvGeometry, batch: int, dtype: npt.DTypeLike = np.float32, repeats: int = 3,
                  forward_only: bool = False) -> Dict[int, float]:
    """{type: seconds} of forward + backward (or the forward alone) on random
    data, the best of `repeats` runs, the types interleaved (a shared machine
    drifts)."""
    from . import conv_backward, conv_forward
    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)
    x = rng.standard_normal(geom.input_shape(batch)).astype(dtype)
    w = rng.standard_normal(geom.weight_shape).astype(dtype)
    dy = rng.standard_normal(geom.output_shape(batch)).astype(dtype)
    y, dx = np.empty(geom.output_shape(batch), dtype), np.empty_like(x)
    arena = Arena()

    def run(kind: int) -> None:
        conv_forward(x, w, geom, kind, out=y, ws=arena)
        if not forward_only:
            conv_backward(x, dy, w, geom, kind, ws=arena, dx_out=dx)

    return _interleaved_best(TYPES, run, repeats)


Candidate = TypeVar("Candidate")


def _interleaved_best(candidates: Iterable[Candidate], run: Callable[[Candidate], object],
                      repeats: int) -> Dict[Candidate, float]:
    """{candidate: seconds}: run(candidate) once each to warm (the arena
    grows to each one's buffers, kernels compile), then the best of `repeats`
    rounds, the candidates interleaved (a shared machine drifts)."""
    for candidate in candidates:
        run(candidate)
    seconds: Dict[Candidate, List[float]] = {candidate: [] for candidate in candidates}
    for _ in range(repeats):
        for candidate in candidates:
            start = time.perf_counter()
            run(candidate)
            seconds[candidate].append(time.perf_counter() - start)
    return {candidate: min(times) for candidate, times in seconds.items()}


def measured_batch(geom: ConvGeometry, batch: int, itemsize: int) -> int:
    """The batch used when timing a shape: whole, or as many images as keep
    every type's largest matrix within MEASURE_BYTES."""
    largest = max(image_bytes(geom, t, itemsize) for t in TYPES)
    return int(max(1, min(batch, MEASURE_BYTES // largest)))


def choose_by_measurement(geom: ConvGeometry, batch: int, dtype: npt.DTypeLike = np.float32,
                          forward_only: bool = False) -> int:
    dtype = np.dtype(dtype)
    key = shape_key(geom, batch, dtype.itemsize, forward_only)
    with _lock:
        path = cache_path()
        stored = _load_cache(path)["choices"].get(key)
    if stored and stored.get("type") in TYPES:
        return stored["type"]
    seconds = measure_types(geom, measured_batch(geom, batch, dtype.itemsize), dtype, forward_only=forward_only)
    choice = min(TYPES, key=lambda t: (seconds[t], t))
    with _lock:
        contents = _load_cache(path)
        contents["choices"][key] = {"type": choice, "seconds": {str(t): seconds[t] for t in TYPES}}
        _save_cache(path, contents)
    return choice


# The model's constants on a host not calibrated yet: the middle of this
# 2-core machine's calibrations, which spread 1.6x (BENCHMARKS.md, "Loading
# a .caffemodel (issue 39)"). A choice the model makes alike on every
# machine around them (nominal_machines) needs no calibration.
NOMINAL_MACHINE = Machine(bandwidth=15e9, gather_row=3.7e-9, scatter_row=1.5e-9, add_row=1.3e-8, gemm_flops=1.3e11,
                          gemm_out_bandwidth=5e9, gemm_in_bandwidth=9e9, calibrations=0)
MACHINE_SPREAD = 3.0                   # each group of constants this many times faster and slower
CALIBRATIONS = 3                       # merged measurements after which a stored Machine is used without more
CLOSE_ENOUGH = 1.1                     # a pick this near each nominal machine's own needs no calibration


def nominal_machines(machine=NOMINAL_MACHINE, spread=MACHINE_SPREAD):
    """`machine`, and for each group of its constants (GEMM arithmetic, GEMM
    memory traffic, copy bandwidth, copy row costs) the same machine with
    that group `spread` times faster and `spread` times slower."""
    groups = (("gemm_flops",), ("gemm_out_bandwidth", "gemm_in_bandwidth"), ("bandwidth",),
              ("gather_row", "scatter_row", "add_row"))
    machines = [machine]
    for names in groups:
        for factor in (spread, 1 / spread):          # faster, slower: a row cost is a time
            machines.append(dataclasses.replace(machine, **{
                name: getattr(machine, name) / factor if name.endswith("_row") else getattr(machine, name) * factor
                for name in names}))
    return machines


_NOMINAL_MACHINES = nominal_machines()


def choose_uncalibrated(geom, batch, itemsize=4, budget=None, forward_only=False):
    """The type the model picks on NOMINAL_MACHINE where, on every nominal
    machine, it costs at most CLOSE_ENOUGH times that machine's own pick;
    else None: the choice then depends on this host's constants."""
    key = (geom, batch, itemsize, budget, forward_only)
    with _lock:
        if key in _robust:
            return _robust[key]
    choice = None
    for machine in _NOMINAL_MACHINES:
        costs = {t: estimate(geom, batch, t, machine, itemsize, budget, forward_only) for t in TYPES}
        if choice is None:                   # the first is NOMINAL_MACHINE itself
            choice = min(TYPES, key=lambda t: (costs[t], t))
        if costs[choice] > CLOSE_ENOUGH * min(costs.values()):
            choice = None
            break
    with _lock:
        _robust[key] = choice
    return choice


def choose(geom: ConvGeometry, batch: int, machine: Optional[Machine] = None, measure: bool = False,
           dtype: npt.DTypeLike = np.float32, budget: Optional[int] = None, forward_only: bool = False) -> int:
    """The lowering type for `geom` at `batch`: by the cost model, or with
    measure=True by timing every type once on this shape (cached per shape),
    for forward + backward or, forward_only, the forward alone. The model
    runs on `machine`, else this host's calibration where one is known
    (known_machine); else a choice that holds on every nominal machine
    (choose_uncalibrated) is taken as it is, and only a choice that depends on
    the constants calibrates the host (load_machine, about 0.2 s).
    Nothing to lower (an empty batch, geom.empty) runs no type: type 1, unmeasured."""
    if batch == 0 or geom.empty:
        return 1
    if measure:
        return choose_by_measurement(geom, batch, dtype, forward_only)
    itemsize = np.dtype(dtype).itemsize
    if machine is not None:
        return choose_by_model(geom, batch, machine, itemsize, budget, forward_only)
    # a calibration made later in this process must not change what nets built before it run
    key = ("type", geom, batch, itemsize, budget, forward_only)
    with _lock:
        if key in _decided:
            return _decided[key]
    machine = known_machine()
    choice = choose_uncalibrated(geom, batch, itemsize, budget, forward_only) if machine is None else None
    if choice is None:
        choice = choose_by_model(geom, batch, machine or load_machine(), itemsize, budget, forward_only)
    with _lock:
        return _decided.setdefault(key, choice)


# --- Winograd for forwards alone ----------------------------------------------------------------
# Winograd is kept only where its timed forward takes at most this share of
# the lowering's: a near tie is noise, and the lowering's numbers are the
# closer to Caffe's (BENCHMARKS.md, "Winograd for deploy convolutions (session 9)").
CLEARLY_FASTER = 0.95
# Largest input + output (bytes) of the batch Winograd is timed on: the
# lowerings' MEASURE_BYTES, which bounds their largest matrix, would time
# CaffeNet's conv2 (type 3: 25 MB an image) on one image where the layer runs
# eight, and Winograd gains with the batch (its GEMMs widen); the lowering
# is timed in its budget's chunks, as the layer runs it.
FORWARD_MEASURE_BYTES = 128 * 2 ** 20


def forward_measured_batch(geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
    """The batch Winograd and the lowering are timed on: whole, or as many
    images as keep input and output within FORWARD_MEASURE_BYTES."""
    per_image = (geom.channels * geom.in_h * geom.in_w + geom.num_output * geom.out_h * geom.out_w) * itemsize
    return int(max(1, min(batch, FORWARD_MEASURE_BYTES // max(1, per_image))))


# Timed runs of each candidate in measure_forward: at least 3, and more (up to
# 9) while a candidate's runs add up to under FORWARD_TIMING_SECONDS: small
# forwards are the noisy ones (BENCHMARKS.md, "Winograd for deploy convolutions (session 9)").
FORWARD_TIMING_SECONDS = 0.02
FORWARD_REPEATS = (3, 9)


def measure_forward(geom: ConvGeometry, batch: int, lowering_type: int, dtype: npt.DTypeLike = np.float32,
                    repeats: Optional[int] = None, threads: Optional[int] = None, spread: int = 1) -> Dict[int, float]:
    """{0: the lowering's forward, m: Winograd F(m x m, r x r)'s for the tile
    sizes winograd.timing_tiles takes} in seconds on random data, the best of
    `repeats` interleaved runs (None: as many as
    FORWARD_TIMING_SECONDS allows, within FORWARD_REPEATS), at `threads` BLAS
    threads when given, on the one pool's `spread` threads where more than
    one (as the step of a layer run whole on several has them: its parallel
    kernels and side-by-side products); Winograd's include checking
    its transformed weights (cct.lowering.winograd.TransformedWeights), as
    every forward of a layer does."""
    from . import conv_forward, winograd
    rng = np.random.default_rng(0)
    x = rng.standard_normal(geom.input_shape(batch)).astype(dtype)
    w = rng.standard_normal(geom.weight_shape).astype(dtype)
    bias = rng.standard_normal(geom.num_output).astype(dtype)
    y = np.empty(geom.output_shape(batch), dtype)
    arena = Arena()
    tiles = winograd.timing_tiles(geom, batch)
    cached = {m: winograd.TransformedWeights() for m in tiles}
    itemsize = np.dtype(dtype).itemsize
    chunk = min(chunk_size(geom, lowering_type, batch, itemsize, DEFAULT_BUDGET_MB * 2 ** 20),
                cache_chunk(geom, lowering_type, batch, itemsize))

    def run(m: int) -> None:
        if m:
            winograd.forward(x, cached[m].get(w, geom, m), geom, m, out=y, ws=arena, bias=bias)
        else:
            conv_forward(x, w, geom, lowering_type, out=y, ws=arena, chunk=chunk, bias=bias)

    limited = blas_limited(threads) if threads else contextlib.nullcontext()
    with limited, _pool_lent(spread):
        if repeats is None:
            start = time.perf_counter()
            run(0)
            once = max(time.perf_counter() - start, 1e-6)
            low, high = FORWARD_REPEATS
            repeats = int(min(high, max(low, FORWARD_TIMING_SECONDS // once)))
        return _interleaved_best((0,) + tiles, run, repeats)


@contextlib.contextmanager
def _pool_lent(threads: int) -> Iterator[None]:
    """The one pool lent to this thread meanwhile (cct.devices.pool) where
    `threads` is more than one and the pool can hold them, started now if
    numba's warm-up has not yet (a timing is worth its wait); else nothing."""
    lent = threads > 1 and pool.start() and pool.acquire(threads)
    try:
        yield
    finally:
        if lent:
            pool.release()


# Winograd's transforms cost this many times a strided copy of the values
# they write (V, M) in the model (winograd_estimate): the value whose picks
# agreed best with the timed ones on the three deploy nets' shapes at batch 1
# and 10 (BENCHMARKS.md, "Loading a .caffemodel (issue 39)").
TRANSFORM_COST = 2.0
# The model picks Winograd without timing where it estimates at most this
# share of the lowering's forward, beyond the model's error; a closer call
# keeps the lowering (CLEARLY_FASTER; BENCHMARKS.md, "Loading a .caffemodel (issue 39)").
MODEL_CLEARLY_FASTER = 0.8


def winograd_estimate(geom, batch, m, machine, itemsize=4, spread=1):
    """Modelled seconds of Winograd F(m x m, r x r)'s forward as
    cct.lowering.winograd runs it: per block of images, alpha^2 GEMMs per
    group of (tiles x C/group) by (C/group x O/group); the input and output
    transforms as strided copies of what they write, TRANSFORM_COST times
    over, plus a read of the input, shared among `spread` threads where the
    layer runs whole on several (the transforms are the pool's parallel
    kernels, cct.lowering.winograd); the check of the weights against their
    copy (two passes over them)."""
    from . import winograd
    g = geom
    alpha = m + g.kernel_h - 1
    tiles_h, tiles_w = winograd.tile_counts(g, m)
    per_image = tiles_h * tiles_w
    step = winograd.block_images(g, m, batch)
    products = transforms = 0.0
    for start in range(0, batch, step):
        columns = min(step, batch - start) * per_image
        products += machine.gemm_seconds(columns, g.outputs_per_group, g.channels_per_group, itemsize,
                                         alpha * alpha * g.group)
        transforms += TRANSFORM_COST * (machine.gather(alpha * alpha * g.channels * columns, g.channels, itemsize)
                                        + machine.gather(alpha * alpha * g.num_output * columns, g.num_output, itemsize))
    transforms += machine.gather(g.channels * batch * g.in_h * g.in_w, g.in_w, itemsize)
    check = 2 * g.num_output * g.channels_per_group * g.kernel_h * g.kernel_w * itemsize / machine.bandwidth
    return products + transforms / max(1, spread) + check


def choose_forward_by_model(geom, batch, lowering_type, machine, itemsize=4, spread=1):
    """0 (the lowering) or the tile size m the model puts at or under
    MODEL_CLEARLY_FASTER of the lowering's forward, in its budget's chunks
    (Winograd's transforms shared among `spread` threads: winograd_estimate)."""
    from . import winograd
    tiles = winograd.timing_tiles(geom, batch)
    if not tiles:
        return 0
    lowered = estimate(geom, batch, lowering_type, machine, itemsize, DEFAULT_BUDGET_MB * 2 ** 20, forward_only=True)
    seconds = {m: winograd_estimate(geom, batch, m, machine, itemsize, spread) for m in tiles}
    fastest = min(tiles, key=lambda m: (seconds[m], m))
    return fastest if seconds[fastest] <= MODEL_CLEARLY_FASTER * lowered else 0


def choose_forward(geom, batch, lowering_type, dtype=np.float32, threads=None, measure=False, spread=1):
    """0 (the lowering) or the Winograd tile size m for a forward alone of
    this shape at `threads` BLAS threads (those of the batch partition that
    runs it; None: the count in force), its parallel kernels on `spread`
    threads (more than one where the layer runs whole on several: the
    model's transforms are shared among them; BENCHMARKS.md, "Winograd's
    transforms on the pool, in the model"). A choice timed earlier on this shape,
    count and machine (cached beside the lowering choices) stands; else the
    model decides (choose_forward_by_model, on this host's calibration where
    one is known, else NOMINAL_MACHINE: nothing timed), or with measure=True
    the forwards are timed (measure_forward) and the answer cached: Winograd
    only where it is clearly faster (CLEARLY_FASTER). Only for shapes
    cct.lowering.winograd.applicable takes. Timed at the partition's threads:
    the ratio moves with the count (BENCHMARKS.md, "Winograd for deploy convolutions (session 9)")."""
    dtype = np.dtype(dtype)
    # "winograd5": timed on the partition's own batch and BLAS threads (the first
    # timings, on the lowerings' capped batch at the process's threads, are not
    # reused), each shape tiles or channels innermost (nor are earlier timings)
    key = (shape_key(geom, batch, dtype.itemsize, forward_only=True)
           + f"|winograd5|t{lowering_type}|threads={threads or _blas_threads()}")
    if spread > 1:                   # timed on the pool: another timing than one thread's
        key += f"|spread={spread}"
    with _lock:
        path = cache_path()
        stored = _load_cache(path)["choices"].get(key)
    if stored and "seconds" in stored:
        from . import winograd
        allowed = (0,) + winograd.timing_tiles(geom, forward_measured_batch(geom, batch, dtype.itemsize))
        return _winograd_pick({int(m): s for m, s in stored["seconds"].items() if int(m) in allowed})
    if not measure:
        with _lock:
            if key not in _decided:
                _decided[key] = choose_forward_by_model(geom, batch, lowering_type,
                                                        known_machine() or NOMINAL_MACHINE, dtype.itemsize, spread)
            return _decided[key]
    seconds = measure_forward(geom, forward_measured_batch(geom, batch, dtype.itemsize), lowering_type, dtype,
                              threads=threads, spread=spread)
    choice = _winograd_pick(seconds)
    with _lock:
        contents = _load_cache(path)
        contents["choices"][key] = {"winograd": choice, "seconds": {str(m): seconds[m] for m in seconds}}
        _save_cache(path, contents)
    return choice


def _winograd_pick(seconds: Dict[int, float]) -> int:
    """The fastest tile size if clearly faster than the lowering (key 0), else 0."""
    tiles = [m for m in seconds if m]
    if not tiles:
        return 0
    fastest = min(tiles, key=lambda m: (seconds[m], m))
    return fastest if seconds[fastest] <= CLEARLY_FASTER * seconds[0] else 0
