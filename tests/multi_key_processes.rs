//! Multi-key holds across two real OS processes on PostgreSQL: two `bin/multi_key_worker.rs`
//! processes take the same two keys with `acquire_all`, one naming them `{a, b}` and the other
//! `{b, a}`, round after round. Under each hold a worker reads a shared counter row and writes
//! it back plus one, fenced by the hold's fencing token. Both finish every round well within
//! their acquire timeout (a timeout makes a worker fail, so a deadlock cannot hide as a slow
//! run), and the counter shows every increment: no two holds overlapped.

use std::process::Stdio;
use std::time::Duration;

use lockingkit::testing::unique_prefix;
use lockingkit_tests::postgres::PostgresServer;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// Rounds per worker.
const ROUNDS: u32 = 150;

/// How long one `acquire_all` may wait before the worker gives up (and fails). A hold lasts a
/// few milliseconds, so only a deadlock comes near it.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(20);

/// How long both workers may take in all: generous for a loaded 2-core machine, and bounded.
const RUN_BOUND: Duration = Duration::from_secs(120);

fn worker(server: &PostgresServer, keys: &[&str], table: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_multi_key_worker"))
        .arg(keys.join(","))
        .arg(ROUNDS.to_string())
        .arg(table)
        .env("MULTI_KEY_WORKER_CONNECTION", server.connection_string())
        .env(
            "MULTI_KEY_WORKER_TIMEOUT_MS",
            ACQUIRE_TIMEOUT.as_millis().to_string(),
        )
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the worker starts")
}

/// Waits for a worker to exit; returns whether it succeeded, and what it printed.
async fn finish(child: Child, until: Instant) -> (std::process::ExitStatus, String) {
    let output = tokio::time::timeout_at(until, child.wait_with_output())
        .await
        .expect("the worker finished within the run bound (no deadlock)")
        .expect("its output");
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_taking_two_keys_in_opposite_orders_never_deadlock_and_never_overlap() {
    let server = PostgresServer::start().await;
    let prefix = unique_prefix("multi/processes");
    let (a, b) = (format!("{prefix}/a"), format!("{prefix}/b"));
    let table = format!(
        "counter_{}",
        prefix.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
    );
    server
        .connect()
        .await
        .batch_execute(&format!(
            "CREATE TABLE {table} (id int PRIMARY KEY, value bigint NOT NULL, fence bigint NOT NULL); \
             INSERT INTO {table} VALUES (1, 0, 0)"
        ))
        .await
        .expect("the counter table");

    let started = Instant::now();
    let until = started + RUN_BOUND;
    let forward = worker(&server, &[&a, &b], &table);
    let backward = worker(&server, &[&b, &a], &table);
    let (forward, backward) = tokio::join!(finish(forward, until), finish(backward, until));
    let took = started.elapsed();
    for (name, (status, said)) in [("{a, b}", forward), ("{b, a}", backward)] {
        assert!(
            status.success(),
            "the {name} worker failed ({status}): {said}"
        );
        assert_eq!(said.trim(), format!("done {ROUNDS}"), "the {name} worker");
    }

    let row = server
        .connect()
        .await
        .query_one(
            &format!("SELECT value, fence FROM {table} WHERE id = 1"),
            &[],
        )
        .await
        .expect("the counter");
    let (value, fence): (i64, i64) = (row.get(0), row.get(1));
    assert_eq!(
        value,
        i64::from(2 * ROUNDS),
        "every increment landed: no overlap"
    );
    assert!(fence > 0, "every write was fenced");
    for key in [&a, &b] {
        assert!(
            server.lock_holders(key).await.is_empty(),
            "nothing left held"
        );
    }
    eprintln!("{} rounds in two processes took {took:?}", 2 * ROUNDS);
}
