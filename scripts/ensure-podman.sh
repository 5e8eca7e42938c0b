#!/usr/bin/env bash
# Make sure an image builder is here for `make test-image`: a working Docker engine, or podman
# (with buildah's runc runtime) and mmdebstrap, which builds a stand-in base image where the
# Dockerfile's base cannot be pulled. Idempotent: installs only what is missing.
set -euo pipefail
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  exit 0
fi
missing=()
for tool in podman runc mmdebstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "image tools missing (${missing[*]}): installing Debian packages podman runc mmdebstrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    podman buildah runc uidmap fuse-overlayfs slirp4netns mmdebstrap >/dev/null
  exit 0
fi
echo "make test-image needs Docker or podman + runc + mmdebstrap, e.g.:" \
  "sudo apt-get install podman runc mmdebstrap" >&2
exit 1
