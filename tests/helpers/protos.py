"""Prototxt text in, caffe.proto messages out, and messages compared as text."""
from google.protobuf import text_format

from cct.proto import caffe_pb2


def parse(text, message=None):
    """`text` parsed into `message` (a new NetParameter by default)."""
    return text_format.Parse(text, message or caffe_pb2.NetParameter())


def assert_same(actual, expected_text):
    """`actual` equals the message of its type that `expected_text` spells, compared as text."""
    expected = parse(expected_text, type(actual)())
    assert text_format.MessageToString(actual) == text_format.MessageToString(expected)
