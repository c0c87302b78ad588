//! A small locked service for the shutdown test (tests/shutdown.rs): an axum route behind
//! `lock_route`, a background job holding a lock for as long as the process runs, and, on
//! SIGTERM, the graceful shutdown the HTTP guide describes — the server drains its requests,
//! then `DistributedLock::shutdown` gives every lock up and closes the backend's sessions.
//!
//! `LOCKED_SERVICE_PROVIDER` is `postgres` or `azure`, `LOCKED_SERVICE_CONNECTION` its
//! connection string. It prints `listening <port>` once it serves, `holding` once the job's
//! lock is held, and `shut down` once the shutdown finished.

use std::time::Duration;

use axum::routing::post;
use axum::Router;
use lockingkit::{
    AzureBlobBackend, AzureBlobOptions, DistributedLock, PostgresBackend, PostgresOptions,
};
use tokio::signal::unix::{signal, SignalKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let connection = std::env::var("LOCKED_SERVICE_CONNECTION")?;
    let locks = match std::env::var("LOCKED_SERVICE_PROVIDER")?.as_str() {
        "postgres" => {
            DistributedLock::builder(PostgresBackend::new(PostgresOptions::new(connection))?)
                .build()?
        }
        "azure" => {
            let backend = AzureBlobBackend::new(
                AzureBlobOptions::from_connection_string(connection)
                    .with_lease_duration(Duration::from_secs(30)),
            )?;
            backend.ensure_container().await?;
            DistributedLock::builder(backend).build()?
        }
        other => return Err(format!("unknown provider {other}").into()),
    };
    locks.verify().await?;

    // A background job that holds its lock until the process stops.
    let job = locks.try_acquire("jobs/nightly-export").await?;
    println!("holding");

    let app = Router::new().route(
        "/orders/{id}",
        post(|| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            "done"
        })
        .route_layer(lockingkit_axum::lock_route(locks.clone(), "orders/{id}")),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening {}", listener.local_addr()?.port());
    let mut terminate = signal(SignalKind::terminate())?;
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            terminate.recv().await;
        })
        .await?;

    // A handle dropped just before the process exits: its release runs in the background,
    // and the shutdown below waits for it.
    drop(locks.try_acquire("orders/last-minute").await?);
    locks.shutdown(Duration::from_secs(5)).await?;
    assert!(!job.is_held(), "the job's lock was given up");
    println!("shut down");
    Ok(())
}
