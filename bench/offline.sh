#!/usr/bin/env bash
# `h3gen bench` on a GPU machine with no package index: torch, transformers and friends are already there,
# the rest comes as wheels in .devwheels/ (diffusers, av, platformdirs, importlib_metadata).
#   bench/offline.sh --preset h3-base --durations 10 --random-weights full --forwards 1 -o "$OUT"
set -euo pipefail
site=/tmp/h3gen-site
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --no-compile --target "$site" .
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
cd /tmp
exec python3 -m h3gen.cli.main bench "$@"
