//! PostgreSQL at fleet scale (row 7): 256 tasks, each on keys of its own, doing
//! `try_acquire` + `release` pairs as fast as they can, through one `DistributedLock` with the
//! default session budget; next to the same tasks running raw prepared try-lock + unlock pairs
//! over a pool of 16 dedicated connections (deadpool-postgres, one statement at a time per
//! connection). Rounds of each alternate, and each side reports the connections it opened.

use std::time::Duration;

use lockingkit::keys::PostgresLockKeys;
use lockingkit::{PostgresBackend, PostgresOptions};
use lockingkit_tests::postgres::PostgresServer;

use crate::load::{alternating, pairs_for, Throughput, WARM_UP};
use crate::pair::{lock_on, lock_pair};
use crate::postgres_pairs::{backend, raw_pair, TRY_LOCK, UNLOCK};

/// Overrides the session budget of the throughput and HTTP rows (and MySQL's throughput row),
/// to compare budgets.
const SESSIONS_ENV: &str = "LOCKINGKIT_BENCH_MAX_SESSIONS";

/// The session budget [`SESSIONS_ENV`] sets, if it does.
pub(crate) fn max_sessions_override() -> Option<usize> {
    std::env::var(SESSIONS_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
}

/// The options of the LockingKit side of the load rows: the defaults, unless
/// [`SESSIONS_ENV`] says otherwise.
pub(crate) fn lockingkit_options(server: &PostgresServer) -> PostgresOptions {
    let mut options = PostgresOptions::new(server.connection_string());
    if let Some(sessions) = max_sessions_override() {
        options.max_sessions = sessions;
    }
    options
}

/// Alternates `rounds` rounds of LockingKit and raw pairs, `length` each, `tasks` at once.
pub async fn throughput(
    server: &PostgresServer,
    tasks: usize,
    rounds: usize,
    length: Duration,
) -> Throughput {
    let pid = std::process::id();
    let locks = lock_on(backend(lockingkit_options(server)));
    let pool = server.plain_pool(16);

    let kit_pair = {
        let locks = locks.clone();
        move |task: usize, _round: u64| {
            let locks = locks.clone();
            async move { lock_pair(&locks, &format!("bench/throughput/{pid}/{task}")).await }
        }
    };
    let raw_pair = {
        let pool = pool.clone();
        move |task: usize, _round: u64| {
            let pool = pool.clone();
            async move {
                let key =
                    PostgresLockKeys::advisory_key(&format!("bench/raw-throughput/{pid}/{task}"));
                raw_pair(&pool, TRY_LOCK, UNLOCK, &[&key]).await;
            }
        }
    };
    // Warm-up: sessions open, statements prepared, the fencing sequence exists.
    pairs_for(tasks, WARM_UP, kit_pair.clone()).await;
    pairs_for(tasks, WARM_UP, raw_pair.clone()).await;
    let (kit_per_s, raw_per_s) = alternating(tasks, rounds, length, kit_pair, raw_pair).await;
    let backend = locks
        .backend::<PostgresBackend>()
        .expect("a PostgreSQL backend");
    Throughput {
        lockingkit_pairs_per_s: kit_per_s,
        lockingkit_connections: backend.open_sessions(),
        raw_pairs_per_s: raw_per_s,
        raw_connections: pool.status().size,
    }
}
