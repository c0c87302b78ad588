//! The PostgreSQL provider against a real server: the contract suite, interop with plain SQL,
//! loss, fencing across restarts, connection hygiene and error classification.
//!
//! Each test starts its own throwaway server (see `lockingkit_tests::postgres`), or uses the one
//! named by `LOCKINGKIT_TEST_POSTGRES_URL` where it needs no process control.

use std::time::Duration;

use lockingkit::keys::PostgresLockKeys;
use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{
    DistributedLock, ErrorKind, LockError, LockHandle, LockOptions, LossReason, PostgresBackend,
    PostgresOptions,
};
use lockingkit_tests::chaos::acquire_through_outages;
use lockingkit_tests::checks::release_once_won;
use lockingkit_tests::contract::FixtureContract;
use lockingkit_tests::polling::eventually;
use lockingkit_tests::postgres::PostgresServer;
use tokio::time::Instant;

/// A check interval short enough for loss tests to finish quickly.
const CHECK: Duration = Duration::from_millis(500);

fn lock_on(options: PostgresOptions) -> DistributedLock {
    let backend = PostgresBackend::new(options).expect("valid PostgreSQL options");
    DistributedLock::builder(backend)
        .options(quick_polling())
        .build()
        .expect("valid lock options")
}

fn process(server: &PostgresServer) -> DistributedLock {
    lock_on(server.options(CHECK))
}

fn backend(lock: &DistributedLock) -> &PostgresBackend {
    lock.backend::<PostgresBackend>()
        .expect("a PostgreSQL-backed lock")
}

#[track_caller]
fn kind_of(result: Result<LockHandle, LockError>) -> ErrorKind {
    match result {
        Ok(handle) => panic!("expected an error, got a lock on {}", handle.key()),
        Err(error) => error.kind(),
    }
}

mod contract {
    use super::*;

