"""Convolution family: Convolution, Deconvolution, Im2col.

The arithmetic lives in cct.lowering: the whole batch is lowered into one
matrix and multiplied in one GEMM per group. Each layer has a
`lowering_type` (1, 2 or 3, see cct.lowering): the one its run settings force
(`configure`, pushed by the runtime from the run configuration and
CCT_LOWERING, cct.runtime.settings), else the chooser's (cct.lowering.chooser),
picked per geometry and the batch one GEMM lowers (the largest of the
runtime's batch partitions, told after every reshape by run_partitions;
cached, so the same shape costs a tuple comparison). A scheduler may set the
attribute afterwards; that forces the type.

Intermediates live in the running thread's arena (cct.core.workspace),
reused across iterations, except that a training Convolution keeps its
forward's lowered matrix (and a copy of its bottom) for the backward's weight
gradient, which reads it instead of lowering again while the bottom is
bitwise what was lowered (cct.lowering.kept; the memory plan counts it, and
turns it off where the net would not fit with it). A batch whose largest
lowering matrix exceeds the budget (default 64 MB; set by the run settings'
lowering_budget_mb) runs in chunks of images.

A Convolution its net never runs backward (runs_backward False: a deploy net)
with a 3 x 3 or 5 x 5 kernel at stride 1 may compute its forward by
Winograd's F(2x2, 3x3), F(4x4, 3x3) or F(2x2, 5x5) instead
(cct.lowering.winograd): the run settings' "winograd" ("auto": timed against
the lowering on the shape, once per machine; a forced tile size, where the
kernel has one; or false). Its transformed weights are made
again whenever the weights change, bit for bit.
"""
import numpy as np

from cct.core.layer import TRAIN, Layer, register
from cct.lowering import (ConvGeometry, bind_conv_forward, chooser, conv_backward, conv_backward_data, conv_backward_weights,
                          conv_forward, depthwise, lowering, pointwise, type1, type3, winograd)
from cct.lowering import device as device_lowering
from cct.core.workspace import thread_arena
from cct.lowering.chunking import DEFAULT_BUDGET_MB, band_slot_bytes, cache_chunk, chunk_size, slot_bytes
from cct.lowering.kept import KeptLowering, kept_bytes

DEFAULT_LOWERING = 1          # before the first reshape, and where nothing decides
KEEP_LOWERING = True          # False: every backward lowers again (the bench's baseline)


def read_spatial_params(layer, p, bottom):
    """Kernel, stride, pad and dilation as (h, w) pairs from a ConvolutionParameter,
    with Caffe's checks (BaseConvolutionLayer::LayerSetUp). Only 2 spatial axes."""
    field = "convolution_param"
    # force_nd_im2col only picks Caffe's im2col routine; 2-d results are the same.
    try:
        channel_axis = bottom.canonical_axis(p.axis)
    except ValueError as error:
        raise layer.config_error(f"{field}.axis", str(error)) from None
    spatial_axes = len(bottom.shape) - channel_axis - 1
    if channel_axis != 1 or spatial_axes != 2:
        raise layer.config_error(f"{field}.axis", f"only channel axis 1 with 2 spatial axes (N, C, H, W) is "
                                 f"supported; got axis {p.axis} on a bottom of shape {bottom.shape}")

    def pair(name, default, positive):
        h_name, w_name = f"{name}_h", f"{name}_w"
        repeated = list(getattr(p, name)) if name != "kernel" else list(p.kernel_size)
        repeated_name = "kernel_size" if name == "kernel" else name
        if h_name in _HW_FIELDS and (p.HasField(h_name) or p.HasField(w_name)):
            if repeated:
                raise layer.config_error(f"{field}.{h_name}", f"give either {repeated_name} or "
                                         f"{h_name}/{w_name}, not both")
            values = (getattr(p, h_name), getattr(p, w_name))
        else:
            if len(repeated) not in ((1, 2) if default is None else (0, 1, 2)):
                raise layer.config_error(f"{field}.{repeated_name}", f"give it once or once per spatial "
                                         f"axis (2), got {len(repeated)} values")
            if not repeated:
                repeated = [default]
            values = (repeated[0], repeated[-1])
        if positive and min(values) <= 0:
            raise layer.config_error(f"{field}.{repeated_name}", f"must be > 0, got {values[0]} x {values[1]}")
        return tuple(int(v) for v in values)

    return pair("kernel", None, True), pair("stride", 1, True), pair("pad", 0, False), pair("dilation", 1, True)


