"""Weight fillers, keyed by FillerParameter.type, with Caffe's formulas.

Fan sizes follow Caffe: fan_in = count / shape[0], fan_out = count / shape[1]
(for a conv weight o x c x k x k: c*k*k and o*k*k).
"""
import numpy as np

from cct.core.errors import ConfigError
from cct.core.rng import get_rng


def fill(blob, filler_param, where="filler"):
    """Fill blob.data according to `filler_param` (a caffe_pb2.FillerParameter)."""
    kind = filler_param.type
    filler = FILLERS.get(kind)
    if filler is None:
        raise ConfigError(f"{where}: type: unknown filler {kind!r}; known: {', '.join(sorted(FILLERS))}")
    if not blob.count and kind != "bilinear":     # Caffe's fillers CHECK(count); bilinear checks only its axes
        raise ConfigError(f"{where}: the {kind} filler cannot fill a blob of shape {blob.shape}, which holds "
                          "no values (Caffe refuses it too)")
    blob.data[...] = filler(blob.shape, filler_param, where)
    return blob


# Random values are drawn in float32: a float64 temporary for CaffeNet's fc6
# alone would be 300 MB.
def _uniform_values(low, high, shape):
    values = get_rng().random(shape, dtype=np.float32)
    values *= np.float32(high - low)
    values += np.float32(low)
    return values


def _normal_values(mean, std, shape):
    values = get_rng().standard_normal(shape, dtype=np.float32)
    values *= np.float32(std)
    values += np.float32(mean)
    return values


def _constant(shape, p, where):
    return np.float32(p.value)


def _uniform(shape, p, where):
    return _uniform_values(p.min, p.max, shape)


def _gaussian(shape, p, where):
    if p.sparse < -1:
        raise ConfigError(f"{where}: sparse: must be >= -1, got {p.sparse}")
    values = _normal_values(p.mean, p.std, shape)
    if p.sparse >= 0:
        # Each output keeps about `sparse` non-zero inputs (Caffe's sparse gaussian).
        values *= get_rng().random(shape, dtype=np.float32) < p.sparse / shape[0]
    return values


def _positive_unitball(shape, p, where):
    values = get_rng().random(shape, dtype=np.float32)
    rows = values.reshape(shape[0] if shape else 1, -1)
    rows /= rows.sum(axis=1, keepdims=True)
    return values


def _fan(shape, p, where):
    count = int(np.prod(shape))
    fan_in = count / shape[0]
    fan_out = count / shape[1] if len(shape) > 1 else count
    norms = {0: fan_in, 1: fan_out, 2: (fan_in + fan_out) / 2}   # VarianceNorm enum
    return norms[p.variance_norm]


def _xavier(shape, p, where):
    scale = np.sqrt(3.0 / _fan(shape, p, where))
    return _uniform_values(-scale, scale, shape)


def _msra(shape, p, where):
    std = np.sqrt(2.0 / _fan(shape, p, where))
    return _normal_values(0.0, std, shape)


def _bilinear(shape, p, where):
    """Weights that make a Deconvolution upsample bilinearly (FCN's trick)."""
    if len(shape) != 4 or shape[2] != shape[3]:
        raise ConfigError(f"{where}: type: bilinear needs a 4-d blob with square kernels, got {tuple(shape)}")
    size = shape[3]
    factor = np.ceil(size / 2.0)
    center = (2 * factor - 1 - factor % 2) / (2.0 * factor)
    ramp = 1 - np.abs(np.arange(size) / factor - center)
    return np.broadcast_to(np.outer(ramp, ramp), shape)


FILLERS = {
    "constant": _constant, "uniform": _uniform, "gaussian": _gaussian,
    "positive_unitball": _positive_unitball, "xavier": _xavier, "msra": _msra,
    "bilinear": _bilinear,
}
