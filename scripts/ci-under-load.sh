#!/usr/bin/env bash
# The whole CI run from a fresh clone of this checkout's HEAD, with both cores kept busy by
# stress-ng (two CPU hogs) beside it: a test that fails here fails CI at random. Installs
# Debian's stress-ng when it is missing. Usage: scripts/ci-under-load.sh [clone-dir]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v stress-ng >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "ci-under-load: stress-ng is missing; install it (as root)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends stress-ng
fi

clone="${1:-/tmp/lockingkit-ci-under-load}"
rm -rf "$clone"
git clone -q . "$clone"
stress-ng --cpu 2 --quiet &
hogs=$!
trap 'kill "$hogs" 2>/dev/null || true' EXIT
started=$(date +%s)
status=0
bash "$clone/.ci/run" || status=$?
echo "ci-under-load: .ci/run exited $status after $(( $(date +%s) - started )) s beside two CPU hogs"
exit "$status"
