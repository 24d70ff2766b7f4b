#!/usr/bin/env bash
# `h3gen bench` on a GPU machine with no package index: torch, transformers and friends are already there,
# the rest comes as wheels in .devwheels/ (diffusers, av, platformdirs, importlib_metadata, and setuptools>=77 where
# the machine's is older: the build below takes the one in the site folder first).
#   bench/offline.sh --preset h3-base --durations 10 --random-weights full --forwards 1 -o "$OUT"
set -euo pipefail
site=/tmp/h3gen-site
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$site" .devwheels/*.whl
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --no-compile --target "$site" .
cd /tmp
exec python3 -m h3gen.cli.main bench "$@"
