"""Fuzzing weight files (cct.formats.weights): .caffemodel (binary
NetParameter) and Caffe HDF5 weights, mutated from the reference cases'
weights and loaded into their nets, which then run forward. Each ends as a
CctError or runs."""
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cct
from cct.proto import caffe_pb2
from helpers.fuzz import attempt, byte_ops, fuzz_settings, hdf5_ops, message_ops, mutate_bytes, mutate_hdf5, \
    mutated_message_bytes
from helpers.paths import REPO

pytestmark = pytest.mark.fuzz

CASES = [REPO / "tests" / "reference" / "cases" / name for name in
         ("conv_basic", "inner_product", "batchnorm_global", "prelu", "scale_bias", "deconv", "lstm_basic")]
MODELS = [caffe_pb2.NetParameter.FromString((case / "weights.caffemodel").read_bytes()) for case in CASES]


def _load_and_run(case, weights):
    net = cct.Net(str(case / "net.prototxt"), cct.TEST, weights=str(weights))
    net.forward()


@fuzz_settings()
@given(seed=st.integers(0, len(CASES) - 1), edits=message_ops(), raw=byte_ops())
def test_caffemodel(seed, edits, raw):
    data = mutated_message_bytes(MODELS[seed], edits, raw)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "weights.caffemodel"
        path.write_bytes(data)
        attempt("caffemodel", lambda: _load_and_run(CASES[seed], path), lambda: f"{CASES[seed].name} {edits} {raw}")


@pytest.fixture(scope="module")
def hdf5_weights():
    """Each case's weights as Caffe HDF5, with diffs."""
    folder = Path(tempfile.mkdtemp(prefix="cct-fuzz-h5-"))
    files = []
    for case in CASES:
        net = cct.Net(str(case / "net.prototxt"), cct.TEST, weights=str(case / "weights.caffemodel"))
        files.append(folder / f"{case.name}.caffemodel.h5")
        net.save_hdf5(str(files[-1]), write_diff=True)
    return files


@fuzz_settings()
@given(seed=st.integers(0, len(CASES) - 1), edits=hdf5_ops(), raw=byte_ops())
def test_hdf5_weights(hdf5_weights, seed, edits, raw):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "weights.caffemodel.h5"
        path.write_bytes(hdf5_weights[seed].read_bytes())
        mutate_hdf5(path, edits)
        path.write_bytes(mutate_bytes(path.read_bytes(), raw))
        attempt("hdf5 weights", lambda: _load_and_run(CASES[seed], path), lambda: f"{CASES[seed].name} {edits} {raw}")
