//! The PostgreSQL provider through a real PgBouncer (Debian's `pgbouncer`, started by
//! `lockingkit_tests::pgbouncer` on a loopback port): session locks refused behind transaction
//! and statement pooling before any lock is handed out, and when pooling starts later; session
//! pooling passing the contract suite; transaction-scoped locks working through transaction
//! pooling.

use std::time::Duration;

use lockingkit::providers::postgres::PostgresTransactionLocks;
use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{DistributedLock, ErrorKind, LockError, LockHandle, PostgresBackend};
use lockingkit_tests::contract::FixtureContract;
use lockingkit_tests::pgbouncer::{PgBouncer, PoolMode};
use lockingkit_tests::postgres::PostgresServer;
use tokio::time::Instant;

/// A check interval short enough for the loss test to finish quickly.
const CHECK: Duration = Duration::from_millis(300);

fn lock_through(bouncer: &PgBouncer) -> DistributedLock {
    lock_through_options(bouncer.options(CHECK))
}

fn lock_through_options(options: lockingkit::PostgresOptions) -> DistributedLock {
    let backend = PostgresBackend::new(options.with_check_interval(CHECK)).expect("valid options");
    DistributedLock::builder(backend)
        .options(quick_polling())
        .build()
        .expect("valid lock options")
}

fn sessions(lock: &DistributedLock) -> usize {
    lock.backend::<PostgresBackend>()
        .expect("a PostgreSQL lock")
        .open_sessions()
}

#[track_caller]
fn refusal(result: Result<LockHandle, LockError>) -> LockError {
    match result {
        Ok(handle) => panic!(
            "a lock on {} was handed out behind the pooler",
            handle.key()
        ),
        Err(error) => error,
    }
}

#[track_caller]
fn assert_names_the_pooler_and_the_fix(error: &LockError) {
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    let message = error.message();
    for needle in [
        "pooler",
        "PgBouncer",
        "pool_mode = session",
        "PostgresTransactionLocks",
    ] {
        assert!(
            message.contains(needle),
            "{needle:?} missing from: {message}"
        );
    }
}

/// Every way of taking a lock is refused before one is handed out, and nothing stays behind.
async fn assert_session_locks_refused(mode: PoolMode) {
    let server = PostgresServer::start_local().await;
    let bouncer = PgBouncer::start(&server, mode).await;
    assert_refused_through(&server, &bouncer).await;
}

