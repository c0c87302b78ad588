//! Transaction-scoped locks (`PostgresTransactionLocks`) against a real server: held until the
//! transaction ends, waiting in bounded statements that leave the server log clean, fencing
//! tokens shared with the session provider, and interop with its locks on the same keys.
//!
//! Each test starts its own throwaway server (see `lockingkit_tests::postgres`).

use std::time::Duration;

use lockingkit::keys::PostgresLockKeys;
use lockingkit::providers::postgres::{
    PostgresTransactionLock, PostgresTransactionLocks, PostgresTransactionOptions,
};
use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{DistributedLock, ErrorKind, LockError, PostgresBackend};
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::proxy::FaultProxy;
use tokio::time::Instant;
use tokio_postgres::Client;

/// Transaction locks that poll quickly, so waits end soon after a commit.
fn locks() -> PostgresTransactionLocks {
    PostgresTransactionLocks::new(
        PostgresTransactionOptions::default()
            .with_min_retry_delay(Duration::from_millis(10))
            .with_max_retry_delay(Duration::from_millis(50)),
    )
    .expect("valid options")
}

/// A session-provider lock on `server`, which also creates the fencing sequence on first use.
fn session_locks(server: &PostgresServer) -> DistributedLock {
    let backend = PostgresBackend::new(server.options(Duration::from_secs(5))).expect("options");
    DistributedLock::builder(backend)
        .options(quick_polling())
        .build()
        .expect("lock options")
}

/// A server whose fencing sequence exists, as after any session provider's first lock.
async fn server_with_sequence() -> PostgresServer {
    let server = PostgresServer::start().await;
    let client = server.connect().await;
    locks()
        .create_fencing_sequence(&client)
        .await
        .expect("fencing sequence");
    server
}

