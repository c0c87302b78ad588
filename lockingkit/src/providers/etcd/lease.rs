//! One etcd lease per backend: every hold and queue place of the backend is a key attached to
//! it. The engine's renewals of the holds keep it alive, and while the backend has queue
//! places but no hold, a keeper of its own does (see [`Inner::keep_places_alive`]).
//!
//! # Why one lease, not one per hold
//! A lease per hold costs a grant before and a revoke after every hold: four round trips
//! through Raft per acquire+release pair instead of two. One shared lease costs nothing per
//! hold; its price is that a lease the server drops (expired while the process was paused,
//! revoked by an operator) is loss for every hold on it at once, which is what the engine's
//! `LeaseGone` means.
//!
//! # Coalesced keep-alives, and why they stay safe
//! The engine renews each hold on its own schedule and declares loss at 90% of the TTL after
//! the renewal was *sent*. A renewal that finds a keep-alive of this lease *sent* no more than
//! [`COALESCE_FRACTION`] of the TTL before it (and answered) is answered by that keep-alive
//! instead of sending another: the server's expiry is at least that send time plus the TTL,
//! which is still later than the engine's deadline for the renewal (sent + 90% of the TTL)
//! with half of the 10% margin left for clock-rate differences. So however many holds a
//! backend has, it sends at most one keep-alive per twentieth of the TTL.
//!
//! Every attempt takes the lease through [`SharedLease::fresh`], which applies the same rule,
//! so a new hold never lands on a lease that was about to expire.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::errors::{self, Failure};
use super::members::{Members, Resend};
use super::Inner;
use crate::backend::BackendError;

/// How recent a keep-alive must be to answer a renewal: a twentieth of the TTL.
pub(super) const COALESCE_FRACTION: u32 = 20;

/// The lease of one backend, granted on first use and again after the server dropped it.
pub(super) struct SharedLease {
    /// Keep-alives sent so far, for tests of the coalescing.
    sent: Arc<AtomicU64>,
    ttl: Duration,
    timeout: Duration,
    current: Mutex<Option<Arc<LeaseGeneration>>>,
    /// One grant in flight at a time; how the latest one failed, for the callers that queued
    /// behind it.
    granting: tokio::sync::Mutex<Option<BackendError>>,
    /// Grants that failed so far: a caller that finds it moved while it queued for
    /// [`granting`](Self::granting) is told that failure instead of granting again.
    failed_grants: AtomicU64,
}

/// One granted lease. Its keys live exactly as long as it does.
pub(super) struct LeaseGeneration {
    pub(super) id: i64,
    /// Fires when the server said the lease is gone (expired or revoked).
    gone: CancellationToken,
    keep_alive: tokio::sync::Mutex<KeepAlive>,
    /// Numbers the keys written under this lease, so each is unique.
    entries: AtomicU64,
    sent: Arc<AtomicU64>,
    ttl: Duration,
    timeout: Duration,
}

#[derive(Default)]
struct KeepAlive {
    stream: Option<KeepAliveStream>,
    /// When the latest keep-alive (or the grant) that the server answered was sent.
    last_sent_ok: Option<Instant>,
}

/// The lease's keep-alive stream, open on the member at `at`.
struct KeepAliveStream {
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
    at: String,
}

impl SharedLease {
    pub(super) fn new(ttl: Duration, timeout: Duration) -> Self {
        SharedLease {
            sent: Arc::new(AtomicU64::new(0)),
            ttl,
            timeout,
            current: Mutex::new(None),
            granting: tokio::sync::Mutex::new(None),
            failed_grants: AtomicU64::new(0),
        }
    }

