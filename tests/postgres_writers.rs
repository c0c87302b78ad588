//! Writers on PostgreSQL get the key from the server itself: a waiting writer's watcher is
//! granted the key in the server's lock queue and that grant is the writer's lock, so readers
//! of every kind (plain SQL blocking or retrying, LockingKit readers elsewhere) queue behind a
//! waiting writer, and no session holds the key for nobody after a hand-off.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::keys::PostgresLockKeys;
use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{DistributedLock, ErrorKind, PostgresBackend};
use lockingkit_tests::postgres::PostgresServer;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// How long each reader holds the key.
const READ: Duration = Duration::from_millis(300);

/// A "process": a lock with a backend (and so sessions) of its own.
fn process(server: &PostgresServer) -> DistributedLock {
    let backend =
        PostgresBackend::new(server.options(Duration::from_millis(500))).expect("options");
    DistributedLock::builder(backend)
        .options(quick_polling())
        .build()
        .expect("lock options")
}

/// Whether some session waits in the server's queue for `key` exclusively: a writer's intent.
async fn writer_queued(admin: &tokio_postgres::Client, key: &str) -> bool {
    let advisory_key = PostgresLockKeys::advisory_key(key);
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND mode = 'ExclusiveLock' AND NOT granted \
             AND classid::bigint = ($1::bigint >> 32) & 4294967295 \
             AND objid::bigint = $1::bigint & 4294967295",
            &[&advisory_key],
        )
        .await
        .expect("pg_locks")
        .get::<_, i64>(0)
        > 0
}

/// Whether plain SQL on `admin` takes the advisory lock `advisory_key` at once (giving it
/// back if so).
async fn plain_sql_takes_and_gives_back(admin: &tokio_postgres::Client, advisory_key: i64) -> bool {
    let row = admin
        .query_one("SELECT pg_try_advisory_lock($1)", &[&advisory_key])
        .await
        .expect("plain try");
    let taken = row.get::<_, bool>(0);
    if taken {
        admin
            .execute("SELECT pg_advisory_unlock($1)", &[&advisory_key])
            .await
            .expect("plain unlock");
    }
    taken
}

/// Runs two readers' turn loops side by side, `reader(0)` and `reader(1)`; the task returns
/// the turns granted to both.
fn two_readers<F>(reader: impl Fn(u32) -> F) -> JoinHandle<usize>
where
    F: Future<Output = usize> + Send + 'static,
{
    let mut turns = JoinSet::new();
    for client in 0..2 {
        turns.spawn(reader(client));
    }
    tokio::spawn(async move {
        let mut total = 0;
        while let Some(granted) = turns.join_next().await {
            total += granted.expect("reader task");
        }
        total
    })
}