async fn connect(connection_string: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(connection_string, tokio_postgres::NoTls)
        .await
        .expect("a plain PostgreSQL session");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

#[track_caller]
fn kind_of(result: Result<PostgresTransactionLock, LockError>) -> ErrorKind {
    match result {
        Ok(lock) => panic!("expected an error, got {lock:?}"),
        Err(error) => error.kind(),
    }
}

/// Whether `transaction` still runs statements (a failed statement would have aborted it).
async fn usable(transaction: &tokio_postgres::Transaction<'_>) -> bool {
    transaction.query_one("SELECT 1", &[]).await.is_ok()
}

/// The lines of the server log that report an error.
fn error_lines(server: &PostgresServer) -> Vec<String> {
    server
        .server_log()
        .lines()
        .filter(|l| l.contains("ERROR:") || l.contains("FATAL:"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_frees_the_key_and_so_do_rollback_and_dropping_the_transaction() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/ends");
    let (mut first, mut second) = (server.connect().await, server.connect().await);

    let holding = first.transaction().await.unwrap();
    let held = locks.try_acquire(&holding, &key).await.expect("free key");
    assert!(!held.is_shared());
    assert_eq!(held.advisory_key(), PostgresLockKeys::advisory_key(&key));
    assert_eq!(server.lock_holders(&key).await.len(), 1);
    let other = second.transaction().await.unwrap();
    assert_eq!(
        kind_of(locks.try_acquire(&other, &key).await),
        ErrorKind::Busy
    );
    assert!(
        usable(&other).await,
        "a busy answer must not abort the transaction"
    );
    holding.commit().await.expect("commit");

    let taken = locks
        .try_acquire(&other, &key)
        .await
        .expect("free after COMMIT");
    assert_eq!(
        taken.fencing_token(),
        held.fencing_token() + 1,
        "a busy attempt must leave the sequence alone"
    );
    other.rollback().await.expect("rollback");

    let again = first.transaction().await.unwrap();
    locks
        .try_acquire(&again, &key)
        .await
        .expect("free after ROLLBACK");
    // tokio-postgres rolls a dropped transaction back: it queues a ROLLBACK on the connection,
    // which the server has run once a later statement on it answers.
    drop(again);
    first.query_one("SELECT 1", &[]).await.unwrap();
    let last = second.transaction().await.unwrap();
    locks
        .try_acquire(&last, &key)
        .await
        .expect("free after the transaction was dropped");
    last.commit().await.unwrap();
    assert!(server.lock_holders(&key).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_transaction_waits_and_gets_the_key_once_the_first_commits() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/wait");
    let mut holder = server.connect().await;
    let holding = holder.transaction().await.unwrap();
    let held = locks.try_acquire(&holding, &key).await.unwrap();

    // The waiter talks through a proxy, so the test can see its attempts reach the server.
    let proxy = FaultProxy::to_port(server.port()).await;
    let mut waiter = connect(&format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        proxy.port()
    ))
    .await;
    let started = Instant::now();
    let waiting = tokio::spawn({
        let (locks, key) = (locks.clone(), key.clone());
        async move {
            let transaction = waiter.transaction().await.unwrap();
            let lock = locks
                .acquire(&transaction, &key, Duration::from_secs(10))
                .await;
            let taken_at = Instant::now();
            transaction.commit().await.unwrap();
            (lock, taken_at)
        }
    });
    // BEGIN, then at least two busy attempts: the waiter is waiting.
    let mut seen = started;
    for _ in 0..3 {
        seen = proxy.exchange_after(seen).await.answered;
    }
    assert!(!waiting.is_finished(), "the waiter got a held key");
    let committed = Instant::now();
    holding.commit().await.unwrap();

    let (lock, taken_at) = waiting.await.unwrap();
    let lock = lock.expect("the waiter gets the key after the commit");
    assert!(taken_at >= committed);
    assert!(lock.fencing_token() > held.fencing_token());
    // Polls at most 50 ms apart: it got the key soon after the commit.
    let after = taken_at - committed;
    assert!(
        after < Duration::from_secs(2),
        "took {after:?} after the commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_stays_busy_times_out_in_short_statements_and_leaves_the_log_clean() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/timeout");
    let mut holder = server.connect().await;
    let holding = holder.transaction().await.unwrap();
    locks.try_acquire(&holding, &key).await.unwrap();
    let errors_before = error_lines(&server);

    let mut waiter = server.connect().await;
    let waiting = waiter.transaction().await.unwrap();
    let admin = server.connect().await;
    let queued = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted";
    let wait = locks.acquire(&waiting, &key, Duration::from_millis(800));
    tokio::pin!(wait);
    let started = Instant::now();
    // While the wait runs, the server never has a request queued for the key: each attempt is
    // a try-lock that answers at once.
    let result = loop {
        tokio::select! {
            result = &mut wait => break result,
            row = async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                admin.query_one(queued, &[]).await
            } => {
                assert_eq!(row.unwrap().get::<_, i64>(0), 0, "a request waits in the lock queue");
            }
        }
    };
    let waited = started.elapsed();
    assert_eq!(kind_of(result), ErrorKind::Timeout);
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(
        usable(&waiting).await,
        "a timeout must leave the transaction usable"
    );
    assert_eq!(
        kind_of(locks.acquire(&waiting, &key, Duration::ZERO).await),
        ErrorKind::Timeout,
        "a zero timeout tries once and reports the wait's outcome"
    );
    assert_eq!(
        error_lines(&server),
        errors_before,
        "the wait logged errors"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_grow_across_the_session_and_the_transaction_apis() {
    let server = PostgresServer::start().await;
    let session = session_locks(&server);
    let transactions = locks();
    let key = unique_prefix("tx/fencing");
    let mut client = server.connect().await;

    let mut tokens = Vec::new();
    for _ in 0..3 {
        // The session provider creates the sequence on its first lock.
        let handle = session.try_acquire(&key).await.expect("session lock");
        tokens.push(handle.fencing_token());
        handle.release().await.unwrap();
        let transaction = client.transaction().await.unwrap();
        let lock = transactions.try_acquire(&transaction, &key).await.unwrap();
        tokens.push(lock.fencing_token());
        let read = transactions.try_read(&transaction, &key).await.unwrap();
        tokens.push(read.fencing_token());
        transaction.commit().await.unwrap();
    }
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens must grow: {tokens:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_locks_and_transaction_locks_on_one_key_exclude_each_other() {
    let server = PostgresServer::start().await;
    let session = session_locks(&server);
    let locks = locks();
    let key = unique_prefix("tx/interop");
    let mut client = server.connect().await;

    let handle = session.try_acquire(&key).await.unwrap();
    let transaction = client.transaction().await.unwrap();
    assert_eq!(
        kind_of(locks.try_acquire(&transaction, &key).await),
        ErrorKind::Busy
    );
    assert_eq!(
        kind_of(locks.try_read(&transaction, &key).await),
        ErrorKind::Busy
    );
    handle.release().await.unwrap();
    locks.try_acquire(&transaction, &key).await.unwrap();

    assert_eq!(
        session.try_acquire(&key).await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    let readers = session.reader_writer(&key).unwrap();
    assert_eq!(
        readers.try_read().await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    // A session waiter gets the key when the transaction commits.
    let waiting = tokio::spawn({
        let (session, key) = (session.clone(), key.clone());
        async move { session.acquire(&key, Duration::from_secs(10)).await }
    });
    transaction.commit().await.unwrap();
    let handle = waiting.await.unwrap().expect("the key after the commit");
    handle.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_a_key_with_every_reader_and_exclude_writers() {
    let server = PostgresServer::start().await;
    let session = session_locks(&server);
    let locks = locks();
    let key = unique_prefix("tx/readers");
    let readers = session.reader_writer(&key).unwrap();
    let (mut a, mut b, mut c) = (
        server.connect().await,
        server.connect().await,
        server.connect().await,
    );

    let session_reader = readers.try_read().await.unwrap();
    let (first, second) = (
        a.transaction().await.unwrap(),
        b.transaction().await.unwrap(),
    );
    let read = locks.try_read(&first, &key).await.unwrap();
    assert!(read.is_shared());
    locks.try_read(&second, &key).await.unwrap();
    let writer = c.transaction().await.unwrap();
    assert_eq!(
        kind_of(locks.try_acquire(&writer, &key).await),
        ErrorKind::Busy
    );
    assert_eq!(
        readers.try_write().await.unwrap_err().kind(),
        ErrorKind::Busy
    );

    session_reader.release().await.unwrap();
    first.commit().await.unwrap();
    assert_eq!(
        kind_of(locks.try_acquire(&writer, &key).await),
        ErrorKind::Busy,
        "one reader still holds the key"
    );
    second.rollback().await.unwrap();
    let written = locks
        .acquire(&writer, &key, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(!written.is_shared());
    assert_eq!(
        readers.try_read().await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    writer.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_savepoint_rolled_back_releases_the_lock_taken_in_it_and_a_released_one_keeps_it() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/savepoint");
    let mut client = server.connect().await;
    let mut transaction = client.transaction().await.unwrap();

    let nested = transaction.transaction().await.unwrap();
    locks.try_acquire(&nested, &key).await.unwrap();
    nested.rollback().await.unwrap();
    assert!(server.lock_holders(&key).await.is_empty());

    let nested = transaction.transaction().await.unwrap();
    locks.try_acquire(&nested, &key).await.unwrap();
    nested.commit().await.unwrap(); // RELEASE SAVEPOINT
    assert_eq!(server.lock_holders(&key).await.len(), 1);
    transaction.commit().await.unwrap();
    assert!(server.lock_holders(&key).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_that_holds_a_key_is_granted_it_again_with_a_new_token() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/reentrant");
    let mut client = server.connect().await;
    let transaction = client.transaction().await.unwrap();
    let first = locks.try_acquire(&transaction, &key).await.unwrap();
    let again = locks.try_acquire(&transaction, &key).await.unwrap();
    assert!(again.fencing_token() > first.fencing_token());
    locks.try_read(&transaction, &key).await.unwrap();
    transaction.commit().await.unwrap();
    assert!(server.lock_holders(&key).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_keys_are_refused_before_any_statement() {
    let server = server_with_sequence().await;
    let locks = locks();
    let mut client = server.connect().await;
    let transaction = client.transaction().await.unwrap();
    let long = "k".repeat(513);
    for key in ["", long.as_str()] {
        assert_eq!(
            kind_of(locks.try_acquire(&transaction, key).await),
            ErrorKind::InvalidKey
        );
        assert_eq!(
            kind_of(locks.read(&transaction, key, Duration::from_secs(1)).await),
            ErrorKind::InvalidKey
        );
    }
    locks
        .try_acquire(&transaction, &"é".repeat(512))
        .await
        .expect("512 characters is a valid key");
    assert!(usable(&transaction).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_fencing_sequence_is_misconfigured_and_leaves_the_transaction_usable() {
    let server = PostgresServer::start().await;
    let locks = PostgresTransactionLocks::new(
        PostgresTransactionOptions::default().with_fencing_schema("tx_fencing"),
    )
    .unwrap();
    let key = unique_prefix("tx/no-sequence");
    let mut client = server.connect().await;
    let transaction = client.transaction().await.unwrap();
    let error = locks.try_acquire(&transaction, &key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert!(
        error.message().contains("tx_fencing.fencing_tokens")
            && error.message().contains("create_fencing_sequence"),
        "{error}"
    );
    assert!(usable(&transaction).await);
    assert!(server.lock_holders(&key).await.is_empty());
    assert!(
        error_lines(&server).is_empty(),
        "{:?}",
        error_lines(&server)
    );

    transaction.rollback().await.unwrap();

    locks
        .create_fencing_sequence(&server.connect().await)
        .await
        .unwrap();
    let transaction = client.transaction().await.unwrap();
    let lock = locks.try_acquire(&transaction, &key).await.unwrap();
    assert!(lock.fencing_token() >= 1);
    transaction.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_or_aborted_transaction_is_refused_with_its_cause() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/refused");
    let mut client = server.connect().await;

    let read_only = client
        .build_transaction()
        .read_only(true)
        .start()
        .await
        .unwrap();
    let error = locks.try_acquire(&read_only, &key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(error.message().contains("read-only"), "{error}");
    read_only.rollback().await.unwrap();

    let aborted = client.transaction().await.unwrap();
    assert!(aborted.execute("SELECT 1/0", &[]).await.is_err());
    let error = locks
        .acquire(&aborted, &key, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Backend, "{error}");
    assert!(error.message().contains("aborted"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_whose_connection_ends_frees_its_lock_and_cannot_commit() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/terminated");
    let mut holder = server.connect().await;
    let holding = holder.transaction().await.unwrap();
    locks.try_acquire(&holding, &key).await.unwrap();

    assert_eq!(server.terminate_lock_holders(&key).await, 1);
    let mut other = server.connect().await;
    let waiting = other.transaction().await.unwrap();
    locks
        .acquire(&waiting, &key, Duration::from_secs(5))
        .await
        .expect("freed with the ended session");
    assert!(
        holding.commit().await.is_err(),
        "work under a lost lock committed"
    );
}

/// The lock statements prepared on `client`'s server session (asked unnamed, so the question
/// is not among them).
async fn prepared_lock_statements(client: &tokio_postgres::Client) -> i64 {
    client
        .query_typed_one(
            "SELECT count(*) FROM pg_prepared_statements \
             WHERE statement LIKE '%pg_try_advisory_xact_lock%'",
            &[],
        )
        .await
        .expect("pg_prepared_statements")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadpool_transaction_is_taken_as_it_is_and_prepares_each_statement_once() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/deadpool");
    let pool = server.plain_pool(2);
    let mut client = pool.get().await.unwrap();
    let mut other = pool.get().await.unwrap();
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let transaction = client.transaction().await.unwrap();
        let lock = locks
            .acquire(&transaction, &key, Duration::from_secs(1))
            .await
            .unwrap();
        let second = other.transaction().await.unwrap();
        assert_eq!(
            kind_of(locks.try_read(&second, &key).await),
            ErrorKind::Busy
        );
        transaction.commit().await.unwrap();
        let read = locks.try_read(&second, &key).await.unwrap();
        second.commit().await.unwrap();
        tokens.extend([lock.fencing_token(), read.fencing_token()]);
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    // One prepared statement per form and connection, reused by every later attempt.
    assert_eq!(prepared_lock_statements(&client).await, 1);
    assert_eq!(prepared_lock_statements(&other).await, 1);

    // The tokio-postgres transaction it wraps sends the statement unnamed: nothing new.
    let mut plain = server.connect().await;
    let transaction = plain.transaction().await.unwrap();
    locks.try_acquire(&transaction, &key).await.unwrap();
    transaction.commit().await.unwrap();
    assert_eq!(prepared_lock_statements(&plain).await, 0);
    let transaction = client.transaction().await.unwrap();
    locks.try_acquire(&*transaction, &key).await.unwrap();
    transaction.commit().await.unwrap();
    assert_eq!(prepared_lock_statements(&client).await, 1);
}

/// Whether a session of LockingKit's is queued for `key` exclusively: a waiting writer's intent.
async fn writer_is_queued(admin: &Client, key: &str) -> bool {
    let advisory_key = PostgresLockKeys::advisory_key(key);
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND mode = 'ExclusiveLock' AND NOT granted \
             AND ((classid::bigint << 32) | objid::bigint) = $1",
            &[&advisory_key],
        )
        .await
        .expect("pg_locks")
        .get::<_, i64>(0)
        > 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_writer_waiting_for_the_key_holds_transaction_readers_back() {
    let server = PostgresServer::start().await;
    let (holder, writer) = (session_locks(&server), session_locks(&server));
    let locks = locks();
    let key = unique_prefix("tx/writer-intent");
    let reading = holder
        .reader_writer(&key)
        .unwrap()
        .try_read()
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let writer = writer.reader_writer(&key).unwrap();
        async move { writer.write(Duration::from_secs(20)).await }
    });
    let admin = server.connect().await;
    let give_up = Instant::now() + Duration::from_secs(10);
    while !writer_is_queued(&admin, &key).await {
        assert!(Instant::now() < give_up, "the writer's intent never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let mut client = server.connect().await;
    let transaction = client.transaction().await.unwrap();
    assert_eq!(
        kind_of(locks.try_read(&transaction, &key).await),
        ErrorKind::Busy,
        "a new reader got in past a waiting writer"
    );
    transaction.rollback().await.unwrap();
    reading.release().await.unwrap();
    let written = waiting.await.unwrap().expect("the writer gets in");
    written.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_older_than_the_lock_is_refused_naming_the_isolation_level() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/isolation");
    let mut client = server.connect().await;
    let before = {
        let transaction = client.transaction().await.unwrap();
        let token = locks.try_acquire(&transaction, &key).await.unwrap();
        transaction.commit().await.unwrap();
        token.fencing_token()
    };

    for (level, name) in [
        (
            tokio_postgres::IsolationLevel::RepeatableRead,
            "REPEATABLE READ",
        ),
        (tokio_postgres::IsolationLevel::Serializable, "SERIALIZABLE"),
    ] {
        let transaction = client
            .build_transaction()
            .isolation_level(level)
            .start()
            .await
            .unwrap();
        let refused = [
            locks.try_acquire(&transaction, &key).await,
            locks
                .read(&transaction, &key, Duration::from_secs(30))
                .await,
        ];
        for result in refused {
            let error = result.unwrap_err();
            assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
            assert!(
                error.message().contains(name) && error.message().contains("READ COMMITTED"),
                "{error}"
            );
        }
        assert!(server.lock_holders(&key).await.is_empty(), "{name} took it");
        assert!(usable(&transaction).await, "{name}: the refusal aborted it");
        transaction.rollback().await.unwrap();
    }

    // Neither refusal took a token: the sequence moved on by the next lock's alone.
    let transaction = client.transaction().await.unwrap();
    let after = locks.try_acquire(&transaction, &key).await.unwrap();
    assert_eq!(after.fencing_token(), before + 1);
    transaction.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_value_on_a_database_without_the_sequence_is_misconfigured_after_one_with_it() {
    let server = server_with_sequence().await;
    server.create_database("no_sequence").await;
    let locks = locks();
    let key = unique_prefix("tx/two-databases");
    let mut with = server.connect().await;
    let mut without = connect(&server.connection_string_for_database("no_sequence")).await;

    for _ in 0..2 {
        let transaction = with.transaction().await.unwrap();
        locks.try_acquire(&transaction, &key).await.unwrap();
        transaction.commit().await.unwrap();

        // The same value, now on a database without the sequence: refused, never failed.
        let transaction = without.transaction().await.unwrap();
        let error = locks.try_acquire(&transaction, &key).await.unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
        assert!(
            error.message().contains("lockingkit.fencing_tokens"),
            "{error}"
        );
        assert!(usable(&transaction).await, "the refusal aborted it");
        transaction.rollback().await.unwrap();
    }
    assert!(
        error_lines(&server).is_empty(),
        "{:?}",
        error_lines(&server)
    );
}

/// A client whose connection runs through `proxy`.
async fn connect_through(proxy: &FaultProxy) -> Client {
    connect(&format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        proxy.port()
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_line_is_unavailable_and_a_wait_ends_soon_after_its_timeout() {
    let server = server_with_sequence().await;
    let locks = PostgresTransactionLocks::new(
        PostgresTransactionOptions::default().with_query_timeout(Duration::from_secs(4)),
    )
    .unwrap();
    let key = unique_prefix("tx/frozen");
    let proxy = FaultProxy::to_port(server.port()).await;
    let mut client = connect_through(&proxy).await;
    let transaction = client.transaction().await.unwrap();
    locks.try_acquire(&transaction, &key).await.unwrap();
    proxy.set_fault(lockingkit_tests::proxy::Fault::Blackhole);

    // A wait of 1 s gives its attempt the time left (and a small margin), not query_timeout.
    let started = Instant::now();
    let error = locks
        .acquire(&transaction, &key, Duration::from_secs(1))
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(error.message().contains("roll it back"), "{error}");
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_millis(2500),
        "the wait of 1 s took {waited:?}"
    );
    // A try has no timeout of its own: query_timeout bounds it.
    let started = Instant::now();
    let error = locks.try_read(&transaction, &key).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_mid_statement_leaves_the_transaction_usable() {
    let server = server_with_sequence().await;
    let locks = locks();
    let key = unique_prefix("tx/dropped");
    let proxy = FaultProxy::to_port(server.port()).await;
    let mut client = connect_through(&proxy).await;
    let transaction = client.transaction().await.unwrap();

    // The statement is on its way when the call is dropped: the proxy holds its answer back.
    proxy.set_latency(Duration::from_millis(300));
    let attempt = locks.acquire(&transaction, &key, Duration::from_secs(5));
    let dropped = tokio::time::timeout(Duration::from_millis(100), attempt).await;
    assert!(
        dropped.is_err(),
        "the attempt answered before it was dropped"
    );
    proxy.set_latency(Duration::ZERO);

    // The dropped statement ran and took the key: the transaction holds it, and goes on.
    let row = transaction.query_one("SELECT 1", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 1);
    assert_eq!(server.lock_holders(&key).await.len(), 1);
    let again = locks
        .try_acquire(&transaction, &key)
        .await
        .expect("reentrant in the same transaction");
    assert!(again.fencing_token() > 0);
    transaction.commit().await.unwrap();
    assert!(server.lock_holders(&key).await.is_empty());
}
