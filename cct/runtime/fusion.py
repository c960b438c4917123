"""Inference fusion (issue 20): a pass over a built TEST-phase net that makes
each chain of cheap element-wise layers one pass over memory, and lets Split
tops share their bottom's data. On by default for TEST-phase nets, off with
the run configuration's "fusion": false, CCT_FUSION=0 or set_fusion(False)
(cct.runtime.settings); TRAIN-phase nets never fuse.

Rules, each applied only where every blob a user can read (net.blobs) ends a
forward holding Caffe's value:

1. Element-wise runs. A layer whose `epilogue(bottom, top)` describes its
   forward as one of
       ("affine", (shift, scale, bias), r)   y = (x + shift) * scale + bias per channel
                                             (BatchNorm with global statistics,
                                             Scale and Bias of one value per channel)
       ("relu", negative_slope, r)           ReLU
       ("copy", None, r)                     Dropout at TEST
       ("sum", (coeff0, coeff1), r)          Eltwise SUM of two bottoms
   (r: whether its backward reads its input) joins the layer just before it
   when that one is also such a layer and the two chain: it runs in place on
   the run's latest value, or sums that value with a blob the run does not
   write. A run is affine maps, then a ReLU, then a sum, then a ReLU, each
   part optional (conv -> BatchNorm -> Scale -> ReLU in place is
   one; so is ResNet's conv -> BatchNorm -> Scale -> Eltwise -> ReLU). The
   run's layers are channels of a blob viewed as (N, C, rest) and run as one
   compiled pass after the layer that produced their input (usually a
   Convolution or InnerProduct): it reads the input once, and writes the
   run's first blob and the sum's blob, each with the value its last writer
   gives it in Caffe's order. A blob written in place holds only its last
   value in Caffe too, so every blob a user can read is filled. The
   producing op's own parameters (net.params) are never touched, and the
   per-channel maps are read from the layers' blobs at every forward: weights
   loaded or set after the net was built take effect.
   Not joined: a layer whose backward reads an input the pass does not keep
   (a Scale in place whose parameters get gradients, r above) when the net
   runs its backward (layer_need_backward; forward_only(net) says it never
   will, for `cct test`), and a layer with a loss weight.
   Every other backward reads what it reads unfused (BatchNorm's std is set
   by its epilogue), so forward and backward of a TEST net with losses, or
   with force_backward, give the unfused numbers. A run of one layer runs
   that layer's own forward.
2. Output ReLUs: an in-place ReLU right after a Convolution (one top, the
   ReLU's blob) that no run takes, and whose backward reads no input, runs
   in the convolution's output store (Convolution.fuse_output_relu: the
   store's own pass where it has one), with the same numbers as the ReLU
   layer. Only in a forward that goes on to the ReLU (Net.forward's `end`),
   and the ReLU is skipped only when its convolution applied it.
3. Split as aliases: a Split's tops share its bottom's data, so no copy runs,
   where no later layer writes the bottom or a top (in place). The diffs stay
   apart, so a backward is unchanged. (Before the Split runs in a forward
   that stops early, net.forward(end=...), its tops show the bottom's new
   value rather than the last forward's copy.)
4. Concat as views: where a Concat's bottoms are its top's contiguous pieces
   (batch 1 along the channels: GoogLeNet's inception outputs), each
   bottom's data lives in its piece of the top's store (Concat.views), so
   the producers write the top and the Concat copies nothing. Only where
   every bottom is computed by an earlier layer from its bottoms (not a net
   input or a data layer's top), read by no other layer but in place before
   the Concat, and shares its data with no other blob, and where no later
   layer writes a bottom or the top. (As for Split: a forward that stops
   before the Concat shows the bottoms' new values in the top, and a value
   written into the top through net.blobs shows in its bottom.) The
   placement follows the shapes: a reshape to strided pieces, or a forward
   of the Concat on a device, moves the bottoms to stores of their own.

How it runs (the executor, cct.runtime.executor): a run's layers are
reshaped as they come and their pass runs when its last layer has been
reached, or when the forward stops inside the run (Executor.finish, which
ends every Net.forward), or before any layer outside it runs: a forward over
any range (start=, end=) leaves every blob as Caffe would. With per-layer
callbacks subscribed, and for forwards a stream runs, layers run one by one.
A whole run's prepared pass is kept (Replay) and run again by the next
forwards that go through the run, without its layers' reshapes and
epilogues, while its blobs keep their shapes and arrays and its layers'
parameters their values.

Why a pass after the producing op, not BatchNorm and Scale folded into its
weights: pycaffe reads and writes net.params, so folded weights would be
copies, and a write into a numpy view cannot be seen: the copies would be
folded again at every forward (twice the weights' bytes), and ResNet's every
BatchNorm + Scale is followed by a ReLU or an Eltwise that needs a pass over
the output anyway. The pass could move into the convolution's own output
store (cct.lowering's `bias=`) once that takes a per-channel scale and a
ReLU.

Numbers: the per-channel maps are composed, so a fused BatchNorm + Scale
rounds differently from Caffe's two passes (a few float32 ulps); a ReLU,
copy or sum alone rounds the same. Reference cases stay within their 1e-4.
`describe(net)` gives printable lines of what a net fuses (`cct time`).
"""
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from cct.core.arrays import Array, FloatArray, Shape
from cct.core.blob import Blob
from cct.core.errors import ConfigError
from cct.core.layer import TEST, Epilogue
from cct.devices import jit
from cct.devices.jit import kernel, parallel_kernel, prange
from cct.lowering.geometry import relu_value, relu_values
from cct.runtime import threads as threads_module

