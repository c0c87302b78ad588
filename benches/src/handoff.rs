//! Hand-offs, from the start of a holder's release to the moment the next caller holds the
//! key: within one process (row 5), across processes with and without the backend's release
//! hint (rows 6 and 14, etcd's), and while one process waits for many keys at once (row 6).

use std::time::{Duration, Instant};

use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::keys::PostgresLockKeys;
use lockingkit::{DistributedLock, LockMode};
use lockingkit_tests::postgres::PostgresServer;

use crate::pair::lock_on;
use crate::samples::Percentiles;

/// Local hand-off: from the start of a holder's `release` to the moment the next caller of
/// the same `DistributedLock`, already waiting, holds the key. Call from a multi-thread
/// runtime.
pub async fn local_handoff(locks: &DistributedLock, key: &str, samples: usize) -> Percentiles {
    handoff(locks, locks, key, samples, |_| Duration::ZERO).await
}

/// Cross-process hand-off: `holder` and `waiter` are two `DistributedLock`s with backends of
/// their own (two pools, two sets of watchers), as two processes have. The hold lasts from
/// 20 ms to about 1 s, so that releases land at every point of the waiter's backoff (50 ms
/// doubling to 1 s by default).
pub async fn cross_process_handoff(
    holder: &DistributedLock,
    waiter: &DistributedLock,
    key: &str,
    samples: usize,
) -> Percentiles {
    handoff(holder, waiter, key, samples, |i| {
        Duration::from_millis(20 + (i as u64 * 389) % 1000)
    })
    .await
}

/// Each sample: `holder` takes the key, `waiter` starts waiting, the hold lasts `hold(i)`, then
/// from the start of the release to the moment `waiter` holds the key.
pub(crate) async fn handoff(
    holder: &DistributedLock,
    waiter: &DistributedLock,
    key: &str,
    samples: usize,
    hold: impl Fn(usize) -> Duration,
) -> Percentiles {
    let mut taken = Vec::with_capacity(samples);
    for i in 0..samples {
        let held = holder.try_acquire(key).await.unwrap();
        let waiting = tokio::spawn({
            let waiter = waiter.clone();
            let key = key.to_owned();
            async move {
                let handle = waiter.acquire(&key, Duration::from_secs(10)).await.unwrap();
                let at = Instant::now();
                handle.release().await.unwrap();
                at
            }
        });
        while waiter.waiting(key) == 0 {
            tokio::task::yield_now().await;
        }
        let hold = hold(i);
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        let released = Instant::now();
        held.release().await.unwrap();
        let acquired = waiting.await.unwrap();
        taken.push(acquired.saturating_duration_since(released));
    }
    Percentiles::of(taken)
}

/// Cross-process hand-off while `waiter` waits for `keys` keys at once: each round `holder`
/// takes them all, one waiting task per key starts, and after a hold the keys are released one
/// by one; each sample is one key's release to its waiter holding it.
pub async fn handoff_of_many_keys(
    server: &PostgresServer,
    holder: &DistributedLock,
    waiter: &DistributedLock,
    prefix: &str,
    keys: usize,
    rounds: usize,
) -> Percentiles {
    let mut taken = Vec::with_capacity(keys * rounds);
    for round in 0..rounds {
        let names: Vec<String> = (0..keys).map(|k| format!("{prefix}/{k}")).collect();
        let mut held = Vec::new();
        for name in &names {
            held.push(holder.try_acquire(name).await.expect("holder lock"));
        }
        let waiting: Vec<_> = names
            .iter()
            .map(|name| {
                let waiter = waiter.clone();
                let name = name.clone();
                tokio::spawn(async move {
                    let handle = waiter.acquire(&name, Duration::from_secs(30)).await?;
                    let at = tokio::time::Instant::now();
                    handle.release().await.expect("release");
                    Ok::<_, lockingkit::LockError>(at)
                })
            })
            .collect();
        for name in &names {
            while waiter.waiting(name) == 0 {
                tokio::task::yield_now().await;
            }
        }
        tokio::time::sleep(Duration::from_millis(50 + (round as u64 * 389) % 700)).await;
        let mut released_at = Vec::new();
        for handle in held {
            released_at.push(tokio::time::Instant::now());
            handle.release().await.expect("release");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for ((released, task), name) in released_at.into_iter().zip(waiting).zip(&names) {
            match task.await.expect("waiter task") {
                Ok(acquired) => taken.push(acquired.saturating_duration_since(released)),
                Err(error) => {
                    let admin = server.connect().await;
                    let key = PostgresLockKeys::advisory_key(name);
                    let rows = admin
                        .query(
                            "SELECT l.pid, l.mode, l.granted, a.application_name, a.state, a.query \
                             FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                             WHERE l.locktype = 'advisory' \
                             AND ((l.classid::bigint << 32) | l.objid::bigint) = $1",
                            &[&key],
                        )
                        .await
                        .expect("pg_locks");
                    for row in rows {
                        eprintln!(
                            "pid {} {} granted={} app={} state={:?} query={:?}",
                            row.get::<_, i32>(0),
                            row.get::<_, String>(1),
                            row.get::<_, bool>(2),
                            row.get::<_, String>(3),
                            row.get::<_, Option<String>>(4),
                            row.get::<_, Option<String>>(5)
                        );
                    }
                    panic!("round {round}: {name} was not handed over: {error}");
                }
            }
        }
    }
    Percentiles::of(taken)
}

/// A backend with its release hint hidden: waiting is pure polling, the baseline the hint
/// is measured against.
pub struct PollingOnly<B>(pub B);

impl<B: LockBackend> LockBackend for PollingOnly<B> {
    type Lease = B::Lease;
    fn provider(&self) -> &str {
        self.0.provider()
    }
    fn timing(&self) -> LeaseTiming {
        self.0.timing()
    }
    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        self.0.try_acquire(key, mode).await
    }
    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.0.renew(lease).await
    }
    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.0.release(lease).await
    }
    fn lease_ended(&self, lease: &Self::Lease) -> impl std::future::Future<Output = ()> + Send {
        self.0.lease_ended(lease)
    }
}

/// A `DistributedLock` on `backend` with its release hint hidden: its waiters in other
/// processes only poll.
pub fn polling_lock<B: LockBackend>(backend: B) -> DistributedLock {
    lock_on(PollingOnly(backend))
}
