#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs and starts what the tests need, then runs
# every test binary (unit, contract, chaos, HTTP, telemetry) and the doc tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's wall time, printed when the run ends (pass or fail), so a slow step shows.
steps=()
step() {
  local name=$1 began=$SECONDS
  shift
  "$@"
  steps+=("$(printf '%5ds  %s' $((SECONDS - began)) "$name")")
}
report() {
  echo "== step times (total ${SECONDS}s)"
  printf '%s\n' "${steps[@]}"
  # nextest's JUnit report (see .config/nextest.toml) gives each test's time.
  local junit="${CARGO_TARGET_DIR:-target}/nextest/default/junit.xml"
  [ -f "$junit" ] && python3 scripts/slowest-tests.py "$junit" 12
  return 0
}
trap report EXIT

# nextest runs the suites (its profile ends a hung test; see .config/nextest.toml).
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi

setup_servers() {
  for setup in scripts/setup-*.sh; do
    if [ -e "$setup" ]; then bash "$setup"; fi
  done
}
step setup setup_servers

# The code is formatted and lints clean, and the library builds with each feature on its own
# (a provider's code must not lean on another's feature).
step fmt cargo fmt --all --check
step clippy cargo clippy --workspace --all-targets --all-features -- -D warnings
check_each_feature() {
  for features in "" postgres deadpool mysql azure redis etcd testing; do
    cargo check --quiet -p lockingkit --no-default-features ${features:+--features "$features"}
  done
}
step each-feature check_each_feature

# nextest builds what it runs, examples included. The benchmarks are type-checked by clippy's
# --all-targets above; building them is left to `cargo bench`.
step nextest cargo nextest run --workspace --all-features --no-fail-fast
# The short form of the benchmark table (docs/performance.md): each row's ratio to its own raw
# baseline, measured in this run, must stay within 25% of the ratio recorded in
# benches/smoke-reference.txt. It runs in the test profile nextest has just built.
step bench-smoke cargo test --quiet -p lockingkit-benches --bench smoke
# The history checker (docs/reliability.md): a short run per provider, clients under kills,
# pauses, partitions and server crashes, two providers at a time (the output is printed in
# order afterwards). Its verdict depends only on safety violations found in the histories,
# never on timing, throughput or how many faults landed; the seed is printed first for a replay.
check_one() {
  local provider=$1 seed=$2 out=$3 seconds
  # Leases of 3 s (etcd) and 15 s (Azure), not 1 s: their faults last longer.
  case $provider in etcd* | azure) seconds=30 ;; *) seconds=20 ;; esac
  local status=0
  cargo run --quiet -p lockingkit-check -- run --provider "$provider" --seconds "$seconds" \
    --seed "$seed" >"$out/$provider.log" 2>&1 || status=$?
  echo "$status" >"$out/$provider.status"
}
check_histories() {
  local seed=${LOCKINGKIT_CHECK_SEED:-$(date +%s)} out failed=0
  local providers=(memory postgres pgbouncer redis redis-cluster etcd etcd3 azure mysql)
  out=$(mktemp -d)
  cargo build --quiet -p lockingkit-check
  for ((i = 0; i < ${#providers[@]}; i += 2)); do
    check_one "${providers[i]}" "$seed" "$out" &
    if ((i + 1 < ${#providers[@]})); then
      check_one "${providers[i + 1]}" "$seed" "$out" &
    fi
    wait
  done
  for provider in "${providers[@]}"; do
    cat "$out/$provider.log"
    if [ "$(cat "$out/$provider.status")" != 0 ]; then
      echo "check-histories: $provider failed" >&2
      failed=1
    fi
  done
  rm -rf "$out"
  return "$failed"
}
step check-histories check_histories
step doctests cargo test --workspace --all-features --doc
# The API docs build without a broken link or a missing item, as docs.rs would build them.
step doc env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --all-features --no-deps
# The three library crates package and build from their packaged sources alone. Cargo verifies
# each against the others through a temporary local registry, and takes what comes from a
# registry to be immutable: it keeps the unpacked sources (in CARGO_HOME) and the build (in
# the target directory) under names that do not change with the sources. Drop both, or a
# later run verifies against the sources of an earlier one.
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/lockingkit*-0.1.0 \
  "${CARGO_TARGET_DIR:-target}"/debug/.fingerprint/lockingkit*
step package cargo package --workspace --exclude lockingkit-tests --exclude lockingkit-benches --exclude lockingkit-examples --exclude lockingkit-check --allow-dirty
