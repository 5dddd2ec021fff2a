#!/bin/bash
# The wheels a lent GPU machine lacks (its image: Python 3.12, x86_64, no package registry), into an ignored folder
# that the device call carries (`carry: [".whl"]`, at most 64 MiB):
#   bash bench/gpu_wheels.sh [DIR]            (default .whl; from the repository root, on a machine with PyPI)
# then on the device, before bench/gpu_check.sh:
#   pip install --no-index --find-links .whl deepspeed webdataset submitit
# DeepSpeed is an sdist on PyPI: its wheel is built here (pure Python, its ops compiled on first use there).
set -euo pipefail
D=${1:-.whl}; mkdir -p "$D"
PY=${PY:-python3}
# compiled dependencies for CPython 3.12 on manylinux x86_64; pure ones for any Python
$PY -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$D" \
  pydantic-core==2.50.5 msgpack psutil
$PY -m pip download -q --no-deps --only-binary :all: -d "$D" pydantic==2.14.4 typing-inspection annotated-types \
  hjson py-cpuinfo ninja webdataset braceexpand submitit cloudpickle
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$D" "deepspeed==${DS_VERSION:-0.19.8}"
du -sh "$D"; ls "$D"
