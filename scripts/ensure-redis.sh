#!/usr/bin/env bash
# Make sure a redis-server binary is on PATH: the tests start their own server on a free port.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server missing: installing Debian package redis-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server >/dev/null
  exit 0
fi
echo "redis-server is required by the tests. Install it, e.g.: sudo apt-get install redis-server" >&2
exit 1
