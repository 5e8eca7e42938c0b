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
#                                     wheels (if given) beside the machine's own torch, run
#                                     `bench.transfer_descs --device cuda` for an 8B- and a
#                                     70B-TP4-shaped pull (per-layer built and prepared,
#                                     block-major, staged, against a device copy: `## transfer
#                                     descriptors (GPU, MODEL)`), the `gpu` tests, then
#                                     `bench.transfer --device cuda` (`## transfer (GPU)`;
#                                     GPU_SWEEP=0 skips it). With OUT set, the logs, the
#                                     benches' JSON and RESULTS.md are copied there as each
#                                     step ends.
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
  keep() {  # what a step left, copied as it ends: a call cut short still returns the earlier ones
    if [ -n "$out" ]; then
      cp bench/RESULTS.md "$out/RESULTS.md"
      cp bench/.work/transfer-gpu.json "$out/" 2>/dev/null || true
    fi
  }
  # First what the transfer issue is judged on: a 12k-token pull (750 blocks of 16 tokens) of
  # an 8B-shaped cache, per-layer (built, prepared), block-major and staged, against a device
  # copy, with 0, 2 and 8 UCX worker threads; the same pull from blocks in runs of 8; then the
  # 70B-TP4 shape.
  "$py" -m bench.transfer_descs --device cuda --model 8b --blocks 16 128 750 \
    --threads 0 2 8 --reps "${GPU_REPS:-5}" 2>&1 | tee ${out:+"$out/gpu-descs-8b.log"} || rc=1
  keep
  "$py" -m bench.transfer_descs --device cuda --model 8b --blocks 750 --order runs8 \
    --threads 2 --reps "${GPU_REPS:-5}" --section "transfer descriptors (GPU, 8b, runs of 8)" \
    2>&1 | tee ${out:+"$out/gpu-descs-8b-runs8.log"} || rc=1
  keep
  "$py" -m bench.transfer_descs --device cuda --model 70b-tp4 --blocks 16 128 750 \
    --threads 0 2 --reps "${GPU_REPS:-5}" 2>&1 | tee ${out:+"$out/gpu-descs-70b-tp4.log"} || rc=1
  keep
  "$py" -m pytest -q -rs -p no:cacheprovider -m gpu tests/connector/test_transfer_cuda.py \
    tests/bench/test_transfer_descs.py \
    2>&1 | tee ${out:+"$out/gpu-tests.log"} || rc=1
  # The block-size sweep of `## transfer (GPU)`; GPU_SWEEP=0 leaves it out where a lent
  # machine's minutes are short and the section is current.
  if [ "${GPU_SWEEP:-1}" != 0 ]; then
    "$py" -m bench.transfer --device cuda --sizes-kib 16 64 256 1024 4096 \
      --total-mib "${GPU_TOTAL_MIB:-1024}" \
      --reps "${GPU_REPS:-5}" --rejections "${GPU_REJECTIONS:-20}" \
      --json bench/.work/transfer-gpu.json 2>&1 | tee ${out:+"$out/gpu-bench.log"} || rc=1
    keep
  fi
  return $rc
}

case "${1:-}" in
  wheels) fetch_wheels "${2:?usage: scripts/gpu-check.sh wheels DIR}" ;;
  run) run_checks "${2:-}" ;;
  *) sed -n '2,23p' "$0" >&2; exit 2 ;;
esac
