"""Caffe's protobuf schema (installed as ``cct.proto``).

``caffe.proto`` is BVLC Caffe's own schema (the final ``caffe.proto`` of
github.com/BVLC/caffe master), kept wire- and text-format-compatible with it:
same messages, enums, field names, numbers, types and defaults, so that
Caffe's ``.prototxt``, ``.caffemodel``, ``.binaryproto`` and ``.solverstate``
files read and write unchanged.  ``caffe_pb2`` is generated from it by
``tools/gen_proto.sh`` and checked in.
"""

from . import caffe_pb2

__all__ = ["caffe_pb2"]
