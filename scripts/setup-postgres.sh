#!/usr/bin/env bash
# Makes sure the PostgreSQL server binaries (initdb, pg_ctl, postgres) exist for the test
# fixture (tests/support/postgres.rs), which starts throwaway clusters from them on loopback
# ports. Idempotent; installs Debian's postgresql-15 when the binaries are missing. No server
# is started here and no default cluster is created.
set -euo pipefail

found_binaries() {
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1 \
    && command -v postgres >/dev/null 2>&1; then
    return 0
  fi
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    if [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ] && [ -x "$dir/postgres" ]; then
      return 0
    fi
  done
  return 1
}

if ! found_binaries; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-postgres: PostgreSQL binaries are missing; install postgresql-15 (as root)" >&2
    exit 1
  fi
  # The fixture makes its own clusters; the package's default one would only take port 5432.
  mkdir -p /etc/postgresql-common
  if ! grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf; then
    echo 'create_main_cluster = false' >>/etc/postgresql-common/createcluster.conf
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # postgresql-15 is Debian 12's server; newer releases carry another major version.
  apt-get install -y -qq --no-install-recommends postgresql-15 \
    || apt-get install -y -qq --no-install-recommends postgresql
fi

# The server refuses to run as root, so as root the fixture runs it as `postgres` (the
# package creates that user; create it if the binaries came from elsewhere).
if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1; then
  useradd --system --user-group --home-dir /var/lib/postgresql --shell /usr/sbin/nologin postgres
fi

found_binaries
echo "setup-postgres: PostgreSQL binaries ready"
