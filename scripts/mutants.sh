#!/usr/bin/env bash
# Mutation testing of the engine and the key mapping against the fast suites (unit, engine,
# in-memory contract, property tests). Not part of CI: it rebuilds once per mutant.
#
#   bash scripts/mutants.sh                 # engine/, health.rs, backoff.rs and the key mappings
#   bash scripts/mutants.sh --file 'lockingkit/src/keys.rs'   # narrower
#   bash scripts/mutants.sh --iterate       # only what the last run did not catch, and new code
#
# Arguments go to cargo-mutants; without a --file the engine (with the outage gate and the
# backoff it uses), keys.rs and each provider's key mapping (providers/*/keys.rs) are mutated.
#
# Installs cargo-mutants from crates.io if it is missing. Results land in mutants.out/
# (caught, missed, unviable, timeout); a missed mutant is a change no test noticed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo mutants --version >/dev/null 2>&1; then
  cargo install cargo-mutants --locked
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi

files=(--file 'lockingkit/src/engine/**/*.rs' --file 'lockingkit/src/health.rs'
  --file 'lockingkit/src/backoff.rs' --file 'lockingkit/src/keys.rs'
  --file 'lockingkit/src/providers/*/keys.rs')
for arg in "$@"; do
  case "$arg" in
    --file | --file=*) files=() ;;
  esac
done

# The fast suites of the lockingkit crate: no server needed. The in-memory contract run and
# the property tests need the `testing` feature; each key mapping is built, and its unit tests
# run, only with its provider's feature.
exec cargo mutants --package lockingkit "${files[@]}" \
  --test-tool nextest --features testing,azure,etcd,postgres,redis \
  --timeout 120 "$@"