    /// How many keep-alives the backend has sent.
    pub(super) fn keep_alives_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The lease now, if one is granted and not known to be gone.
    pub(super) fn current(&self) -> Option<Arc<LeaseGeneration>> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|generation| !generation.is_gone())
    }

    /// The lease, refreshed so that the server keeps it at least a TTL from about now (see
    /// the module documentation); granted anew if there is none or the server dropped it.
    pub(super) async fn fresh(
        &self,
        members: &Members,
    ) -> Result<Arc<LeaseGeneration>, BackendError> {
        let asked = Instant::now();
        if let Some(generation) = self.current() {
            match generation.refresh(members, asked).await {
                Ok(()) => return Ok(generation),
                Err(error) if generation.is_gone() => {
                    tracing::debug!(target: "lockingkit", %error, "etcd lease gone; granting a new one");
                }
                Err(error) => return Err(error),
            }
        }
        let failures_before = self.failed_grants.load(Ordering::Acquire);
        let mut latest_failure = tokio::time::timeout(self.timeout, self.granting.lock())
            .await
            .map_err(|_| {
                BackendError::unreachable(format!(
                    "the etcd lease grant already in flight did not finish within {:?}",
                    self.timeout
                ))
            })?;
        // Another caller may have granted while we queued, or failed to: its answer is ours.
        if let Some(generation) = self.current() {
            generation.refresh(members, asked).await?;
            return Ok(generation);
        }
        if self.failed_grants.load(Ordering::Acquire) != failures_before {
            if let Some(failure) = latest_failure.as_ref() {
                return Err(failure.clone());
            }
        }
        match self.grant(members).await {
            Ok(generation) => {
                let generation = Arc::new(generation);
                *self.current.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(generation.clone());
                *latest_failure = None;
                Ok(generation)
            }
            Err(failure) => {
                *latest_failure = Some(failure.clone());
                self.failed_grants.fetch_add(1, Ordering::AcqRel);
                Err(failure)
            }
        }
    }

    async fn grant(&self, members: &Members) -> Result<LeaseGeneration, BackendError> {
        let sent = Instant::now();
        // The options allow whole seconds only, so this is exact.
        let ttl = i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX);
        let granted = members
            .call("lease grant", Resend::Idempotent, |client| {
                let mut leases = client.lease_client();
                async move { leases.grant(ttl, None).await }
            })
            .await?;
        if granted.ttl() <= 0 || granted.id() <= 0 {
            return Err(BackendError::permanent(
                "etcd granted a lease without an id or a TTL",
            ));
        }
        Ok(LeaseGeneration {
            id: granted.id(),
            gone: CancellationToken::new(),
            keep_alive: tokio::sync::Mutex::new(KeepAlive {
                stream: None,
                last_sent_ok: Some(sent),
            }),
            entries: AtomicU64::new(0),
            sent: self.sent.clone(),
            ttl: self.ttl,
            timeout: self.timeout,
        })
    }

    /// Revokes the lease now, so the keys still on it go at once: for a backend nobody uses
    /// any more. The lease is forgotten first, so an attempt that starts meanwhile grants a
    /// new one.
    pub(super) async fn revoke(&self, members: &Members) -> Result<(), BackendError> {
        let Some(generation) = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        else {
            return Ok(());
        };
        generation.mark_gone();
        let id = generation.id;
        let revoked = members
            .call("lease revoke", Resend::Idempotent, |client| {
                let mut leases = client.lease_client();
                async move { leases.revoke(id).await }
            })
            .await;
        match revoked {
            Ok(_) => Ok(()),
            // Expired already: the same result.
            Err(failure) if failure.error.kind() == crate::backend::BackendErrorKind::LeaseGone => {
                Ok(())
            }
            Err(failure) => Err(failure.error),
        }
    }
}

impl LeaseGeneration {
    /// Whether the server said this lease is gone.
    pub(super) fn is_gone(&self) -> bool {
        self.gone.is_cancelled()
    }

    /// Fires when the server says this lease is gone.
    pub(super) fn gone(&self) -> &CancellationToken {
        &self.gone
    }

    /// Records that the server does not know this lease any more.
    pub(super) fn mark_gone(&self) {
        self.gone.cancel();
    }

