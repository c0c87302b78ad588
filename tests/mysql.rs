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
    DistributedLock, ErrorKind, LockError, LockHandle, LossReason, MysqlBackend, MysqlOptions,
};
use lockingkit_tests::contract::FixtureContract;
use lockingkit_tests::mariadb::MariaDbServer;
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
async fn a_killed_session_is_loss_and_frees_the_key() {
    let server = MariaDbServer::start().await;
    let locks = lock_on(options(&server, Duration::from_secs(1)));
    let other = process(&server);
    let key = unique_prefix("loss/killed");
    let held = locks.try_acquire(&key).await.expect("lock");
    let first_token = held.fencing_token();
    let holder = holder_of(&server, &key).expect("a holder");

    server.kill_connection(holder).expect("KILL");
    let killed = Instant::now();
    tokio::time::timeout(Duration::from_secs(3), held.lost_token().cancelled())
        .await
        .expect("loss declared");
    assert!(killed.elapsed() < Duration::from_secs(3));
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
async fn a_thousand_locks_live_on_at_most_eight_sessions_and_leave_nothing_behind() {
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
    assert!(backend(&locks).open_sessions() <= 8);
    let count = |server: &MariaDbServer| -> usize {
        server
            .sql(
                "SELECT COUNT(*) FROM performance_schema.metadata_locks \
                 WHERE OBJECT_TYPE = 'USER LEVEL LOCK'",
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
