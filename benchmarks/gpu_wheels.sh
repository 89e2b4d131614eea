#!/usr/bin/env bash
# Fetch, on a machine with the package registry, the wheels that a GPU machine without internet
# needs to run benchmarks/gpu.py from this checkout: CPython 3.12 on x86-64 Linux that already
# has torch (CUDA), numpy, scipy, pandas, psutil, tqdm, rich, fsspec, filelock, pillow and
# tifffile, but not Dagster, Zarr or MONAI.  The versions are the ones this project is tested
# with; a package a wheel names as a dependency and the machine lacks would fail the import
# check of the recipe in benchmarks/gpu.py's docstring, by name.
#
#     bash benchmarks/gpu_wheels.sh [DIR]     # default benchmarks/.wheels (git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-benchmarks/.wheels}
python=${PYTHON:-python3}

wheels=(
  # zarrfeed.definitions and the CT build that gpu.py runs through Dagster
  dagster==1.13.27 dagster-pipes==1.13.27 dagster-shared==1.13.27
  alembic==1.20.1 mako==1.4.3 sqlalchemy==2.1.9
  grpcio==1.85.3 grpcio-health-checking==1.81.1 protobuf==6.33.6
  antlr4-python3-runtime==4.13.2 coloredlogs==14.0 humanfriendly==10.0
  docstring-parser==0.18.0 structlog==26.1.0 toposort==1.10
  universal-pathlib==0.3.10 pathlib-abc==0.5.2 python-dotenv==1.2.4 pytz==2026.6
  tzdata==2026.6 tomli==2.5.0 tomlkit==0.15.2 watchdog==6.0.0 click==8.5.1
  platformdirs==4.14.8 truststore==0.10.5 typing-extensions==4.16.0 tabulate==0.10.0 six==1.17.0
  # the store and the formats
  zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 orjson==3.13.0
  nibabel==5.4.2 isal==1.9.1 pydicom==3.0.2 packaging==26.4 pypng==0.20220715.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  # the hub client zarrfeed imports (the machine's older one lacks httpx2)
  huggingface-hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0
  idna==3.20 hf-xet==1.8.0
  # the trainer's TensorBoard event files (writing them needs no tensorboard-data-server)
  tensorboard==2.21.0 absl-py==2.5.1 markdown==3.11.3
  werkzeug==3.1.9 markupsafe==3.0.4
  # the peer gpu.vs_monai measures (pure Python)
  monai==1.6.1
)

mkdir -p "$dest"
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  -d "$dest" "${wheels[@]}"
count=$(find "$dest" -name '*.whl' | wc -l)
echo "$count wheels, $(du -sh "$dest" | cut -f1) in $dest"
