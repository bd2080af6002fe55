#!/usr/bin/env bash
# GPU readiness in one call: install what is missing, then run scripts/gpu_check.py (kernels against
# float64 references, a bf16 FSDP2 GRPO run with the native engine and with vLLM when it imports, and
# the GPU sections of the benches), within a budget of 8 minutes. The last line is one JSON summary;
# the exit code is non-zero on any mismatch.
#
#   bash scripts/gpu_check.sh                     # uses python3 (its torch must see the GPU)
#   WHEELS=/path/to/wheels bash scripts/gpu_check.sh   # offline machines: install missing packages from there
#
# The machine's own torch (a CUDA build) is kept: tinyzero is installed with --no-deps, and only the
# packages it imports that are missing are added (from $WHEELS when given, else from the index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || {
  echo '{"ok": false, "error": "python3 has no torch that sees a CUDA GPU"}'; exit 2; }
missing=$("$PY" - <<'PY'
import importlib.util
need = {"transformers": "transformers", "tyro": "tyro", "pyarrow": "pyarrow", "safetensors": "safetensors",
        "yaml": "pyyaml", "triton": "triton"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" $missing
  else
    "$PY" -m pip install -q $missing
  fi
fi
"$PY" -c "import tinyzero" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e .
exec timeout 480 "$PY" scripts/gpu_check.py "$@"
