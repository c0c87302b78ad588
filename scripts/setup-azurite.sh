#!/usr/bin/env bash
# Installs Azurite (the Azure Storage emulator) at the version pinned in tests/azurite, for the
# Azure tests and benchmark. Idempotent: skips npm when the installed tree matches the lock file.
# The tests start Azurite themselves, on a free loopback port per test.
set -euo pipefail
cd "$(dirname "$0")/../tests/azurite"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "setup-azurite: installing Node.js and npm from Debian" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi

stamp=node_modules/.lockingkit-installed
want="$(sha256sum package-lock.json | cut -d' ' -f1)"
if [ -x node_modules/.bin/azurite-blob ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

npm ci --no-audit --no-fund --loglevel=error
echo "$want" > "$stamp"
echo "setup-azurite: $(node_modules/.bin/azurite-blob --version 2>/dev/null || echo '?') installed" >&2
