//! An orders API whose writes hold a distributed lock per order and whose reads share it, with
//! axum and LockingKit.
//!
//! ```text
//! cargo run -p lockingkit-examples --example orders_api
//! ```
//!
//! With no settings it runs on the in-memory provider. Given a connection string it runs on a
//! real backend, so several instances of it exclude each other:
//!
//! ```text
//! LOCKINGKIT_POSTGRES_URL=postgres://user:pass@127.0.0.1:5432/app \
//!   cargo run -p lockingkit-examples --features postgres --example orders_api
//! AZURE_STORAGE_CONNECTION_STRING='UseDevelopmentStorage=true' LOCKINGKIT_CREATE_CONTAINER=1 \
//!   cargo run -p lockingkit-examples --features azure --example orders_api
//! LOCKINGKIT_REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run -p lockingkit-examples --features redis --example orders_api
//! ```
//!
//! On Azure the example checks at startup that the `locks` container exists and the
//! credentials are accepted, and refuses to start with a message saying what is wrong.
//! `LOCKINGKIT_CREATE_CONTAINER=1` creates the container instead, which a fresh Azurite needs
//! (creating containers takes more rights than locking: leave it off in production).
//!
//! Every refused request is logged to stderr with its error code and message (never the key),
//! so a lock service that refuses everything is visible, not just a stream of 500s.
//!
//! Routes:
//! - `POST /orders/{id}/ship` — locks `orders/{id}` for one attempt: a second concurrent call
//!   gets `409` with a problem document (`locking.busy`).
//! - `POST /orders/{id}/pay` — waits up to 10 s for `orders/{id}`, so concurrent calls queue,
//!   and a payment waits for the reads in flight.
//! - `GET /orders/{id}` — reads `orders/{id}` *shared* (waiting up to 10 s for a write in
//!   progress): reads of one order run together, never beside a write. Reading takes 3 s here
//!   too, so you can see two reads overlap and a payment wait for both. On Azure, whose leases
//!   are exclusive only, the example says so at startup and serves reads without a lock.
//!
//! Writes send the lock's fencing token to the (in-process) order store, which refuses a token
//! lower than one it has already seen: the last line of defence when a paused process wakes up
//! believing it still holds a lock it lost.

