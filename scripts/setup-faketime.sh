#!/usr/bin/env bash
# Makes sure Debian's libfaketime exists for the history checker (lockingkit-check), which runs
# a client process with its clocks (monotonic included) running fast or slow, preloading the
# library. Idempotent; installs the `faketime` package (which brings libfaketime) when missing.
set -euo pipefail

library() {
  for dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib; do
    if [ -e "$dir/faketime/libfaketime.so.1" ]; then
      echo "$dir/faketime/libfaketime.so.1"
      return 0
    fi
  done
  return 1
}

if ! library >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-faketime: libfaketime is missing; install Debian's faketime (as root)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends faketime >/dev/null
fi

echo "setup-faketime: $(library) ready"
