#!/usr/bin/env bash
# The GPU checks: NIXL reads between two engine processes whose KV caches live in one CUDA
# device's memory (the `gpu` tests) and the GPU sections of bench/transfer.py and
# bench/transfer_descs.py.
#
#   scripts/gpu-check.sh wheels DIR   on a machine with network: download into DIR (`.whl` in
#                                     the tree is git-ignored) the wheels a GPU machine without
#                                     network needs (nixl-cu13 with its expert-parallel kernels
#                                     stripped, the connector's pure-Python needs at this venv's
#                                     versions); GPU_PYTHON picks the Python version (3.12)
#   scripts/gpu-check.sh run [DIR]    on the GPU machine, from the repository root: install DIR's
#                                     wheels (if given) beside the machine's own torch, run the
#                                     `gpu` tests, `bench.transfer --device cuda` (writes
#                                     `## transfer (GPU)` in bench/RESULTS.md), then
#                                     `bench.transfer_descs --device cuda` for an 8B- and a
#                                     70B-TP4-shaped pull (per-layer built and prepared,
#                                     block-major, staged, against a device copy: `## transfer
#                                     descriptors (GPU, MODEL)`). With OUT set, the logs, the
#                                     benches' JSON and RESULTS.md are copied there.
#
# The machine must have torch built for CUDA 13 (nixl-cu13) and a CUDA device; the run stops at
# once, saying so, where either is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# The wheels a bare GPU image lacks: nixl (meta and CUDA 13 build) and the connector's and test
# harness's pure-Python needs that are not part of a PyTorch image.
NEEDS=(pydantic pydantic_core annotated-types typing-inspection orjson pydantic-settings
       python-dotenv redis httptools dnspython)

fetch_wheels() {
  local dir=$1 py=${GPU_PYTHON:-3.12}
  mkdir -p "$dir"
  local venv_python=.venv/bin/python
  [ -x "$venv_python" ] || { echo "make venv first: versions are taken from .venv" >&2; exit 1; }
  local pins=(nixl==1.5.1 nixl-cu13==1.5.1)
  for name in "${NEEDS[@]}"; do
    pins+=("$name==$("$venv_python" -c "import importlib.metadata as m; print(m.version('$name'))")")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "${pins[@]}"
  # nixl_ep_cu13 (expert-parallel kernels, about half the wheel) is never imported by the
  # connector; without it the wheel fits what a GPU machine here can be sent.
  python3 - "$dir"/nixl_cu13-*.whl <<'PY'
import base64, csv, hashlib, io, os, sys, zipfile
for path in sys.argv[1:]:
    src = zipfile.ZipFile(path)
    record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
    rows, tmp = [], path + ".part"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.startswith("nixl_ep_cu13/") or info.filename == record:
                continue
            data = src.read(info.filename)
            out.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append((info.filename, f"sha256={digest.decode()}", str(len(data))))
        rows.append((record, "", ""))
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        out.writestr(record, text.getvalue())
    os.replace(tmp, path)
PY
  du -sh "$dir"
}

run_checks() {
  local dir=${1:-} py=${PYTHON:-python3} site=/tmp/kvrelay-gpu-site
  export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  if [ -n "$dir" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$dir"/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"  # after the tree; beside the machine's torch
  fi
  local out=${OUT:-}
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; fi
  "$py" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: the GPU checks cannot run here")
import nixl._api  # noqa: F401  (the CUDA build nixl picks for this torch)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
PY
  local rc=0
  "$py" -m pytest -q -rs -p no:cacheprovider -m gpu tests/connector/test_transfer_cuda.py \
    2>&1 | tee ${out:+"$out/gpu-tests.log"} || rc=1
  "$py" -m bench.transfer --device cuda --sizes-kib 16 64 256 1024 4096 \
    --total-mib "${GPU_TOTAL_MIB:-1024}" \
    --reps "${GPU_REPS:-5}" --rejections "${GPU_REJECTIONS:-20}" \
    --json bench/.work/transfer-gpu.json 2>&1 | tee ${out:+"$out/gpu-bench.log"} || rc=1
  # A 12k-token pull is 750 blocks of 16 tokens; UCX worker threads as the connector's default.
  local model
  for model in 8b 70b-tp4; do
    "$py" -m bench.transfer_descs --device cuda --model "$model" --blocks 16 128 750 \
      --threads 2 --reps "${GPU_REPS:-5}" 2>&1 | tee ${out:+"$out/gpu-descs-$model.log"} || rc=1
  done
  if [ -n "$out" ]; then
    cp bench/RESULTS.md "$out/RESULTS.md"
    cp bench/.work/transfer-gpu.json "$out/" 2>/dev/null || true
  fi
  return $rc
}

case "${1:-}" in
  wheels) fetch_wheels "${2:?usage: scripts/gpu-check.sh wheels DIR}" ;;
  run) run_checks "${2:-}" ;;
  *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