Net = Any                         # cct.core.net.Net, whose executor imports this module: not imported back

# Elements per thread below which a pass runs on one thread: a smaller pass loses more to the hand-off and the shared
# memory bandwidth than a second thread gains (BENCHMARKS.md, "Behind cct/runtime/fusion.py").
PARALLEL_ELEMENTS = 1 << 21


# --- the pass ---------------------------------------------------------------------------------------
# Values per step of the pass: a step's row lives in a scratch buffer of this
# many values (16 KiB: in L1 beside the rows it reads and writes).
PASS_CHUNK = 4096

# Run.prepare's pass: its arrays (source, shift, scale, bias, value, other, out) and its flags (affine,
# slope1, relu1, store_value, self_coeff, other_coeff, summed, slope2, relu2, in place, kept sum)
Prepared = Tuple[List[FloatArray], Tuple[bool, float, bool, bool, float, float, bool, float, bool, bool, bool]]
# ParamWatch's per word width: the arrays (kept alive: the compiled check reads them at
# their addresses), their addresses, their snapshots end to end, the offsets
Watched = Tuple[List[Array], Array, Array, Array]


@kernel
def _affine_into(source: FloatArray, shift: float, scale: float, bias: float, scratch: FloatArray, count: int) -> None:
    for s in range(count):
        scratch[s] = (source[s] + shift) * scale + bias


@kernel
def _copy_into(source: FloatArray, target: FloatArray, count: int) -> None:
    for s in range(count):
        target[s] = source[s]


@kernel
def _relu_in_place(values: FloatArray, slope: float, count: int) -> None:
    """ReLU as cct's layer (relu_value: -0.0 and NaN as np.maximum)."""
    for s in range(count):
        values[s] = relu_value(values[s], slope)


@kernel
def _sum_in_place(values: FloatArray, self_coeff: float, other: FloatArray, other_coeff: float, count: int) -> None:
    for s in range(count):
        values[s] = values[s] * self_coeff + other[s] * other_coeff


@kernel
def _fused_pass(source: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool, slope1: float,
                relu1: bool, value: FloatArray, store_value: bool, other: FloatArray, self_coeff: float,
                other_coeff: float, summed: bool, slope2: float, relu2: bool, out: FloatArray) -> None:
    """One pass over source (N, C, S), element by element:
        v = (x + shift[c]) * scale[c] + bias[c]    if affine
        v = ReLU(v, slope1)                        if relu1
        value[n, c, s] = v                         if store_value
        v = v * self_coeff + other[n, c, s] * other_coeff   if summed
        v = ReLU(v, slope2)                        if relu2
        out[n, c, s] = v
    Any of the arrays may be the same one (in place): each chunk of a row is
    read into a scratch buffer, worked there step by step, and written out.
    Why the buffer: a loop that reads one array argument and writes another
    vectorises only behind a runtime check that they do not overlap, and in
    place they do, so the one-loop pass this replaced ran element by element
    in the nets; the scratch buffer is the kernel's own, so no check is needed
    (BENCHMARKS.md, "Behind cct/runtime/fusion.py")."""
    batch, channels, inner = source.shape
    scratch = np.empty(min(inner, PASS_CHUNK), source.dtype)
    for n in range(batch):
        for c in range(channels):
            for start in range(0, inner, PASS_CHUNK):
                count = min(PASS_CHUNK, inner - start)
                stop = start + count
                if affine:
                    _affine_into(source[n, c, start:stop], shift[c], scale[c], bias[c], scratch, count)
                else:
                    _copy_into(source[n, c, start:stop], scratch, count)
                if relu1:
                    _relu_in_place(scratch, slope1, count)
                if store_value:
                    _copy_into(scratch, value[n, c, start:stop], count)
                if summed:
                    _sum_in_place(scratch, self_coeff, other[n, c, start:stop], other_coeff, count)
                if relu2:
                    _relu_in_place(scratch, slope2, count)
                _copy_into(scratch, out[n, c, start:stop], count)


def _relu(v: FloatArray, slope: float) -> FloatArray:
    return np.maximum(v, 0) if slope == 0 else np.where(v > 0, v, v * v.dtype.type(slope))


def reference_pass(source: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                   slope1: float, relu1: bool, value: FloatArray, store_value: bool, other: FloatArray,
                   self_coeff: float, other_coeff: float, summed: bool, slope2: float, relu2: bool,
                   out: FloatArray) -> None:
    """_fused_pass in whole-array numpy steps (the tests' reference)."""
    v = source.astype(source.dtype, copy=True)
    if affine:
        v = (v + shift[:, None]) * scale[:, None] + bias[:, None]
    if relu1:
        v = _relu(v, slope1)
    if store_value:
        value[...] = v
    if summed:
        v = v * self_coeff + other * other_coeff
    if relu2:
        v = _relu(v, slope2)
    out[...] = v


