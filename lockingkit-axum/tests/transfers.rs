//! Multi-key routes over real HTTP on 127.0.0.1: `POST /transfers/{from}/{to}` locks both
//! accounts. Transfers in both directions at once never deadlock and never lose an update; a
//! busy account is `409`; a lost account drops the handler.

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use lockingkit::{DistributedLock, MemoryBackend, MemoryStore};
use lockingkit_axum::{lock_route_all, HeldLocks};

use support::{post as http_post, serve, short_lease_locks};

/// A bound on how long a test may hang if the code under test deadlocks.
const HANG_GUARD: Duration = Duration::from_secs(60);

type Balances = Arc<Mutex<HashMap<u64, i64>>>;

/// Moves 1 from `from` to `to` as a read, a pause and a write: without the locks, two
/// transfers that overlap lose one of their updates.
async fn transfer(
    State(balances): State<Balances>,
    Path((from, to)): Path<(u64, u64)>,
    locks: HeldLocks,
) -> String {
    let read = |id| {
        balances
            .lock()
            .expect("not poisoned")
            .get(&id)
            .copied()
            .unwrap_or(0)
    };
    let (debit, credit) = (read(from), read(to));
    tokio::time::sleep(Duration::from_millis(1)).await;
    {
        let mut balances = balances.lock().expect("not poisoned");
        balances.insert(from, debit - 1);
        balances.insert(to, credit + 1);
    }
    format!("{} keys", locks.members().len())
}

fn app(locks: DistributedLock, balances: Balances, wait: Option<Duration>) -> Router {
    let layer = lock_route_all(locks, &["accounts/{from}", "accounts/{to}"]);
    let layer = match wait {
        Some(timeout) => layer.wait(timeout),
        None => layer,
    };
    Router::new()
        .route("/transfers/{from}/{to}", post(transfer))
        .route_layer(layer)
        .with_state(balances)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_in_both_directions_on_two_instances_never_deadlock_or_lose_an_update() {
    let store = MemoryStore::new();
    let balances: Balances = Arc::new(Mutex::new(HashMap::from([(1, 100), (2, 100)])));
    // Two instances of the service on one store, as two processes on one backend.
    let mut servers = Vec::new();
    for _ in 0..2 {
        let locks = DistributedLock::builder(MemoryBackend::new(store.clone()))
            .min_retry_delay(Duration::from_millis(5))
            .max_retry_delay(Duration::from_millis(20))
            .build()
            .expect("valid options");
        servers.push(serve(app(locks, balances.clone(), Some(Duration::from_secs(30)))).await);
    }
    let mut clients = Vec::new();
    for client in 0..8usize {
        let addr = servers[client % 2];
        let path = if client % 4 < 2 {
            "/transfers/1/2"
        } else {
            "/transfers/2/1"
        };
        clients.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..10 {
                statuses.push(http_post(addr, path).await.status);
            }
            statuses
        }));
    }
    let mut ok = 0;
    for client in clients {
        let statuses = tokio::time::timeout(HANG_GUARD, client)
            .await
            .expect("a client hung: deadlock")
            .expect("client task");
        assert!(
            statuses.iter().all(|s| *s == StatusCode::OK),
            "{statuses:?}"
        );
        ok += statuses.len();
    }
    assert_eq!(ok, 80);
    // As many transfers went each way: every update landed.
    let balances = balances.lock().expect("not poisoned").clone();
    assert_eq!(balances[&1], 100, "{balances:?}");
    assert_eq!(balances[&2], 100, "{balances:?}");
    assert!(!store.is_locked("accounts/1") && !store.is_locked("accounts/2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_account_is_409_and_the_other_account_is_not_kept() {
    let locks = DistributedLock::in_memory();
    let balances: Balances = Arc::default();
    let addr = serve(app(locks.clone(), balances.clone(), None)).await;
    // `accounts/1` sorts first: the layer takes it, then finds `accounts/2` busy.
    let held = locks.try_acquire("accounts/2").await.expect("free");
    let reply = http_post(addr, "/transfers/1/2").await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
    assert_eq!(reply.code(), "locking.busy");
    assert!(reply.retry_after().is_some());
    let other = locks
        .try_acquire("accounts/1")
        .await
        .expect("accounts/1 was given back");
    drop(other);
    held.release().await.expect("released");
    assert!(
        balances.lock().expect("not poisoned").is_empty(),
        "the handler never ran"
    );

    let reply = http_post(addr, "/transfers/2/1").await;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    assert_eq!(reply.text(), "2 keys");
    // A transfer to the same account locks it once.
    let reply = http_post(addr, "/transfers/3/3").await;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    assert_eq!(reply.text(), "1 keys");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lost_mid_request_drops_the_handler_and_answers_500_lost() {
    let store = MemoryStore::new();
    let locks = short_lease_locks(&store);
    let (entered_tx, entered) = tokio::sync::oneshot::channel::<()>();
    let entered_tx = Arc::new(Mutex::new(Some(entered_tx)));
    let (dropped_tx, dropped) = tokio::sync::oneshot::channel::<()>();
    let dropped_tx = Arc::new(Mutex::new(Some(dropped_tx)));
    struct OnDrop(Option<tokio::sync::oneshot::Sender<()>>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }
    let handler = move |_: HeldLocks| {
        let entered = entered_tx.lock().expect("not poisoned").take();
        let dropped = OnDrop(dropped_tx.lock().expect("not poisoned").take());
        async move {
            let _dropped = dropped;
            if let Some(entered) = entered {
                let _ = entered.send(());
            }
            std::future::pending::<&'static str>().await
        }
    };
    let app = Router::new()
        .route("/transfers/{from}/{to}", post(handler))
        .route_layer(lock_route_all(locks, &["accounts/{from}", "accounts/{to}"]));
    let addr = serve(app).await;
    let request = tokio::spawn(async move { http_post(addr, "/transfers/5/6").await });
    entered.await.expect("the handler ran");
    assert!(store.break_lease("accounts/6"));
    let reply = tokio::time::timeout(HANG_GUARD, request)
        .await
        .expect("answered")
        .expect("request task");
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.code(), "locking.lost");
    dropped.await.expect("the handler was dropped");
    assert!(
        !store.is_locked("accounts/5"),
        "the other account was given up"
    );
}