_HW_FIELDS = {"kernel_h", "stride_h", "pad_h"}     # dilation has no _h/_w form in caffe.proto


def kernel_fields(layer):
    """`convolution_param.kernel_size 3 x 3, pad 0 x 0, stride 1 x 1, dilation 1 x 1`:
    the fields an output size is computed from, for a message refusing it."""
    pairs = zip(("kernel_size", "pad", "stride", "dilation"), (layer.kernel, layer.pad, layer.stride, layer.dilation))
    return "convolution_param." + ", ".join(f"{name} {h} x {w}" for name, (h, w) in pairs)


class _ConvolutionBase(Layer):
    """Shared by Convolution and Deconvolution (Caffe's BaseConvolutionLayer)."""
    min_bottoms = 1
    min_tops = 1
    reverse = False               # Deconvolution: forward is the convolution's backward
    batch_independent = True
    splits_backward = True
    # the lowering choice its reshape makes is made again at every forward's
    # run_partitions, which also sees the run settings (configure)
    reshape_reads_layout = True
    run_settings = ("lowering", "measure", "lowering_budget_mb", "winograd")

    def setup(self, bottom, top):
        if len(bottom) != len(top):
            raise self.config_error("top", f"needs one top per bottom, got {len(bottom)} bottoms "
                                    f"and {len(top)} tops")
        p = self.layer_param.convolution_param
        self.kernel, self.stride, self.pad, self.dilation = read_spatial_params(self, p, bottom[0])
        self.channels = bottom[0].shape[1]
        self.num_output = p.num_output
        self.group = p.group
        if self.num_output <= 0:
            raise self.config_error("convolution_param.num_output", f"must be > 0, got {self.num_output}")
        if self.group <= 0:
            raise self.config_error("convolution_param.group", f"must be > 0, got {self.group}")
        if self.channels % self.group:
            raise self.config_error("convolution_param.group", f"must divide the input channels "
                                    f"({self.channels}), got {self.group}")
        if self.num_output % self.group:
            raise self.config_error("convolution_param.group", f"must divide num_output "
                                    f"({self.num_output}), got {self.group}")
        self.bias_term = p.bias_term
        # Only a training net's backward reads a kept lowering; the memory plan may turn it off.
        self.keep_lowering = self.phase == TRAIN and not self.reverse
        # Partition twins (clone) share the original's choice and budget.
        self._owner = self
        self._output_relu = None      # the ReLU folded into the output store (fuse_output_relu)
        self._budget_share = 1
        self._forced_type, self.measure_lowering = None, False
        self._lowering_budget = DEFAULT_BUDGET_MB * 2 ** 20
        self._budget_given = False    # lowering_budget_mb set: a device keeps to it too, not to its memory's share
        self._auto_type = None
        self._bound_choice = None     # (lowering type, Winograd tile) the last choice gave
        self._choice_key = None       # the (geometry, batch, dtype, partitions, backward) the chooser picked _auto_type for
        self._partitions = 1          # the runtime's batch partitions (run_partitions)
        self._partition_threads = None    # ... and the BLAS threads each one's call runs at
        self._spread = None           # ... and, run whole on several threads, those threads (Layer.run_partitions)
        self._shape_key = None        # the one of the last reshape
        self._configured = False      # run settings received: reshape may choose now
        self._chunk_key = None
        # Winograd for a forward the net never runs backward (cct.lowering.winograd):
        # the setting ("auto", False, 2 or 4), the tile size in use (0: the
        # lowering) and the shape it was chosen for, the transformed weights.
        self._winograd_setting, self._winograd_m, self._winograd_key = "auto", 0, None
        self._transformed = winograd.TransformedWeights()
        # The convolution's own (input, output) channels; swapped for Deconvolution.
        conv_in, conv_out = ((self.num_output, self.channels) if self.reverse
                             else (self.channels, self.num_output))
        if not self.channels and p.weight_filler.type != "bilinear":
            # Caffe's LayerSetUp takes 0 channels, but every filler except bilinear
            # refuses the empty weight blob it then fills (CHECK(count), filler.hpp).
            # With a bilinear one it runs: each output is the bias.
            raise self.shape_error(f"bottom '{self._bottom_name(0)}' {bottom[0].shape} has no channels, so the "
                                   f"weights ({conv_out}, {conv_in // self.group}, {self.kernel[0]}, "
                                   f"{self.kernel[1]}) are empty; convolution_param.weight_filler "
                                   f"({p.weight_filler.type}) cannot fill an empty blob (Caffe's fillers "
                                   "refuse one, all but bilinear)")
        self.blobs = [self.filled_blob((conv_out, conv_in // self.group) + self.kernel, p.weight_filler,
                                       "convolution_param.weight_filler")]
        if self.bias_term:
            self.blobs.append(self.filled_blob((self.num_output,), p.bias_filler, "convolution_param.bias_filler"))
        self.param_propagate_down = [True] * len(self.blobs)

    def _bottom_name(self, index):
        names = self.layer_param.bottom
        return names[index] if index < len(names) else f"#{index}"

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.shape_error(f"bottom must be 4-d (N, C, H, W), got {shape}")
        if shape[1] != self.channels:
            raise self.shape_error(f"bottom has {shape[1]} channels, the layer was set up for {self.channels}")
        for index, blob in enumerate(bottom[1:], 1):
            if blob.shape != shape:
                raise self.shape_error(f"every bottom must have bottom[0]'s shape {shape}, "
                                       f"bottom[{index}] is {blob.shape}")
        # The geometry depends on the bottom's spatial size alone: a repeated forward of one shape
        # skips building and checking it, half the reshape's time (BENCHMARKS.md, "Behind layers/conv.py").
        if shape[2:] != getattr(self, "_geometry_of", None):
            geom = self._geometry(shape)
            if geom != getattr(self, "geom", None):
                self.geom = geom
                self._chunk_key = None
            self._geometry_of = shape[2:]
        for blob in top:
            blob.reshape(self._top_shape(shape[0]))
        self._shape_key = (self.geom, shape[0], bottom[0].dtype)
        if self._owner is self and self._configured:
            self._choose()

    def _choose(self):
        """The chooser's type for the last reshape's shape and the runtime's
        partitions (cached per both); not asked while a type is forced. A layer
        chooses at reshape and when told its partitions (run_partitions) once
        its run settings arrived (configure), else at its first use: set_up's
        reshape runs before the runtime pushes the settings, which may force a
        type or ask for measuring, and calibrating the chooser for nothing
        costs a GEMM benchmark."""
        if self._shape_key is None:
            return self._forced_type or DEFAULT_LOWERING
        geom, batch, dtype = self._shape_key
        # Chosen for what one GEMM lowers: the largest partition, in its share of the
        # budget; by the forward's cost alone where the net never runs the backward (a deploy
        # net: the model of both passes picked types with slower forwards; BENCHMARKS.md,
        # "Session 10: per-layer costs, kept fused passes, Winograd channels innermost").
        parts = max(1, min(self._partitions, batch))
        key = (geom, -(-batch // parts), dtype, parts, self.runs_backward)
        if self._forced_type:
            kind = self._forced_type
        else:
            if key != self._choice_key:
                self._auto_type = chooser.choose(geom, key[1], measure=self.measure_lowering, dtype=dtype,
                                                 budget=max(1, self._lowering_budget // parts),
                                                 forward_only=not self.runs_backward)
                self._choice_key = key
            kind = self._auto_type
        self._choose_winograd(key + (self._partition_threads, self._spread.count if self._spread else 1), kind)
        if (kind, self._winograd_m) != self._bound_choice:
            self._bound_choice = (kind, self._winograd_m)
            self.layout_changed()     # a plan's bound forward holds the old choice
        return kind

    def _choose_winograd(self, key, kind):
        """Set _winograd_m for the chooser's key (and the partitions' BLAS
        threads and spread): the forced tile size, or for "auto" the
        chooser's (chooser.choose_forward: its model's, or with the measure
        setting the timed one), where the net never runs this layer's
        backward and Winograd can run the shape; a forced lowering type keeps
        "auto" off, as the lowering was asked for."""
        setting = self._winograd_setting
        key = key + (setting, self._forced_type, kind, self.measure_lowering)
        if key == self._winograd_key:
            return
        self._winograd_key = key
        geom, batch, dtype, spread = key[0], key[1], key[2], key[6]
        if (setting is False or self.reverse or self.runs_backward or not winograd.applicable(geom, dtype)
                or (setting == "auto" and self._forced_type)):
            self._winograd_m = 0
        elif setting != "auto":
            self._winograd_m = setting if setting in winograd.tile_sizes(geom.kernel_h) else 0
        elif not winograd.worth_timing(geom, batch):
            self._winograd_m = 0
        else:
            self._winograd_m = chooser.choose_forward(geom, batch, kind, dtype, threads=self._partition_threads,
                                                      measure=self.measure_lowering, spread=spread)

    @property
    def winograd_tile(self):
        """The Winograd output tile size m the forward runs (0: it lowers)."""
        self._owner._choose()
        return self._owner._winograd_m

    def _held_tile(self):
        """The tile of the transformed weights this layer holds (0: none; a
        partition twin uses its original's)."""
        return self.winograd_tile if self._owner is self and self.blobs else 0

    def ahead(self):
        m = self._held_tile()
        return self._transformed.reserve(self.blobs[0].data, self.geom, m) if m else []

    def params_loaded(self):
        m = self._held_tile()
        if m:
            self._transformed.get(self.blobs[0].data, self.geom, m)

    def run_partitions(self, count, threads=None, spread=None):
        self._partitions = count
        self._partition_threads = threads
        self._spread = spread         # a one-image forward in bands shares its rows among their threads
        if self._configured:
            self._choose()            # now, not in the twins, which run at once and read it

    def _spread_threads(self):
        """The threads this layer's step runs on where it runs whole (its spread), else 1."""
        return self._spread.parts if self._spread is not None else 1

    def flops(self, bottom, top):
        # One GEMM per bottom, over the spatial size of the convolution's output:
        # the top's, or for a deconvolution (a convolution's backward) the bottom's.
        spatial = top[0] if not self.reverse else bottom[0]
        gemm = 2 * spatial.shape[0] * spatial.count_range(2) * self.blobs[0].count * len(bottom)
        return gemm, gemm, gemm

    def configure(self, settings):
        lowering = settings.get("lowering")
        self._forced_type = None if lowering in (None, "auto") else int(lowering)
        self._winograd_setting = settings.get("winograd", "auto")
        chooser_inputs = (self.measure_lowering, self.lowering_budget)
        self.measure_lowering = bool(settings.get("measure", False))
        self.lowering_budget = int(settings.get("lowering_budget_mb", DEFAULT_BUDGET_MB) * 2 ** 20)
        self._owner._budget_given = "lowering_budget_mb" in settings
        if (self.measure_lowering, self.lowering_budget) != chooser_inputs:
            self._choice_key = None           # choose again
        self._configured = True

    def clone(self, share=1):
        twin = super().clone(share)
        twin._owner = self._owner             # the lowering choice stays the original's
        twin._budget_share = share
        return twin

    @property
    def _device_budget(self):
        """lowering_budget_mb in float32 elements where it is set: a device
        lowers a chunk of images at a time within it, as the host does; None
        where not: a share of the device's memory (cct.lowering.device)."""
        return max(1, self._owner._lowering_budget // 4) if self._owner._budget_given else None

    @property
    def lowering_budget(self):
        """Workspace bytes: the original's budget, split among the `share`
        partition twins that run at once."""
        return max(1, self._owner._lowering_budget // self._budget_share)

    @lowering_budget.setter
    def lowering_budget(self, value):
        self._owner._lowering_budget = int(value)
        self._owner._budget_given = True
        self.layout_changed()         # a plan's bound chunk is the old budget's

    @property
    def lowering_type(self):
        """The type in use: forced (configuration, CCT_LOWERING, assignment) or chosen."""
        return self._owner._choose()

    @lowering_type.setter
    def lowering_type(self, value):
        self._owner._forced_type = value
        self.layout_changed()

    def _geometry_for(self, channels, num_output, in_h, in_w):
        try:
            return ConvGeometry(channels, num_output, in_h, in_w, *self.kernel, *self.stride, *self.pad,
                                *self.dilation, self.group)
        except ValueError as error:
            raise self.shape_error(f"input {in_h} x {in_w} does not fit the kernel "
                                   f"({kernel_fields(self)}): {error}") from None

    def _lowering(self):
        """The lowering type in use, checked."""
        kind = self.lowering_type
        try:
            lowering(kind)
        except ValueError as error:
            raise self.config_error("lowering_type", str(error)) from None
        return kind

    def planned_bytes(self, bottom, top, partitions):
        """The workspace of one partition's call: its lowering (chosen at the
        reshape after configure) on its chunk of images."""
        if not bottom or not bottom[0].shape:
            return {}
        batch, itemsize = -(-bottom[0].shape[0] // partitions), bottom[0].dtype.itemsize
        kind = self.lowering_type
        m = self.winograd_tile
        if m:
            return {"lowering": sum(winograd.slot_bytes(self.geom, m, batch).values()),
                    "held": winograd.held_bytes(self.blobs[0].data, m)}
        if pointwise(self.geom, batch) and not self.runs_backward:
            return {}                 # the forward multiplies the blobs themselves; only a backward lowers
        if depthwise.applies(self.geom):
            return {}                 # the direct kernels lower nothing, forward or backward
        chunk = min(chunk_size(self.geom, kind, batch, itemsize, max(1, self._owner._lowering_budget // partitions)),
                    cache_chunk(self.geom, kind, batch, itemsize))
        keeps = self._keeps(batch, chunk)
        rows = type1.band_rows(self.geom, batch, itemsize) if kind == 1 and not keeps else 0
        if rows:                      # one image lowered a band at a time (conv_forward), a band a thread
            pieces = len(type1.band_pieces(self.geom, rows, self._owner._spread_threads()))
            return {"lowering": sum(band_slot_bytes(self.geom, rows, itemsize, pieces).values())}
        slots = slot_bytes(self.geom, kind, chunk, itemsize)
        needs = {"lowering": sum(slots.values())}
        if keeps:
            needs["kept"] = len(bottom) * kept_bytes(slots, kind, batch * bottom[0].count_range(1) * itemsize)
        return needs

    def _keeps(self, batch, chunk):
        """Whether a forward of `batch` images in chunks of `chunk` keeps its
        lowering for the backward's weight gradient: where that gradient is
        wanted, of a whole batch in one chunk, lowered at all (a pointwise
        forward multiplies the input itself: cct.lowering.pointwise)."""
        return (KEEP_LOWERING and self.keep_lowering and self.param_propagate_down[0] and chunk >= batch
                and not pointwise(self.geom, batch))

    def _kept(self, index, kind, x):
        """Bottom `index`'s KeptLowering for a forward on `x` that keeps its
        lowering (a whole batch in one chunk), else None and nothing kept.
        Each partition twin keeps its own (Layer.clone drops _scratch_ attributes)."""
        kept = self.__dict__.setdefault("_scratch_kept", {})
        if not self._keeps(x.shape[0], self._chunk(kind, x)):
            kept.pop(index, None)
            return None
        return kept.setdefault(index, KeptLowering())

    def _kept_matrix(self, index, kind, x):
        """The lowering of `x` the forward kept for bottom `index`, while x is unchanged; else None."""
        kept = self.__dict__.get("_scratch_kept", {}).get(index)
        return None if kept is None else kept.matrix_for(x, kind, self.geom)

    def _spent_kept(self, index, kind, x, arena):
        """(x's kept lowering or None, the workspace) for a backward of both
        gradients: the data gradient's lowered-shaped product then goes over
        the kept matrix once the weight gradient has read it (KeptLowering.
        workspace; the matrix is spent), so one such matrix is in cache, not
        two: the next forward writes its lowering where the backward just wrote."""
        lowered = self._kept_matrix(index, kind, x)
        if lowered is None:
            return None, arena
        return lowered, self._scratch_kept[index].workspace(arena, kind)

    def _chunk(self, lowering_type, x):
        batch = x.shape[0]
        key = (lowering_type, batch, x.dtype.itemsize, self.lowering_budget)
        if key != self._chunk_key:            # reshape-stable: computed once per shape
            self._chunk_key = key
            self._chunk_images = min(chunk_size(self.geom, lowering_type, batch, x.dtype.itemsize,
                                                self.lowering_budget),
                                     cache_chunk(self.geom, lowering_type, batch, x.dtype.itemsize))
        return self._chunk_images

    def _add_bias(self, y):
        if self.bias_term:
            y += self.blobs[1].data.reshape(1, -1, 1, 1)

    def _bias_gradient(self, top):
        for blob in top:
            self.blobs[1].diff[...] += blob.diff.sum(axis=(0, 2, 3))

    # --- on a device: lowering type 1 (cct.lowering.device) --------------------------
    def runs_on(self, device, bottom, top):
        return self.all_float32(bottom, top, self.blobs)

    def forward_on(self, device, bottom, top):
        weight = self.blobs[0].device_data(device)
        bias = self.blobs[1].device_data(device) if self.bias_term else None
        for b, t in zip(bottom, top):
            self._forward_on(device, b, t, weight, bias)

    def backward_on(self, device, top, propagate_down, bottom):
        if self.bias_term and self.param_wanted(1):
            bias_diff = self.blobs[1].mutable_device_diff(device)
            for t in top:
                device_lowering.bias_gradient(device, t.device_diff(device), t.shape[0], t.shape[1],
                                              t.count_range(2), bias_diff)
        weight = self.blobs[0].device_data(device)
        weight_diff = self.blobs[0].mutable_device_diff(device) if self.param_wanted(0) else None
        for t, down, b in zip(top, propagate_down, bottom):
            if down or weight_diff is not None:
                self._backward_on(device, t, b, weight, weight_diff, down)

    def backward_param(self, index, top, bottom):
        """Parameter 0's gradient (the weights: _weight_gradient, the family's
        own) or parameter 1's (the bias)."""
        if index == 1:
            self._bias_gradient(top)
        else:
            self._weight_gradient(top, bottom, self._lowering(), thread_arena())


@register("Convolution")
class Convolution(_ConvolutionBase):
    """2-d convolution by lowering (cct.lowering), shared weights over several bottoms.

    convolution_param: num_output, bias_term, kernel_size | kernel_h+kernel_w,
    stride | stride_h+stride_w, pad | pad_h+pad_w, dilation (once or per axis),
    group, weight_filler, bias_filler, axis (must be 1), force_nd_im2col (no
    effect: 2-d only). Params: weight (O, C/group, KH, KW), bias (O,).
    bottom[i] (N, C, H, W) -> top[i] (N, O, OH, OW),
    OH = (H + 2*pad_h - (dilation_h*(KH-1)+1)) / stride_h + 1 (OW alike), the
    division truncating toward zero as in Caffe: a kernel may overrun the padded
    input by less than the stride, the cells beyond it reading as zero (kernel
    3, stride 2 on 2 x 2: a 1 x 1 output). OH or OW may be 0 (an empty top, as
    Caffe's), not negative (Caffe's Blob::Reshape refuses it). A bottom of 0
    channels takes a bilinear weight_filler (Caffe's other fillers refuse the
    empty weights); its top is then the bias.
    """
    output_relu = True              # inference fusion folds the in-place ReLU after it into its store

    def _geometry(self, shape):
        return self._geometry_for(self.channels, self.num_output, shape[2], shape[3])

    def _top_shape(self, batch):
        return self.geom.output_shape(batch)

    def forward(self, bottom, top):
        kind = self._lowering()
        weight, arena = self.blobs[0].data, thread_arena()
        bias = self.blobs[1].data if self.bias_term else None
        m = self._owner._winograd_m
        if m:
            transformed = self._owner._transformed.get(weight, self.geom, m)
            for b, t in zip(bottom, top):
                winograd.forward(b.data, transformed, self.geom, m, out=t.data, ws=arena, bias=bias,
                                 relu=self._owner._output_relu)
            return
        for index, (b, t) in enumerate(zip(bottom, top)):
            x = b.data
            conv_forward(x, weight, self.geom, kind, out=t.data, ws=arena, chunk=self._chunk(kind, x), bias=bias,
                         keep=self._kept(index, kind, x), relu=self._owner._output_relu,
                         threads=self._owner._spread_threads())

    def bind_forward(self, bottom, top, output_relu=None):
        """The forward of one bottom by lowering with the lowering type, chunk
        and kept matrix chosen now (Layer.bind_forward), ending with a ReLU of
        negative slope `output_relu` where given (fusion's output ReLU);
        Winograd, several bottoms and partition twins keep the per-call path,
        and with `output_relu` give None."""
        kind = self._lowering()
        if len(bottom) != 1 or self._owner is not self or self._winograd_m:
            return None if output_relu is not None else super().bind_forward(bottom, top)
        b, t, blobs, geom, bias_term = bottom[0], top[0], self.blobs, self.geom, self.bias_term
        chunk, keep = self._chunk(kind, b.data), self._kept(0, kind, b.data)
        bound = None if keep is not None else bind_conv_forward(b.data, blobs[0].data, geom, kind, t.data, chunk)
        if bound is not None:
            return lambda: bound(blobs[1].data if bias_term else None, output_relu)

        def forward():
            conv_forward(b.data, blobs[0].data, geom, kind, out=t.data, ws=thread_arena(), chunk=chunk,
                         bias=blobs[1].data if bias_term else None, keep=keep, relu=output_relu,
                         threads=self._spread_threads())
        return forward

    def fuse_output_relu(self, slope):
        """The next forwards end with a ReLU of negative slope `slope` in their
        output store (None: none again): inference fusion (cct.runtime.fusion)
        folds the in-place ReLU after this layer into it. The batch
        partitions' twins read it from the original."""
        self._owner._output_relu = slope

    def backward(self, top, propagate_down, bottom):
        """The sub-tasks' numbers (backward_param, backward_data), with one
        lowering call per bottom for both gradients: lowering types 2 and 3 then
        lift the top's gradient once for the two."""
        kind = self._lowering()
        if self.bias_term and self.param_propagate_down[1]:
            self._bias_gradient(top)
        for index, (t, down, b) in enumerate(zip(top, propagate_down, bottom)):
            self._backward_bottom(index, t, down, b, kind, self._chunk(kind, b.data))

    def _backward_bottom(self, index, t, down, b, kind, chunk):
        """Bottom `index`'s share of backward: its diff where `down`, and its
        part of the weight gradient where the weights learn."""
        need_weights = self.param_propagate_down[0]
        if not (down or need_weights):
            return
        x, arena = b.data, thread_arena()
        lowered, space = self._spent_kept(index, kind, x, arena) if need_weights else (None, arena)
        _, dw = conv_backward(x, t.diff, self.blobs[0].data, self.geom, kind, data=down, weights=need_weights,
                              ws=space, chunk=chunk, dx_out=b.diff if down else None, lowered=lowered)
        if need_weights:
            self.blobs[0].diff[...] += dw

    def bind_backward(self, top, propagate_down, bottom):
        """backward with the lowering type and chunk chosen now (bind_forward's terms)."""
        kind = self._lowering()
        if len(bottom) != 1 or self._owner is not self:
            return super().bind_backward(top, propagate_down, bottom)
        t, down, b, chunk = top[0], propagate_down[0], bottom[0], self._chunk(kind, bottom[0].data)
        pointwise_backward = None if kind != 3 or self.geom.empty else type3.bind_pointwise_backward(
            b.data, t.diff, self.blobs[0].data, self.geom, b.diff if down else None)   # (no diff made where none is)

        def backward():
            if self.bias_term and self.param_propagate_down[1]:
                self._bias_gradient(top)
            if pointwise_backward is None:
                self._backward_bottom(0, t, down, b, kind, chunk)
                return
            dw = pointwise_backward(down, self.param_propagate_down[0])
            if dw is not None:
                self.blobs[0].diff[...] += dw
        return backward

    def _weight_gradient(self, top, bottom, kind, arena):
        for index, (t, b) in enumerate(zip(top, bottom)):
            x = b.data
            _, dw = conv_backward(x, t.diff, self.blobs[0].data, self.geom, kind, data=False, weights=True,
                                  ws=arena, chunk=self._chunk(kind, x), lowered=self._kept_matrix(index, kind, x))
            self.blobs[0].diff[...] += dw

    def _forward_on(self, device, b, t, weight, bias):
        device_lowering.forward(device, b.device_data(device), weight, self.geom, b.shape[0],
                                t.mutable_device_data(device, upload=False), bias,     # written whole
                                budget=self._device_budget)

    def _backward_on(self, device, t, b, weight, weight_diff, down):
        device_lowering.backward(device, b.device_data(device), t.device_diff(device), weight, self.geom,
                                 b.shape[0], dx=b.mutable_device_diff(device, upload=False) if down else None,
                                 dw=weight_diff, budget=self._device_budget)         # dx set whole

    def backward_data(self, top, propagate_down, bottom):
        kind, arena = self._lowering(), thread_arena()
        for t, down, b in zip(top, propagate_down, bottom):
            if down:
                conv_backward(b.data, t.diff, self.blobs[0].data, self.geom, kind, data=True, weights=False,
                              ws=arena, chunk=self._chunk(kind, b.data), dx_out=b.diff)


@register("Deconvolution")
class Deconvolution(_ConvolutionBase):
    """Transposed convolution (Caffe's): forward is the convolution's data gradient.

    convolution_param: as Convolution. Params: weight (C, O/group, KH, KW) where
    C is the bottom's channels, bias (O,).
    bottom[i] (N, C, H, W) -> top[i] (N, O, OH, OW),
    OH = stride_h*(H-1) + dilation_h*(KH-1)+1 - 2*pad_h (OW alike).
    """
    reverse = True

    def _geometry(self, shape):
        # The geometry of the convolution this layer transposes: it maps top to bottom.
        out_h = self.stride[0] * (shape[2] - 1) + self.dilation[0] * (self.kernel[0] - 1) + 1 - 2 * self.pad[0]
        out_w = self.stride[1] * (shape[3] - 1) + self.dilation[1] * (self.kernel[1] - 1) + 1 - 2 * self.pad[1]
        if out_h < 0 or out_w < 0:        # Caffe's Blob::Reshape refuses it (CHECK_GE); 0 runs, empty
            raise self.shape_error(f"output would be {out_h} x {out_w} for input {shape[2]} x {shape[3]} "
                                   f"({kernel_fields(self)})")
        return self._geometry_for(self.num_output, self.channels, out_h, out_w)

    def _top_shape(self, batch):
        return self.geom.input_shape(batch)

    def forward(self, bottom, top):
        kind = self._lowering()
        weight, arena = self.blobs[0].data, thread_arena()
        for b, t in zip(bottom, top):
            conv_backward_data(b.data, weight, self.geom, kind, out=t.data, ws=arena,
                               chunk=self._chunk(kind, b.data))
            self._add_bias(t.data)

    # backward (Layer.backward): the weight gradient, the bias gradient, the data gradient
    def _weight_gradient(self, top, bottom, kind, arena):
        for t, b in zip(top, bottom):
            self.blobs[0].diff[...] += conv_backward_weights(t.diff, b.data, self.geom, kind, ws=arena,
                                                             chunk=self._chunk(kind, b.data))

    # on a device: the convolution's gradients and forward with the roles swapped
    def _forward_on(self, device, b, t, weight, bias):
        batch, output = b.shape[0], t.mutable_device_data(device)
        device_lowering.backward(device, None, b.device_data(device), weight, self.geom, batch, dx=output,
                                 budget=self._device_budget)
        if bias is not None:
            device_lowering.add_bias(device, output, batch, t.shape[1], t.count_range(2), bias)

    def _backward_on(self, device, t, b, weight, weight_diff, down):
        batch, top_diff = b.shape[0], t.device_diff(device)
        if weight_diff is not None:
            device_lowering.backward(device, top_diff, b.device_data(device), None, self.geom, batch,
                                     dw=weight_diff, budget=self._device_budget)
        if down:
            device_lowering.forward(device, top_diff, weight, self.geom, batch, b.mutable_device_diff(device),
                                    budget=self._device_budget)

    def backward_data(self, top, propagate_down, bottom):
        kind, arena = self._lowering(), thread_arena()
        for t, down, b in zip(top, propagate_down, bottom):
            if down:
                conv_forward(t.diff, self.blobs[0].data, self.geom, kind, out=b.diff, ws=arena,
                             chunk=self._chunk(kind, b.data))


@register("Im2col")
class Im2col(Layer):
    """Caffe's im2col of each image, as a layer.

    convolution_param: kernel_size | kernel_h+kernel_w, stride | stride_h+stride_w,
    pad | pad_h+pad_w, dilation, axis (must be 1), force_nd_im2col (no effect).
    bottom (N, C, H, W) -> top (N, C*KH*KW, OH, OW) with OH, OW as Convolution
    (truncating division included); channel index c*KH*KW + i*KW + j holds input
    pixel (oh*sh - ph + i*dh, ow*sw - pw + j*dw), zero outside the image.
    """
    batch_independent = True
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.layer_param.convolution_param
        self.kernel, self.stride, self.pad, self.dilation = read_spatial_params(self, p, bottom[0])

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.shape_error(f"bottom must be 4-d (N, C, H, W), got {shape}")
        try:
            self.geom = ConvGeometry(shape[1], 1, shape[2], shape[3], *self.kernel, *self.stride,
                                     *self.pad, *self.dilation)
        except ValueError as error:
            raise self.shape_error(f"input {shape[2]} x {shape[3]} does not fit the kernel "
                                   f"({kernel_fields(self)}): {error}") from None
        g = self.geom
        top[0].reshape(shape[0], shape[1] * g.kernel_h * g.kernel_w, g.out_h, g.out_w)

    def forward(self, bottom, top):
        g, n = self.geom, bottom[0].shape[0]
        if not n or g.empty:              # nothing to lower: the windows read only padding, or there are none
            top[0].data[...] = 0
            return
        cols = type1.lower(bottom[0].data, g)                          # (C*KH*KW, N*OH*OW)
        rows = g.channels * g.kernel_h * g.kernel_w
        top[0].data[...] = cols.reshape(rows, n, g.out_h, g.out_w).transpose(1, 0, 2, 3)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if not bottom[0].shape[0] or self.geom.empty:
            bottom[0].diff[...] = 0
            return
        cols = top[0].diff.transpose(1, 0, 2, 3)                       # (C*KH*KW, N, OH, OW)
        type1.col2im(np.ascontiguousarray(cols), self.geom, bottom[0].shape[0], out=bottom[0].diff)
