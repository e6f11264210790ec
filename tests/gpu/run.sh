#!/usr/bin/env bash
# The GPU verification (docs/gpu-verification.md) on an NVIDIA machine, from a checkout with no network.
#
#   tests/gpu/run.sh all            build the CUDA and CPU bundles, then verify everything
#   tests/gpu/run.sh setup|build-bg|wait-build|verify|bring-back ...   the same in steps
#
# Wheels for what the machine lacks go in .gpu/whl (ignored through .git/info/exclude), the
# engine sdist in .gpu/src, Gemma's GGUF (whole or in parts) in .gpu/gemma. See
# docs/gpu-verification.md. Everything else is tests/gpu/verify_gpu.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
SITE=${STOKER_GPU_SITE:-/tmp/stoker-gpu-site}
WHEELS=${STOKER_GPU_WHEELS:-.gpu/whl}

if compgen -G "$WHEELS/*.whl" >/dev/null && [ ! -f "$SITE/.stoker-wheels" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
    touch "$SITE/.stoker-wheels"
fi
mkdir -p "$SITE"
# A CUDA bundle carries its runtime (libcudart, libcublas, libcublasLt): everything runs with
# the toolkit's libraries hidden from the loader, as on a user's machine with only the driver.
unset LD_LIBRARY_PATH
# Stoker runs from this checkout, not installed: register its backend entry points beside the
# wheels so that daemon/backends/registry.py finds the built-ins.
"$PY" - "$SITE" "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib, pathlib
site, pyproject = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
project = tomllib.loads(pyproject.read_text())["project"]
info = site / f"stoker-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: stoker\nVersion: {project['version']}\n")
lines = []
for group, points in project.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {target}" for name, target in points.items()]
lines.append("[console_scripts]")
lines += [f"{name} = {target}" for name, target in project.get("scripts", {}).items()]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
EOF
# The packages by their installed names (stoker.daemon -> daemon/ ...), as an install has them.
mkdir -p "$SITE/stoker"
for d in daemon states store tui; do ln -sfn "$ROOT/$d" "$SITE/stoker/$d"; done
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "${1:-}" = bench ]; then  # a benchmark with the same environment: run.sh bench NAME ARGS
    shift; name=$1; shift
    exec "$PY" "tests/bench/$name.py" "$@"
fi
exec "$PY" tests/gpu/verify_gpu.py "$@"
