//! The MySQL provider against a real MariaDB server: the contract suite, interop with plain
//! SQL from the `mariadb` command-line client, loss, fencing across restarts, connection
//! hygiene and error classification.
//!
//! Each test starts its own throwaway server (see `lockingkit_tests::mariadb`), or uses the one
//! named by `LOCKINGKIT_TEST_MYSQL_URL` where it needs no process control.

use std::time::Duration;

use lockingkit::keys::MysqlLockKeys;
use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{
    DistributedLock, ErrorKind, LockError, LockHandle, LockOptions, LossReason, MysqlBackend,
    MysqlOptions,
};
use lockingkit_tests::contract::FixtureContract;
use lockingkit_tests::mariadb::MariaDbServer;
use lockingkit_tests::polling::eventually;
use tokio::time::Instant;

/// A check interval short enough for loss tests to finish quickly.
const CHECK: Duration = Duration::from_millis(500);

fn options(server: &MariaDbServer, check: Duration) -> MysqlOptions {
    MysqlOptions::new(server.url()).with_check_interval(check)
}

fn lock_on(options: MysqlOptions) -> DistributedLock {
    let backend = MysqlBackend::new(options).expect("valid MySQL options");
    DistributedLock::builder(backend)
        .options(quick_polling())
        .build()
        .expect("valid lock options")
}

fn process(server: &MariaDbServer) -> DistributedLock {
    lock_on(options(server, CHECK))
}

fn backend(lock: &DistributedLock) -> &MysqlBackend {
    lock.backend::<MysqlBackend>().expect("a MySQL-backed lock")
}

#[track_caller]
fn kind_of(result: Result<LockHandle, LockError>) -> ErrorKind {
    match result {
        Ok(handle) => panic!("expected an error, got a lock on {}", handle.key()),
        Err(error) => error.kind(),
    }
}

/// Quotes `text` as a SQL string literal for the command-line client.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "''"))
}

/// `MysqlLockKeys::SQL_EXPRESSION` with `key` in place of its parameter.
fn name_sql(key: &str) -> String {
    MysqlLockKeys::SQL_EXPRESSION.replace('?', &literal(key))
}

/// The connection id holding `key`'s lock, as the server says (`IS_USED_LOCK`).
fn holder_of(server: &MariaDbServer, key: &str) -> Option<u64> {
    let answer = server
        .sql(&format!("SELECT IS_USED_LOCK({})", name_sql(key)))
        .expect("IS_USED_LOCK");
    answer.trim().parse().ok()
}

mod contract {
    use super::*;

