#!/usr/bin/env bash
# Create (or reuse) a virtual environment that has both Ray and torch, for the tests that run a
# torch.distributed job's ranks as Ray actors (tests/integration/test_ranks_ray.py).
#
#   scripts/setup_ray_torch.sh           # venv at $KVDIAG_RAY_TORCH_VENV (default ~/.cache/kvdiag/ray-torch-venv)
#
# The cluster's nodes run on this venv's Python (a raylet's workers run on the Python that started it), and
# kvdiag's capture task runs there too: it gets Ray, torch (CPU is enough: the ranks talk gloo) and kvdiag's
# own dependencies, but not kvdiag itself; the tests put the source tree on PYTHONPATH, so the venv never
# holds a stale copy. Ray's driver and cluster must agree on the versions of Ray and Python: build it with the
# Python of the environment kvdiag is tested in ($KVDIAG_PYTHON, default python3) and the same Ray.
#
# torch's CPU build (about 190 MB) comes from PyTorch's CPU index where pip's configuration does not serve it:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup_ray_torch.sh
# Idempotent: a venv where torch.distributed, ray and kvdiag's dependencies import is reused as it is.
set -euo pipefail
VENV="${KVDIAG_RAY_TORCH_VENV:-$HOME/.cache/kvdiag/ray-torch-venv}"
PYTHON="${KVDIAG_PYTHON:-python3}"
TORCH="${KVDIAG_TORCH_SPEC:-torch==2.13.0+cpu}"
RAY="${KVDIAG_RAY_SPEC:-ray[default]==2.60.0}"
HERE="$(cd "$(dirname "$0")" && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
PROBE='import torch.distributed, ray, ray.util.state, pydantic, typer, psutil, yaml, jinja2, rich, pystack'

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$PROBE" >/dev/null 2>&1; then
  echo "ray-torch venv: reusing $VENV (ray $("$VENV/bin/python" -c 'import ray; print(ray.__version__)'))"
else
  echo "ray-torch venv: creating $VENV ($TORCH, $RAY)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  # kvdiag's own dependencies, as pyproject.toml lists them (kvdiag itself comes from the source tree)
  "$VENV/bin/python" -c 'import tomllib' 2>/dev/null || "$VENV/bin/python" -m pip install -q tomli
  "$VENV/bin/python" - "$HERE/../pyproject.toml" > "$VENV/kvdiag-requirements.txt" <<'PY'
import sys
try:
    import tomllib
except ImportError:      # Python 3.10
    import tomli as tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
PY
  "$VENV/bin/python" -m pip install -q "$TORCH" "$RAY" -r "$VENV/kvdiag-requirements.txt"
  "$VENV/bin/python" -c "$PROBE"
fi
echo "KVDIAG_RAY_TORCH_PYTHON=$VENV/bin/python"
