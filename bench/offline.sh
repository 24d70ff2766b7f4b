#!/usr/bin/env bash
# `h3gen bench` on a GPU machine with no package index: torch, transformers and friends are already there,
# the rest comes as wheels (diffusers, av, platformdirs, importlib_metadata, tomli-w, fa3-fwd, and setuptools>=77
# where the machine's is older: the build below takes the one in the site folder first). Wheels under .devwheels/
# are kept in /tmp/h3gen-wheels, so wheels too large for one transfer can come in two calls while the machine is up:
#   bench/offline.sh --keep-wheels                      # first call: keep what it carried, install nothing
#   bench/offline.sh --preset h3-base --durations 10 --random-weights full --forwards 1 -o "$OUT"
# Or in one call: the wheels installed here into one folder and packed with xz, half their size as wheels:
#   pip install --no-deps --no-index --no-compile --target /tmp/sitepack .devwheels/*/*.whl
#   tar -C /tmp/sitepack -cf - . | xz -9 > .devwheels/site.tar.xz     # then carry .devwheels/site.tar.xz alone
set -euo pipefail
kept=/tmp/h3gen-wheels site=/tmp/h3gen-site
mkdir -p "$kept" "$site"
find .devwheels -name '*.whl' -exec cp {} "$kept/" \; 2>/dev/null || true
[ "${1:-}" = "--keep-wheels" ] && { ls "$kept"; exit 0; }
if [ -f .devwheels/site.tar.xz ]; then
  tar -xJf .devwheels/site.tar.xz -C "$site"
else
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$site" "$kept"/*.whl
fi
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --no-compile --target "$site" .
[ "${1:-}" = "--install" ] && exit 0
cd /tmp
exec python3 -m h3gen.cli.main bench "$@"
