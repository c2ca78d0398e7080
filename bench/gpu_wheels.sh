#!/usr/bin/env bash
# Wheels for a GPU host that has python3 3.12, PyTorch, NVML's bindings, grpcio and pytest but none of
# this project's other requirements, and no package index: run here, then carry the folder there.
#
#   bench/gpu_wheels.sh [DIR]        (default .whl; versions pinned to this checkout's .venv)
# There, before bench/gpu_check.sh:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
set -eu
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$dir"
# The requirements the GPU image lacks (docs/gpu-validation.md): the store, OpenTelemetry, the
# receivers' HTTP/2, the reference engine's ASGI stack, and py-spy to name the daemon's threads.
names="alembic mako sqlalchemy opentelemetry-api opentelemetry-sdk opentelemetry-proto
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common
opentelemetry-instrumentation opentelemetry-instrumentation-asgi opentelemetry-semantic-conventions
opentelemetry-util-http asgiref hpack h2 hyperframe uvicorn starlette googleapis-common-protos py-spy protobuf"
frozen=$("$py" -m pip freeze 2>/dev/null)
for name in $names; do
    pinned=$(printf '%s\n' "$frozen" | grep -i "^${name//-/[-_]}==" || true)
    if [[ -z $pinned ]]; then
        echo "skipped $name: not in $py's environment"
        continue
    fi
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$dir" "$pinned" 2>&1 | grep -v "^WARNING: Location" || true
done
ls "$dir" | wc -l | xargs echo "wheels in $dir:"
du -sh "$dir"