use std::collections::HashMap;
use std::error::Error;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::{FromRef, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use lockingkit::DistributedLock;
use lockingkit_axum::{lock_route_from_state, HeldLock, LockRejection};

/// How long the simulated shipping, payment and reading take, so that a second curl can
/// collide.
const WORK: Duration = Duration::from_secs(3);

/// How long payments and reads wait for the order's lock.
const WAIT: Duration = Duration::from_secs(10);

#[derive(Clone)]
struct AppState {
    locks: DistributedLock,
    orders: OrderStore,
}

impl FromRef<AppState> for DistributedLock {
    fn from_ref(state: &AppState) -> Self {
        state.locks.clone()
    }
}

/// Stands in for the database: it keeps, per order, the history and the highest fencing token
/// that wrote to it.
#[derive(Clone, Default)]
struct OrderStore(Arc<Mutex<HashMap<String, Order>>>);

#[derive(Default)]
struct Order {
    history: Vec<String>,
    highest_token: u64,
}

impl OrderStore {
    /// Records `event` unless a write with a higher fencing token has already happened.
    fn record(&self, id: &str, token: u64, event: &str) -> Result<usize, u64> {
        let mut orders = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let order = orders.entry(id.to_owned()).or_default();
        if token < order.highest_token {
            return Err(order.highest_token);
        }
        order.highest_token = token;
        order
            .history
            .push(format!("{event} (fencing token {token})"));
        Ok(order.history.len())
    }

    fn describe(&self, id: &str) -> Option<String> {
        let orders = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        orders.get(id).map(|order| order.history.join("\n") + "\n")
    }
}

async fn write(state: &AppState, id: &str, lock: &HeldLock, event: &str) -> (StatusCode, String) {
    // If the lock is lost during this sleep, the layer drops this future and answers 503.
    tokio::time::sleep(WORK).await;
    match state.orders.record(id, lock.fencing_token(), event) {
        Ok(events) => (
            StatusCode::OK,
            format!(
                "order {id}: {event} with fencing token {} ({events} events)\n",
                lock.fencing_token()
            ),
        ),
        Err(highest) => (
            StatusCode::CONFLICT,
            format!(
                "order {id}: stale fencing token {}, store has seen {highest}\n",
                lock.fencing_token()
            ),
        ),
    }
}

async fn ship(
    State(state): State<AppState>,
    Path(id): Path<String>,
    lock: HeldLock,
) -> (StatusCode, String) {
    write(&state, &id, &lock, "shipped").await
}

async fn pay(
    State(state): State<AppState>,
    Path(id): Path<String>,
    lock: HeldLock,
) -> (StatusCode, String) {
    write(&state, &id, &lock, "paid").await
}

async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
    // `None` only where the provider cannot hold shared locks (see `app`).
    lock: Option<HeldLock>,
) -> (StatusCode, String) {
    // Other reads of this order may be here at the same time; no write is.
    tokio::time::sleep(WORK).await;
    let held = match &lock {
        Some(lock) => format!("read shared, fencing token {}", lock.fencing_token()),
        None => "read without a lock".to_owned(),
    };
    match state.orders.describe(&id) {
        Some(history) => (StatusCode::OK, format!("order {id} ({held}):\n{history}")),
        None => (
            StatusCode::NOT_FOUND,
            format!("order {id}: nothing recorded yet ({held})\n"),
        ),
    }
}

/// Logs why a request was refused, then answers with the default problem document.
///
/// The rejection carries the error code and message but never the lock key, which is derived
/// from the order id and may identify a customer.
fn log_rejection(rejection: LockRejection) -> Response {
    match rejection.error() {
        Some(error) => eprintln!("lock refused ({}): {}", rejection.status(), error),
        None => eprintln!(
            "lock refused ({}): {}",
            rejection.status(),
            rejection.code()
        ),
    }
    rejection.into_response()
}

/// The lock provider: PostgreSQL, Azure or Redis when configured (and compiled in), else
/// in-memory.
async fn lock_provider() -> Result<DistributedLock, Box<dyn Error>> {
    let postgres = std::env::var("LOCKINGKIT_POSTGRES_URL")
        .ok()
        .filter(|v| !v.is_empty());
    let azure = std::env::var("AZURE_STORAGE_CONNECTION_STRING")
        .ok()
        .filter(|v| !v.is_empty());

    #[cfg(feature = "postgres")]
    if let Some(url) = postgres {
        let backend = lockingkit::PostgresBackend::new(lockingkit::PostgresOptions::new(url))?;
        return Ok(DistributedLock::builder(backend).build()?);
    }
    #[cfg(not(feature = "postgres"))]
    if postgres.is_some() {
        return Err(
            "LOCKINGKIT_POSTGRES_URL is set, but this build lacks --features postgres".into(),
        );
    }

    #[cfg(feature = "azure")]
    if let Some(connection_string) = azure {
        let options = lockingkit::AzureBlobOptions::from_connection_string(connection_string)
            .with_container("locks");
        let backend = lockingkit::AzureBlobBackend::new(options)?;
        // Building sends nothing to Azure; this is where a missing container or a wrong
        // account stops the example instead of every write answering 500.
        let create = std::env::var("LOCKINGKIT_CREATE_CONTAINER").is_ok_and(|v| v == "1");
        if create {
            backend.ensure_container().await?;
        } else {
            backend.verify().await.map_err(|error| {
                use lockingkit::providers::azure::AzureRequestError;
                let code = Error::source(&error)
                    .and_then(|source| source.downcast_ref::<AzureRequestError>())
                    .and_then(AzureRequestError::error_code);
                match code {
                    Some("ContainerNotFound") => format!(
                        "{error}\n(for a fresh Azurite, LOCKINGKIT_CREATE_CONTAINER=1 creates \
                         the container)"
                    ),
                    _ => error.to_string(),
                }
            })?;
        }
        return Ok(DistributedLock::builder(backend).build()?);
    }
    #[cfg(not(feature = "azure"))]
    if azure.is_some() {
        return Err(
            "AZURE_STORAGE_CONNECTION_STRING is set, but this build lacks --features azure".into(),
        );
    }

    let redis = std::env::var("LOCKINGKIT_REDIS_URL")
        .ok()
        .filter(|v| !v.is_empty());
    #[cfg(feature = "redis")]
    if let Some(url) = redis {
        let backend = lockingkit::RedisBackend::new(lockingkit::RedisOptions::new(url))?;
        // Building sends nothing; a server that is down or refuses the password stops the
        // example here.
        backend.verify().await?;
        return Ok(DistributedLock::builder(backend).build()?);
    }
    #[cfg(not(feature = "redis"))]
    if redis.is_some() {
        return Err("LOCKINGKIT_REDIS_URL is set, but this build lacks --features redis".into());
    }

    Ok(DistributedLock::in_memory())
}