async fn assert_refused_through(server: &PostgresServer, bouncer: &PgBouncer) {
    let locks = lock_through(bouncer);
    let key = unique_prefix("pgbouncer/refused");

    assert_names_the_pooler_and_the_fix(&refusal(locks.try_acquire(&key).await));
    let started = Instant::now();
    let waited = refusal(locks.acquire(&key, Duration::from_secs(20)).await);
    assert_names_the_pooler_and_the_fix(&waited);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a wait went on for {:?} behind the pooler",
        started.elapsed()
    );
    let readers = locks.reader_writer(&key).expect("readers");
    assert_names_the_pooler_and_the_fix(&refusal(readers.try_read().await));
    let slots = locks.semaphore(&key, 3).expect("a semaphore");
    assert_names_the_pooler_and_the_fix(&refusal(slots.try_acquire().await));

    assert!(server.lock_holders(&key).await.is_empty());
    assert_eq!(sessions(&locks), 0, "a refused session stayed open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_pooling_is_refused_before_any_lock_is_handed_out() {
    assert_session_locks_refused(PoolMode::Transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_pooling_is_refused_before_any_lock_is_handed_out() {
    assert_session_locks_refused(PoolMode::Statement).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_check_catches_transaction_pooling_and_passes_session_pooling() {
    let server = PostgresServer::start_local().await;
    let pooled = PgBouncer::start(&server, PoolMode::Transaction).await;
    let error = lock_through(&pooled).verify().await.unwrap_err();
    assert_names_the_pooler_and_the_fix(&error);

    let session = PgBouncer::start(&server, PoolMode::Session).await;
    let locks = lock_through(&session);
    locks
        .verify()
        .await
        .expect("session pooling passes the startup check");
    assert_eq!(
        sessions(&locks),
        0,
        "verify's session is its own, and closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_transaction_pooling_over_two_idle_backends_is_refused_too() {
    let server = PostgresServer::start_local().await;
    let bouncer =
        PgBouncer::start_with(&server, PoolMode::Transaction, "server_round_robin = 1\n").await;
    // Two backends in the pool, idle (transactions open at once each need their own). Handed
    // out oldest first, they make the pooler hardest to see: the session's first statement
    // runs on one, the second connection's on the other, and the session's next on the first
    // again, unless the session asks twice before the second connection does.
    let mut clients = Vec::new();
    for _ in 0..2 {
        clients.push(bouncer.connect().await);
    }
    let mut open = Vec::new();
    for client in &mut clients {
        let transaction = client.transaction().await.unwrap();
        let pid = backend_pid(&transaction).await;
        open.push((transaction, pid));
    }
    let pids: std::collections::HashSet<i32> = open.iter().map(|(_, pid)| *pid).collect();
    assert_eq!(pids.len(), 2, "the pool did not grow");
    for (transaction, _) in open {
        transaction.commit().await.unwrap();
    }
    assert_refused_through(&server, &bouncer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_pooling_is_accepted_and_its_locks_exclude_each_other() {
    let server = PostgresServer::start_local().await;
    let bouncer = PgBouncer::start(&server, PoolMode::Session).await;
    let (first, second) = (lock_through(&bouncer), lock_through(&bouncer));
    let key = unique_prefix("pgbouncer/session");
    let held = first
        .try_acquire(&key)
        .await
        .expect("through session pooling");
    assert_eq!(server.lock_holders(&key).await.len(), 1);
    assert_eq!(
        second.try_acquire(&key).await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    // Checks keep passing: the session keeps its server process. Three of them are seen to
    // run on it, each a newer statement there, with the lock still held after each.
    let holder = holder_of(&server, &key).await;
    let admin = server.connect().await;
    let mut seen = Vec::new();
    let give_up = Instant::now() + CHECK * 20;
    while seen.len() < 4 {
        let row = admin
            .query_one(
                "SELECT query, state_change::text FROM pg_stat_activity WHERE pid = $1",
                &[&holder],
            )
            .await
            .unwrap();
        let (query, at): (String, String) = (row.get(0), row.get(1));
        if query.contains("pg_postmaster_start_time") && seen.last() != Some(&at) {
            held.ensure_held().expect("still held after a check");
            seen.push(at);
        }
        assert!(Instant::now() < give_up, "checks seen: {seen:?}");
        tokio::time::sleep(CHECK / 10).await;
    }
    let waiting = tokio::spawn({
        let (second, key) = (second.clone(), key.clone());
        async move { second.acquire(&key, Duration::from_secs(10)).await }
    });
    held.release().await.expect("confirmed release");
    let next = waiting
        .await
        .unwrap()
        .expect("the waiter through the pooler");
    assert!(next.is_held());
    next.release().await.unwrap();
}

/// Takes `key` and releases it: one whole hold.
async fn take_and_release(locks: &DistributedLock, key: &str) {
    let held = locks.try_acquire(key).await.expect("a free key");
    held.release().await.expect("a confirmed release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verifying_a_session_opens_no_extra_connection_when_direct_and_one_through_a_pooler() {
    let server = PostgresServer::start_local().await;
    // A plain TCP proxy passes the server's own cancel key on: verified by one statement.
    let proxy = lockingkit_tests::proxy::FaultProxy::to_port(server.port()).await;
    let direct = lock_through_options(lockingkit::PostgresOptions::new(format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        proxy.port()
    )));
    let key = unique_prefix("pgbouncer/cost");
    take_and_release(&direct, &key).await;
    assert_eq!(proxy.connections_accepted(), 1);

    // Through PgBouncer (its own cancel keys), the second connection is opened once per session.
    let bouncer = PgBouncer::start(&server, PoolMode::Session).await;
    let logins = |bouncer: &PgBouncer| bouncer.log().matches("login attempt").count();
    let before = logins(&bouncer);
    let pooled = lock_through(&bouncer);
    for _ in 0..3 {
        take_and_release(&pooled, &key).await;
    }
    assert_eq!(sessions(&pooled), 1);
    assert_eq!(logins(&bouncer) - before, 2, "{}", bouncer.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_session_over_tls_is_verified_by_the_second_connection_and_accepted() {
    let server = PostgresServer::start_local().await;
    server.enable_tls().await;
    // TLS hides the cancel key from the check, so the probe connection verifies the session.
    let proxy = lockingkit_tests::proxy::FaultProxy::to_port(server.port()).await;
    let locks = lock_through_options(lockingkit::PostgresOptions::new(format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require",
        proxy.port()
    )));
    let key = unique_prefix("pgbouncer/tls");
    let held = locks.try_acquire(&key).await.expect("a direct TLS session");
    let holder = holder_of(&server, &key).await;
    let encrypted: bool = server
        .connect()
        .await
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = $1", &[&holder])
        .await
        .unwrap()
        .get(0);
    assert!(encrypted, "the lock's session is not encrypted");
    assert_eq!(proxy.connections_accepted(), 2, "the session and its probe");
    held.release().await.unwrap();
    let again = locks.try_acquire(&key).await.expect("the same session");
    again.release().await.unwrap();
    assert_eq!(proxy.connections_accepted(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_pool_without_a_spare_server_connection_fails_the_open_within_one_timeout() {
    let server = PostgresServer::start_local().await;
    // One server connection: the session takes it, and the check's second connection waits.
    let bouncer =
        PgBouncer::start_with(&server, PoolMode::Session, "default_pool_size = 1\n").await;
    let timeout = Duration::from_secs(1);
    let locks = lock_through_options(bouncer.options(CHECK).with_query_timeout(timeout));
    let key = unique_prefix("pgbouncer/no-spare");
    let started = Instant::now();
    let error = refusal(locks.try_acquire(&key).await);
    let took = started.elapsed();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(
        error.message().contains("spare server connection"),
        "{error}"
    );
    // Bounded by the check's one deadline (the connect itself is quick here).
    assert!(
        took >= timeout && took < timeout + Duration::from_millis(900),
        "took {took:?}"
    );
    assert!(server.lock_holders(&key).await.is_empty());
    assert_eq!(sessions(&locks), 0);
}

/// The server process (pid) whose session holds `key`.
async fn holder_of(server: &PostgresServer, key: &str) -> i32 {
    let holders = server.lock_holders(key).await;
    assert_eq!(holders.len(), 1, "{holders:?}");
    holders[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooling_that_starts_later_is_loss_for_the_held_locks_and_then_refused() {
    // The warning comes from the check, which runs on the runtime's worker threads: only a
    // global subscriber sees it (nothing else in this test binary installs one).
    let logged = lockingkit_tests::field_log::FieldLog::default();
    {
        use tracing_subscriber::layer::SubscriberExt;
        let subscriber = tracing_subscriber::registry().with(logged.clone());
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
    }
    let server = PostgresServer::start_local().await;
    // Three server processes at most: the lock's, the probe's, and one more.
    let mut bouncer =
        PgBouncer::start_with(&server, PoolMode::Session, "default_pool_size = 3\n").await;
    // Checks a second apart: a check queued behind the pinned processes below has a second to
    // be served once they are given back.
    let check = Duration::from_secs(1);
    let backend = PostgresBackend::new(bouncer.options(check)).expect("valid options");
    let locks = DistributedLock::builder(backend)
        .options(quick_polling())
        .build()
        .expect("valid lock options");
    let key = unique_prefix("pgbouncer/later");
    let held = locks
        .try_acquire(&key)
        .await
        .expect("through session pooling");
    let holder = holder_of(&server, &key).await;

    // From now on the pooler lends the lock's server process to other clients between the
    // session's statements. Other clients pin every other process in open transactions until
    // one is lent the lock's (no more than three tries: the pool has three processes).
    bouncer.switch_to(PoolMode::Transaction).await;
    let mut pinned = Vec::new();
    pin_until(&bouncer, holder, &mut pinned).await;
    assert!(
        pinned.len() <= 3,
        "the pool grew past three: {}",
        pinned.len()
    );
    let lent = pinned.pop().expect("the client on the lock's process");
    // What makes it unsafe: the lock's session lock is granted to this client too.
    let taken: bool = lent
        .query_one(
            "SELECT pg_try_advisory_lock($1)",
            &[&lockingkit::keys::PostgresLockKeys::advisory_key(&key)],
        )
        .await
        .unwrap()
        .get(0);
    assert!(taken, "the lent process grants the lock by re-entrancy");
    // The other processes go back to the pool, for the session's next check to run on.
    for client in &pinned {
        client.batch_execute("COMMIT").await.unwrap();
    }

    // That check answers from another process: the lock is lost, not silently held.
    tokio::time::timeout(check * 5, held.lost_token().cancelled())
        .await
        .expect("the holder sees loss within a few checks");
    assert_eq!(held.ensure_held().unwrap_err().kind(), ErrorKind::Lost);
    let other_key = unique_prefix("pgbouncer/after");
    assert_names_the_pooler_and_the_fix(&refusal(locks.try_acquire(&other_key).await));
    lent.batch_execute("ROLLBACK").await.unwrap();
    // Said once, at the first check that saw it, naming the fix; the refusals say it again.
    let logged = logged.text();
    let warnings: Vec<&str> = logged
        .lines()
        .filter(|line| line.contains("so a pooler moved it"))
        .collect();
    assert_eq!(warnings.len(), 1, "{logged}");
    assert!(
        warnings[0].contains("pool_mode = session"),
        "{}",
        warnings[0]
    );
}

/// A transaction-mode PgBouncer in front of a new local server, and transaction-scoped locks
/// whose fencing sequence was created through it.
async fn transaction_locks_through_transaction_pooling(
) -> (PostgresServer, PgBouncer, PostgresTransactionLocks) {
    let server = PostgresServer::start_local().await;
    let bouncer = PgBouncer::start(&server, PoolMode::Transaction).await;
    let locks = PostgresTransactionLocks::default();
    locks
        .create_fencing_sequence(&bouncer.connect().await)
        .await
        .expect("the fencing sequence through the pooler");
    (server, bouncer, locks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_scoped_locks_work_through_transaction_pooling() {
    let (server, bouncer, locks) = transaction_locks_through_transaction_pooling().await;
    let key = unique_prefix("pgbouncer/transaction");
    let (mut a, mut b) = (bouncer.connect().await, bouncer.connect().await);

    for _ in 0..3 {
        let first = a.transaction().await.unwrap();
        let held = locks.try_acquire(&first, &key).await.expect("free key");
        let second = b.transaction().await.unwrap();
        assert_eq!(
            locks.try_acquire(&second, &key).await.unwrap_err().kind(),
            ErrorKind::Busy
        );
        assert_eq!(server.lock_holders(&key).await.len(), 1);
        first.commit().await.unwrap();
        let next = locks
            .acquire(&second, &key, Duration::from_secs(5))
            .await
            .expect("free after the commit");
        assert!(next.fencing_token() > held.fencing_token());
        second.rollback().await.unwrap();
    }
    assert!(server.lock_holders(&key).await.is_empty());
    assert!(
        !server.server_log().contains("ERROR:"),
        "{}",
        server.server_log()
    );
}

/// The server process that `client`'s statements run on now, through the pooler.
async fn backend_pid(client: &impl tokio_postgres::GenericClient) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Pins server process `wanted` in a transaction of a fresh client (kept in `pinned`): opens
/// transactions on fresh clients, keeping each open, until one runs on `wanted`. The pooler
/// hands out its idle processes before opening new ones, so `wanted`, idle, is reached
/// within as many tries as the pool has processes.
async fn pin_until(bouncer: &PgBouncer, wanted: i32, pinned: &mut Vec<tokio_postgres::Client>) {
    for _ in 0..50 {
        let client = bouncer.connect().await;
        client.batch_execute("BEGIN").await.unwrap();
        let pid = backend_pid(&client).await;
        pinned.push(client);
        if pid == wanted {
            return;
        }
    }
    panic!("the pooler never handed out process {wanted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_attempts_through_a_pooler_without_prepared_statements_are_misconfigured() {
    let (_server, bouncer, locks) = transaction_locks_through_transaction_pooling().await;
    let config: tokio_postgres::Config = bouncer.connection_string().parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .build()
        .unwrap();
    let mut client = pool.get().await.unwrap();
    let key = unique_prefix("pgbouncer/prepared");

    // Prepared on the server process of the first transaction.
    let first = client.transaction().await.unwrap();
    let prepared_on = backend_pid(&*first).await;
    locks.try_acquire(&first, &key).await.expect("prepared");
    first.commit().await.unwrap();

    // With that process pinned by another client, the next transaction runs on another one,
    // which has never seen the statement: PgBouncer 1.18 does not carry it over.
    let mut pinned = Vec::new();
    pin_until(&bouncer, prepared_on, &mut pinned).await;
    let second = client.transaction().await.unwrap();
    let error = locks.try_acquire(&second, &key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    for needle in ["26000", "max_prepared_statements", "&*transaction"] {
        assert!(error.message().contains(needle), "{needle}: {error}");
    }
    second.rollback().await.unwrap();

    // The unnamed form works on the same transaction-pooled connection.
    let third = client.transaction().await.unwrap();
    locks
        .try_acquire(&*third, &key)
        .await
        .expect("unnamed through the pooler");
    third.commit().await.unwrap();
    drop(pinned);
}

mod contract {
    use super::*;

    /// The check interval of the suite, as on a direct connection (tests/postgres.rs): the
    /// kit gives a release a quarter of it to settle, and PgBouncer adds a hop.
    const CONTRACT_CHECK: Duration = Duration::from_millis(500);

    // Each "process" is a `DistributedLock` with its own sessions, all through one
    // session-mode PgBouncer in front of one server (dropped after the PgBouncer).
    lockingkit::contract_tests!(async {
        let server = PostgresServer::start_local().await;
        let bouncer = PgBouncer::start(&server, PoolMode::Session).await;
        FixtureContract::new(
            (bouncer, server),
            CONTRACT_CHECK,
            |(bouncer, _): &(PgBouncer, PostgresServer)| {
                PostgresBackend::new(bouncer.options(CONTRACT_CHECK)).expect("options")
            },
        )
    });
}
