"""Fuzzing the net descriptions cct reads (cct.formats.prototxt, the Net it
builds, its runtime): prototxt text and binary NetParameter files, mutated from
the reference cases and the small models, built with cct.Net and run forward
and backward at 1 to 3 batch partitions. Each ends as a CctError or runs."""
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cct
from cct.proto import caffe_pb2
from cct.formats.prototxt import parse_text
from cct.runtime.settings import PARTITIONS_ENV
from helpers.fuzz import attempt, byte_ops, fuzz_settings, message_ops, mutate_bytes, mutate_text, \
    mutated_message_bytes, text_ops
from helpers.paths import MODELS, REPO

pytestmark = pytest.mark.fuzz

CASES = sorted(path.parent for path in (REPO / "tests" / "reference" / "cases").glob("*/net.prototxt"))
MODEL_NETS = [MODELS / "lenet" / "lenet.prototxt", MODELS / "lenet" / "lenet_train_test.prototxt",
              MODELS / "cifar10_quick" / "cifar10_quick.prototxt", MODELS / "digits_lstm" / "train_test.prototxt"]
SEEDS = [(case / "net.prototxt", (case / "phase.txt").read_text().strip()) for case in CASES] + \
        [(path, "TEST") for path in MODEL_NETS]
TEXTS = [path.read_text() for path, _ in SEEDS]
PARTITIONS = st.sampled_from([None, "1", "2", "3"])


def run_net(path, phase, partitions):
    """Build, run forward and backward, close the data layers' threads."""
    previous = os.environ.pop(PARTITIONS_ENV, None)
    if partitions:
        os.environ[PARTITIONS_ENV] = partitions
    try:
        net = cct.Net(str(path), cct.TRAIN if phase == "TRAIN" else cct.TEST)
        try:
            net.forward()
            net.backward()
        finally:
            for layer in net.layers:
                getattr(layer, "close", lambda: None)()
    finally:
        os.environ.pop(PARTITIONS_ENV, None)
        if previous is not None:
            os.environ[PARTITIONS_ENV] = previous


@fuzz_settings()
@given(seed=st.integers(0, len(SEEDS) - 1), edits=text_ops(), raw=byte_ops(), partitions=PARTITIONS)
def test_prototxt_text(seed, edits, raw, partitions):
    data = mutate_bytes(mutate_text(TEXTS[seed], edits).encode(), raw)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "net.prototxt"
        path.write_bytes(data)
        attempt("prototxt", lambda: run_net(path, SEEDS[seed][1], partitions), lambda: data.decode(errors="replace"))


def _parsed(text):
    try:
        return parse_text(text, caffe_pb2.NetParameter())
    except Exception:
        return None


MESSAGES = [(message, phase) for message, (_, phase) in zip(map(_parsed, TEXTS), SEEDS) if message is not None]


@fuzz_settings()
@given(seed=st.integers(0, len(MESSAGES) - 1), edits=message_ops(), raw=byte_ops(), partitions=PARTITIONS)
def test_binary_net(seed, edits, raw, partitions):
    message, phase = MESSAGES[seed]
    data = mutated_message_bytes(message, edits, raw)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "net.caffemodel"          # read_net reads binary by this extension
        path.write_bytes(data)
        attempt("binary net", lambda: run_net(path, phase, partitions), lambda: repr(data[:600]))
