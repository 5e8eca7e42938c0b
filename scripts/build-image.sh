#!/usr/bin/env bash
# Build the proxy image as CI does (`make test-image`): Docker when its engine answers, podman
# otherwise. Where the Dockerfile's base image is neither here nor pullable (no registry), a
# stand-in with the same Python (Debian bookworm's python3, 3.11) is made with mmdebstrap and
# stored under the base's name; the script says which base it used.
#
#   KVRELAY_IMAGE      tag to build (default kvrelay:ci)
#   CONTAINERS_CONF    podman's config (default build/podman/containers.conf, written here)
#
# pip inside the build reaches the package index with this machine's CA bundle (PIP_CERT or
# pip's `cert`) and index URL (PIP_INDEX_URL or pip's `index-url`), handed in as build secrets:
# nothing of them stays in the image.
set -euo pipefail
cd "$(dirname "$0")/.."
image="${KVRELAY_IMAGE:-kvrelay:ci}"
base="$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)"
py="${PYTHON:-python3}"

bash scripts/ensure-podman.sh
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  engine=docker
  build_flags=()
else
  engine=podman
  export CONTAINERS_CONF="${CONTAINERS_CONF:-$PWD/build/podman/containers.conf}"
  if [ ! -f "$CONTAINERS_CONF" ]; then
    # runc (crun refuses some cgroup set-ups); container rlimits within this shell's hard
    # limits, which an unprivileged runtime cannot raise.
    mkdir -p "$(dirname "$CONTAINERS_CONF")"
    nofile="$(ulimit -Hn)"
    [ "$nofile" = unlimited ] && nofile=1048576
    cat > "$CONTAINERS_CONF" <<CONF
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=4096:4096"]
[engine]
runtime = "runc"
CONF
  fi
  # Docker format keeps HEALTHCHECK (OCI images have no such field); host network: the
  # build's pip uses this machine's route to the index.
  build_flags=(--format docker --network host)
fi
echo "image engine: $engine"

if "$engine" image inspect "$base" >/dev/null 2>&1; then
  echo "base image: $base (already present: $("$engine" image inspect --format '{{.Id}}' "$base"))"
elif timeout 120 "$engine" pull -q "$base" >/dev/null 2>&1; then
  echo "base image: $base (pulled)"
else
  command -v mmdebstrap >/dev/null || { echo "cannot pull $base and mmdebstrap is missing" >&2; exit 1; }
  echo "base image: $base cannot be pulled; making a stand-in with mmdebstrap (Debian bookworm, python3 3.11)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$tmp/base.tar"
  "$engine" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
    "$tmp/base.tar" "$base" >/dev/null
  echo "base image: $base = stand-in $("$engine" run --rm "$base" python --version)"
fi

secrets=()
cert="${PIP_CERT:-$("$py" -m pip config get global.cert 2>/dev/null || true)}"
if [ -n "$cert" ] && [ -f "$cert" ]; then
  secrets+=(--secret "id=pip-cert,src=$cert")
fi
index="${PIP_INDEX_URL:-$("$py" -m pip config get global.index-url 2>/dev/null || true)}"
if [ -n "$index" ]; then
  conf_dir="$(mktemp -d)"
  printf '[global]\nindex-url = %s\n' "$index" > "$conf_dir/pip.conf"
  secrets+=(--secret "id=pip-conf,src=$conf_dir/pip.conf")
fi

start=$SECONDS
"$engine" build "${build_flags[@]}" "${secrets[@]}" -t "$image" .
[ -n "${conf_dir:-}" ] && rm -rf "$conf_dir"
size="$("$engine" image inspect --format '{{.Size}}' "$image")"
echo "built $image with $engine in $((SECONDS - start))s: $((size / 1000000)) MB"
