#!/usr/bin/env bash
# Wheels for a GPU machine that has CUDA's torch (and accelerate, peft, pandas, pyarrow, ...) but no network: what
# benchmarks/gpu.py needs beyond them, at the versions this project is tested with, for Python 3.12 on x86-64.
#
#   benchmarks/gpu_wheels.sh DIR          # here, with network: download into DIR (about 18 MB)
#   python3 -m pip install --no-index --no-deps --target SITE DIR/*.whl && export PYTHONPATH=SITE:.
#   python3 benchmarks/gpu.py             # there, from the repository's root
set -euo pipefail
dir="${1:?usage: benchmarks/gpu_wheels.sh DIR}"
python="${PYTHON:-python3}"
version="${PYTHON_VERSION:-3.12}"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$dir" \
    transformers==5.24.0 datasets==5.2.0 fsspec==2026.9.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2 \
    torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
    opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 googleapis-common-protos==1.76.0 \
    opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2
ls "$dir"
