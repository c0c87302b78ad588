#!/usr/bin/env bash
# Makes sure the `pgbouncer` binary exists for the test fixture (tests/support/pgbouncer.rs),
# which starts throwaway PgBouncers on loopback ports in front of the PostgreSQL fixture, in
# session, transaction and statement pooling modes. Idempotent; installs Debian's pgbouncer
# when the binary is missing. The package starts a system service on port 6432: it is stopped
# and disabled here, since the fixture runs its own and nothing else should listen.
set -euo pipefail

found_binary() {
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]
}

if ! found_binary; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-pgbouncer: pgbouncer is missing; install Debian's pgbouncer (as root)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A package installed without a running init system must not try to start its service.
  # The policy is ours only if we wrote it, and it goes away however the install ends (a
  # failed apt-get under `set -e` included): left behind, it would stop every later package's
  # service from starting.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends pgbouncer
fi

# Whatever installed it, the packaged service stays off: the fixture starts its own.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  systemctl disable --now pgbouncer.service >/dev/null 2>&1 || true
fi
if [ -x /etc/init.d/pgbouncer ]; then
  /etc/init.d/pgbouncer stop >/dev/null 2>&1 || true
fi
if command -v update-rc.d >/dev/null 2>&1 && [ -e /etc/init.d/pgbouncer ]; then
  update-rc.d pgbouncer disable >/dev/null 2>&1 || true
fi

# PgBouncer refuses to run as root, so as root the fixture runs it as `postgres`, like the
# server (scripts/setup-postgres.sh creates that user).
if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1; then
  useradd --system --user-group --home-dir /var/lib/postgresql --shell /usr/sbin/nologin postgres
fi

found_binary
echo "setup-pgbouncer: pgbouncer $( (pgbouncer --version 2>/dev/null || /usr/sbin/pgbouncer --version) | head -n1) ready"
