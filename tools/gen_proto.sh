#!/usr/bin/env bash
# Regenerate proto/caffe_pb2.py from proto/caffe.proto with grpcio-tools' protoc.
# Run from anywhere; it works from the repository root.
# The generated module is checked in; tests/proto/test_schema.py fails if it
# is stale.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python -m grpc_tools.protoc -I proto --python_out=proto proto/caffe.proto
