#!/usr/bin/env bash
# Makes sure the etcd server binary and protoc exist: the test fixture (tests/support/etcd.rs)
# starts throwaway etcd clusters from the `etcd` binary on loopback ports, and the `etcd`
# feature's etcd-client crate compiles its gRPC code with `protoc` at build time. Idempotent;
# installs Debian's etcd-server, protobuf-compiler and libprotobuf-dev when they are missing. No server is
# started here, and the package's own service is stopped and disabled.
set -euo pipefail

missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
# protoc's well-known types (google/protobuf/descriptor.proto, struct.proto), which etcd's
# protos import; Debian ships them in the development package.
[ -e /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)

if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-etcd: missing ${missing[*]}; install them (as root)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # The fixture starts its own clusters; the package's service would only take port 2379.
  # The policy is removed however the install ends (a failed download included), so no later
  # package install on the machine finds its services refused to start.
  # An operator's own policy is left alone.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

command -v etcd >/dev/null
command -v protoc >/dev/null
[ -e /usr/include/google/protobuf/descriptor.proto ]
echo "setup-etcd: etcd $(etcd --version 2>/dev/null | head -n1 | awk '{print $3}') and $(protoc --version) ready"
