#!/usr/bin/env bash
# GPU readiness in one call: install what is missing, then run scripts/gpu_check.py (Triton kernels against
# float64, the precision policy on the live model, packed training, bf16 GRPO / PPO / LoRA runs with a
# kill-and-resume through train.py, vLLM when it imports, and the GPU parts of the benches).
# The summary is one JSON object, printed last and written to $SUMMARY; exit code 0 only when every
# section ran on the GPU and passed.
#
#   bash scripts/gpu_check.sh                          # uses python3 (its torch must see the GPU)
#   WHEELS=/path/to/wheels bash scripts/gpu_check.sh   # offline machines: install missing packages from there
#   SUMMARY=out.json bash scripts/gpu_check.sh --sections kernels,precision
#
# The machine's own torch (a CUDA build) is kept: tinyzero is installed with --no-deps, and only the
# packages it imports that are missing are added (from $WHEELS when given, else from the index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUMMARY=${SUMMARY:-gpu_check_summary.json}
BUDGET_S=${BUDGET_S:-420}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || {
  echo '{"ok": false, "error": "python3 has no torch that sees a CUDA GPU"}' | tee "$SUMMARY"; exit 2; }
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
# The outer limit leaves a minute past the script's own budget, so its summary is always written.
exec timeout $((BUDGET_S + 60)) "$PY" scripts/gpu_check.py --budget-s "$BUDGET_S" --summary "$SUMMARY" "$@"