fn app(state: AppState) -> Router {
    // Each lock is layered on its own method router: a `Router::route_layer` would also wrap
    // every route added before it, and two layers locking the same key refuse each other.
    let ship_lock = lock_route_from_state(&state, "orders/{id}").map_rejection(log_rejection);
    let pay_lock = lock_route_from_state(&state, "orders/{id}")
        .wait(WAIT)
        .map_rejection(log_rejection);
    // A provider without shared locks refuses `shared()` here, at startup. Serving reads
    // unlocked is this application's choice (reads only show the history); one whose reads
    // must never see a write in progress would stop instead.
    let show = match lock_route_from_state(&state, "orders/{id}").shared() {
        Ok(read_lock) => get(show).route_layer(read_lock.wait(WAIT).map_rejection(log_rejection)),
        Err(error) => {
            eprintln!("orders_api: reads take no lock: {error}");
            get(show)
        }
    };
    Router::new()
        .route("/orders/{id}/ship", post(ship).route_layer(ship_lock))
        .route("/orders/{id}/pay", post(pay).route_layer(pay_lock))
        .route("/orders/{id}", show)
        .with_state(state)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Display, not Debug: the message says what is wrong and what to do.
            eprintln!("orders_api: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn Error>> {
    let locks = lock_provider().await?;
    let addr = std::env::var("ORDERS_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let addr = listener.local_addr()?;
    println!(
        "orders API on http://{addr}, locks on the {} provider",
        locks.provider()
    );
    println!();
    println!("Two ships at once: one 200, one 409 application/problem+json (locking.busy):");
    println!("  curl -si -X POST http://{addr}/orders/42/ship & curl -si -X POST http://{addr}/orders/42/ship; wait");
    println!("Two payments at once: the second waits for the first, both 200:");
    println!("  curl -s -X POST http://{addr}/orders/42/pay & curl -s -X POST http://{addr}/orders/42/pay; wait");
    println!("Different orders run in parallel:");
    println!("  curl -s -X POST http://{addr}/orders/1/ship & curl -s -X POST http://{addr}/orders/2/ship; wait");
    println!("Two reads run together; a payment waits for both, a ship is refused meanwhile:");
    println!("  curl -s http://{addr}/orders/42 & curl -s http://{addr}/orders/42 & sleep 0.5; curl -si -X POST http://{addr}/orders/42/ship; curl -s -X POST http://{addr}/orders/42/pay; wait");

    let state = AppState {
        locks,
        orders: OrderStore::default(),
    };
    axum::serve(listener, app(state)).await?;
    Ok(())
}
