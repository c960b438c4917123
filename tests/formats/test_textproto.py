"""cct.formats.textproto against protobuf's text_format: on every prototxt of
the repository (and of ../shared where it is beside the checkout) the same
message, byte for byte; outside the subset it gives up, leaving the message
empty, and parse_text then gives text_format's message or error."""
from pathlib import Path

import pytest
from google.protobuf import text_format

from cct.core.errors import ConfigError
from cct.formats import textproto
from cct.formats.prototxt import parse_text
from cct.proto import caffe_pb2

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


def prototxt_files():
    files = sorted(REPO.glob("models/**/*.prototxt")) + sorted(REPO.glob("tests/**/*.prototxt"))
    if SHARED.is_dir():
        files += sorted(SHARED.glob("**/*.prototxt"))
    return files


def reference(text):
    """text_format's message for `text` as a net, else as a solver; None if neither parses."""
    for kind in (caffe_pb2.NetParameter, caffe_pb2.SolverParameter):
        try:
            return text_format.Parse(text, kind())
        except text_format.ParseError:
            continue
    return None


def test_every_prototxt_as_text_format_reads_it():
    files = prototxt_files()
    assert len(files) > 50
    fast = 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        expected = reference(text)
        if expected is None:
            assert not textproto.parse(text, caffe_pb2.NetParameter()), path
            continue
        message = type(expected)()
        if textproto.parse(text, message):
            fast += 1
            assert message.SerializeToString() == expected.SerializeToString(), path
        else:
            assert not message.ListFields(), path
    assert fast >= 0.9 * len(files)          # the subset is what the files are made of


ACCEPTED = [
    'name: "a" layer { name: "b" type: "ReLU" bottom: "x" top: "x" }',
    "layer < name: 'b' type: 'ReLU' > layer: { name: \"c\" }",
    "input_dim: [1, 3, 4, 4] input_dim: 7  # a comment\n",
    'layer { convolution_param { num_output: -0 pad: 1 kernel_size: [3, 3] weight_filler { type: "gaussian" '
    "std: .5 mean: -1. } } param { lr_mult: 1e-3 decay_mult: -0 } }",
    "layer { pooling_param { pool: AVE global_pooling: true } relu_param { negative_slope: 2E+2 } }",
    "force_backward: false state { phase: TEST level: -3 stage: 'x' }",
    "",
    "# only a comment",
]


@pytest.mark.parametrize("text", ACCEPTED)
def test_subset_reads_as_text_format(text):
    message = caffe_pb2.NetParameter()
    assert textproto.parse(text, message)
    assert message.SerializeToString() == text_format.Parse(text, caffe_pb2.NetParameter()).SerializeToString()


OUTSIDE = [
    r'name: "a\"b"',                                  # an escape
    'name: "a" "b"',                                  # concatenated strings
    "layer { convolution_param { num_output: 0x10 } }",
    "layer { convolution_param { num_output: 010 } }",
    "layer { pooling_param { pool: 1 } }",             # an enum by number
    "force_backward: 1",
    "force_backward: True",
    "layer { relu_param { negative_slope: 1.0f } }",
    "layer { relu_param { negative_slope: inf } }",
    "layer { relu_param { negative_slope: -nan } }",
    "layer { relu_param { negative_slope: 3e39 } }",
    "layer { relu_param { negative_slope: 1_0 } }",
    "layer { convolution_param { num_output: 4294967296 } }",
    "layer { convolution_param { num_output: -1 } }",  # uint32
    "layer { convolution_param { axis: 2147483648 } }",
    'name: "a" name: "b"',                            # a singular field twice
    "state { phase: TEST } state { level: 1 }",
    "no_such_field: 1",
    "layer [ { name: 'a' }, { name: 'b' } ]",
    "[caffe.foo]: 1",
    "name: 'a', layer { name: 'b' };",
    "layer { name: 'a'",
    "layer { name: 'a' } }",
    "layer { name: 'a' >",
    "layer { name { } }",
    "layer name: 'a'",
    "input_dim: [1, 2",
]


@pytest.mark.parametrize("text", OUTSIDE)
def test_outside_the_subset_text_format_decides(text):
    message = caffe_pb2.NetParameter()
    assert not textproto.parse(text, message)
    assert not message.ListFields()
    try:
        expected = text_format.Parse(text, caffe_pb2.NetParameter())
    except text_format.ParseError as error:
        with pytest.raises(ConfigError) as raised:
            parse_text(text, caffe_pb2.NetParameter(), source="t.prototxt")
        assert str(error) in str(raised.value)
    else:
        assert parse_text(text, caffe_pb2.NetParameter()).SerializeToString() == expected.SerializeToString()


def test_a_message_with_fields_goes_to_text_format():
    """text_format's multiple-field checks see the fields already there."""
    message = caffe_pb2.NetParameter(name="kept")
    assert not textproto.parse('layer { name: "a" }', message)
    assert message.name == "kept"
    with pytest.raises(ConfigError, match="multiple"):
        parse_text('name: "b"', message)
