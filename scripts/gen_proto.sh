#!/usr/bin/env bash
# Regenerate the Python code for serving/proto/jbatch/v1/*.proto (committed next to the .proto).
# Needs grpcio-tools (pip install -e ".[test]"). Run from anywhere: ./scripts/gen_proto.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
proto_root="$root/serving/proto"
out="$proto_root/jbatch/v1"
python -m grpc_tools.protoc -I "$proto_root" \
  --python_out="$proto_root" --pyi_out="$proto_root" --grpc_python_out="$proto_root" \
  "$out"/*.proto
# protoc writes absolute imports ("from jbatch.v1 import generation_pb2"), which would resolve
# to the jbatch Python package; the generated modules sit side by side, so import relatively.
for f in "$out"/*_pb2_grpc.py; do
  sed -i -E 's/^from jbatch\.v1 import ([a-z0-9_]+_pb2)/from . import \1/' "$f"
done
echo "generated: $(cd "$root" && ls serving/proto/jbatch/v1/*_pb2*.py*)"