    /// A name for a new key under this lease, unique across the cluster.
    pub(super) fn next_entry_id(&self) -> String {
        let n = self.entries.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}-{n:x}", self.id)
    }

    /// Makes sure a keep-alive of this lease was sent no earlier than a twentieth of the TTL
    /// before `asked` and answered, sending one if needed. `LeaseGone` when the server says the
    /// lease expired or was revoked.
    pub(super) async fn refresh(
        &self,
        members: &Members,
        asked: Instant,
    ) -> Result<(), BackendError> {
        if self.is_gone() {
            return Err(BackendError::lease_gone(
                "the etcd lease expired or was revoked",
            ));
        }
        let window = self.ttl / COALESCE_FRACTION;
        // A keep-alive in flight is waited for, but no longer than a request may take.
        let mut keep_alive = tokio::time::timeout(self.timeout, self.keep_alive.lock())
            .await
            .map_err(|_| {
                BackendError::unreachable(format!(
                    "the etcd keep-alive already in flight did not finish within {:?}",
                    self.timeout
                ))
            })?;
        let recent = keep_alive
            .last_sent_ok
            .is_some_and(|sent| asked.saturating_duration_since(sent) <= window);
        if recent {
            return Ok(());
        }
        let sent = Instant::now();
        self.sent.fetch_add(1, Ordering::Relaxed);
        match tokio::time::timeout(self.timeout, self.send(members, &mut keep_alive)).await {
            Ok(Ok(())) => {
                keep_alive.last_sent_ok = Some(sent);
                Ok(())
            }
            Ok(Err(error)) => {
                keep_alive.stream = None;
                Err(error)
            }
            Err(_) => {
                // A late answer on this stream would be taken for the next request's.
                let at = keep_alive.stream.take().map_or_else(
                    || "etcd".to_owned(),
                    |stream| format!("etcd at {}", stream.at),
                );
                Err(BackendError::unreachable(format!(
                    "{at} did not answer the lease keep-alive within {:?}",
                    self.timeout
                )))
            }
        }
    }

    /// One keep-alive on the lease's stream, opening it on a member if needed (opening sends
    /// the first).
    async fn send(
        &self,
        members: &Members,
        keep_alive: &mut KeepAlive,
    ) -> Result<(), BackendError> {
        let Some(open) = keep_alive.stream.as_mut() else {
            let lent = members.lend().await?;
            let at = lent.endpoint().to_owned();
            let mut leases = lent.client.lease_client();
            return match leases.keep_alive(self.id).await {
                Ok((keeper, answers)) => {
                    lent.answered();
                    keep_alive.stream = Some(KeepAliveStream {
                        keeper,
                        answers,
                        at,
                    });
                    Ok(())
                }
                Err(error) => {
                    let failure = self.failed(&at, error);
                    lent.failed(&failure);
                    Err(failure.error)
                }
            };
        };
        let at = &open.at;
        open.keeper
            .keep_alive()
            .await
            .map_err(|e| self.failed(at, e).error)?;
        match open.answers.message().await {
            Ok(Some(answer)) if answer.ttl() > 0 => Ok(()),
            Ok(Some(_)) => {
                self.mark_gone();
                Err(BackendError::lease_gone(
                    "etcd says the lease expired or was revoked",
                ))
            }
            Ok(None) => Err(BackendError::unreachable(format!(
                "the etcd keep-alive stream at {at} ended"
            ))),
            Err(error) => Err(self.failed(at, error).error),
        }
    }

    fn failed(&self, at: &str, error: etcd_client::Error) -> Failure {
        if errors::is_lease_not_found(&error) {
            self.mark_gone();
        }
        errors::classify("lease keep-alive", at, error)
    }
}

impl Inner {
    /// Keeps the lease alive while the backend has queue places, from a task of its own: a
    /// place lives on the lease, and a waiter woken only by watches (or polling less often than
    /// the TTL) would otherwise lose it. Holds need no help, the engine renews them; renewals
    /// and this keeper coalesce (see the module documentation). One keeper per backend, which
    /// ends when the last place goes.
    pub(super) fn keep_places_alive(self: &Arc<Self>) {
        if self
            .place_keeper
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.place_keeper
                .store(false, std::sync::atomic::Ordering::Release);
            return;
        };
        runtime.spawn(keep_places_alive(Arc::downgrade(self), self.ttl / 3));
    }
}

async fn keep_places_alive(backend: Weak<Inner>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(backend) = backend.upgrade() else {
            return;
        };
        if backend.places() == 0 || backend.closed.is_cancelled() {
            backend
                .place_keeper
                .store(false, std::sync::atomic::Ordering::Release);
            // A place made since the check starts its own keeper.
            if backend.places() > 0 && !backend.closed.is_cancelled() {
                backend.keep_places_alive();
            }
            return;
        }
        if let Some(generation) = backend.lease.current() {
            // A failure is retried at the next turn; the places' lease is the holds' too, and
            // a lease the server dropped took the places with it.
            let _ = generation.refresh(&backend.members, Instant::now()).await;
        }
    }
}