    // Each "process" is a `DistributedLock` with its own pool on one server, with the default
    // session budget: the look-alike case holds 26 locks at once in one process on at most
    // four shared sessions.
    lockingkit::contract_tests!(async {
        FixtureContract::new(PostgresServer::start().await, CHECK, |server| {
            PostgresBackend::new(server.options(CHECK)).expect("options")
        })
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_expression_matches_advisory_key_for_the_reference_keys() {
    let server = PostgresServer::start().await;
    let client = server.connect().await;
    let statement = client
        .prepare(&format!("SELECT {}", PostgresLockKeys::SQL_EXPRESSION))
        .await
        .expect("the SQL expression is valid SQL");
    let reference: Vec<(String, i64)> = vec![
        ("orders/42".into(), -4261225075031449721),
        ("jobs/nightly-export".into(), -6608059426078546604),
        ("a/b".into(), -4517992508584211555),
        ("a~2Fb".into(), -3104486523395018178),
        ("a%2Fb".into(), 8581366813078647055),
        ("..".into(), 6828011081595845693),
        (".".into(), -3624009932037567382),
        ("a.".into(), 6536483355239894009),
        ("/a".into(), 7660865432161832061),
        ("a/".into(), -5486046568002236813),
        ("a//b".into(), 8834601437433283040),
        ("a///b".into(), 9163303817191787408),
        ("a/./b".into(), 3620760808985749615),
        ("a/.b".into(), -293456851317068515),
        ("ключ".into(), 2153681812738117024),
        ("🔒".into(), 7701668758205862634),
        ("A b".into(), -6385909787353675517),
        ("x".repeat(512), 7212026910977811256),
        ("é".repeat(512), -1504857556536219294),
        ("a/".repeat(300) + "a", -3062980543607982088),
    ];
    for (key, expected) in reference {
        let in_sql: i64 = client
            .query_one(&statement, &[&key])
            .await
            .expect("SQL expression")
            .get(0);
        assert_eq!(in_sql, expected, "SQL advisory key of a reference key");
        assert_eq!(PostgresLockKeys::advisory_key(&key), expected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_sql_sees_the_librarys_lock_as_taken() {
    let server = PostgresServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("interop/library-first");
    let plain = server.connect().await;
    let try_lock = format!(
        "SELECT pg_try_advisory_lock({})",
        PostgresLockKeys::SQL_EXPRESSION
    );

    let held = locks.try_acquire(&key).await.expect("library lock");
    let taken: bool = plain.query_one(&try_lock, &[&key]).await.unwrap().get(0);
    assert!(!taken, "plain SQL took a lock the library holds");

    held.release().await.expect("confirmed release");
    let taken: bool = plain.query_one(&try_lock, &[&key]).await.unwrap().get(0);
    assert!(
        taken,
        "plain SQL could not take the lock after the library released it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_sees_a_lock_taken_by_plain_sql_as_busy() {
    let server = PostgresServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("interop/sql-first");
    let plain = server.connect().await;
    plain
        .execute(
            &format!(
                "SELECT pg_advisory_lock({})",
                PostgresLockKeys::SQL_EXPRESSION
            ),
            &[&key],
        )
        .await
        .expect("plain SQL lock");

    assert_eq!(kind_of(locks.try_acquire(&key).await), ErrorKind::Busy);
    // The server answered "busy" every time, so this is contention, not an outage.
    assert_eq!(
        kind_of(locks.acquire(&key, Duration::from_millis(300)).await),
        ErrorKind::Timeout
    );

    let unlocked: bool = plain
        .query_one(
            &format!(
                "SELECT pg_advisory_unlock({})",
                PostgresLockKeys::SQL_EXPRESSION
            ),
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    assert!(unlocked);
    let held = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("free after the plain session unlocked");
    held.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_through_the_same_lock_is_busy_although_session_locks_are_reentrant() {
    let server = PostgresServer::start().await;
    let locks = process(&server);
    let other = process(&server);
    let key = unique_prefix("reentrancy");

    let held = locks.try_acquire(&key).await.expect("first");
    assert_eq!(kind_of(locks.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(
        kind_of(locks.acquire(&key, Duration::from_millis(200)).await),
        ErrorKind::Timeout
    );
    assert_eq!(kind_of(other.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(
        server.lock_holders(&key).await.len(),
        1,
        "exactly one session holds the lock"
    );
    held.release().await.expect("release");
    assert!(server.lock_holders(&key).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_backend_share_its_session_and_never_take_a_key_twice_by_reentrancy() {
    let server = PostgresServer::start().await;
    let shared = PostgresBackend::new(server.options(CHECK).with_max_sessions(1)).expect("options");
    let first = DistributedLock::builder(shared.clone())
        .build()
        .expect("lock");
    let second = DistributedLock::builder(shared).build().expect("lock");
    let key = unique_prefix("reentrancy/shared-session");

    let held = first.try_acquire(&key).await.expect("first");
    // Both engines send on the one session that holds the key: only the provider stands
    // between the second attempt and a re-entrant grant.
    assert_eq!(kind_of(second.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(
        kind_of(second.acquire(&key, Duration::from_millis(200)).await),
        ErrorKind::Timeout
    );
    assert_eq!(backend(&second).open_sessions(), 1, "one session for both");
    held.release().await.expect("release");
    assert!(
        server.lock_holders(&key).await.is_empty(),
        "one unlock freed it: the session held it once"
    );
    let next = second.try_acquire(&key).await.expect("free now");
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_sees_loss_as_soon_as_its_session_is_terminated() {
    let server = PostgresServer::start().await;
    // Checks far apart: the loss must come from the connection closing, not from a check.
    let slow_checks = Duration::from_secs(5);
    let locks = lock_on(server.options(slow_checks));
    let other = process(&server);
    let key = unique_prefix("loss/terminated");
    let held = locks.try_acquire(&key).await.expect("lock");
    let first_token = held.fencing_token();

    assert_eq!(server.terminate_lock_holders(&key).await, 1);
    let terminated = Instant::now();
    tokio::time::timeout(Duration::from_secs(1), held.lost_token().cancelled())
        .await
        .expect("loss declared as the connection closed, long before the next check");
    assert!(terminated.elapsed() < slow_checks);
    assert!(!held.is_held());
    assert_eq!(held.loss_reason(), Some(LossReason::ConnectionLost));
    assert_eq!(held.ensure_held().unwrap_err().kind(), ErrorKind::Lost);
    assert_eq!(held.release().await.unwrap_err().kind(), ErrorKind::Lost);

    // The client sees the socket close as the terminated backend exits; the server drops that
    // backend's locks during the same exit, a moment later at most. Loss is declared first,
    // which is the safe order: the holder stops before anyone else can take the key.
    let next = other
        .acquire(&key, Duration::from_secs(2))
        .await
        .expect("free once the terminated session has ended");
    assert!(next.fencing_token() > first_token);
    next.release().await.expect("release");
}

/// Whether a LockingKit session is queued for an exclusive lock on `key`: a waiting process's
/// watcher, which the server wakes when the key is freed.
async fn watcher_is_queued(server: &PostgresServer, key: &str) -> bool {
    let advisory_key = PostgresLockKeys::advisory_key(key);
    let (high, low) = (
        i64::from((advisory_key >> 32) as u32),
        i64::from(advisory_key as u32),
    );
    let admin = server.connect().await;
    let row = admin
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.mode = 'ExclusiveLock' \
             AND NOT l.granted AND l.classid::bigint = $1 AND l.objid::bigint = $2 \
             AND a.application_name = 'lockingkit'",
            &[&high, &low],
        )
        .await
        .expect("pg_locks");
    row.get::<_, i64>(0) > 0
}

/// A lock with a one-second backoff: polling alone would find a release up to a second late.
fn patient(server: &PostgresServer) -> DistributedLock {
    let backend = PostgresBackend::new(server.options(CHECK)).expect("options");
    DistributedLock::builder(backend)
        .options(
            LockOptions::default()
                .with_min_retry_delay(Duration::from_secs(1))
                .with_max_retry_delay(Duration::from_secs(1)),
        )
        .build()
        .expect("lock options")
}

/// Starts `waiter` waiting up to 10 s for `key`, held elsewhere, and returns once its watcher
/// is queued behind the holder: from then on, only a wake-up can hand the key over quickly.
async fn wait_behind_the_holder(
    server: &PostgresServer,
    waiter: &DistributedLock,
    key: &str,
) -> tokio::task::JoinHandle<(Instant, LockHandle)> {
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        let key = key.to_owned();
        async move {
            let handle = waiter
                .acquire(&key, Duration::from_secs(10))
                .await
                .expect("handed over");
            (Instant::now(), handle)
        }
    });
    eventually(
        "the waiter's watcher",
        Duration::from_secs(10),
        async || watcher_is_queued(server, key).await,
    )
    .await;
    waiting
}

/// Checks that the waiter got the key well within its 1 s backoff of the release at
/// `released`, then releases it.
async fn assert_handed_over_quickly(
    waiting: tokio::task::JoinHandle<(Instant, LockHandle)>,
    released: Instant,
    round: usize,
) {
    let (acquired, handle) = waiting.await.expect("waiter task");
    let handoff = acquired.saturating_duration_since(released);
    assert!(
        handoff < Duration::from_millis(150),
        "round {round}: hand-off took {handoff:?}, the backoff was 1 s"
    );
    handle.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_at_once_by_a_plain_sql_unlock_and_by_the_holders_session_ending() {
    let server = PostgresServer::start().await;
    let waiter = patient(&server);
    let key = unique_prefix("handoff/plain");
    let advisory_key = PostgresLockKeys::advisory_key(&key);
    // Round 0: a plain SQL holder unlocks; round 1: a plain SQL holder's session ends. Neither
    // sends anything a client could listen for; the server's lock queue wakes the watcher.
    for round in 0..2 {
        let holder = server.connect().await;
        holder
            .execute("SELECT pg_advisory_lock($1)", &[&advisory_key])
            .await
            .expect("plain lock");
        let waiting = wait_behind_the_holder(&server, &waiter, &key).await;
        if round == 0 {
            holder
                .execute("SELECT pg_advisory_unlock($1)", &[&advisory_key])
                .await
                .expect("plain unlock");
        } else {
            drop(holder);
        }
        assert_handed_over_quickly(waiting, Instant::now(), round).await;
    }
}

/// The lines a server logged at `ERROR` or `WARNING` (and the statements it quoted for them).
fn errors_and_warnings(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| line.contains("ERROR:") || line.contains("WARNING:"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_writes_nothing_into_the_servers_log() {
    // A watcher waits in half-second slices; a slice that ended in a `lock_timeout` error would
    // log an ERROR and its statement twice a second per waiting process.
    let server = PostgresServer::start_local().await;
    let holder = process(&server);
    let waiter = process(&server);
    let writer_key = unique_prefix("log/writer");
    let reader_key = unique_prefix("log/reader");
    let held = holder.try_acquire(&writer_key).await.expect("lock");
    let readers = waiter.reader_writer(&reader_key).expect("readers");
    let writers = holder.reader_writer(&reader_key).expect("writers");
    let written = writers.try_write().await.expect("write lock");
    let waited = tokio::join!(
        waiter.acquire(&writer_key, Duration::from_secs(3)),
        readers.read(Duration::from_secs(3)),
    );
    assert_eq!(kind_of(waited.0), ErrorKind::Timeout);
    assert_eq!(kind_of(waited.1), ErrorKind::Timeout);
    held.release().await.expect("release");
    written.release().await.expect("release");
    let log = server.server_log();
    assert_eq!(errors_and_warnings(&log), Vec::<&str>::new(), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_in_another_process_long_before_its_backoff_ends() {
    let server = PostgresServer::start().await;
    let holder = lock_on(server.options(CHECK));
    let waiter = patient(&server);
    let key = unique_prefix("handoff/release");
    // Several hand-offs, so that a poll that happened to land just after a release cannot
    // pass the test by luck (each has about a 15% chance of landing within the bound).
    for round in 0..3 {
        let held = holder.try_acquire(&key).await.expect("lock");
        let waiting = wait_behind_the_holder(&server, &waiter, &key).await;
        // The waiter's watcher is queued behind the lock, so the server wakes it on release.
        held.release().await.expect("release");
        assert_handed_over_quickly(waiting, Instant::now(), round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopped_in_immediate_mode_is_loss_within_one_check_interval() {
    // As after a failover: every session ends and every lock with it.
    let mut server = PostgresServer::start_local().await;
    let locks = process(&server);
    let key = unique_prefix("loss/stopped");
    let held = locks.try_acquire(&key).await.expect("lock");
    server.stop_immediate();
    let stopped = Instant::now();
    tokio::time::timeout(
        CHECK + Duration::from_millis(300),
        held.lost_token().cancelled(),
    )
    .await
    .expect("loss declared within one check interval");
    assert!(stopped.elapsed() <= CHECK + Duration::from_millis(300));
    assert_eq!(held.loss_reason(), Some(LossReason::ConnectionLost));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_sees_loss_within_two_check_intervals_when_the_server_freezes() {
    let mut server = PostgresServer::start_local().await;
    let locks = lock_on(
        server
            .options(CHECK)
            .with_query_timeout(Duration::from_millis(300)),
    );
    let key = unique_prefix("loss/frozen");
    let held = locks.try_acquire(&key).await.expect("lock");

    server.pause();
    let paused = Instant::now();
    let lost = tokio::time::timeout(
        CHECK * 2 + Duration::from_millis(300),
        held.lost_token().cancelled(),
    )
    .await;
    server.resume();
    lost.expect("loss declared although the server never answers");
    assert!(paused.elapsed() <= CHECK * 2 + Duration::from_millis(300));
    assert_eq!(held.loss_reason(), Some(LossReason::ConnectionLost));

    // The lost lock's connection was closed, so the thawed server frees the lock.
    let other = process(&server);
    let next = other
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("free once the server thawed");
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_restart_and_a_crash() {
    let mut server = PostgresServer::start_local().await;
    let key = unique_prefix("fencing/restart");
    let token = |locks: DistributedLock, key: String| async move {
        let held = locks
            .acquire(&key, Duration::from_secs(10))
            .await
            .expect("lock");
        let token = held.fencing_token();
        held.release().await.expect("release");
        token
    };
    let locks = process(&server);
    let before = token(locks.clone(), key.clone()).await;

    server.restart().await;
    // The same lock object: its pooled connection died with the server and is replaced.
    let after_restart = token(locks.clone(), key.clone()).await;
    assert!(
        after_restart > before,
        "token {after_restart} after a restart is not above {before}"
    );

    server.kill();
    server.start_again().await;
    let after_crash = token(process(&server), key.clone()).await;
    assert!(
        after_crash > after_restart,
        "token {after_crash} after a crash is not above {after_restart}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_taken_one_after_another_share_one_session() {
    let server = PostgresServer::start().await;
    let locks = process(&server);
    let prefix = unique_prefix("sessions/sequential");
    let mut held = Vec::new();
    for i in 0..20 {
        held.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("lock"),
        );
    }
    assert_eq!(
        backend(&locks).open_sessions(),
        1,
        "nothing ran concurrently, so one session serves every lock"
    );
    let holders: std::collections::HashSet<i32> = {
        let mut pids = std::collections::HashSet::new();
        for i in 0..20 {
            pids.extend(server.lock_holders(&format!("{prefix}/{i}")).await);
        }
        pids
    };
    assert_eq!(holders.len(), 1, "one server session holds all 20 locks");
    for handle in held {
        handle.release().await.expect("release");
    }
    for i in 0..20 {
        assert!(server
            .lock_holders(&format!("{prefix}/{i}"))
            .await
            .is_empty());
    }
    assert_eq!(backend(&locks).open_sessions(), 1, "kept for the next lock");
}

/// A process whose sessions carry their own `application_name`, so the server can tell them
/// from every other process's.
fn named_process(server: &PostgresServer, name: &str, options: PostgresOptions) -> DistributedLock {
    lock_on(options.with_connection_string(format!(
        "{} application_name={name}",
        server.connection_string_for_database("postgres")
    )))
}

/// The sessions the server has for `application_name`.
async fn sessions_named(admin: &tokio_postgres::Client, application_name: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&application_name],
        )
        .await
        .expect("pg_stat_activity")
        .get(0)
}

/// The advisory locks the server holds, granted or queued.
async fn advisory_locks(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1",
            &[],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfirmed_unlock_keeps_the_sessions_other_locks_and_never_lets_the_key_be_retaken() {
    let server = PostgresServer::start_local().await;
    let proxy = lockingkit_tests::proxy::FaultProxy::to_port(server.port()).await;
    let locks = lock_on(
        PostgresOptions::new(format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            proxy.port()
        ))
        .with_max_sessions(1)
        .with_query_timeout(Duration::from_millis(300))
        // Long enough that no check runs while answers are slow.
        .with_check_interval(Duration::from_secs(30)),
    );
    let key = unique_prefix("sessions/unconfirmed");
    let neighbour = unique_prefix("sessions/neighbour");
    let held = locks.try_acquire(&key).await.expect("lock");
    let kept = locks.try_acquire(&neighbour).await.expect("lock");
    assert_eq!(backend(&locks).open_sessions(), 1, "both on one session");

    // Answers now take longer than the statement timeout: the unlock goes unconfirmed.
    proxy.set_latency(Duration::from_millis(700));
    let released = held.release().await;
    assert_eq!(
        released.unwrap_err().kind(),
        ErrorKind::Unavailable,
        "an unlock that did not answer in time is not a confirmed release"
    );
    // Meanwhile the key is not taken again on the session that may still hold it.
    let retried = locks.try_acquire(&key).await;
    assert!(
        retried.is_err(),
        "the key may still be held by this process's session"
    );
    assert!(
        kept.is_held(),
        "the neighbour on the same session is untouched"
    );

    proxy.set_latency(Duration::ZERO);
    // Once the retried unlock is answered, the server no longer holds the key.
    eventually(
        "the retried unlock freeing the key",
        Duration::from_secs(5),
        async || server.lock_holders(&key).await.is_empty(),
    )
    .await;
    assert!(kept.is_held());
    assert_eq!(
        server.lock_holders(&neighbour).await.len(),
        1,
        "the session, and the neighbour's lock with it, stayed"
    );
    let again = locks.try_acquire(&key).await.expect("free again");
    again.release().await.expect("release");
    kept.release().await.expect("release");
    assert!(server.lock_holders(&neighbour).await.is_empty());
    // Settling the unlock unlocked only what the session held: an unlock of a lock it no
    // longer held would have logged "you don't own a lock".
    let log = server.server_log();
    assert_eq!(errors_and_warnings(&log), Vec::<&str>::new(), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settling_an_unanswered_attempt_that_took_nothing_logs_nothing() {
    // An attempt that goes unanswered (a frozen or slow server) may have taken its key, so the
    // session unlocks it before taking anything else; if the server had answered it busy, a
    // plain unlock would log "WARNING: you don't own a lock".
    let server = PostgresServer::start_local().await;
    let proxy = lockingkit_tests::proxy::FaultProxy::to_port(server.port()).await;
    let locks = lock_on(
        PostgresOptions::new(format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            proxy.port()
        ))
        .with_max_sessions(1)
        .with_query_timeout(Duration::from_millis(300))
        .with_check_interval(Duration::from_secs(30)),
    );
    let key = unique_prefix("log/unanswered");
    // A lock of our own keeps the session open while the attempt is settled.
    let kept = locks
        .try_acquire(&unique_prefix("log/kept"))
        .await
        .expect("lock");
    let plain = server.connect().await;
    let advisory_key = PostgresLockKeys::advisory_key(&key);
    plain
        .execute("SELECT pg_advisory_lock($1)", &[&advisory_key])
        .await
        .expect("plain lock");
    proxy.set_latency(Duration::from_millis(700));
    assert_eq!(
        kind_of(locks.try_acquire(&key).await),
        ErrorKind::Unavailable
    );
    proxy.set_latency(Duration::ZERO);
    // Once the attempt is settled the session takes new locks again.
    eventually(
        "the session settling the unanswered attempt",
        Duration::from_secs(10),
        async || match locks.try_acquire(&unique_prefix("log/after")).await {
            Ok(handle) => handle.release().await.is_ok(),
            Err(_) => false,
        },
    )
    .await;
    assert_eq!(backend(&locks).open_sessions(), 1, "the same session");
    assert!(kept.is_held());
    kept.release().await.expect("release");
    let log = server.server_log();
    assert_eq!(errors_and_warnings(&log), Vec::<&str>::new(), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfirmed_unlock_of_a_sessions_last_lock_closes_the_session_which_frees_it() {
    let mut server = PostgresServer::start_local().await;
    let locks = lock_on(
        server
            .options(CHECK)
            .with_query_timeout(Duration::from_millis(300))
            // Long enough that no check runs while the server is paused.
            .with_check_interval(Duration::from_secs(30)),
    );
    let key = unique_prefix("sessions/unconfirmed-last");
    let held = locks.try_acquire(&key).await.expect("lock");
    assert_eq!(backend(&locks).open_sessions(), 1);

    server.pause();
    let released = held.release().await;
    server.resume();
    assert_eq!(
        released.unwrap_err().kind(),
        ErrorKind::Unavailable,
        "an unlock that never answered is not a confirmed release"
    );
    assert_eq!(
        backend(&locks).open_sessions(),
        0,
        "nothing else depended on the session that may still hold the lock, so it closed"
    );
    eventually(
        "the server freeing the lock",
        Duration::from_secs(5),
        async || server.lock_holders(&key).await.is_empty(),
    )
    .await;
    let again = locks
        .try_acquire(&key)
        .await
        .expect("lock again on a new session");
    again.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_a_missing_database_is_misconfigured() {
    let server = PostgresServer::start_local().await;
    let wrong = server.create_password_role("right-horse", "hunter2").await;
    let locks = lock_on(PostgresOptions::new(wrong));
    let key = unique_prefix("misconfigured");
    let error = locks.try_acquire(&key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(!format!("{error} {error:?}").contains("hunter2"));
    // A waiter stops at once instead of retrying for the whole timeout.
    let started = Instant::now();
    assert_eq!(
        kind_of(locks.acquire(&key, Duration::from_secs(30)).await),
        ErrorKind::Misconfigured
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    let missing = lock_on(PostgresOptions::new(
        server.connection_string_for_database("no_such_database"),
    ));
    let error = missing.try_acquire(&key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_checks_the_server_the_credentials_and_the_fencing_objects_at_startup() {
    let mut server = PostgresServer::start_local().await;
    let admin = server.connect().await;
    let objects = async |admin: &tokio_postgres::Client| -> (bool, bool) {
        let row = admin
            .query_one(
                "SELECT to_regclass('lockingkit.fencing_tokens') IS NOT NULL, \
                 to_regprocedure('lockingkit.wait_advisory_lock(bigint, boolean, integer, regclass)') IS NOT NULL",
                &[],
            )
            .await
            .expect("catalog");
        (row.get(0), row.get(1))
    };
    assert_eq!(objects(&admin).await, (false, false));
    let locks = process(&server);
    locks.verify().await.expect("a working server verifies");
    assert_eq!(objects(&admin).await, (true, true), "created at the check");
    assert_eq!(
        backend(&locks).open_sessions(),
        0,
        "the check's session is its own, and closed"
    );

    let wrong = server.create_password_role("right-horse", "hunter2").await;
    let error = lock_on(PostgresOptions::new(wrong))
        .verify()
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(error.to_string().contains("credentials"), "{error}");
    assert!(!format!("{error} {error:?}").contains("hunter2"));
    let missing = lock_on(PostgresOptions::new(
        server.connection_string_for_database("no_such_database"),
    ));
    let error = missing.verify().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(error.to_string().contains("database"), "{error}");

    // Through the registry, each problem is prefixed with its section.
    let locking = lockingkit::Locking::from_config(lockingkit::LockingConfig::new().with_section(
        "Default",
        serde_json::json!({
            "provider": "postgres",
            "connection_string": server.connection_string_for_database("no_such_database"),
        }),
    ))
    .expect("valid configuration");
    let error = locking.verify().await.unwrap_err();
    assert!(error.to_string().contains("Locking.Default:"), "{error}");

    server.kill();
    let error = locks.verify().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_down_is_unavailable_not_busy_or_timed_out() {
    let mut server = PostgresServer::start_local().await;
    let locks = process(&server);
    let key = unique_prefix("down");
    server.kill();
    assert_eq!(
        kind_of(locks.try_acquire(&key).await),
        ErrorKind::Unavailable
    );
    assert_eq!(
        kind_of(locks.acquire(&key, Duration::from_millis(500)).await),
        ErrorKind::Unavailable
    );
    server.start_again().await;
    // Until the gate's next probe finds the server back, a call is still told the outage
    // (at once, by design): the caller retries, as a worker would.
    let (held, _) = acquire_through_outages(&locks, &key, Duration::from_secs(10))
        .await
        .expect("usable again once the server is back");
    held.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_makes_attempts_unavailable_within_the_query_timeout() {
    let mut server = PostgresServer::start_local().await;
    let locks = lock_on(
        server
            .options(CHECK)
            .with_query_timeout(Duration::from_millis(300)),
    );
    let key = unique_prefix("frozen");
    server.pause();
    let started = Instant::now();
    let result = locks.try_acquire(&key).await;
    let elapsed = started.elapsed();
    server.resume();
    assert_eq!(kind_of(result), ErrorKind::Unavailable);
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_starting_together_create_the_fencing_objects_without_racing() {
    let server = PostgresServer::start_local().await;
    let mut tasks = Vec::new();
    for n in 0..8 {
        let locks = process(&server);
        let key = unique_prefix(&format!("fencing/race/{n}"));
        tasks.push(tokio::spawn(async move {
            let held = locks.try_acquire(&key).await?;
            let token = held.fencing_token();
            held.release().await?;
            Ok::<u64, LockError>(token)
        }));
    }
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.push(
            task.await
                .expect("task")
                .expect("first use on a fresh server"),
        );
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 8, "every holder got its own token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_locks_live_on_at_most_max_sessions_and_leave_nothing_behind() {
    const LOCKS: usize = 10_000;
    let server = PostgresServer::start().await;
    let admin = server.connect().await;
    // The default check interval: a burst of 10,000 releases queues statements on the
    // sessions for longer than the short interval the loss tests use.
    let locks = named_process(&server, "lk_ten_thousand", PostgresOptions::default());
    let rival = process(&server);
    let prefix = unique_prefix("sessions/many");
    let keys: Vec<String> = (0..LOCKS).map(|i| format!("{prefix}/{i}")).collect();

    let mut held = Vec::with_capacity(LOCKS);
    for batch in keys.chunks(500) {
        let mut tasks = tokio::task::JoinSet::new();
        for key in batch {
            let locks = locks.clone();
            let key = key.clone();
            tasks.spawn(async move { locks.try_acquire(&key).await });
        }
        while let Some(result) = tasks.join_next().await {
            held.push(result.expect("task").expect("every distinct key is free"));
        }
    }
    let sessions = sessions_named(&admin, "lk_ten_thousand").await;
    assert!(
        (1..=4).contains(&sessions),
        "{LOCKS} locks on {sessions} sessions; the default budget is 4"
    );
    assert_eq!(advisory_locks(&admin).await, LOCKS as i64);
    // Every lock excludes another process.
    for key in keys.iter().step_by(50) {
        assert_eq!(kind_of(rival.try_acquire(key).await), ErrorKind::Busy);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for handle in held {
        tasks.spawn(handle.release());
    }
    while let Some(result) = tasks.join_next().await {
        result.expect("task").expect("confirmed release");
    }
    assert_eq!(advisory_locks(&admin).await, 0, "no advisory lock left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_short_holds_on_default_options_all_succeed() {
    let server = PostgresServer::start().await;
    let locks = lock_on(PostgresOptions::new(server.connection_string()));
    let prefix = unique_prefix("sessions/thousand");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000 {
        let locks = locks.clone();
        let key = format!("{prefix}/{i}");
        tasks.spawn(async move {
            let handle = locks.try_acquire(&key).await?;
            tokio::time::sleep(Duration::from_millis(50)).await;
            handle.release().await
        });
    }
    let mut failures = Vec::new();
    while let Some(result) = tasks.join_next().await {
        if let Err(error) = result.expect("task") {
            failures.push(error.to_string());
        }
    }
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(backend(&locks).open_sessions() <= 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_shared_session_loses_exactly_its_own_locks() {
    let server = PostgresServer::start().await;
    let admin = server.connect().await;
    // Checks far apart: the loss must come from the session ending, not from a check.
    let locks = lock_on(server.options(Duration::from_secs(30)));
    let prefix = unique_prefix("sessions/terminated");
    // Taken in concurrent bursts until they spread over several sessions (a session opens
    // once every open one has many statements in flight).
    let mut held = Vec::new();
    for burst in 0..20 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..200 {
            let locks = locks.clone();
            let key = format!("{prefix}/{burst}/{i}");
            tasks.spawn(async move { locks.try_acquire(&key).await.expect("lock") });
        }
        while let Some(handle) = tasks.join_next().await {
            held.push(handle.expect("task"));
        }
        if backend(&locks).open_sessions() >= 2 {
            break;
        }
    }
    let mut by_session: std::collections::HashMap<i32, Vec<LockHandle>> =
        std::collections::HashMap::new();
    for handle in held {
        let pid = server.lock_holders(handle.key()).await[0];
        by_session.entry(pid).or_default().push(handle);
    }
    assert!(
        by_session.len() >= 2,
        "the locks spread over {} sessions",
        by_session.len()
    );
    let (&victim, _) = by_session
        .iter()
        .max_by_key(|(_, handles)| handles.len())
        .expect("a session");
    let lost = by_session.remove(&victim).expect("victim");
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&victim])
        .await
        .expect("pg_terminate_backend");
    let terminated = Instant::now();
    for handle in &lost {
        tokio::time::timeout(Duration::from_secs(1), handle.lost_token().cancelled())
            .await
            .expect("every lock on the session is lost within moments");
        assert_eq!(handle.loss_reason(), Some(LossReason::ConnectionLost));
    }
    let noticed = terminated.elapsed();
    assert!(noticed < Duration::from_millis(500), "took {noticed:?}");
    // The server sends its FATAL before the ending backend gives its locks back, so the
    // client can declare loss a moment before the server has freed the keys: wait for that,
    // within a bound.
    for handle in &lost {
        let freed_by = Instant::now() + Duration::from_secs(2);
        while !server.lock_holders(handle.key()).await.is_empty() {
            assert!(
                Instant::now() < freed_by,
                "the server still holds a key of the terminated session"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for handles in by_session.values() {
        for handle in handles {
            assert!(handle.is_held(), "locks on other sessions are untouched");
            assert_eq!(server.lock_holders(handle.key()).await.len(), 1);
        }
    }
    for handle in by_session.into_values().flatten() {
        handle.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lock_table_is_a_clear_error_and_the_session_stays_healthy() {
    let server = PostgresServer::start().await;
    let admin = server.connect().await;
    let locks = lock_on(server.options(CHECK).with_max_sessions(1));
    let prefix = unique_prefix("sessions/full");
    // Fill the server's shared lock table from a plain session until it refuses.
    let filler = server.connect().await;
    filler
        .batch_execute(
            "DO $$ BEGIN FOR i IN 1..1000000 LOOP PERFORM pg_advisory_lock(-i::bigint); END LOOP; \
             EXCEPTION WHEN out_of_memory THEN NULL; END $$",
        )
        .await
        .expect("fill the lock table");
    let full = locks.try_acquire(&format!("{prefix}/one")).await;
    let error = full.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    assert!(
        error.to_string().contains("max_locks_per_transaction"),
        "says which setting to raise: {error}"
    );
    drop(filler);
    eventually(
        "the filler's locks going",
        Duration::from_secs(5),
        async || advisory_locks(&admin).await == 0,
    )
    .await;
    // The failure may have been the connect's (a new server process needs lock-table entries
    // too): until the backoff after it passes, callers are told it again without a request.
    let give_up = Instant::now() + Duration::from_secs(2);
    let next = loop {
        match locks.try_acquire(&format!("{prefix}/two")).await {
            Ok(next) => break next,
            Err(error) if Instant::now() < give_up => {
                assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => panic!("the backend takes locks again: {error}"),
        }
    };
    assert_eq!(backend(&locks).open_sessions(), 1);
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_are_per_database() {
    let server = PostgresServer::start_local().await;
    server.create_database("other").await;
    let here = process(&server);
    let there = lock_on(
        PostgresOptions::new(server.connection_string_for_database("other"))
            .with_check_interval(CHECK),
    );
    let key = unique_prefix("per-database");
    let a = here.try_acquire(&key).await.expect("lock in postgres");
    let b = there
        .try_acquire(&key)
        .await
        .expect("the same key in another database");
    a.release().await.expect("release");
    b.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_modes_follow_libpq_against_a_server_without_tls() {
    let server = PostgresServer::start_local().await;
    let plain = server.connection_string().replace("sslmode=disable", "");
    let key = unique_prefix("tls");

    // prefer falls back to plain TCP when the server offers no TLS.
    let prefer = lock_on(PostgresOptions::new(format!("{plain} sslmode=prefer")));
    prefer
        .try_acquire(&key)
        .await
        .expect("prefer works without TLS")
        .release()
        .await
        .expect("release");

    // require refuses to go on unencrypted; retrying cannot help.
    let require = lock_on(PostgresOptions::new(format!("{plain} sslmode=require")));
    let error = require.try_acquire(&key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");

    // verify-full with an unreadable CA file is refused at construction.
    let error = PostgresBackend::new(PostgresOptions::new(format!(
        "{plain} sslmode=verify-full sslrootcert=/nonexistent/ca.pem"
    )))
    .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert!(error.to_string().contains("sslrootcert"), "{error}");
}

#[test]
fn invalid_options_are_refused_at_construction_with_every_problem() {
    let error = PostgresBackend::new(
        PostgresOptions::default()
            .with_max_sessions(0)
            .with_query_timeout(Duration::ZERO),
    )
    .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    for field in ["connection_string", "max_sessions", "query_timeout"] {
        assert!(
            error.to_string().contains(&format!("PostgresOptions.{field}")),
            "built in code, problems name the options type, not a section nobody configured: {error}"
        );
    }
    assert!(!error.to_string().contains("Locking."), "{error}");
}

#[test]
fn renew_every_is_refused_for_a_postgres_lock_built_in_code() {
    let backend = PostgresBackend::new(PostgresOptions::new("host=127.0.0.1 user=app"))
        .expect("valid options");
    let error = DistributedLock::builder(backend)
        .options(LockOptions::default().with_renew_every(Duration::from_secs(1)))
        .build()
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert!(
        error.to_string().contains("renew_every does not apply"),
        "{error}"
    );
}

/// How long the oldest statement of `application_name` that holds a snapshot has been
/// running, by the server's clock (zero when none does).
async fn oldest_snapshot(admin: &tokio_postgres::Client, application_name: &str) -> Duration {
    let seconds: f64 = admin
        .query_one(
            "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - query_start)), 0)::float8 \
             FROM pg_stat_activity \
             WHERE application_name = $1 AND backend_xmin IS NOT NULL AND state = 'active'",
            &[&application_name],
        )
        .await
        .expect("pg_stat_activity")
        .get(0);
    Duration::from_secs_f64(seconds.max(0.0))
}

/// Lock requests of `application_name` the server has queued and not granted.
async fn queued_requests(admin: &tokio_postgres::Client, application_name: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = $1",
            &[&application_name],
        )
        .await
        .expect("pg_locks")
        .get(0)
}

/// The dead rows VACUUM left in `table` because some snapshot might still see them.
async fn dead_rows_after_vacuum(admin: &tokio_postgres::Client, table: &str) -> i64 {
    admin
        .batch_execute(&format!("VACUUM {table}"))
        .await
        .expect("VACUUM");
    admin
        .query_one(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = $1",
            &[&table],
        )
        .await
        .expect("pg_stat_user_tables")
        .get(0)
}

/// A process that waits up to `timeout` for `key` in the background.
fn start_waiting(
    waiter: &DistributedLock,
    key: &str,
    timeout: Duration,
) -> tokio::task::JoinHandle<Result<LockHandle, LockError>> {
    let waiter = waiter.clone();
    let key = key.to_owned();
    tokio::spawn(async move { waiter.acquire(&key, timeout).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_process_holds_no_snapshot_long_so_vacuum_and_concurrent_indexes_proceed() {
    let server = PostgresServer::start().await;
    let admin = server.connect().await;
    admin
        .batch_execute(
            "CREATE TABLE churn (id int PRIMARY KEY, v int); \
             INSERT INTO churn SELECT i, 0 FROM generate_series(1, 1000) i; \
             CREATE TABLE other (v int); INSERT INTO other SELECT generate_series(1, 1000);",
        )
        .await
        .expect("tables");
    let holder = process(&server);
    let waiter = named_process(&server, "lk_snapshot_waiter", server.options(CHECK));
    let key = unique_prefix("waiting/snapshot");
    let held = holder.try_acquire(&key).await.expect("lock");
    let waiting = start_waiting(&waiter, &key, Duration::from_secs(30));
    eventually(
        "the waiter queued behind the holder",
        Duration::from_secs(5),
        async || queued_requests(&admin, "lk_snapshot_waiter").await > 0,
    )
    .await;

    // Sampled for 3 s: no statement of the waiting process keeps a snapshot for over a second.
    let mut oldest = Duration::ZERO;
    let sampling = Instant::now();
    while sampling.elapsed() < Duration::from_secs(3) {
        oldest = oldest.max(oldest_snapshot(&admin, "lk_snapshot_waiter").await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        oldest > Duration::ZERO,
        "the sampling saw the waiter's statements"
    );
    assert!(
        oldest < Duration::from_millis(1100),
        "a waiting statement kept its snapshot for {oldest:?}"
    );

    // Rows that die while the process waits are removable within a couple of seconds.
    admin
        .batch_execute("UPDATE churn SET v = v + 1")
        .await
        .expect("UPDATE");
    let updated = Instant::now();
    loop {
        let dead = dead_rows_after_vacuum(&admin, "churn").await;
        if dead == 0 {
            break;
        }
        assert!(
            updated.elapsed() < Duration::from_secs(3),
            "VACUUM still leaves {dead} dead rows {:?} after the update",
            updated.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Another session's CREATE INDEX CONCURRENTLY does not wait for the holder to let go.
    tokio::time::timeout(
        Duration::from_secs(3),
        admin.batch_execute("CREATE INDEX CONCURRENTLY other_v ON other (v)"),
    )
    .await
    .expect("CREATE INDEX CONCURRENTLY finished while the process waited")
    .expect("CREATE INDEX CONCURRENTLY");

    assert!(!waiting.is_finished(), "the waiter still waits");
    held.release().await.expect("release");
    let handed = waiting.await.expect("task").expect("handed over");
    handed.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_can_create_an_index_concurrently_under_its_lock_while_another_process_waits() {
    // Local: the server's log tells whether the deadlock detector killed anyone.
    let server = PostgresServer::start_local().await;
    let admin = server.connect().await;
    admin
        .batch_execute(
            "CREATE TABLE migrated (v int); INSERT INTO migrated SELECT generate_series(1, 1000);",
        )
        .await
        .expect("table");
    let waiter = process(&server);
    let key = unique_prefix("waiting/migration");
    let advisory_key = PostgresLockKeys::advisory_key(&key);
    // The usual migration: one session takes the lock and builds an index concurrently.
    let migration = server.connect().await;
    migration
        .execute("SELECT pg_advisory_lock($1)", &[&advisory_key])
        .await
        .expect("lock");
    let waiting = start_waiting(&waiter, &key, Duration::from_secs(30));
    eventually(
        "the waiter's watcher queued",
        Duration::from_secs(5),
        async || watcher_is_queued(&server, &key).await,
    )
    .await;
    tokio::time::timeout(
        Duration::from_secs(10),
        migration.batch_execute("CREATE INDEX CONCURRENTLY migrated_v ON migrated (v)"),
    )
    .await
    .expect("the index is built while the other process waits")
    .expect("no deadlock error on the holder's side");
    assert!(!waiting.is_finished(), "the waiter waited");
    let log = server.server_log();
    assert!(
        !log.contains("deadlock detected"),
        "the deadlock detector killed a statement:\n{log}"
    );
    migration
        .execute("SELECT pg_advisory_unlock($1)", &[&advisory_key])
        .await
        .expect("unlock");
    release_once_won(waiting, "handed over after the unlock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waits_leave_no_queued_request_and_no_session_behind() {
    let server = PostgresServer::start().await;
    let admin = server.connect().await;
    let holder = process(&server);
    let waiter = named_process(&server, "lk_dropped_waits", server.options(CHECK));
    let key = unique_prefix("waiting/dropped");
    let held = holder.try_acquire(&key).await.expect("lock");
    let waits: Vec<_> = (0..20)
        .map(|_| start_waiting(&waiter, &key, Duration::from_secs(60)))
        .collect();
    eventually(
        "the waiter queued behind the holder",
        Duration::from_secs(5),
        async || queued_requests(&admin, "lk_dropped_waits").await > 0,
    )
    .await;
    assert_eq!(
        backend(&waiter).wait_sessions(),
        1,
        "one session watches the key"
    );

    for wait in &waits {
        wait.abort();
    }
    let dropped = Instant::now();
    eventually(
        "the dropped waits' request and session going",
        Duration::from_millis(1500),
        async || {
            queued_requests(&admin, "lk_dropped_waits").await == 0
                && sessions_named(&admin, "lk_dropped_waits").await
                    == backend(&waiter).open_sessions() as i64
        },
    )
    .await;
    assert_eq!(backend(&waiter).wait_sessions(), 0);
    let gone = dropped.elapsed();
    assert!(held.is_held());
    held.release().await.expect("release");
    eprintln!("request and session gone {gone:?} after the waits were dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_requests_in_flight_on_a_locked_route_all_succeed_on_default_options() {
    use lockingkit_tests::http::{orders_route, serve, Connection};
    let server = PostgresServer::start().await;
    let locks = lock_on(PostgresOptions::new(server.connection_string()));
    // Counts the handlers running at once: each holds its request's lock.
    let running = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = orders_route(Some(locks.clone()), {
        let (running, most) = (running.clone(), most.clone());
        move || {
            let (running, most) = (running.clone(), most.clone());
            async move {
                use std::sync::atomic::Ordering::SeqCst;
                most.fetch_max(running.fetch_add(1, SeqCst) + 1, SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                running.fetch_sub(1, SeqCst);
            }
        }
    });
    let addr = serve(app).await;
    let prefix = unique_prefix("http").replace('/', "-");
    let mut requests = tokio::task::JoinSet::new();
    for i in 0..500 {
        let path = format!("/orders/{prefix}-{i}");
        requests.spawn(async move { Connection::open(addr).await.post(&path).await });
    }
    let mut statuses = std::collections::BTreeMap::new();
    while let Some(status) = requests.join_next().await {
        *statuses
            .entry(status.expect("request").as_u16())
            .or_insert(0) += 1;
    }
    assert_eq!(
        statuses,
        [(200, 500)].into(),
        "every request held its own lock"
    );
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    // One connection per held lock capped this at the pool size (16).
    assert!(most >= 64, "only {most} locked handlers ran at once");
    assert!(backend(&locks).open_sessions() <= 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_check_per_session_per_interval_vouches_for_every_lock_on_it() {
    let server = PostgresServer::start().await;
    let proxy = lockingkit_tests::proxy::FaultProxy::to_port(server.port()).await;
    let interval = Duration::from_millis(200);
    let locks = lock_on(
        PostgresOptions::new(format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            proxy.port()
        ))
        .with_check_interval(interval),
    );
    let prefix = unique_prefix("sessions/checks");
    let mut held = Vec::new();
    for i in 0..50 {
        held.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("lock"),
        );
    }
    assert_eq!(backend(&locks).open_sessions(), 1);
    // Five check intervals with nothing else on the line: every exchange is a check.
    let since = Instant::now();
    tokio::time::sleep(interval * 5).await;
    let checks = proxy
        .exchanges()
        .iter()
        .filter(|exchange| exchange.sent >= since)
        .count();
    assert!(
        (3..=8).contains(&checks),
        "{checks} checks in five intervals for 50 locks on one session (one per lock would be 250)"
    );
    for handle in held {
        assert!(handle.is_held());
        handle.release().await.expect("release");
    }
}

// ---------------------------------------------------------------------------------------------
// Readers, writers and semaphores.

mod modes {
    use super::*;
    use lockingkit::backend::{Acquired, LockBackend};
    use lockingkit::providers::postgres::PostgresLease;
    use lockingkit::LockMode;

    const SHARED: LockMode = LockMode::Shared;
    const EXCLUSIVE: LockMode = LockMode::Exclusive;

    fn semaphore(max_count: u32) -> LockMode {
        LockMode::Semaphore { max_count }
    }

    /// A backend with at most `max_sessions` sessions for its locks.
    fn backend_with(server: &PostgresServer, max_sessions: usize) -> PostgresBackend {
        PostgresBackend::new(server.options(CHECK).with_max_sessions(max_sessions))
            .expect("options")
    }

    async fn take(
        backend: &PostgresBackend,
        key: &str,
        mode: LockMode,
    ) -> Option<Acquired<PostgresLease>> {
        backend
            .try_acquire(key, mode)
            .await
            .expect("the server answered")
    }

    #[track_caller]
    fn held(acquired: Option<Acquired<PostgresLease>>, what: &str) -> Acquired<PostgresLease> {
        acquired.unwrap_or_else(|| panic!("{what}: busy"))
    }

    async fn release(backend: &PostgresBackend, acquired: Acquired<PostgresLease>) {
        backend
            .release(&acquired.lease)
            .await
            .expect("confirmed release");
    }

    /// The `bigint` advisory locks of `key` on the server: (pid, mode, granted).
    async fn key_rows(admin: &tokio_postgres::Client, key: &str) -> Vec<(i32, String, bool)> {
        admin
            .query(
                "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory' \
                 AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1 \
                 ORDER BY pid, mode",
                &[&PostgresLockKeys::advisory_key(key)],
            )
            .await
            .expect("pg_locks")
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect()
    }

    /// The granted slot locks of semaphore `key` on the server: (pid, slot), as the documented
    /// mapping names them (`objsubid = 2`, `classid` the semaphore key, `objid` the slot).
    async fn slot_rows(admin: &tokio_postgres::Client, key: &str) -> Vec<(i32, i64)> {
        let semaphore_key = i64::from(PostgresLockKeys::semaphore_key(key) as u32);
        admin
            .query(
                "SELECT pid, objid::bigint FROM pg_locks WHERE locktype = 'advisory' \
                 AND objsubid = 2 AND granted AND mode = 'ExclusiveLock' \
                 AND classid::bigint = $1 ORDER BY objid",
                &[&semaphore_key],
            )
            .await
            .expect("pg_locks")
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readers_on_two_backends_hold_together_and_a_writer_is_busy_even_on_a_readers_session()
    {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        // One session: the writer's attempt can only go to the session that reads the key,
        // where the server itself would grant it (one session's locks never conflict).
        let first = backend_with(&server, 1);
        let second = backend_with(&server, 4);
        let key = unique_prefix("modes/readers");
        assert!(first.supports(SHARED));

        let a = held(take(&first, &key, SHARED).await, "first reader");
        // The only reader is this very session: nothing but the provider stands between the
        // writer's attempt and a grant.
        assert!(
            take(&first, &key, EXCLUSIVE).await.is_none(),
            "a writer on the reader's own session"
        );
        let b = held(take(&second, &key, SHARED).await, "second reader");
        assert!(take(&second, &key, EXCLUSIVE).await.is_none());
        let fresh = backend_with(&server, 4);
        assert!(take(&fresh, &key, EXCLUSIVE).await.is_none());
        let rows = key_rows(&admin, &key).await;
        assert_eq!(rows.len(), 2, "two readers and nothing else: {rows:?}");
        assert!(rows
            .iter()
            .all(|(_, mode, granted)| mode == "ShareLock" && *granted));
        assert!(
            b.fencing_token > a.fencing_token,
            "tokens grow across readers"
        );

        release(&first, a).await;
        assert!(
            take(&fresh, &key, EXCLUSIVE).await.is_none(),
            "one reader left"
        );
        release(&second, b).await;
        let writer = held(
            take(&fresh, &key, EXCLUSIVE).await,
            "writer after the readers",
        );
        assert!(
            take(&first, &key, SHARED).await.is_none(),
            "a reader while the writer holds"
        );
        release(&fresh, writer).await;
        assert!(
            key_rows(&admin, &key).await.is_empty(),
            "nothing left behind"
        );
        assert_eq!(first.open_sessions(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_reads_a_key_twice_and_each_lease_unlocks_one_hold() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let readers = backend_with(&server, 1);
        let writers = backend_with(&server, 1);
        let key = unique_prefix("modes/stacked");

        let a = held(take(&readers, &key, SHARED).await, "first reader");
        let b = held(
            take(&readers, &key, SHARED).await,
            "second reader, same session",
        );
        let rows = key_rows(&admin, &key).await;
        assert_eq!(rows.len(), 1, "one session holds both reads: {rows:?}");

        release(&readers, a).await;
        assert_eq!(
            key_rows(&admin, &key).await,
            rows,
            "one unlock left the other reader's hold"
        );
        assert!(take(&writers, &key, EXCLUSIVE).await.is_none());
        release(&readers, b).await;
        assert!(
            key_rows(&admin, &key).await.is_empty(),
            "the second unlock freed it"
        );
        let writer = held(take(&writers, &key, EXCLUSIVE).await, "writer");
        release(&writers, writer).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_queued_writer_holds_back_a_reader_even_on_a_session_that_reads_the_key_already() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let readers = backend_with(&server, 1);
        let key = unique_prefix("modes/queued-writer");
        let first = held(take(&readers, &key, SHARED).await, "first reader");

        // A writer queued in the server's lock queue, as a waiting writer's watcher is.
        let writer = server.connect().await;
        writer
            .batch_execute("SET lock_timeout = '2s'")
            .await
            .expect("lock_timeout");
        let queued = tokio::spawn({
            let key = key.clone();
            async move {
                let sql = format!(
                    "SELECT pg_advisory_lock({})",
                    PostgresLockKeys::SQL_EXPRESSION
                );
                writer.query_one(&sql, &[&key]).await.map(|_| writer)
            }
        });
        eventually("the writer queued", Duration::from_secs(5), async || {
            key_rows(&admin, &key)
                .await
                .iter()
                .any(|(_, mode, granted)| mode == "ExclusiveLock" && !granted)
        })
        .await;
        // The server would grant this session another share without looking at the queue.
        assert!(
            take(&readers, &key, SHARED).await.is_none(),
            "a new reader while a writer is queued"
        );
        assert!(take(&backend_with(&server, 1), &key, SHARED)
            .await
            .is_none());

        release(&readers, first).await;
        let writer = queued
            .await
            .expect("task")
            .expect("the queued writer got in");
        assert!(
            take(&readers, &key, SHARED).await.is_none(),
            "the writer holds"
        );
        writer
            .query_one(
                &format!(
                    "SELECT pg_advisory_unlock({})",
                    PostgresLockKeys::SQL_EXPRESSION
                ),
                &[&key],
            )
            .await
            .expect("unlock");
        let after = held(
            take(&readers, &key, SHARED).await,
            "a reader after the writer",
        );
        release(&readers, after).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_that_holds_a_key_exclusively_never_takes_it_shared() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let backend = backend_with(&server, 1);
        let key = unique_prefix("modes/exclusive-then-shared");

        let writer = held(take(&backend, &key, EXCLUSIVE).await, "writer");
        assert!(take(&backend, &key, SHARED).await.is_none());
        let rows = key_rows(&admin, &key).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].1, "ExclusiveLock");
        release(&backend, writer).await;
        assert!(key_rows(&admin, &key).await.is_empty());
        let reader = held(
            take(&backend, &key, SHARED).await,
            "reader after the writer",
        );
        release(&backend, reader).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_semaphore_of_three_admits_three_holders_across_backends_and_the_fourth_waits_for_a_free_slot(
    ) {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let backends: Vec<PostgresBackend> = (0..4).map(|_| backend_with(&server, 2)).collect();
        let key = unique_prefix("modes/semaphore");
        let three = semaphore(3);
        assert!(backends[0].supports(three));

        let mut holders = Vec::new();
        for backend in &backends[..3] {
            holders.push(held(take(backend, &key, three).await, "a free slot"));
        }
        assert!(
            take(&backends[3], &key, three).await.is_none(),
            "every slot taken"
        );
        let slots = slot_rows(&admin, &key).await;
        assert_eq!(
            slots.iter().map(|(_, slot)| *slot).collect::<Vec<_>>(),
            vec![0, 1, 2],
            "each holder one slot"
        );
        // The semaphore and the lock of the same key are unrelated.
        let lock = held(take(&backends[3], &key, EXCLUSIVE).await, "the plain lock");
        release(&backends[3], lock).await;

        let freed = holders.remove(1);
        let freed_slot = freed.lease.semaphore_slot().expect("a slot lease").1;
        let freed_token = freed.fencing_token;
        release(&backends[1], freed).await;
        let next = held(take(&backends[3], &key, three).await, "the freed slot");
        assert_eq!(next.lease.semaphore_slot().map(|s| s.1), Some(freed_slot));
        assert!(next.fencing_token > freed_token, "tokens grow per slot");
        assert!(take(&backends[1], &key, three).await.is_none());

        release(&backends[3], next).await;
        for (backend, holder) in [&backends[0], &backends[2]].into_iter().zip(holders) {
            release(backend, holder).await;
        }
        assert!(
            slot_rows(&admin, &key).await.is_empty(),
            "nothing left behind"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_semaphore_attempt_takes_one_slot_and_a_session_never_retakes_its_own() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        // One session: every slot it holds would be granted to it again by re-entrancy.
        let backend = backend_with(&server, 1);
        let key = unique_prefix("modes/semaphore-one-session");
        let five = semaphore(5);

        let mut holders = Vec::new();
        let mut tokens = Vec::new();
        for taken in 1..=5 {
            let acquired = held(take(&backend, &key, five).await, "a slot of five");
            tokens.push(acquired.fencing_token);
            holders.push(acquired);
            let slots = slot_rows(&admin, &key).await;
            assert_eq!(slots.len(), taken, "one slot per attempt: {slots:?}");
        }
        let mut slots: Vec<i32> = holders
            .iter()
            .filter_map(|h| h.lease.semaphore_slot().map(|s| s.1))
            .collect();
        slots.sort_unstable();
        assert_eq!(slots, vec![0, 1, 2, 3, 4], "five distinct slots");
        assert!(tokens.windows(2).all(|w| w[0] < w[1]));
        assert!(
            take(&backend, &key, five).await.is_none(),
            "the sixth is busy"
        );
        assert_eq!(slot_rows(&admin, &key).await.len(), 5);
        assert_eq!(backend.open_sessions(), 1);
        for holder in holders {
            release(&backend, holder).await;
        }
        assert!(
            slot_rows(&admin, &key).await.is_empty(),
            "each unlock freed its slot"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_semaphore_attempts_on_one_backend_never_share_a_slot() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let backend = backend_with(&server, 2);
        let key = unique_prefix("modes/semaphore-concurrent");
        let four = semaphore(4);

        let attempts = (0..24).map(|_| {
            let backend = backend.clone();
            let key = key.clone();
            tokio::spawn(async move { backend.try_acquire(&key, four).await })
        });
        let mut holders = Vec::new();
        for attempt in attempts {
            if let Some(acquired) = attempt.await.expect("task").expect("answered") {
                holders.push(acquired);
            }
        }
        let slots = slot_rows(&admin, &key).await;
        assert!(
            holders.len() <= 4,
            "{} holders of a semaphore of 4",
            holders.len()
        );
        assert_eq!(slots.len(), holders.len(), "one slot per holder: {slots:?}");
        for holder in holders {
            release(&backend, holder).await;
        }
        assert!(slot_rows(&admin, &key).await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn semaphore_sizes_outside_the_limit_are_not_supported() {
        let server = PostgresServer::start().await;
        let backend = backend_with(&server, 1);
        assert!(!backend.supports(semaphore(0)));
        assert!(backend.supports(semaphore(lockingkit::backend::MAX_SEMAPHORE_COUNT)));
        assert!(!backend.supports(semaphore(lockingkit::backend::MAX_SEMAPHORE_COUNT + 1)));
        let refused = backend
            .try_acquire("modes/too-big", semaphore(u32::MAX))
            .await
            .unwrap_err();
        assert_eq!(
            refused.kind(),
            lockingkit::backend::BackendErrorKind::Misconfigured
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plain_sql_sees_readers_and_slots_as_documented_and_takes_them_with_the_documented_sql()
    {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let plain = server.connect().await;
        let backend = backend_with(&server, 1);
        let key = unique_prefix("interop/modes");
        let sql =
            |function: &str| format!("SELECT {function}({})", PostgresLockKeys::SQL_EXPRESSION);

        let reader = held(take(&backend, &key, SHARED).await, "reader");
        let rows = key_rows(&admin, &key).await;
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].1, "ShareLock");
        let shared: bool = plain
            .query_one(&sql("pg_try_advisory_lock_shared"), &[&key])
            .await
            .expect("plain shared")
            .get(0);
        assert!(shared, "plain SQL reads beside the library's reader");
        let exclusive: bool = plain
            .query_one(&sql("pg_try_advisory_lock"), &[&key])
            .await
            .expect("plain exclusive")
            .get(0);
        assert!(!exclusive, "plain SQL cannot write while readers hold");
        release(&backend, reader).await;
        assert!(
            take(&backend, &key, EXCLUSIVE).await.is_none(),
            "the plain reader keeps the library's writer out"
        );
        plain
            .query_one(&sql("pg_advisory_unlock_shared"), &[&key])
            .await
            .expect("plain unlock");

        // Slot 0 and 2 of a semaphore of 3, taken by plain SQL with the documented mapping.
        let slot_sql = format!(
            "SELECT pg_try_advisory_lock({}, $2)",
            PostgresLockKeys::SEMAPHORE_SQL_EXPRESSION
        );
        for slot in [0i32, 2] {
            let taken: bool = plain
                .query_one(&slot_sql, &[&key, &slot])
                .await
                .expect("plain slot")
                .get(0);
            assert!(taken);
        }
        let three = semaphore(3);
        let holder = held(take(&backend, &key, three).await, "the one slot left");
        assert_eq!(
            holder.lease.semaphore_slot(),
            Some(PostgresLockKeys::semaphore_slot(&key, 1))
        );
        assert!(take(&backend, &key, three).await.is_none());
        let slots = slot_rows(&admin, &key).await;
        assert_eq!(slots.iter().map(|s| s.1).collect::<Vec<_>>(), vec![0, 1, 2]);
        let busy: bool = plain
            .query_one(&slot_sql, &[&key, &1i32])
            .await
            .expect("plain slot")
            .get(0);
        assert!(!busy, "plain SQL finds the library's slot taken");
        release(&backend, holder).await;
        assert_eq!(
            slot_rows(&admin, &key).await.len(),
            2,
            "the plain session's two"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_terminated_readers_session_frees_its_share_and_leaves_the_other_reader_holding() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let key = unique_prefix("modes/terminated-reader");
        let rw_of =
            |locks: DistributedLock| locks.reader_writer(&key).expect("readers on PostgreSQL");
        let doomed = named_process(&server, "doomed-reader", server.options(CHECK));
        let other = process(&server);
        let writer = process(&server);

        let first = rw_of(doomed.clone())
            .try_read()
            .await
            .expect("first reader");
        let second = rw_of(other.clone())
            .try_read()
            .await
            .expect("second reader");
        assert_eq!(
            kind_of(rw_of(writer.clone()).try_write().await),
            ErrorKind::Busy
        );

        assert_eq!(server.terminate_backends("doomed-reader").await, 1);
        tokio::time::timeout(Duration::from_secs(2), first.lost_token().cancelled())
            .await
            .expect("the terminated reader sees loss");
        assert_eq!(first.loss_reason(), Some(LossReason::ConnectionLost));
        eventually(
            "the server freeing the share",
            Duration::from_secs(5),
            async || key_rows(&admin, &key).await.len() == 1,
        )
        .await;
        assert!(second.is_held(), "the other reader is unaffected");
        assert_eq!(
            kind_of(rw_of(writer.clone()).try_write().await),
            ErrorKind::Busy
        );

        let second_token = second.fencing_token();
        second.release().await.expect("release");
        let written = rw_of(writer)
            .try_write()
            .await
            .expect("the writer once every reader is gone");
        assert!(written.fencing_token() > second_token);
        written.release().await.expect("release");
        assert!(key_rows(&admin, &key).await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_waiting_behind_overlapping_readers_gets_in_once_the_readers_holding_then_are_gone(
    ) {
        let server = PostgresServer::start().await;
        let key = unique_prefix("modes/writer-intent");
        let readers = process(&server).reader_writer(&key).expect("readers");
        let writers = process(&server).reader_writer(&key).expect("writers");
        const READ: Duration = Duration::from_millis(400);

        // A reader every 100 ms, each holding 400 ms: the key is never free of readers, so a
        // writer that only tried would never get in.
        let stop = lockingkit::CancellationToken::new();
        let refused = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stream = tokio::spawn({
            let (readers, stop, refused) = (readers.clone(), stop.clone(), refused.clone());
            async move {
                let mut reads = tokio::task::JoinSet::new();
                while !stop.is_cancelled() {
                    match readers.try_read().await {
                        Ok(handle) => {
                            reads.spawn(async move {
                                tokio::time::sleep(READ).await;
                                handle.release().await.expect("reader release");
                            });
                        }
                        Err(error) if error.kind() == ErrorKind::Busy => {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(error) => panic!("reader: {error}"),
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                while reads.join_next().await.is_some() {}
            }
        });
        tokio::time::sleep(Duration::from_millis(600)).await;
        let started = Instant::now();
        let written = writers
            .write(Duration::from_secs(10))
            .await
            .expect("the writer gets in");
        let waited = started.elapsed();
        stop.cancel();
        written.release().await.expect("release");
        stream.await.expect("reader stream");
        // Once its watcher queues (after its first busy attempt), no new reader gets in; the
        // readers holding then are gone within one read, and a slice of the watcher plus the
        // hand-off covers the rest.
        assert!(
            waited < READ + Duration::from_millis(900),
            "the writer waited {waited:?} behind readers holding {READ:?} each"
        );
        assert!(
            refused.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "new readers were held back while the writer waited"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_semaphore_through_the_public_api_hands_a_freed_slot_to_a_waiter_in_another_process()
    {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let key = unique_prefix("modes/semaphore-e2e");
        let here = process(&server).semaphore(&key, 2).expect("a semaphore");
        let there = process(&server).semaphore(&key, 2).expect("a semaphore");

        let a = here.try_acquire().await.expect("first slot");
        let b = there.try_acquire().await.expect("second slot");
        assert_eq!(kind_of(there.try_acquire().await), ErrorKind::Busy);
        let waiting = tokio::spawn({
            let there = there.clone();
            async move { there.acquire(Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let a_token = a.fencing_token();
        a.release().await.expect("release");
        let c = waiting.await.expect("task").expect("the freed slot");
        assert!(c.fencing_token() > a_token);
        assert_eq!(slot_rows(&admin, &key).await.len(), 2);
        b.release().await.expect("release");
        c.release().await.expect("release");
        assert!(slot_rows(&admin, &key).await.is_empty());
        assert_eq!(
            kind_of(process(&server).semaphore(&key, 0).map(|_| unreachable!())),
            ErrorKind::Misconfigured
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unconfirmed_shared_unlock_never_takes_the_hold_of_a_reader_on_the_same_session() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let proxy = lockingkit_tests::proxy::FaultProxy::to_port(server.port()).await;
        let backend = PostgresBackend::new(
            PostgresOptions::new(format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
                proxy.port()
            ))
            .with_max_sessions(1)
            .with_query_timeout(Duration::from_millis(300))
            .with_check_interval(Duration::from_secs(30)),
        )
        .expect("options");
        let key = unique_prefix("modes/unconfirmed-shared");
        let a = held(take(&backend, &key, SHARED).await, "first reader");
        let b = held(
            take(&backend, &key, SHARED).await,
            "second reader, same session",
        );

        proxy.set_latency(Duration::from_millis(700));
        let unconfirmed = backend.release(&a.lease).await;
        assert!(
            unconfirmed.is_err(),
            "an unlock that did not answer in time"
        );
        drop(a);
        proxy.set_latency(Duration::ZERO);
        // Whatever the retries do, the other reader's hold stays on the server.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let rows = key_rows(&admin, &key).await;
        assert_eq!(rows.len(), 1, "the second reader still holds: {rows:?}");
        assert_eq!(rows[0].1, "ShareLock");
        let writer = backend_with(&server, 1);
        assert!(take(&writer, &key, EXCLUSIVE).await.is_none());

        release(&backend, b).await;
        eventually("nothing left behind", Duration::from_secs(5), async || {
            key_rows(&admin, &key).await.is_empty()
        })
        .await;
        let written = held(take(&writer, &key, EXCLUSIVE).await, "the writer");
        release(&writer, written).await;
    }

    /// Whether a LockingKit session is queued on `key` in `mode` (`ShareLock`, `ExclusiveLock`):
    /// a waiting process's watcher.
    async fn watcher_queued_as(admin: &tokio_postgres::Client, key: &str, mode: &str) -> bool {
        key_rows(admin, key)
            .await
            .iter()
            .any(|(_, queued, granted)| queued == mode && !granted)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_waiting_for_a_writer_queues_shared_and_holds_no_other_reader_back() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let key = unique_prefix("modes/waiting-reader");
        let writer = process(&server).reader_writer(&key).expect("rw");
        // A one-second backoff: only the watcher can hand the key over quickly.
        let reader = patient(&server).reader_writer(&key).expect("rw");
        let other = process(&server).reader_writer(&key).expect("rw");

        let written = writer.try_write().await.expect("writer");
        let waiting = tokio::spawn({
            let reader = reader.clone();
            async move {
                let handle = reader.read(Duration::from_secs(10)).await;
                (Instant::now(), handle)
            }
        });
        eventually(
            "the reader's watcher",
            Duration::from_secs(10),
            async || watcher_queued_as(&admin, &key, "ShareLock").await,
        )
        .await;
        assert!(
            !watcher_queued_as(&admin, &key, "ExclusiveLock").await,
            "a waiting reader is no writer's intent"
        );
        let released = Instant::now();
        written.release().await.expect("release");
        let (read_at, read) = waiting.await.expect("task");
        let read = read.expect("the reader once the writer left");
        assert!(
            read_at.saturating_duration_since(released) < Duration::from_millis(300),
            "woken by its watcher, not its 1 s backoff"
        );
        let beside = other.try_read().await.expect("another reader beside it");
        read.release().await.expect("release");
        beside.release().await.expect("release");
        assert!(key_rows(&admin, &key).await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_waiting_for_readers_queues_exclusively_and_new_readers_are_refused() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let key = unique_prefix("modes/waiting-writer");
        let readers = process(&server).reader_writer(&key).expect("rw");
        let writer = patient(&server).reader_writer(&key).expect("rw");

        let read = readers.try_read().await.expect("reader");
        let waiting = tokio::spawn({
            let writer = writer.clone();
            async move {
                let handle = writer.write(Duration::from_secs(10)).await;
                (Instant::now(), handle)
            }
        });
        eventually(
            "the writer's watcher",
            Duration::from_secs(10),
            async || watcher_queued_as(&admin, &key, "ExclusiveLock").await,
        )
        .await;
        assert_eq!(
            kind_of(readers.try_read().await),
            ErrorKind::Busy,
            "a new reader while a writer waits"
        );
        let released = Instant::now();
        read.release().await.expect("release");
        let (written_at, written) = waiting.await.expect("task");
        let written = written.expect("the writer once the reader left");
        assert!(
            written_at.saturating_duration_since(released) < Duration::from_millis(300),
            "woken by its watcher, not its 1 s backoff"
        );
        written.release().await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unanswered_semaphore_attempt_frees_whatever_slot_it_took_and_keeps_the_sessions_locks(
    ) {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let proxy = lockingkit_tests::proxy::FaultProxy::to_port(server.port()).await;
        let backend = PostgresBackend::new(
            PostgresOptions::new(format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
                proxy.port()
            ))
            .with_max_sessions(1)
            .with_query_timeout(Duration::from_millis(300))
            .with_check_interval(Duration::from_secs(30)),
        )
        .expect("options");
        let key = unique_prefix("modes/unanswered-slot");
        let lock_key = unique_prefix("modes/unanswered-slot-neighbour");
        let five = semaphore(5);
        let neighbour = held(take(&backend, &lock_key, EXCLUSIVE).await, "a plain lock");
        let first = held(take(&backend, &key, five).await, "a slot");

        // The attempt reaches the server, which takes a slot, but its answer comes too late.
        proxy.set_latency(Duration::from_millis(700));
        let unanswered = backend.try_acquire(&key, five).await;
        assert!(
            unanswered.is_err(),
            "no answer within the statement timeout"
        );
        proxy.set_latency(Duration::ZERO);

        // The late attempt took a slot: it drew a fencing token in the same statement.
        eventually(
            "the late attempt reaching the server",
            Duration::from_secs(5),
            async || {
                let last: i64 = admin
                    .query_one("SELECT last_value FROM lockingkit.fencing_tokens", &[])
                    .await
                    .expect("the fencing sequence")
                    .get(0);
                u64::try_from(last).is_ok_and(|last| last > first.fencing_token)
            },
        )
        .await;
        eventually(
            "the slot the unanswered attempt took freed again",
            Duration::from_secs(5),
            async || slot_rows(&admin, &key).await.len() == 1,
        )
        .await;
        assert_eq!(
            slot_rows(&admin, &key).await[0].1,
            i64::from(first.lease.semaphore_slot().expect("slot").1),
            "the lease's own slot stays"
        );
        assert_eq!(
            key_rows(&admin, &lock_key).await.len(),
            1,
            "the neighbour stays"
        );
        assert_eq!(backend.open_sessions(), 1, "on the same session");
        let second = held(take(&backend, &key, five).await, "a slot once settled");
        assert_eq!(slot_rows(&admin, &key).await.len(), 2);
        release(&backend, second).await;
        release(&backend, first).await;
        release(&backend, neighbour).await;
        assert!(slot_rows(&admin, &key).await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn more_local_readers_and_slot_holders_than_sessions_all_fit_and_leave_nothing_behind() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let locks = lock_on(server.options(CHECK).with_max_sessions(2));
        let key = unique_prefix("modes/many-readers");
        let rw = locks.reader_writer(&key).expect("rw");
        let reads = futures_join_all((0..12).map(|_| rw.try_read())).await;
        let reads: Vec<LockHandle> = reads
            .into_iter()
            .map(|r| r.expect("every reader fits"))
            .collect();
        assert!(backend(&locks).open_sessions() <= 2);
        let sessions = key_rows(&admin, &key).await;
        assert!(sessions.len() <= 2, "{sessions:?}");
        assert_eq!(
            kind_of(
                process(&server)
                    .reader_writer(&key)
                    .expect("rw")
                    .try_write()
                    .await
            ),
            ErrorKind::Busy
        );
        for read in reads {
            read.release().await.expect("release");
        }
        assert!(
            key_rows(&admin, &key).await.is_empty(),
            "each lease unlocked its own hold"
        );

        let slots = locks.semaphore(&key, 8).expect("semaphore");
        let holders = futures_join_all((0..8).map(|_| slots.try_acquire())).await;
        let holders: Vec<LockHandle> = holders
            .into_iter()
            .map(|h| h.expect("eight slots for eight holders"))
            .collect();
        assert_eq!(kind_of(slots.try_acquire().await), ErrorKind::Busy);
        assert_eq!(slot_rows(&admin, &key).await.len(), 8);
        for holder in holders {
            holder.release().await.expect("release");
        }
        assert!(slot_rows(&admin, &key).await.is_empty());
        assert!(backend(&locks).open_sessions() <= 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_terminated_slot_holder_frees_its_slot_and_the_other_holders_keep_theirs() {
        let server = PostgresServer::start().await;
        let admin = server.connect().await;
        let key = unique_prefix("modes/terminated-slot");
        let doomed = named_process(&server, "doomed-slot", server.options(CHECK))
            .semaphore(&key, 2)
            .expect("semaphore");
        let other = process(&server).semaphore(&key, 2).expect("semaphore");
        let a = doomed.try_acquire().await.expect("slot");
        let b = other.try_acquire().await.expect("slot");
        assert_eq!(kind_of(other.try_acquire().await), ErrorKind::Busy);

        assert_eq!(server.terminate_backends("doomed-slot").await, 1);
        tokio::time::timeout(Duration::from_secs(2), a.lost_token().cancelled())
            .await
            .expect("the terminated holder sees loss");
        let c = other
            .acquire(Duration::from_secs(5))
            .await
            .expect("the freed slot");
        assert!(c.fencing_token() > a.fencing_token());
        assert!(b.is_held());
        b.release().await.expect("release");
        c.release().await.expect("release");
        assert!(slot_rows(&admin, &key).await.is_empty());
    }

    /// Runs the futures concurrently on this task and collects their outputs in order.
    async fn futures_join_all<F: std::future::Future>(
        futures: impl Iterator<Item = F>,
    ) -> Vec<F::Output> {
        let mut set = Vec::new();
        for future in futures {
            set.push(Box::pin(future));
        }
        let mut outputs: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (future, output) in set.iter_mut().zip(outputs.iter_mut()) {
                if output.is_none() {
                    match future.as_mut().poll(cx) {
                        std::task::Poll::Ready(value) => *output = Some(value),
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        outputs.into_iter().flatten().collect()
    }
}
