#!/usr/bin/env bash
# Makes sure the MariaDB binaries (mariadbd, mariadb-install-db, mariadb) exist for the test
# fixture (tests/support/mariadb.rs), which makes one template data directory per machine and
# starts throwaway servers on copies of it, on loopback ports. Idempotent; installs Debian's
# mariadb-server and mariadb-client when a binary is missing, and keeps the package's own
# service (port 3306, data in /var/lib/mysql) from running: the fixture needs no shared
# server, and one left running would only use memory. No server is started here.
set -euo pipefail

# mariadbd lives in /usr/sbin, which is not on a regular user's PATH on Debian.
found_binaries() {
  { command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ]; } \
    && command -v mariadb-install-db >/dev/null 2>&1 \
    && command -v mariadb >/dev/null 2>&1
}

# Whether anything listens on TCP port 3306 (IPv4 or IPv6), read from /proc: a fresh machine
# may lack ss and netstat. State 0A is LISTEN; 0CEA is 3306.
listens_on_3306() {
  cat /proc/net/tcp /proc/net/tcp6 2>/dev/null \
    | awk '$4 == "0A" && $2 ~ /:0CEA$/ { found = 1 } END { exit !found }'
}

if ! found_binaries; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-mariadb: MariaDB binaries are missing; install mariadb-server and mariadb-client (as root)" >&2
    exit 1
  fi
  # A server someone else runs on 3306 is theirs: only a port that was free must stay free.
  port_was_free=true
  if listens_on_3306; then port_was_free=false; fi
  export DEBIAN_FRONTEND=noninteractive
  # A policy that refuses every service start keeps the package from starting its server
  # (invoke-rc.d and deb-systemd-invoke both ask it). It is removed however the install ends,
  # so no later package install on the machine finds its services refused to start. An
  # operator's own policy is left alone.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends mariadb-server mariadb-client >/dev/null
  # Under systemd, the unit must not start at the next boot either; and should an operator's
  # policy have let the package start its server, it is stopped here.
  if [ -d /run/systemd/system ]; then
    systemctl disable --now mariadb >/dev/null 2>&1 || true
  elif [ -x /etc/init.d/mariadb ]; then
    /etc/init.d/mariadb stop >/dev/null 2>&1 || true
  fi
  if "$port_was_free"; then
    for _ in $(seq 1 100); do
      listens_on_3306 || break
      sleep 0.1
    done
    if listens_on_3306; then
      echo "setup-mariadb: something still listens on port 3306 after the install; stop it" >&2
      exit 1
    fi
  fi
fi

# As root the fixture runs the server as `mysql` (mariadbd refuses to run as root); the
# package creates that user, so create it if the binaries came from elsewhere.
if [ "$(id -u)" -eq 0 ] && ! id mysql >/dev/null 2>&1; then
  useradd --system --user-group --home-dir /nonexistent --shell /usr/sbin/nologin mysql
fi

found_binaries
mariadbd=$(command -v mariadbd || echo /usr/sbin/mariadbd)
echo "setup-mariadb: mariadbd $("$mariadbd" --version | awk '{print $3}') ready"