    // Each "process" is a `DistributedLock` with its own sessions on one server, on the
    // default session budget. MySQL's named locks have no shared mode: the suite checks that
    // readers are refused.
    lockingkit::contract_tests!(
        async {
            FixtureContract::new(MariaDbServer::start().await, CHECK, |server| {
                MysqlBackend::new(options(server, CHECK)).expect("options")
            })
        },
        without: [readers]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_name_is_what_the_server_computes_and_shows() {
    let server = MariaDbServer::start().await;
    let locks = process(&server);
    for key in ["orders/42", "ключ", "🔒", "A b", &"é".repeat(400), "it's"] {
        let key = format!("{}{key}", unique_prefix("names/"));
        let in_sql = server
            .sql(&format!("SELECT {}", name_sql(&key)))
            .expect("the SQL expression is valid SQL");
        assert_eq!(in_sql.trim(), MysqlLockKeys::lock_name(&key));

        let held = locks.try_acquire(&key).await.expect("lock");
        let shown = server
            .sql(&format!(
                "SELECT OBJECT_NAME FROM performance_schema.metadata_locks \
                 WHERE OBJECT_TYPE = 'USER LEVEL LOCK' AND OBJECT_NAME = {}",
                literal(&MysqlLockKeys::lock_name(&key))
            ))
            .expect("metadata_locks");
        assert_eq!(shown.trim(), MysqlLockKeys::lock_name(&key));
        assert!(
            holder_of(&server, &key).is_some(),
            "IS_USED_LOCK shows the holder"
        );
        held.release().await.expect("release");
        assert_eq!(holder_of(&server, &key), None, "free after the release");
    }
    let slot = server
        .sql(&format!(
            "SELECT {}",
            MysqlLockKeys::SEMAPHORE_SQL_EXPRESSION
                .replacen('?', &literal("orders/42"), 1)
                .replacen('?', "7", 1)
        ))
        .expect("the slot expression is valid SQL");
    assert_eq!(slot.trim(), MysqlLockKeys::semaphore_slot("orders/42", 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_sql_and_the_library_refuse_each_others_locks() {
    let server = MariaDbServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("interop/library-first");
    let mut plain = server.session();
    let try_lock = format!("SELECT GET_LOCK({}, 0);", name_sql(&key));

    let held = locks.try_acquire(&key).await.expect("library lock");
    assert_eq!(
        plain.run(&try_lock),
        vec!["0"],
        "plain SQL took a held lock"
    );
    held.release().await.expect("confirmed release");
    assert_eq!(
        plain.run(&try_lock),
        vec!["1"],
        "plain SQL after the release"
    );

    // Now plain SQL holds it: the library is told busy, and times out waiting.
    assert_eq!(kind_of(locks.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(
        kind_of(locks.acquire(&key, Duration::from_millis(300)).await),
        ErrorKind::Timeout
    );
    let unlock = format!("SELECT RELEASE_LOCK({});", name_sql(&key));
    assert_eq!(plain.run(&unlock), vec!["1"]);
    let held = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("free after the plain session unlocked");
    held.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_backend_share_its_session_and_never_take_a_key_twice_by_reentrancy() {
    let server = MariaDbServer::start().await;
    let shared = MysqlBackend::new(options(&server, CHECK).with_max_sessions(1)).expect("options");
    let first = DistributedLock::builder(shared.clone())
        .build()
        .expect("lock");
    let second = DistributedLock::builder(shared).build().expect("lock");
    let key = unique_prefix("reentrancy/shared-session");

    let held = first.try_acquire(&key).await.expect("first");
    // Both engines send on the one session that holds the key: only the provider stands
    // between the second attempt and a re-entrant grant.
    assert_eq!(kind_of(second.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(backend(&second).open_sessions(), 1, "one session for both");
    held.release().await.expect("release");
    assert_eq!(holder_of(&server, &key), None, "one unlock freed it");
    let next = second.try_acquire(&key).await.expect("free now");
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_session_is_loss_at_once_and_frees_the_key() {
    let server = MariaDbServer::start().await;
    // Checks far apart: the loss must come from the session's sentinel, not from a check.
    let slow_checks = Duration::from_secs(5);
    let locks = lock_on(options(&server, slow_checks));
    let other = process(&server);
    let key = unique_prefix("loss/killed");
    let held = locks.try_acquire(&key).await.expect("lock");
    let first_token = held.fencing_token();
    let holder = holder_of(&server, &key).expect("a holder");

    server.kill_connection(holder).expect("KILL");
    let killed = Instant::now();
    tokio::time::timeout(Duration::from_secs(1), held.lost_token().cancelled())
        .await
        .expect("loss declared as the server ended the session, long before the next check");
    assert!(killed.elapsed() < slow_checks);
    assert!(!held.is_held());
    assert_eq!(held.loss_reason(), Some(LossReason::ConnectionLost));
    assert_eq!(held.release().await.unwrap_err().kind(), ErrorKind::Lost);

    let next = other
        .acquire(&key, Duration::from_secs(2))
        .await
        .expect("free once the killed session ended");
    assert!(next.fencing_token() > first_token);
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_restart() {
    let mut server = MariaDbServer::start_local().await;
    let locks = process(&server);
    let key = unique_prefix("fencing/restart");
    let before = locks.try_acquire(&key).await.expect("lock");
    let token = before.fencing_token();
    before.release().await.expect("release");

    server.restart().await;
    let after = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("lock after the restart");
    assert!(after.fencing_token() > token);
    after.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_moves_tokens_on_to_a_new_epoch() {
    let mut server = MariaDbServer::start_local().await;
    let locks = process(&server);
    let key = unique_prefix("fencing/crash");
    let mut last = 0;
    for _ in 0..50 {
        let held = locks.try_acquire(&key).await.expect("lock");
        assert!(held.fencing_token() > last, "tokens grow within an epoch");
        last = held.fencing_token();
        held.release().await.expect("release");
    }
    let epoch = last >> 47;
    server.kill();
    server.start_again().await;
    let after =
        lockingkit_tests::chaos::acquire_through_outages(&locks, &key, Duration::from_secs(30))
            .await
            .expect("a lock after the crash")
            .0;
    assert!(after.fencing_token() > last, "tokens grow across the crash");
    assert_eq!(after.fencing_token() >> 47, epoch + 1, "one new epoch");
    after.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_of_another_server_start_or_a_spent_epoch_moves_on_to_a_new_epoch() {
    let server = MariaDbServer::start().await;
    let key = unique_prefix("fencing/epochs");
    let token_of = async |locks: &DistributedLock| {
        let held = locks.try_acquire(&key).await.expect("lock");
        let token = held.fencing_token();
        held.release().await.expect("release");
        token
    };
    let first = token_of(&process(&server)).await;
    let epoch = first >> 47;
    assert!(epoch >= 1, "{first}");

    // The row claims another server start (as a replica's row after a promotion would): a
    // new process moves it on, and its tokens lie above every earlier one.
    server
        .sql("UPDATE lockingkit.lockingkit_fencing SET started = started - 1 WHERE id = 1")
        .expect("update");
    let second = token_of(&process(&server)).await;
    assert!(second > first);
    assert_eq!(second >> 47, epoch + 1, "one new epoch");

    // The epoch's span is spent: the same.
    server
        .sql("UPDATE lockingkit.lockingkit_fencing SET base = base - (1 << 47) WHERE id = 1")
        .expect("update");
    let third = token_of(&process(&server)).await;
    assert!(third > second);
    assert_eq!(third >> 47, epoch + 2, "one more epoch");

    // A process that read the current epoch keeps drawing in it, without a write.
    let reader = process(&server);
    let fourth = token_of(&reader).await;
    let fifth = token_of(&reader).await;
    assert!(third < fourth && fourth < fifth);
    assert_eq!(fifth >> 47, epoch + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_epoch_runs_out_moves_on_without_losing_its_locks() {
    let server = MariaDbServer::start().await;
    let key = unique_prefix("fencing/spent");
    let first = process(&server);
    let held = first.try_acquire(&key).await.expect("lock");
    let epoch = held.fencing_token() >> 47;
    held.release().await.expect("release");
    drop(first);
    // The epoch's span ends eight draws from now: the next process's session reads the epoch
    // while it is still good, and a few grants later its draws run past the span.
    server
        .sql(
            "UPDATE lockingkit.lockingkit_fencing \
             SET base = UUID_SHORT() - (1 << 47) + 8 WHERE id = 1",
        )
        .expect("update");
    let locks = process(&server);
    let kept = locks
        .try_acquire(&format!("{key}/kept"))
        .await
        .expect("lock");
    let mut tokens = vec![kept.fencing_token()];
    for _ in 0..10 {
        let held = locks.try_acquire(&key).await.expect("never an error");
        tokens.push(held.fencing_token());
        held.release().await.expect("release");
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    assert_eq!(tokens[0] >> 47, epoch, "{tokens:?}");
    assert_eq!(tokens[10] >> 47, epoch + 1, "{tokens:?}");
    // The session was not ended for it: the lock it held all along is still held.
    assert!(kept.is_held());
    assert_eq!(kept.loss_reason(), None);
    kept.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_locks_live_on_at_most_eight_server_sessions_and_leave_nothing_behind() {
    let server = MariaDbServer::start().await;
    let locks = process(&server);
    let prefix = unique_prefix("many");
    let mut held = Vec::new();
    for i in 0..1000 {
        held.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("lock"),
        );
    }
    assert!(backend(&locks).open_sessions() <= 4, "the default budget");
    // Each session and its sentinel: at most eight connections at the server.
    let connections = server
        .sql("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = 'lockingkit'")
        .expect("processlist");
    assert!(
        connections.trim().parse::<usize>().is_ok_and(|n| n <= 8),
        "{connections} connections"
    );
    let count = |server: &MariaDbServer| -> usize {
        server
            .sql(
                "SELECT COUNT(*) FROM performance_schema.metadata_locks \
                 WHERE OBJECT_TYPE = 'USER LEVEL LOCK' AND OBJECT_NAME NOT LIKE 'lkw:%'",
            )
            .expect("metadata_locks")
            .trim()
            .parse()
            .unwrap_or(usize::MAX)
    };
    assert_eq!(count(&server), 1000);
    for handle in held {
        handle.release().await.expect("release");
    }
    assert_eq!(count(&server), 0, "every lock released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_misconfigured_and_verify_says_so() {
    let server = MariaDbServer::start().await;
    let locks = lock_on(MysqlOptions::new(server.url_with_password("wrong")));
    let key = unique_prefix("wrong-password");
    assert_eq!(
        kind_of(locks.try_acquire(&key).await),
        ErrorKind::Misconfigured
    );
    let error = locks.verify().await.expect_err("verify refuses");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert!(!error.to_string().contains("wrong"), "{error}");

    let good = process(&server);
    good.verify().await.expect("verify passes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_down_is_unavailable_not_busy() {
    let mut server = MariaDbServer::start_local().await;
    let locks = process(&server);
    server.stop();
    let key = unique_prefix("down");
    assert_eq!(
        kind_of(locks.try_acquire(&key).await),
        ErrorKind::Unavailable
    );
    server.start_again().await;
    // The backend's reconnect backoff decides when it asks again: within a second or so.
    let held = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("a lock once the server is back");
    held.release().await.expect("release");
}

/// The errors and warnings in the server's log (an aborted connection is a warning).
fn complaints(server: &MariaDbServer) -> Vec<String> {
    server
        .error_log()
        .lines()
        .filter(|line| line.contains("[ERROR]") || line.contains("[Warning]"))
        .map(str::to_owned)
        .collect()
}

/// A lock with a one-second backoff: a hand-off much faster than that came from a wake-up.
fn patient(server: &MariaDbServer) -> DistributedLock {
    let backend = MysqlBackend::new(options(server, CHECK)).expect("options");
    DistributedLock::builder(backend)
        .options(
            LockOptions::default()
                .with_min_retry_delay(Duration::from_secs(1))
                .with_max_retry_delay(Duration::from_secs(1)),
        )
        .build()
        .expect("lock options")
}

/// How many requests wait in `GET_LOCK` for a lock name now (sentinels, which wait for their
/// session's marker, aside).
fn waiting_sessions(server: &MariaDbServer) -> usize {
    server
        .sql(
            "SELECT COUNT(*) FROM performance_schema.metadata_locks \
             WHERE OBJECT_TYPE = 'USER LEVEL LOCK' AND LOCK_STATUS = 'PENDING' \
             AND OBJECT_NAME NOT LIKE 'lkw:%'",
        )
        .expect("metadata_locks")
        .trim()
        .parse()
        .unwrap_or(usize::MAX)
}

/// Starts `waiter` waiting up to 10 s for `key`, held elsewhere, and returns once its waiting
/// session is blocked in `GET_LOCK`: from then on, only the server's grant can hand the key
/// over quickly.
async fn wait_behind_the_holder(
    server: &MariaDbServer,
    waiter: &DistributedLock,
    key: &str,
) -> tokio::task::JoinHandle<(Instant, LockHandle)> {
    let before = waiting_sessions(server);
    let waiting = tokio::spawn({
        let (waiter, key) = (waiter.clone(), key.to_owned());
        async move {
            let handle = waiter
                .acquire(&key, Duration::from_secs(10))
                .await
                .expect("handed over");
            (Instant::now(), handle)
        }
    });
    eventually(
        "the waiter's waiting session",
        Duration::from_secs(10),
        async || waiting_sessions(server) > before,
    )
    .await;
    waiting
}

/// Checks that the waiter got the key well within its 1 s backoff of the release at
/// `released`, then releases it.
async fn assert_handed_over_quickly(
    waiting: tokio::task::JoinHandle<(Instant, LockHandle)>,
    released: Instant,
    what: &str,
) -> u64 {
    let (acquired, handle) = waiting.await.expect("waiter task");
    let handoff = acquired.saturating_duration_since(released);
    assert!(
        handoff < Duration::from_millis(150),
        "{what}: hand-off took {handoff:?}, the backoff was 1 s"
    );
    let token = handle.fencing_token();
    handle.release().await.expect("release");
    token
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_handed_the_key_at_once_by_a_release_a_plain_unlock_and_a_killed_holder() {
    let server = MariaDbServer::start().await;
    let holder = process(&server);
    let waiter = patient(&server);
    let key = unique_prefix("handoff");
    let mut last_token = 0;
    // Several releases, so that a poll that happened to land just after one cannot pass by
    // luck.
    for round in 0..3 {
        let held = holder.try_acquire(&key).await.expect("lock");
        let waiting = wait_behind_the_holder(&server, &waiter, &key).await;
        held.release().await.expect("release");
        let what = format!("release {round}");
        let token = assert_handed_over_quickly(waiting, Instant::now(), &what).await;
        assert!(token > last_token, "{what}: tokens grow");
        last_token = token;
    }
    // A plain SQL holder unlocks, then a plain SQL holder's session is killed: neither tells
    // any client; the server's queue for the name wakes the waiting session.
    for killed in [false, true] {
        let mut plain = server.session();
        let lock = format!("SELECT GET_LOCK({}, 0);", name_sql(&key));
        assert_eq!(plain.run(&lock), vec!["1"]);
        let waiting = wait_behind_the_holder(&server, &waiter, &key).await;
        if killed {
            let id = plain.connection_id();
            server.kill_connection(id).expect("KILL");
        } else {
            let unlock = format!("SELECT RELEASE_LOCK({});", name_sql(&key));
            assert_eq!(plain.run(&unlock), vec!["1"]);
        }
        let what = if killed {
            "a killed holder"
        } else {
            "a plain unlock"
        };
        let token = assert_handed_over_quickly(waiting, Instant::now(), what).await;
        assert!(token > last_token, "{what}: tokens grow");
        last_token = token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_waits_leave_no_request_queued_and_locking_logs_nothing() {
    let server = MariaDbServer::start_local().await;
    let holder = process(&server);
    let waiter = process(&server);
    let key = unique_prefix("waits/ended");
    let held = holder.try_acquire(&key).await.expect("lock");
    // Waits that time out, and waits whose callers go away, while the holder keeps the key.
    for _ in 0..3 {
        assert_eq!(
            kind_of(waiter.acquire(&key, Duration::from_millis(300)).await),
            ErrorKind::Timeout
        );
        let dropped = tokio::time::timeout(
            Duration::from_millis(300),
            waiter.acquire(&key, Duration::from_secs(10)),
        )
        .await;
        assert!(dropped.is_err(), "the holder still holds the key");
    }
    eventually(
        "every withdrawn request gone",
        Duration::from_secs(5),
        async || waiting_sessions(&server) == 0,
    )
    .await;
    assert_eq!(backend(&waiter).wait_sessions(), 0);
    held.release().await.expect("release");
    // Nothing the waits left refuses the next try, in the waiter's process or another.
    waiter
        .try_acquire(&key)
        .await
        .expect("free")
        .release()
        .await
        .expect("release");
    holder
        .try_acquire(&key)
        .await
        .expect("free")
        .release()
        .await
        .expect("release");

    holder
        .shutdown(Duration::from_secs(5))
        .await
        .expect("shutdown");
    waiter
        .shutdown(Duration::from_secs(5))
        .await
        .expect("shutdown");
    assert_eq!(
        complaints(&server),
        Vec::<String>::new(),
        "the server complained"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_grants_in_four_processes_each_take_a_name_once() {
    // Every grant bumps the one counter row, so grants queue for its row lock; each still
    // takes its name exactly once (one release frees it) and gets a token of its own.
    let server = MariaDbServer::start().await;
    let prefix = unique_prefix("concurrent");
    let mut tasks = Vec::new();
    for p in 0..4 {
        let locks = process(&server);
        for t in 0..16 {
            let (locks, prefix) = (locks.clone(), prefix.clone());
            tasks.push(tokio::spawn(async move {
                let mut tokens = Vec::new();
                for round in 0..10 {
                    let key = format!("{prefix}/{}", (p * 16 + t + round) % 24);
                    if let Ok(handle) = locks.acquire(&key, Duration::from_secs(10)).await {
                        tokens.push(handle.fencing_token());
                        handle.release().await.expect("release");
                    }
                }
                tokens
            }));
        }
    }
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.extend(task.await.expect("task"));
    }
    assert_eq!(tokens.len(), 640, "every acquire got its lock");
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 640, "every grant got a token of its own");
    let left = server
        .sql(
            "SELECT COUNT(*) FROM performance_schema.metadata_locks \
             WHERE OBJECT_TYPE = 'USER LEVEL LOCK' AND OBJECT_NAME NOT LIKE 'lkw:%'",
        )
        .expect("metadata_locks");
    assert_eq!(left.trim(), "0", "a name was taken twice and released once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_create_needs_the_tables_made_and_a_deleted_epoch_row_is_misconfigured() {
    let server = MariaDbServer::start().await;
    let table = format!("fencing_{}", std::process::id());
    server
        .sql(
            "CREATE USER IF NOT EXISTS 'nocreate'@'127.0.0.1' IDENTIFIED BY 'nocreate-pw'; \
             GRANT SELECT, INSERT, UPDATE ON lockingkit.* TO 'nocreate'@'127.0.0.1'",
        )
        .expect("a user without CREATE");
    let url = server
        .url()
        .replace("lockingkit:lockingkit-test@", "nocreate:nocreate-pw@");
    let options = MysqlOptions::new(url).with_fencing_table(&table);
    let locks = lock_on(options.clone());
    let error = locks
        .verify()
        .await
        .expect_err("no table, no right to create it");
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    let key = unique_prefix("no-create");
    assert_eq!(
        kind_of(locks.try_acquire(&key).await),
        ErrorKind::Misconfigured
    );

    // An administrator runs the documented statement; then everything works.
    server
        .sql(&format!(
            "USE lockingkit; {}",
            lockingkit::providers::mysql::setup_sql(&options)
        ))
        .expect("setup SQL");
    locks.verify().await.expect("verify passes");
    let held = locks.try_acquire(&key).await.expect("lock");
    // The first epoch.
    assert_eq!(held.fencing_token() >> 47, 1);
    held.release().await.expect("release");

    // Someone deletes the epoch row: a process that has to read it is told, never "busy",
    // and tokens never start over.
    server
        .sql(&format!("DELETE FROM lockingkit.`{table}`"))
        .expect("delete");
    assert_eq!(
        kind_of(lock_on(options.clone()).try_acquire(&key).await),
        ErrorKind::Misconfigured
    );
    assert_eq!(
        locks.verify().await.unwrap_err().kind(),
        ErrorKind::Misconfigured
    );
    assert_eq!(holder_of(&server, &key), None, "nothing left held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_are_closed_by_us_before_the_servers_idle_limit() {
    // One-second checks: the server closes our sessions after 10 s idle (the floor), and we
    // close a session that holds nothing after 5 s, quietly, before the server would (which
    // would log an aborted connection).
    let server = MariaDbServer::start_local().await;
    let locks = lock_on(options(&server, Duration::from_secs(1)));
    let key = unique_prefix("idle");
    let held = locks.try_acquire(&key).await.expect("lock");
    held.release().await.expect("release");
    assert_eq!(backend(&locks).open_sessions(), 1);
    eventually(
        "the idle session closed",
        Duration::from_secs(9),
        async || backend(&locks).open_sessions() == 0,
    )
    .await;
    let connections = || {
        server
            .sql("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = 'lockingkit'")
            .expect("processlist")
    };
    eventually(
        "the session and its sentinel gone at the server",
        Duration::from_secs(2),
        async || connections().trim() == "0",
    )
    .await;
    // And the backend opens a new one when asked.
    let held = locks.try_acquire(&key).await.expect("lock again");
    held.release().await.expect("release");
    assert_eq!(
        complaints(&server),
        Vec::<String>::new(),
        "the server complained"
    );
}
