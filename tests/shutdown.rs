//! A service stopped with SIGTERM leaves nothing behind: the locked service in
//! `bin/locked_service.rs` serves a request, holds a background job's lock and drops one handle
//! as it exits; after it exits, every key is free at once (no lease left to run out on Azure)
//! and no session of it remains on PostgreSQL, whose log stays clean.

use std::process::Stdio;
use std::time::Duration;

use http::StatusCode;
use lockingkit::{AzureBlobBackend, AzureBlobOptions, DistributedLock};
use lockingkit_tests::azurite::Azurite;
use lockingkit_tests::http::Connection;
use lockingkit_tests::postgres::PostgresServer;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// The keys the service locks: its job's, the request's, the handle it drops at exit.
const KEYS: [&str; 3] = ["jobs/nightly-export", "orders/7", "orders/last-minute"];

/// Starts the service and waits until it serves; returns it, its output and its port.
async fn start(provider: &str, connection: String) -> (Child, Lines<BufReader<ChildStdout>>, u16) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_locked_service"))
        .env("LOCKED_SERVICE_PROVIDER", provider)
        .env("LOCKED_SERVICE_CONNECTION", connection)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the service starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let port = loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the service came up in time")
            .expect("its output")
            .expect("it is still running");
        if let Some(port) = line.strip_prefix("listening ") {
            break port.parse().expect("a port");
        }
    };
    (child, lines, port)
}

/// Sends a request that is still in flight when SIGTERM arrives, then stops the service the
/// way an orchestrator does; the request is served, and the service exits cleanly.
async fn stop_with_a_request_in_flight(
    child: &mut Child,
    lines: &mut Lines<BufReader<ChildStdout>>,
    port: u16,
) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let request = tokio::spawn(async move { Connection::open(addr).await.post("/orders/7").await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let pid = i32::try_from(child.id().expect("running")).expect("a pid");
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert_eq!(
        request.await.expect("request"),
        StatusCode::OK,
        "drained, not cut off"
    );
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("the service stopped in time")
        .expect("exit status");
    assert!(status.success(), "{status}");
    let mut said = Vec::new();
    while let Ok(Some(line)) = lines.next_line().await {
        said.push(line);
    }
    assert!(said.iter().any(|line| line == "shut down"), "{said:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_service_stopped_with_sigterm_leaves_no_lock_and_no_session_behind() {
    let server = PostgresServer::start_local().await;
    let (mut child, mut lines, port) = start("postgres", server.connection_string()).await;
    stop_with_a_request_in_flight(&mut child, &mut lines, port).await;
    let admin = server.connect().await;
    // The server ends a session a moment after its client closes the socket.
    let mut sessions = i64::MAX;
    for _ in 0..100 {
        sessions = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'lockingkit'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if sessions == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sessions, 0, "no session of the service remains");
    let locks: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .expect("pg_locks")
        .get(0);
    assert_eq!(locks, 0, "no advisory lock remains");
    for key in KEYS {
        assert!(server.lock_holders(key).await.is_empty(), "{key}");
    }
    let log = server.server_log();
    let noise: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("ERROR:") || line.contains("WARNING:"))
        .collect();
    assert!(noise.is_empty(), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_azure_service_stopped_with_sigterm_leaves_no_lease_behind() {
    let azurite = Azurite::start().await;
    let (mut child, mut lines, port) = start("azure", azurite.connection_string()).await;
    stop_with_a_request_in_flight(&mut child, &mut lines, port).await;
    // Every key is free at once: no lease of the stopped process runs out over 30 s.
    let other = DistributedLock::builder(
        AzureBlobBackend::new(AzureBlobOptions::from_connection_string(
            azurite.connection_string(),
        ))
        .expect("options"),
    )
    .build()
    .expect("lock");
    for key in KEYS {
        let held = other
            .try_acquire(key)
            .await
            .unwrap_or_else(|error| panic!("{key} is still leased: {error}"));
        held.release().await.expect("release");
    }
}
