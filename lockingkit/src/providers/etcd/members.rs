//! The cluster's members, each reached through a client of its own, and how a request finds
//! one that answers without hammering those that do not.
//!
//! etcd-client balances one channel over every endpoint, and tonic reconnects a channel's
//! endpoint the moment a request is routed to it: with a member down, every request routed
//! there costs a connect attempt, and a caller that resends at once turns that into a storm.
//! So each member has a client (one HTTP/2 connection once used) and a [`Health`] gate of its
//! own, and a request goes to the **preferred** member — the last one that answered — first:
//!
//! - a member that failed (refused or dropped the connection, did not answer within the
//!   request timeout, or answered that it has no leader) is not asked again until its backoff
//!   has passed, [`OUTAGE_FIRST`] doubling (with equal jitter) to [`OUTAGE_MOST`], and then by one
//!   request at a time (its probe): **one connect in flight per member**, never a reconnect per
//!   request. Callers queued behind a connect (and its login) that failed are told its failure
//!   instead of connecting again;
//! - a member that refused our credentials is held back the same way, and while it is, the
//!   refusal is every caller's answer: users are cluster state, so the other members would
//!   refuse them too, and each login costs the server a password hash;
//! - a request that a member could not serve *and that did nothing* (never sent, or refused
//!   for want of a leader) is sent to the next member, after a pause that grows from
//!   [`FIRST_RESEND_PAUSE`]: at most one try per member, within the one request timeout. A
//!   request that may safely apply twice ([`Resend::Idempotent`]) is also sent on when the
//!   connection failed under it;
//! - while every member is failing and none is due, a request is not sent at all: the caller
//!   is told the latest cause at once, which costs the cluster nothing.
//!
//! Streams (keep-alive, watch) are opened on the member [`Members::lend`] picks, and report how
//! it went the same way.

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::time::Instant;

use super::errors::{classify, Effect, Failure, Next};
use crate::backend::{BackendError, BackendErrorKind};
use crate::health::{Admission, Health, Probe, Refusal, OUTAGE_FIRST, OUTAGE_MOST};

/// The pause before a request is sent to the next member; it doubles with each member tried.
const FIRST_RESEND_PAUSE: Duration = Duration::from_millis(5);

/// Whether a failed request is sent to the next member (each member is tried at most once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Resend {
    /// Never: one member only, for work that has retries of its own (background deletes).
    Never,
    /// When the request certainly did nothing (never sent, refused for want of a leader):
    /// for writes whose second application would differ from the first.
    IfUnapplied,
    /// Also when the connection failed under the request: for requests that may apply twice
    /// with the same result (reads, compare-and-delete, lease grants and revokes, and the
    /// attempts, which find their own key if their first send applied).
    Idempotent,
}

/// Every member of the cluster, and which one requests go to first.
pub(super) struct Members {
    members: Vec<Member>,
    /// The index of the member asked first: the last one that answered.
    preferred: AtomicUsize,
    timeout: Duration,
}

struct Member {
    endpoint: String,
    connect: ConnectOptions,
    /// Made on first use (authenticating, when the options name a user), one at a time.
    connection: tokio::sync::Mutex<Connection>,
    /// Connects (and logins) that failed so far: a caller that finds it moved while it queued
    /// for [`connection`](Self::connection) shares the failure instead of connecting again.
    failed_connects: AtomicU64,
    health: Arc<Health>,
}

#[derive(Default)]
struct Connection {
    client: Option<Client>,
    /// How the latest connect failed.
    failed: Option<Failure>,
}

/// A member's client, lent for one request or one stream. Report how it went with
/// [`answered`](Self::answered) or [`failed`](Self::failed); dropped unreported (the caller
/// went away), it reports nothing.
pub(super) struct Lent<'a> {
    members: &'a Members,
    index: usize,
    pub(super) client: Client,
    probe: Option<Probe>,
}

impl Members {
    /// The members at `endpoints`; nothing is sent until the first request.
    pub(super) fn new(endpoints: &[String], connect: &ConnectOptions, timeout: Duration) -> Self {
        let members: Vec<Member> = endpoints
            .iter()
            .map(|endpoint| Member {
                endpoint: endpoint.clone(),
                connect: connect.clone(),
                connection: tokio::sync::Mutex::default(),
                failed_connects: AtomicU64::new(0),
                health: Arc::new(Health::new(OUTAGE_FIRST, OUTAGE_MOST)),
            })
            .collect();
        // Processes start on different members, so a fleet spreads over the cluster.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_usize(members.len());
        let first = usize::try_from(hasher.finish() % members.len().max(1) as u64).unwrap_or(0);
        Members {
            members,
            preferred: AtomicUsize::new(first),
            timeout,
        }
    }

