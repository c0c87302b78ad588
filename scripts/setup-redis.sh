#!/usr/bin/env bash
# Makes sure the Redis server binaries (redis-server, redis-cli) and openssl exist for the test fixture
# (tests/support/redis.rs), which starts throwaway servers and a three-master Redis Cluster
# from them on loopback ports. Idempotent; installs Debian's redis-server when a binary is
# missing, and keeps the package's own service (port 6379) from running: the fixture needs no
# shared server, and one left running would only use memory. No server is started here.
set -euo pipefail

# openssl makes the throwaway certificates of the TLS tests.
found_binaries() {
  command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
    && command -v openssl >/dev/null 2>&1
}

if ! found_binaries; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-redis: redis-server is missing; install Debian's redis-server (as root)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Without an init system (containers, CI) the package must not start its service on port
  # 6379: a policy that refuses every service start is put in place for the install, unless
  # the machine has one already (which is then left exactly as it was).
  policy=/usr/sbin/policy-rc.d
  if ! [ -d /run/systemd/system ] && ! [ -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends redis-server redis-tools openssl >/dev/null
  if [ -d /run/systemd/system ]; then
    systemctl disable --now redis-server >/dev/null 2>&1 || true
  fi
fi

found_binaries
echo "setup-redis: $(redis-server --version | cut -d' ' -f1-3) ready"
