"""Weight fillers, keyed by FillerParameter.type, with Caffe's formulas.

Fan sizes follow Caffe: fan_in = count / shape[0], fan_out = count / shape[1]
(for a conv weight o x c x k x k: c*k*k and o*k*k).
"""
import math
from typing import Callable, Dict, Sequence

import numpy as np

from cct.core.arrays import Array, Float32Array
from cct.core.blob import Blob
from cct.core.errors import ConfigError
from cct.core.rng import get_rng
from cct.proto import caffe_pb2


def fill(blob: Blob, filler_param: caffe_pb2.FillerParameter, where: str = "filler") -> Blob:
    """Fill blob.data according to `filler_param` (a caffe_pb2.FillerParameter)."""
    kind = filler_param.type
    filler = FILLERS.get(kind)
    if filler is None:
        raise ConfigError(f"{where}: type: unknown filler {kind!r}; known: {', '.join(sorted(FILLERS))}")
    if not blob.count and kind != "bilinear":     # Caffe's fillers CHECK(count); bilinear checks only its axes
        raise ConfigError(f"{where}: the {kind} filler cannot fill a blob of shape {blob.shape}, which holds "
                          "no values (Caffe refuses it too)")
    filler(blob.data, filler_param, where)
    return blob


def fills_zeros(filler_param: caffe_pb2.FillerParameter) -> bool:
    """Whether the filler writes +0.0 everywhere: Caffe's default, a constant 0."""
    return filler_param.type == "constant" and filler_param.value == 0 and math.copysign(1.0, filler_param.value) > 0


# Random values are drawn in float32, and straight into a float32 blob: a
# float64 temporary for CaffeNet's fc6 alone would be 300 MB, and a DummyData
# refill of CaffeNet's images at batch 256 would add 151 MiB to the peak.
def _drawn_into(out: Array, draw: Callable[[Float32Array], None]) -> Array:
    """out = draw(array) in float32: into `out` itself when it is a C-contiguous
    float32 array, else into a float32 array then copied (the same numbers)."""
    direct = out.dtype == np.float32 and out.flags.c_contiguous
    values = out if direct else np.empty(out.shape, np.float32)
    draw(values)
    if not direct:
        out[...] = values
    return out


def _uniform_values(low: float, high: float, out: Array) -> Array:
    def draw(values: Float32Array) -> None:
        get_rng().random(dtype=np.float32, out=values)
        values *= np.float32(high - low)
        values += np.float32(low)
    return _drawn_into(out, draw)


def _normal_values(mean: float, std: float, out: Array) -> Array:
    def draw(values: Float32Array) -> None:
        get_rng().standard_normal(dtype=np.float32, out=values)
        values *= np.float32(std)
        values += np.float32(mean)
    return _drawn_into(out, draw)


def _constant(out: Array, p: caffe_pb2.FillerParameter, where: str) -> None:
    out[...] = np.float32(p.value)


def _uniform(out: Array, p: caffe_pb2.FillerParameter, where: str) -> None:
    _uniform_values(p.min, p.max, out)


def _gaussian(out: Array, p: caffe_pb2.FillerParameter, where: str) -> None:
    if p.sparse < -1:
        raise ConfigError(f"{where}: sparse: must be >= -1, got {p.sparse}")
    _normal_values(p.mean, p.std, out)
    if p.sparse >= 0:
        # Each output keeps about `sparse` non-zero inputs (Caffe's sparse gaussian).
        out *= get_rng().random(out.shape, dtype=np.float32) < p.sparse / out.shape[0]


def _positive_unitball(out: Array, p: caffe_pb2.FillerParameter, where: str) -> None:
    def draw(values: Float32Array) -> None:
        get_rng().random(dtype=np.float32, out=values)
        rows = values.reshape(values.shape[0] if values.shape else 1, -1)
        rows /= rows.sum(axis=1, keepdims=True)
    _drawn_into(out, draw)


def _fan(shape: Sequence[int], p: caffe_pb2.FillerParameter, where: str) -> float:
    count = int(np.prod(shape))
    fan_in = count / shape[0]
    fan_out = count / shape[1] if len(shape) > 1 else count
    norms = {0: fan_in, 1: fan_out, 2: (fan_in + fan_out) / 2}   # VarianceNorm enum
    return norms[p.variance_norm]


def _xavier(out: Array, p: caffe_pb2.FillerParameter, where: str) -> None:
    scale = np.sqrt(3.0 / _fan(out.shape, p, where))
    _uniform_values(-scale, scale, out)


def _msra(out: Array, p: caffe_pb2.FillerParameter, where: str) -> None:
    std = np.sqrt(2.0 / _fan(out.shape, p, where))
    _normal_values(0.0, std, out)


def _bilinear(out: Array, p: caffe_pb2.FillerParameter, where: str) -> None:
    """Weights that make a Deconvolution upsample bilinearly (FCN's trick)."""
    shape = out.shape
    if len(shape) != 4 or shape[2] != shape[3]:
        raise ConfigError(f"{where}: type: bilinear needs a 4-d blob with square kernels, got {tuple(shape)}")
    size = shape[3]
    factor = np.ceil(size / 2.0)
    center = (2 * factor - 1 - factor % 2) / (2.0 * factor)
    ramp = 1 - np.abs(np.arange(size) / factor - center)
    out[...] = np.outer(ramp, ramp)


FILLERS: Dict[str, Callable[[Array, caffe_pb2.FillerParameter, str], None]] = {
    "constant": _constant, "uniform": _uniform, "gaussian": _gaussian,
    "positive_unitball": _positive_unitball, "xavier": _xavier, "msra": _msra,
    "bilinear": _bilinear,
}