    /// The longest one request may take.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How many members have a client now (each is one connection once used).
    pub(super) fn clients(&self) -> usize {
        self.members
            .iter()
            .filter(|m| m.connection.try_lock().is_ok_and(|c| c.client.is_some()))
            .count()
    }

    /// Sends `request` under the request timeout (see the module documentation for which
    /// members it tries). `what` names the request in errors.
    pub(super) async fn call<T, F, Fut>(
        &self,
        what: &'static str,
        resend: Resend,
        mut request: F,
    ) -> Result<T, Failure>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = crate::clock::in_(self.timeout);
        let tries = match resend {
            Resend::Never => 1,
            Resend::IfUnapplied | Resend::Idempotent => self.members.len(),
        };
        let mut tried = Vec::with_capacity(tries);
        let mut pause = FIRST_RESEND_PAUSE;
        // The latest failure, marked as of unknown effect if any try's effect was unknown:
        // the request as a whole may have applied.
        let mut last: Option<Failure> = None;
        while tried.len() < tries {
            if !tried.is_empty() {
                tokio::time::sleep_until(crate::clock::in_(pause).min(deadline)).await;
                pause = pause.saturating_mul(2);
            }
            let lent = match self.lend_excluding(&tried, deadline).await {
                Ok(lent) => lent,
                Err(refused) => return Err(last.unwrap_or(refused)),
            };
            tried.push(lent.index);
            let failure =
                match tokio::time::timeout_at(deadline, request(lent.client.clone())).await {
                    Ok(Ok(value)) => {
                        lent.answered();
                        return Ok(value);
                    }
                    Ok(Err(error)) => classify(what, lent.endpoint(), error),
                    Err(_) => Failure::timed_out(what, lent.endpoint(), self.timeout),
                };
            lent.failed(&failure);
            let elsewhere = match resend {
                Resend::Never => false,
                Resend::IfUnapplied => failure.next == Next::OtherMember,
                Resend::Idempotent => failure.next == Next::OtherMember || failure.member_failed,
            };
            let failure = match &last {
                Some(earlier) if earlier.effect == Effect::Unknown => Failure {
                    effect: Effect::Unknown,
                    ..failure
                },
                _ => failure,
            };
            if !elsewhere || Instant::now() >= deadline {
                return Err(failure);
            }
            last = Some(failure);
        }
        Err(last.unwrap_or_else(|| Failure::refused(BackendError::unreachable("no etcd member"))))
    }

    /// The client of the member to use now, for a stream: the preferred one unless it is
    /// failing. `Err` without a request when every member is failing and none is due.
    pub(super) async fn lend(&self) -> Result<Lent<'_>, Failure> {
        self.lend_excluding(&[], crate::clock::in_(self.timeout))
            .await
    }

    /// The first member from the preferred one on, not in `tried`, that its gate lets through,
    /// with its client (connected now if it has none).
    async fn lend_excluding(
        &self,
        tried: &[usize],
        deadline: Instant,
    ) -> Result<Lent<'_>, Failure> {
        let count = self.members.len();
        let start = self.preferred.load(Ordering::Relaxed);
        let mut refusal = None;
        // A member that could not be connected to, for the caller if no other one can be.
        let mut unreachable = None;
        for offset in 0..count {
            let index = (start + offset) % count;
            if tried.contains(&index) {
                continue;
            }
            let member = &self.members[index];
            let probe = match member.health.admit() {
                Admission::Go => None,
                Admission::Probe(probe) => Some(probe),
                // Refused credentials are the cluster's answer, not this member's trouble.
                Admission::Refused(refused)
                    if refused.cause.kind() == BackendErrorKind::Misconfigured =>
                {
                    return Err(Failure::refused(unsent(refused)));
                }
                Admission::Refused(refused) => {
                    refusal.get_or_insert(refused);
                    continue;
                }
            };
            match member.client(deadline, self.timeout).await {
                Ok(client) => {
                    return Ok(Lent {
                        members: self,
                        index,
                        client,
                        probe,
                    })
                }
                Err(failure) => {
                    report(&member.health, probe, &failure);
                    // A failed connect is the member's gate's to pace.
                    let failure = failure.paced_by_member();
                    if failure.next != Next::OtherMember {
                        return Err(failure);
                    }
                    unreachable = Some(failure);
                }
            }
        }
        if let Some(failure) = unreachable {
            return Err(failure);
        }
        Err(Failure::refused(match refusal {
            Some(refused) => unsent(refused),
            None => BackendError::unreachable("no etcd member could be reached"),
        }))
    }

    fn prefer(&self, index: usize) {
        self.preferred.store(index, Ordering::Relaxed);
    }

    /// Moves requests off `index` if it is the preferred member.
    fn avoid(&self, index: usize) {
        let next = (index + 1) % self.members.len().max(1);
        let _ = self
            .preferred
            .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// What a caller is told when no request was sent for it: the latest cause, its kind kept
/// when it is refused credentials, and when the member is asked again.
fn unsent(refused: Refusal) -> BackendError {
    let now = Instant::now();
    let (since, next) = (
        now.saturating_duration_since(refused.since),
        refused.retry_at.saturating_duration_since(now),
    );
    if refused.cause.kind() == BackendErrorKind::Misconfigured {
        let message = format!(
            "{} (no request sent: etcd has refused them for {since:?}; the next login is in {next:?})",
            refused.cause.message(),
        );
        return refused.cause.with_message(message).paced_by_provider();
    }
    BackendError::unreachable(format!(
        "{} (no request sent: the etcd members have failed for {since:?}; the next is asked in {next:?})",
        refused.cause.message(),
    ))
    .paced_by_provider()
}

impl Member {
    /// The member's client, made now if it has none (by one caller at a time, within
    /// `deadline`; `timeout` is the request timeout, for the message). A caller that queued
    /// while a connect failed is told that failure: one connect, and one login, per turn.
    async fn client(&self, deadline: Instant, timeout: Duration) -> Result<Client, Failure> {
        let timeout = || Failure::timed_out("connection", &self.endpoint, timeout);
        let failures_before = self.failed_connects.load(Ordering::Acquire);
        let mut slot = tokio::time::timeout_at(deadline, self.connection.lock())
            .await
            .map_err(|_| timeout())?;
        if let Some(client) = slot.client.as_ref() {
            return Ok(client.clone());
        }
        if self.failed_connects.load(Ordering::Acquire) != failures_before {
            if let Some(failed) = &slot.failed {
                return Err(failed.clone());
            }
        }
        let connect = Client::connect([self.endpoint.as_str()], Some(self.connect.clone()));
        let failure = match tokio::time::timeout_at(deadline, connect).await {
            Ok(Ok(client)) => {
                slot.client = Some(client.clone());
                slot.failed = None;
                return Ok(client);
            }
            Ok(Err(error)) => classify("connection", &self.endpoint, error),
            Err(_) => timeout(),
        };
        slot.failed = Some(failure.clone());
        self.failed_connects.fetch_add(1, Ordering::AcqRel);
        Err(failure)
    }
}

impl Lent<'_> {
    /// The lent member's endpoint, for messages.
    pub(super) fn endpoint(&self) -> &str {
        &self.members.members[self.index].endpoint
    }

    /// The member answered (whatever it said): it works.
    pub(super) fn answered(self) {
        match self.probe {
            Some(probe) => {
                probe.answered();
            }
            None => {
                self.members.members[self.index].health.answered();
            }
        }
        self.members.prefer(self.index);
    }

    /// The request or stream failed with `failure`.
    pub(super) fn failed(self, failure: &Failure) {
        let member = &self.members.members[self.index];
        if failure.member_failed {
            self.members.avoid(self.index);
        }
        report(&member.health, self.probe, failure);
    }
}

/// Tells a member's gate how its request went: a failure of the member, or its refusal of
/// our credentials (not another answer of its), starts or extends its backoff.
fn report(health: &Health, probe: Option<Probe>, failure: &Failure) {
    match (failure.holds_member_back(), probe) {
        (true, Some(probe)) => probe.failed(&failure.error),
        (true, None) => {
            health.failed(&failure.error, false);
        }
        (false, Some(probe)) => {
            probe.answered();
        }
        (false, None) => {
            health.answered();
        }
    }
}