/// A plain tokio-postgres session on `url`, as another program's reader would open.
async fn plain_session(url: &str) -> tokio_postgres::Client {
    let (sql, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("reader connects");
    tokio::spawn(connection);
    sql
}

/// Two plain-SQL readers of `key`, each on a session of its own and the second starting half
/// a turn after the first, running `turns(session, advisory key, client, stop)`; the task
/// returns the turns granted to both.
fn two_sql_readers<F>(
    server: &PostgresServer,
    key: &str,
    stop: Arc<AtomicBool>,
    turns: fn(tokio_postgres::Client, i64, u32, Arc<AtomicBool>) -> F,
) -> JoinHandle<usize>
where
    F: Future<Output = usize> + Send + 'static,
{
    let (url, k) = (
        server.connection_string(),
        PostgresLockKeys::advisory_key(key),
    );
    two_readers(move |client| {
        let (url, stop) = (url.clone(), stop.clone());
        async move {
            let sql = plain_session(&url).await;
            tokio::time::sleep(READ / 2 * client).await;
            turns(sql, k, client, stop).await
        }
    })
}

/// A plain-SQL client's turns with blocking `pg_advisory_lock_shared`, each holding [`READ`],
/// until `stop`: with two of them in overlapping turns, some reader always holds the key
/// unless a writer queued ahead of them. Returns the turns granted.
async fn blocking_turns(
    sql: tokio_postgres::Client,
    k: i64,
    _client: u32,
    stop: Arc<AtomicBool>,
) -> usize {
    let mut granted = 0;
    while !stop.load(Ordering::SeqCst) {
        sql.execute("SELECT pg_advisory_lock_shared($1)", &[&k])
            .await
            .expect("blocking shared lock");
        granted += 1;
        tokio::time::sleep(READ).await;
        sql.execute("SELECT pg_advisory_unlock_shared($1)", &[&k])
            .await
            .expect("unlock");
        // The other client holds meanwhile; take the next turn before it ends.
        tokio::time::sleep(READ / 4).await;
    }
    granted
}

/// A plain-SQL client's turns retrying `pg_try_advisory_lock_shared` every 1–10 ms and holding
/// [`READ`], until `stop`. Returns the turns granted.
async fn retrying_turns(
    sql: tokio_postgres::Client,
    k: i64,
    client: u32,
    stop: Arc<AtomicBool>,
) -> usize {
    let (mut granted, mut round) = (0, u64::from(client));
    while !stop.load(Ordering::SeqCst) {
        let row = sql
            .query_one("SELECT pg_try_advisory_lock_shared($1)", &[&k])
            .await
            .expect("try shared");
        if row.get::<_, bool>(0) {
            granted += 1;
            tokio::time::sleep(READ).await;
            sql.execute("SELECT pg_advisory_unlock_shared($1)", &[&k])
                .await
                .expect("unlock");
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(1 + round * 7 % 10)).await;
    }
    granted
}

/// LockingKit readers in two other processes, taking turns as the plain-SQL ones do.
fn lockingkit_readers(
    server: &PostgresServer,
    key: &str,
    stop: Arc<AtomicBool>,
) -> JoinHandle<usize> {
    let processes = [process(server), process(server)];
    let key = key.to_owned();
    two_readers(move |client| {
        let readers = processes[client as usize]
            .reader_writer(&key)
            .expect("reader_writer");
        let stop = stop.clone();
        async move {
            tokio::time::sleep(READ / 2 * client).await;
            let mut granted = 0;
            while !stop.load(Ordering::SeqCst) {
                match readers.try_read().await {
                    Ok(read) => {
                        granted += 1;
                        tokio::time::sleep(READ).await;
                        read.release().await.expect("reader release");
                    }
                    Err(error) if error.kind() == ErrorKind::Busy => {}
                    Err(error) => panic!("reader: {error}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            granted
        }
    })
}

/// Starts `readers`, lets them overlap, then times a writer of another process: it must get
/// in within two reader holds of arriving (the readers holding then finish within one; one
/// more covers a reader that got in before the writer's watcher queued), with headroom for a
/// loaded machine.
async fn writer_gets_in_behind(
    server: &PostgresServer,
    readers: fn(&PostgresServer, &str, Arc<AtomicBool>) -> JoinHandle<usize>,
    name: &str,
) {
    let key = unique_prefix(name);
    let stop = Arc::new(AtomicBool::new(false));
    let stream = readers(server, &key, stop.clone());
    let writers = process(server).reader_writer(&key).expect("writers");
    // A first hand-off warms the writer's sessions up, so the timed wait is not a connect.
    tokio::time::sleep(READ * 3).await;
    let mut waits = Vec::new();
    for _ in 0..3 {
        let asked = Instant::now();
        let written = writers
            .write(Duration::from_secs(15))
            .await
            .expect("the writer gets in");
        waits.push(asked.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
        written.release().await.expect("release");
        tokio::time::sleep(READ * 2).await;
    }
    stop.store(true, Ordering::SeqCst);
    let turns = stream.await.expect("reader stream");
    assert!(turns >= 4, "the readers never overlapped ({turns} turns)");
    eprintln!("{name}: the writer waited {waits:?}; {turns} reader turns granted");
    let bound = READ * 2 + Duration::from_millis(250);
    for (round, waited) in waits.iter().enumerate() {
        assert!(
            *waited <= bound,
            "round {round}: the writer waited {waited:?} behind readers holding {READ:?} each \
             (bound {bound:?}; all rounds {waits:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_gets_in_within_two_reader_holds_behind_blocking_or_retrying_sql_readers() {
    let server = PostgresServer::start().await;
    writer_gets_in_behind(
        &server,
        |server, key, stop| two_sql_readers(server, key, stop, blocking_turns),
        "writers/blocking-sql",
    )
    .await;
    writer_gets_in_behind(
        &server,
        |server, key, stop| two_sql_readers(server, key, stop, retrying_turns),
        "writers/retrying-sql",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_gets_in_within_two_reader_holds_behind_lockingkit_readers_elsewhere() {
    let server = PostgresServer::start().await;
    writer_gets_in_behind(&server, lockingkit_readers, "writers/lockingkit").await;
}

/// Hold → another process waits → release → the waiter takes it and releases → at once, a
/// third LockingKit process and a plain-SQL client each try: the key is free, so neither may
/// be answered busy (a session left queued behind the waiter's hold would be granted at its
/// release and hold the key for nobody).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_hand_off_and_its_release_the_key_is_free_for_everyone_at_once() {
    let server = PostgresServer::start().await;
    let (holder, waiter, third) = (process(&server), process(&server), process(&server));
    let admin = server.connect().await;
    let key = unique_prefix("writers/ghost");
    let advisory_key = PostgresLockKeys::advisory_key(&key);
    let refused = AtomicUsize::new(0);
    const ROUNDS: usize = 200;
    for round in 0..ROUNDS {
        let held = holder.try_acquire(&key).await.expect("the holder takes it");
        let waiting = tokio::spawn({
            let (waiter, key) = (waiter.clone(), key.clone());
            async move { waiter.acquire(&key, Duration::from_secs(10)).await }
        });
        let give_up = Instant::now() + Duration::from_secs(10);
        while !writer_queued(&admin, &key).await {
            assert!(
                Instant::now() < give_up,
                "round {round}: the waiter never queued"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        held.release().await.expect("holder release");
        let taken = waiting.await.expect("waiter task").expect("handed over");
        taken.release().await.expect("waiter release");
        match third.try_acquire(&key).await {
            Ok(handle) => handle.release().await.expect("third release"),
            Err(error) if error.kind() == ErrorKind::Busy => {
                refused.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => panic!("round {round}: {error}"),
        }
        if !plain_sql_takes_and_gives_back(&admin, advisory_key).await {
            refused.fetch_add(1, Ordering::Relaxed);
        }
    }
    assert_eq!(
        refused.load(Ordering::Relaxed),
        0,
        "tries refused after the waiter's release in {ROUNDS} rounds"
    );
}

/// Reader hand-offs between two processes: a writer holds, a reader in another process waits,
/// the writer releases, the reader gets the key (from the server, through its wait) and
/// releases it, confirmed. At once, a plain-SQL `pg_try_advisory_lock` and a LockingKit
/// exclusive try from a third process must both get in: the reader's process keeps no grant,
/// no queued request and no second reader's lock for nobody (the waiting reader used to be
/// granted the key twice, once on a lock session and once on its waiting session, and the
/// second grant outlived its release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_reader_hand_offs_leave_the_key_free_for_writers_elsewhere() {
    let server = PostgresServer::start().await;
    let (writer, reader, third) = (process(&server), process(&server), process(&server));
    let readers = reader
        .reader_writer(&unique_prefix("writers/readers"))
        .expect("readers");
    let key = readers.key().to_owned();
    let advisory_key = PostgresLockKeys::advisory_key(&key);
    let admin = server.connect().await;
    let (mut refused_sql, mut refused_lockingkit) = (Vec::new(), Vec::new());
    const ROUNDS: usize = 300;
    for round in 0..ROUNDS {
        let held = writer.try_acquire(&key).await.expect("the writer takes it");
        let waiting = tokio::spawn({
            let readers = readers.clone();
            async move { readers.read(Duration::from_secs(10)).await }
        });
        // Released at every stage of the reader's wait: before its first attempt, between its
        // busy answer and its watcher's request, and once that request has queued.
        tokio::time::sleep(Duration::from_micros(500 * (round % 7) as u64)).await;
        held.release().await.expect("writer release");
        let taken = waiting.await.expect("reader task").expect("handed over");
        taken.release().await.expect("reader release");
        if !plain_sql_takes_and_gives_back(&admin, advisory_key).await {
            refused_sql.push(round);
        }
        match third.try_acquire(&key).await {
            Ok(handle) => handle.release().await.expect("third release"),
            Err(error) if error.kind() == ErrorKind::Busy => refused_lockingkit.push(round),
            Err(error) => panic!("round {round}: {error}"),
        }
    }
    eprintln!(
        "{ROUNDS} reader hand-offs: plain SQL refused in rounds {refused_sql:?}, a LockingKit \
         writer elsewhere in rounds {refused_lockingkit:?}"
    );
    assert!(refused_sql.is_empty() && refused_lockingkit.is_empty());
}