# --- a run of layers ----------------------------------------------------------------------------------
class Run:
    """A run of fusable layers being gathered: what its pass reads and writes.

    source          the blob the pass reads (the first layer's bottom)
    shift, scale,   the composed per-channel affine map, (x + shift) * scale + bias;
    bias            None where a part is absent
    relu1           the negative slope of a ReLU after the map, or None
    value           the blob the affine part and relu1 write (None: the run starts with a sum)
    other, coeffs   the sum's second operand and (coefficient of the run's value, of other)
    out, relu2      the blob the sum writes, and the negative slope of a ReLU on it
    """

    def __init__(self) -> None:
        self.members: List[int] = []
        self.source: Optional[Blob] = None
        self.value: Optional[Blob] = None
        self.other: Optional[Blob] = None
        self.out: Optional[Blob] = None
        self.shift: Optional[FloatArray] = None
        self.scale: Optional[FloatArray] = None
        self.bias: Optional[FloatArray] = None
        self.relu1: Optional[float] = None
        self.relu2: Optional[float] = None
        self.coeffs: Optional[Tuple[float, ...]] = None

    @property
    def latest(self) -> Optional[Blob]:
        """The blob holding the run's latest value."""
        return self.out if self.other is not None else self.value

    def add(self, index: int, op: Epilogue, bottom: Sequence[Blob], top: Sequence[Blob]) -> bool:
        """Take layer `index` (its epilogue `op` and blobs) into the run, if it
        chains (module docstring, rule 1); whether it did."""
        kind, args, _ = op
        if not self.members:
            self.source = bottom[0]
            if kind == "sum":
                self.other, self.coeffs, self.out = bottom[1], tuple(args), top[0]
            else:
                self.value = top[0]
                self._apply(kind, args)
            self.members.append(index)
            return True
        latest = self.latest
        if kind == "sum":
            if self.other is not None or len(bottom) != 2:
                return False
            mine = [k for k in (0, 1) if bottom[k] is latest]
            if len(mine) != 1:
                return False
            k = mine[0]
            self.other, self.coeffs, self.out = bottom[1 - k], (args[k], args[1 - k]), top[0]
        elif bottom[0] is not latest or top[0] is not latest:
            return False                  # joins only in place on the run's latest value
        elif self.other is not None:      # after the sum: a ReLU (or a copy)
            if kind == "copy":
                pass
            elif kind == "relu" and self.relu2 is None:
                self.relu2 = args
            else:
                return False
        elif not self._apply(kind, args):
            return False
        self.members.append(index)
        return True

    def _apply(self, kind: str, args: Any) -> bool:
        if kind == "copy":
            return True
        if self.relu1 is not None:
            return False                  # an affine map or a second ReLU after a ReLU: another pass
        if kind == "relu":
            self.relu1 = args
            return True
        shift, scale, bias = args
        if self.shift is None and self.scale is None and self.bias is None:
            self.shift, self.scale, self.bias = shift, scale, bias
            return True
        # ((x + P) * Q + R + p) * q + r = (x + P) * (Q q) + ((R + p) q + r)
        carried = self.bias
        if shift is not None:
            carried = shift if carried is None else carried + shift
        if scale is not None:
            self.scale = scale if self.scale is None else self.scale * scale
            carried = None if carried is None else carried * scale
        if bias is not None:
            carried = bias if carried is None else carried + bias
        self.bias = carried
        return True

    def run(self, threads: int = 1) -> None:
        """The pass, on up to `threads` threads (pieces of the batch, or of
        the channels for a batch of one)."""
        _execute(self.prepare(), threads)

    def prepare(self) -> Prepared:
        """(the pass's arrays, its flags): what run() hands the kernel, kept
        by a Replay for the forwards that change nothing."""
        assert self.source is not None    # (set by the first add)
        source = self.source.data
        affine = not (self.shift is None and self.scale is None and self.bias is None)
        batch = source.shape[0] if source.ndim else 1
        # Without per-channel maps an image is one row, not C kernel calls, unless it is large enough for _execute
        # to split it between threads by channels (BENCHMARKS.md, "Behind cct/runtime/fusion.py").
        split_by_channels = batch == 1 and source.size >= 2 * PARALLEL_ELEMENTS
        channels = source.shape[1] if source.ndim > 1 and (affine or split_by_channels) else 1
        shape = (batch, channels, source.size // max(1, batch * channels))
        dtype = source.dtype

        def per_channel(values: Optional[FloatArray], default: float) -> FloatArray:
            return np.full(channels, default, dtype) if values is None else np.array(values, dtype)

        nothing = np.zeros((0, 0, 0), dtype)
        summed = self.other is not None
        out = self.out if summed else self.value
        assert out is not None            # the sum's top, or the first layer's
        store_value = summed and self.value is not None and self.value is not self.out
        arrays = [source.reshape(shape), per_channel(self.shift, 0), per_channel(self.scale, 1),
                  per_channel(self.bias, 0), cast(Blob, self.value).data.reshape(shape) if store_value else nothing,
                  self.other.data.reshape(shape) if self.other is not None else nothing, out.data.reshape(shape)]
        coeffs = self.coeffs or (1, 1)
        in_place = not summed and out is self.source      # (store_value needs a sum)
        kept_sum = store_value and self.value is self.source
        flags = (affine, dtype.type(self.relu1 or 0), self.relu1 is not None, store_value,
                 dtype.type(coeffs[0]), dtype.type(coeffs[1]), summed, dtype.type(self.relu2 or 0),
                 self.relu2 is not None, in_place, kept_sum)
        return arrays, flags


@kernel
def _mapped(v: float, shift: float, scale: float, bias: float, affine: bool, slope: float, relu: bool) -> float:
    """One value through a pass's first steps: the affine map, then relu1."""
    if affine:
        v = (v + shift) * scale + bias
    return relu_value(v, slope) if relu else v


@parallel_kernel
def _in_place_pass(values: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                   slope1: float, relu1: bool, slope2: float, relu2: bool) -> None:
    """_fused_pass's steps, in the same order, for a pass that writes its
    source and neither sums nor keeps a value (a BatchNorm + Scale + ReLU run
    in place): one array argument, so the loop vectorises with no overlap
    check and needs no scratch buffer, and so takes a fraction of
    _fused_pass's time (BENCHMARKS.md, "Behind cct/runtime/fusion.py")."""
    batch, channels, inner = values.shape
    for plane in prange(batch * channels):
        n, c = plane // channels, plane % channels
        p, q, r = shift[c], scale[c], bias[c]
        for s in range(inner):
            v = _mapped(values[n, c, s], p, q, r, affine, slope1, relu1)
            values[n, c, s] = relu_value(v, slope2) if relu2 else v


@parallel_kernel
def _mapped_pass(source: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                 slope1: float, relu1: bool, slope2: float, relu2: bool, out: FloatArray) -> None:
    """_fused_pass's steps, in the same order, for a pass that reads one blob
    and writes another, neither summing nor keeping a value (a BatchNorm +
    Scale + ReLU out of place: the pre-activation blocks of res10 and of
    ResNet-v2, which read a sum that the skip keeps): with source and out
    apart the loop vectorises behind its overlap check, with no scratch
    buffer, plane by plane on the pool (BENCHMARKS.md, "Behind cct/runtime/fusion.py").
    _in_place_pass's loop, which stays its own: given one array twice, this
    one's overlap check would send it element by element."""
    batch, channels, inner = source.shape
    for plane in prange(batch * channels):
        n, c = plane // channels, plane % channels
        p, q, r = shift[c], scale[c], bias[c]
        for s in range(inner):
            v = _mapped(source[n, c, s], p, q, r, affine, slope1, relu1)
            out[n, c, s] = relu_value(v, slope2) if relu2 else v


@parallel_kernel
def _kept_sum_pass(values: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                   slope1: float, relu1: bool, other: FloatArray, self_coeff: float, other_coeff: float,
                   slope2: float, relu2: bool, out: FloatArray) -> None:
    """_fused_pass's steps, in the same order, for a pass whose kept value is
    its source (in place) and which then sums into another blob (ResNet's
    BatchNorm + Scale on a convolution's top, then the Eltwise sum and its
    ReLU): the source is one array argument, so with `other` and `out`
    apart the loop vectorises behind its overlap check, with no scratch
    buffer (BENCHMARKS.md, "Behind cct/runtime/fusion.py")."""
    batch, channels, inner = values.shape
    for plane in prange(batch * channels):
        n, c = plane // channels, plane % channels
        p, q, r = shift[c], scale[c], bias[c]
        for s in range(inner):
            v = _mapped(values[n, c, s], p, q, r, affine, slope1, relu1)
            values[n, c, s] = v
            v = v * self_coeff + other[n, c, s] * other_coeff
            out[n, c, s] = relu_value(v, slope2) if relu2 else v


# The passes' twins (cct.devices.jit): each value's steps as the kernels take
# them, as whole-array numpy steps (every value is its own chain of
# operations, so the order across values does not matter). A product by a
# coefficient of 1 is the value itself, bit for bit, and is skipped.
def _mapped_values(values: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                   slope: float, relu: bool, out: Optional[FloatArray] = None) -> FloatArray:
    """_mapped over (N, C, S) values, into `out` (new when None; may be values)."""
    if affine:
        v = np.add(values, shift.reshape(1, -1, 1), out=out)
        np.multiply(v, scale.reshape(1, -1, 1), out=v)
        np.add(v, bias.reshape(1, -1, 1), out=v)
    elif out is None:
        v = values.copy()
    else:
        v = out
        np.copyto(v, values)
    return relu_values(v, slope) if relu else v


def _summed_values(v: FloatArray, self_coeff: float, other: FloatArray, other_coeff: float,
                   out: FloatArray) -> FloatArray:
    """v * self_coeff + other * other_coeff, into `out` (which may be v or other)."""
    scaled = v if self_coeff == 1 else np.multiply(v, self_coeff)
    return np.add(scaled, other if other_coeff == 1 else other * other_coeff, out=out)


@_fused_pass.twin
def _fused_pass_twin(source: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                     slope1: float, relu1: bool, value: FloatArray, store_value: bool, other: FloatArray,
                     self_coeff: float, other_coeff: float, summed: bool, slope2: float, relu2: bool,
                     out: FloatArray) -> None:
    v = _mapped_values(source, shift, scale, bias, affine, slope1, relu1)
    if store_value:
        value[...] = v
    if summed:
        _summed_values(v, self_coeff, other, other_coeff, v)
    if relu2:
        relu_values(v, slope2)
    out[...] = v


@_in_place_pass.twin
def _in_place_pass_twin(values: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                        slope1: float, relu1: bool, slope2: float, relu2: bool) -> None:
    _mapped_values(values, shift, scale, bias, affine, slope1, relu1, out=values)
    if relu2:
        relu_values(values, slope2)


@_mapped_pass.twin
def _mapped_pass_twin(source: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                      slope1: float, relu1: bool, slope2: float, relu2: bool, out: FloatArray) -> None:
    _mapped_values(source, shift, scale, bias, affine, slope1, relu1, out=out)
    if relu2:
        relu_values(out, slope2)


@_kept_sum_pass.twin
def _kept_sum_pass_twin(values: FloatArray, shift: FloatArray, scale: FloatArray, bias: FloatArray, affine: bool,
                        slope1: float, relu1: bool, other: FloatArray, self_coeff: float, other_coeff: float,
                        slope2: float, relu2: bool, out: FloatArray) -> None:
    _mapped_values(values, shift, scale, bias, affine, slope1, relu1, out=values)
    _summed_values(values, self_coeff, other, other_coeff, out)     # (out may be other: value by value)
    if relu2:
        relu_values(out, slope2)


def _execute(prepared: Prepared, threads: int) -> None:
    """Run.prepare's pass on up to `threads` threads."""
    arrays, flags = prepared

    def piece(part: Sequence[FloatArray]) -> None:
        s, shift, scale, bias, value, other, o = part
        if flags[9]:                      # in place, nothing summed or kept
            _in_place_pass(o, shift, scale, bias, flags[0], flags[1], flags[2], flags[7], flags[8])
            return
        if not (flags[3] or flags[6]):    # out of place, nothing summed or kept
            _mapped_pass(s, shift, scale, bias, flags[0], flags[1], flags[2], flags[7], flags[8], o)
            return
        if flags[10]:                     # the kept value is the source, then a sum into another blob
            _kept_sum_pass(s, shift, scale, bias, flags[0], flags[1], flags[2], other, flags[4], flags[5], flags[7],
                           flags[8], o)
            return
        _fused_pass(s, shift, scale, bias, flags[0], flags[1], flags[2], value, flags[3], other, flags[4],
                    flags[5], flags[6], flags[7], flags[8], o)

    source = arrays[0]
    parts = max(1, min(threads, source.size // PARALLEL_ELEMENTS))
    if parts == 1:
        piece(arrays)
        return
    along = 0 if source.shape[0] >= parts else 1
    edges = np.linspace(0, source.shape[along], parts + 1).astype(int)
    pieces = [(_piece(arrays, along, start, stop),) for start, stop in zip(edges[:-1], edges[1:])]
    threads_module.run_all(threads_module.workers(parts), piece, pieces)


def _piece(arrays: Sequence[FloatArray], along: int, start: int, stop: int) -> List[FloatArray]:
    """Every array's slice [start, stop) along the batch (0) or channel (1)
    axis; the per-channel vectors follow a channel slice, empty arrays stay."""
    sliced = []
    for array in arrays:
        if array.ndim == 1:
            sliced.append(array[start:stop] if along == 1 else array)
        elif array.size == 0:
            sliced.append(array)
        else:
            sliced.append(array[start:stop] if along == 0 else array[:, start:stop])
    return sliced


# --- a run's pass again ----------------------------------------------------------------------------
@kernel
def _same_bits(current: Array, snapshot: Array) -> bool:
    """Whether the flat arrays (unsigned-integer views of the values) hold
    the same bits: -0.0 against 0.0 differs, a NaN left alone does not."""
    if current.shape[0] != snapshot.shape[0]:
        return False
    for i in range(current.shape[0]):
        if current[i] != snapshot[i]:
            return False
    return True


@_same_bits.twin
def _same_bits_twin(current: Array, snapshot: Array) -> bool:
    return current.shape[0] == snapshot.shape[0] and bool(np.array_equal(current, snapshot))


def _first_changed(currents: Sequence[Array], snapshot: Array, offsets: Array) -> int:
    """The index of the first of `currents` (flat unsigned views) whose bits
    are not its piece of `snapshot` (offsets[i] to offsets[i + 1]), else -1:
    cct.devices.addressed.first_changed's twin, called by ParamWatch itself
    while numba is not ready (the kernel takes the arrays' addresses)."""
    for i, current in enumerate(currents):
        start, stop = int(offsets[i]), int(offsets[i + 1])
        if current.shape[0] != stop - start or not np.array_equal(current, snapshot[start:stop]):
            return i
    return -1


class ParamWatch:
    """The parameters of a net's kept passes, checked in one compiled call per
    word width (an execution plan's, before each forward): whether any
    changed since the passes were kept. Arrays of a whole number of 8-byte
    words are compared by those, the others by 4-byte ones."""

    def __init__(self, fusion: "Fusion") -> None:
        pieces: Dict[type, Tuple[List[Array], List[Array]]] = {np.uint64: ([], []), np.uint32: ([], [])}
        for replay in fusion._replays.values():
            for _, _, data, _, snapshot in replay.params:
                word = np.uint64 if data.nbytes % 8 == 0 else np.uint32
                pieces[word][0].append(data.reshape(-1).view(word))
                pieces[word][1].append(snapshot.view(word))
        self.groups = [_watched(arrays, snapshots) for arrays, snapshots in pieces.values() if arrays]

    def changed(self) -> bool:
        if not jit.ready():
            return any(_first_changed(arrays, snapshot, offsets) >= 0
                       for arrays, _, snapshot, offsets in self.groups)
        from cct.devices import addressed         # numba is started: no import cost here
        return any(addressed.first_changed(addresses, snapshot, offsets) >= 0
                   for _, addresses, snapshot, offsets in self.groups)


def _watched(arrays: List[Array], snapshots: List[Array]) -> Watched:
    offsets = np.cumsum([0] + [piece.size for piece in snapshots]).astype(np.uint64)
    addresses = np.array([array.ctypes.data for array in arrays], np.uint64)
    return arrays, addresses, np.concatenate(snapshots), offsets


def _bits(values: Array) -> Array:
    """A blob's values as a flat view of unsigned integers of their width."""
    return values.reshape(-1).view(f"u{values.dtype.itemsize}")


class Replay:
    """A whole run's prepared pass, kept for the next forwards: composing it
    (its layers' reshapes and epilogues, the per-channel maps multiplied
    together) cost more than the pass itself on small blobs (BENCHMARKS.md,
    "Behind cct/runtime/fusion.py"), and a net runs the same shapes and
    parameters forward after forward. It is used only while every blob of
    the run has the shape and the array it had, and every parameter of its
    layers the values (compared bit for bit: pycaffe writes them through
    numpy views, which nothing else sees); otherwise the run is composed
    again and replaces it."""

    def __init__(self, net: Net, members: Sequence[int], prepared: Prepared) -> None:
        self.prepared = prepared
        self.blobs: List[Tuple[Blob, Shape, Array]] = []
        for index in members:
            for blob in net.bottom_vecs[index] + net.top_vecs[index]:
                if all(blob is not known for known, _, _ in self.blobs):
                    self.blobs.append((blob, blob.shape, blob.data))
        # (the layer's blob list, its index, the array, a view of its bits, a copy
        # of them): looked up in the list again, so that a blob put in another's
        # place is seen too; the view serves every forward the array is the same
        self.params = [(layer.blobs, k, blob.data, _bits(blob.data), _bits(blob.data).copy())
                       for layer in (net.layers[index] for index in members) for k, blob in enumerate(layer.blobs)]

    def still_valid(self) -> bool:
        for blob, shape, data in self.blobs:
            if blob.shape != shape or blob.data is not data:
                return False
        for blobs, k, data, bits, snapshot in self.params:
            if blobs[k].data is not data or not _same_bits(bits, snapshot):
                return False
        return True

    def run(self, threads: int) -> None:
        _execute(self.prepared, threads)


# --- the plan over a net --------------------------------------------------------------------------------
class Fusion:
    """A built net's fusion plan and the run being gathered. `runs`: the
    layer indices of each run of two or more layers; `aliases`: the indices
    of the Split layers whose tops alias their bottom; `forward_only`: the
    runs were planned for a net that never runs backward (forward_only())."""

    def __init__(self, net: Net, threads: int) -> None:
        self._net = weakref.ref(net)  # the net owns its executor, which owns this: no cycle
        self.threads = threads        # the passes' threads: the executor's
        self.forward_only = False
        self.applied: Optional[int] = None   # the ReLU whose convolution applied it in this forward
        self.plan_runs(net)
        self.aliases = _plan_aliases(net)
        for index in self.aliases:
            layer = net.layers[index]
            layer.aliases = True
            layer.reshape(net.bottom_vecs[index], net.top_vecs[index])   # the tops' own stores are dropped now
        self.concat_views = _plan_concat_views(net)
        for index in self.concat_views:
            layer = net.layers[index]
            layer.views = True
            layer.reshape(net.bottom_vecs[index], net.top_vecs[index])   # the bottoms placed now
        self.pending: Optional[Run] = None     # the Run being gathered
        self._pending_run: Optional[int] = None   # its number in runs, and the index expected next
        self._expected: Optional[int] = None
        self._replays: Dict[int, Replay] = {}   # run number -> its Replay
        self._replaying: Optional[int] = None  # the number of the run being replayed in this forward

    def plan_runs(self, net: Net) -> None:
        """(Re)plan the runs and output ReLUs: at construction, and when
        forward_only() says so."""
        self.runs = _plan_runs(net, self.forward_only)
        net.layout.changed()          # plans bound to the old runs are stale
        self._replays = {}
        self.run_of = {index: number for number, run in enumerate(self.runs) for index in run}
        self.output_relus = _plan_output_relus(net, self.run_of, self.forward_only)

    def output_relu(self, index: int, end: Optional[int]) -> Optional[Tuple[int, float]]:
        """(the ReLU's index, its negative slope) for the convolution `index`
        to apply in a forward that runs through layer `end`, else None."""
        entry = self.output_relus.get(index)
        return entry if entry is not None and end is not None and entry[0] <= end else None

    @property
    def net(self) -> Net:
        return self._net()

    def before_backward(self) -> None:
        """Run a pass still pending; refuse a backward of a forward-only plan."""
        self.flush()
        if self.forward_only:
            raise ConfigError(f"net '{self.net.name}': its fusion was planned forward only "
                              "(cct.runtime.fusion.forward_only), so a fused layer's backward would read "
                              "an input its pass did not keep; build the net again to run backward")

    def forward(self, index: int, end: Optional[int]) -> bool:
        """Take layer `index` of a forward through layer `end` into the
        current run (True) or, when it is no run's, run the pending pass first
        and leave the layer to the caller (False)."""
        number = self.run_of.get(index)
        if self._replaying is not None:
            if number == self._replaying and index == self._expected:
                return self._replay_member(index)
            self.flush()
        if self.pending is not None and (number != self._pending_run or index != self._expected):
            self.flush()
        net = self.net
        applied, self.applied = self.applied, None
        if index != applied:
            if number is None:
                return False
            if self._replay_start(number, index, end):
                return True
        layer, bottom, top = net.layers[index], net.bottom_vecs[index], net.top_vecs[index]
        with layer.naming_allocations(top):
            layer.reshape_if_changed(bottom, top)
        if index == applied:              # its convolution's store ran it
            return True
        assert number is not None         # a run's layer (the applied ReLU returned above)
        op = layer.epilogue(bottom, top)
        if op is None:                    # the shapes no longer allow it
            self.flush()
            return False
        if self.pending is None or not self.pending.add(index, op, bottom, top):
            self.flush()
            self.pending = Run()
            self.pending.add(index, op, bottom, top)
        run = self.runs[number]
        self._pending_run, self._expected = number, index + 1
        if index == run[-1]:
            self.flush()
        return True

    def replay(self, number: int, threads: int) -> bool:
        """Run `number`'s kept pass (an execution plan's step for the whole
        run: the plan's layout vouches for the blobs, its ParamWatch for the
        parameters); whether there was one."""
        replay = self._replays.get(number)
        if replay is None:
            return False
        replay.run(threads)
        return True

    def _replay_start(self, number: int, index: int, end: Optional[int]) -> bool:
        """At the first layer of run `number`: replay its kept pass when the
        forward goes through the whole run (to `end`) and nothing it read has
        changed (the run's layers are then neither reshaped nor asked again)."""
        run = self.runs[number]
        replay = self._replays.get(number)
        if replay is None or index != run[0] or end is None or end < run[-1] or not replay.still_valid():
            return False
        self._replaying, self._expected = number, index
        return self._replay_member(index)

    def _replay_member(self, index: int) -> bool:
        self._expected = index + 1
        number = self._replaying
        assert number is not None         # called while a run replays
        if index == self.runs[number][-1]:
            replay, self._replaying = self._replays[number], None
            replay.run(self.threads)
        return True

    def flush(self) -> None:
        """Run the pending pass, if any: a run of one layer runs that layer's
        own forward (reshaped as it joined; element-wise, so whole). A whole
        run's pass is kept for its next forwards (Replay)."""
        pending, self.pending = self.pending, None
        number, self._pending_run = self._pending_run, None
        self._expected = self._replaying = None
        if pending is None:
            return
        net = self.net
        if len(pending.members) == 1:
            index = pending.members[0]
            layer, bottom, top = net.layers[index], net.bottom_vecs[index], net.top_vecs[index]
            with layer.naming_allocations(top):
                layer.forward(bottom, top)
            return
        prepared = pending.prepare()
        if number is not None and pending.members == self.runs[number]:
            self._replays[number] = Replay(net, pending.members, prepared)
        _execute(prepared, self.threads)


def _op(net: Net, index: int, forward_only: bool = False) -> Optional[Epilogue]:
    """Layer `index`'s epilogue when it may join a run: it has one, no loss
    weight, and a backward the net runs reads no input the pass drops
    (unless the net never runs backward)."""
    layer = net.layers[index]
    if layer.epilogue is None or any(layer.loss_weights):
        return None
    op = layer.epilogue(net.bottom_vecs[index], net.top_vecs[index])
    if op is None or (op[2] and net.layer_need_backward[index] and not forward_only):
        return None
    return op


def _plan_runs(net: Net, forward_only: bool = False) -> List[List[int]]:
    """[[layer index, ...]] of the runs of two or more consecutive layers that chain."""
    runs: List[List[int]] = []
    current: Optional[Run] = None
    for index in range(len(net.layers)):
        op = _op(net, index, forward_only)
        if op is not None and current is not None and current.add(index, op, net.bottom_vecs[index],
                                                                     net.top_vecs[index]):
            continue
        if current is not None and len(current.members) > 1:
            runs.append(current.members)
        current = None
        if op is not None:
            current = Run()
            current.add(index, op, net.bottom_vecs[index], net.top_vecs[index])
    if current is not None and len(current.members) > 1:
        runs.append(current.members)
    return runs


def _plan_output_relus(net: Net, run_of: Dict[int, int], forward_only: bool) -> Dict[int, Tuple[int, float]]:
    """{convolution index: (ReLU index, negative slope)} (module docstring, rule 2)."""
    relus: Dict[int, Tuple[int, float]] = {}
    for index in range(len(net.layers) - 1):
        layer, after = net.layers[index], index + 1
        if not layer.output_relu or len(net.top_vecs[index]) != 1 or after in run_of:
            continue
        op = _op(net, after, forward_only)
        bottom, top = net.bottom_vecs[after], net.top_vecs[after]
        # ("relu", slope) is the layer's own declaration (Layer.epilogue), not its type name
        if op is not None and op[0] == "relu" and bottom[0] is top[0] is net.top_vecs[index][0]:
            relus[index] = (after, float(op[1]))
    return relus


def _plan_aliases(net: Net) -> List[int]:
    """Indices of the Split layers (layers with `aliases`) no later layer
    writes the bottom or a top of."""
    chosen = []
    for index, layer in enumerate(net.layers):
        if layer.aliases is None:
            continue
        shared = [net.bottom_vecs[index][0]] + [top for top in net.top_vecs[index]]
        written_later = any(top is blob for later in net.top_vecs[index + 1:] for top in later for blob in shared)
        if not written_later:
            chosen.append(index)
    return chosen


def _plan_concat_views(net: Net) -> List[int]:
    """Indices of the Concat layers (layers with `views`) whose bottoms may
    live in the top's store (module docstring, rule 4)."""
    chosen = []
    blobs = list(net.blobs.values())
    for index, layer in enumerate(net.layers):
        if layer.views is None:
            continue
        bottom, top = net.bottom_vecs[index], net.top_vecs[index][0]
        if all(_may_view(net, index, blob, blobs) for blob in bottom) and not _written_after(net, index, top):
            chosen.append(index)
    return chosen


def _may_view(net: Net, index: int, blob: Blob, blobs: Sequence[Blob]) -> bool:
    """Whether `blob`, bottom of the Concat `index`, may live in its top: an
    earlier layer computes it (not a net input: the user writes those), no
    other layer reads it but in place before the Concat, no later layer
    writes it, and no other blob shares its data."""
    made = any(net.bottom_vecs[j] and any(top is blob for top in net.top_vecs[j]) for j in range(index))
    for j, (bottoms, tops) in enumerate(zip(net.bottom_vecs, net.top_vecs)):
        reads, writes = any(b is blob for b in bottoms), any(t is blob for t in tops)
        if j != index and reads and not (writes and j < index):
            return False
    return (made and not _written_after(net, index, blob)
            and not any(other is not blob and other.shares_data_with(blob) for other in blobs))


def _written_after(net: Net, index: int, blob: Blob) -> bool:
    return any(top is blob for tops in net.top_vecs[index + 1:] for top in tops)


def plan(net: Net, threads: int) -> Fusion:
    """The net's Fusion, its passes on `threads` threads (it sets the aliases at once)."""
    return Fusion(net, threads)


def forward_only(net: Net) -> Optional[Fusion]:
    """Tell a fused net it will never run backward (`cct test`, a
    classifier): its runs are planned again with every layer that may join
    one, in-place Scales whose parameters learn included (a TEST net built
    from a train_val prototxt keeps those out otherwise), and a backward is
    refused from then on. Returns the net's Fusion, or None (fusion off)."""
    fusion = net.executor.fusion
    if fusion is not None:
        fusion.flush()
        fusion.forward_only = True
        fusion.plan_runs(net)
    return fusion


# --- what a net fuses, for cct time ------------------------------------------------------------------------
def describe(net: Net) -> List[str]:
    """Printable lines: whether the net fuses, each run (the layer whose output
    it follows, its layers, the blobs its one pass writes) and the aliased
    Splits. Timed layer by layer, a run's pass counts as its last layer's
    forward; the others take next to nothing, as do aliased Splits."""
    fusion = net.executor.fusion
    if fusion is None:
        why = ("switched off by the run configuration's \"fusion\", CCT_FUSION or set_fusion"
               if net.phase == TEST else "a TRAIN-phase net")
        return [f"Fusion: off ({why})"]
    names = {id(blob): name for name, blob in net.blobs.items()}
    fused = sum(len(run) for run in fusion.runs)
    lines = [f"Fusion: {fused} layers run as {len(fusion.runs)} passes; {len(fusion.output_relus)} ReLUs in "
             f"their convolution's output store; {len(fusion.aliases)} Split layers as aliases; "
             f"{len(fusion.concat_views)} Concat layers as views"]
    for run in fusion.runs:
        first = run[0]
        source = net.bottom_vecs[first][0]
        producer = next((net.layers[i].name for i in range(first - 1, -1, -1)
                         if any(top is source for top in net.top_vecs[i])), None)
        written: List[Blob] = []
        for index in run:
            for top in net.top_vecs[index]:
                if all(top is not blob for blob in written):
                    written.append(top)
        after = f"after {producer}: " if producer else ""
        lines.append(f"  {after}{' + '.join(net.layers[i].name for i in run)} "
                     f"(one pass writing {', '.join(repr(names[id(b)]) for b in written)})")
    for index, (relu, _) in sorted(fusion.output_relus.items()):
        lines.append(f"  {net.layers[index].name} + {net.layers[relu].name} (the ReLU in the output store)")
    for index in fusion.aliases:
        tops = ", ".join(repr(names[id(top)]) for top in net.top_vecs[index])
        lines.append(f"  {net.layers[index].name}: {tops} share '{names[id(net.bottom_vecs[index][0])]}'")
    for index in fusion.concat_views:
        bottoms = ", ".join(repr(names[id(blob)]) for blob in net.bottom_vecs[index])
        lines.append(f"  {net.layers[index].name}: {bottoms} written in place in "
                     f"'{names[id(net.top_vecs[index][0])]}' (where contiguous)")
    return lines
