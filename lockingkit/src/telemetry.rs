//! Spans through `tracing` and metrics through the OpenTelemetry API meter `lockingkit`.
//!
//! Nothing here depends on an OpenTelemetry SDK. Until the host installs a meter provider the
//! instruments are no-ops, and until it installs a `tracing` subscriber the spans are disabled
//! callsites. Keys are never recorded: they routinely carry customer ids. Errors are recorded by
//! kind only.
//!
//! # Wiring
//! Bridge the spans with `tracing-opentelemetry` and hand the lock a meter, either implicitly
//! (the global provider's `lockingkit` meter is taken when the lock is built, so install the
//! global provider first) or explicitly:
//!
//! ```
//! use lockingkit::{DistributedLock, MemoryBackend, MemoryStore};
//!
//! # fn demo(provider: &impl opentelemetry::metrics::MeterProvider) -> Result<(), lockingkit::LockError> {
//! let locks = DistributedLock::builder(MemoryBackend::new(MemoryStore::new()))
//!     .name("Jobs")
//!     .meter(lockingkit::telemetry::meter(provider))
//!     .build()?;
//! # let _ = locks; Ok(()) }
//! ```
//!
//! # What is recorded
//! Spans (kind client): `try_acquire {name}`, `acquire {name}` and `release {name}`, with
//! `lockingkit.lock`, `lockingkit.provider`, `lockingkit.operation`, `lockingkit.outcome`
//! (`acquired`, `busy`, `timeout`, `cancelled`, `failure`; `released` or `failure` on release),
//! `lockingkit.acquire.attempts`, `lockingkit.fencing_token`, and on failures only `error.type`
//! (the error code, such as `locking.unavailable`) and `lockingkit.error.kind`. Busy and timeout
//! are outcomes, not errors, so they leave the span status unset.
//!
//! Metrics, each with `lockingkit.lock` and `lockingkit.provider`:
//! `lockingkit.acquire.duration` (s; plus operation and outcome), `lockingkit.acquire.attempts`,
//! `lockingkit.hold.duration` (s; plus `lockingkit.end` = `released` or `lost`),
//! `lockingkit.locks.held`, `lockingkit.waiters`, `lockingkit.renewals` (plus outcome `ok` or
//! `failed`) and `lockingkit.lost` (plus `lockingkit.loss.reason`).

use crate::backend::LockMode;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter, MeterProvider, UpDownCounter};
use opentelemetry::{InstrumentationScope, KeyValue};
use tracing::field::Empty;
use tracing::Span;

use crate::error::LockError;

/// The name of the OpenTelemetry meter LockingKit records on.
pub const METER_NAME: &str = "lockingkit";

/// Why a held lock was lost, as recorded in `lockingkit.loss.reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// No renewal succeeded in time; the handle gave up before the lease could expire.
    Deadline,
    /// The backend answered that the lease is no longer ours.
    LeaseGone,
    /// The connection that held the lock failed or stopped answering.
    ConnectionLost,
}

impl LossReason {
    pub(crate) const COUNT: usize = 3;
    /// In discriminant order, so `reason as usize` indexes arrays built from it.
    pub(crate) const ALL: [LossReason; Self::COUNT] = [
        LossReason::Deadline,
        LossReason::LeaseGone,
        LossReason::ConnectionLost,
    ];

    /// The attribute value: `deadline`, `lease_gone` or `connection_lost`.
    pub const fn as_str(self) -> &'static str {
        match self {
            LossReason::Deadline => "deadline",
            LossReason::LeaseGone => "lease_gone",
            LossReason::ConnectionLost => "connection_lost",
        }
    }
}

/// Which public operation a span or measurement belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operation {
    TryAcquire,
    Acquire,
}

impl Operation {
    const COUNT: usize = 2;
    /// In discriminant order, so `operation as usize` indexes arrays built from it.
    const ALL: [Operation; Self::COUNT] = [Operation::TryAcquire, Operation::Acquire];

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Operation::TryAcquire => "try_acquire",
            Operation::Acquire => "acquire",
        }
    }
}

/// The outcome attribute of an acquire call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Acquired,
    Busy,
    Timeout,
    Cancelled,
    Failure,
}

impl Outcome {
    const COUNT: usize = 5;
    /// In discriminant order, so `outcome as usize` indexes arrays built from it.
    const ALL: [Outcome; Self::COUNT] = [
        Outcome::Acquired,
        Outcome::Busy,
        Outcome::Timeout,
        Outcome::Cancelled,
        Outcome::Failure,
    ];

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Outcome::Acquired => "acquired",
            Outcome::Busy => "busy",
            Outcome::Timeout => "timeout",
            Outcome::Cancelled => "cancelled",
            Outcome::Failure => "failure",
        }
    }

    pub(crate) fn of(result: &Result<u64, &LockError>) -> Outcome {
        match result {
            Ok(_) => Outcome::Acquired,
            Err(e) => match e.kind() {
                crate::ErrorKind::Busy => Outcome::Busy,
                crate::ErrorKind::Timeout => Outcome::Timeout,
                _ => Outcome::Failure,
            },
        }
    }
}

/// The values of `lockingkit.lock.mode`, in the order of [`mode_index`].
const MODES: [&str; 3] = ["exclusive", "shared", "semaphore"];

fn mode_index(mode: LockMode) -> usize {
    match mode {
        LockMode::Exclusive => 0,
        LockMode::Shared => 1,
        LockMode::Semaphore { .. } => 2,
    }
}

/// Every attribute set a measurement can carry, built once per lock.
///
/// The attribute values come from a handful of fixed strings, so building the sets up front
/// makes each measurement a slice borrow: no allocation and no reference-count traffic on the
/// hot path, which is what keeps the no-provider path as cheap as not recording at all.
struct AttributeSets {
    base: Box<[KeyValue]>,
    /// Indexed by `[mode_index(mode)][Operation as usize][Outcome as usize]`.
    acquire: [[[Box<[KeyValue]>; Outcome::COUNT]; Operation::COUNT]; MODES.len()],
    hold_released: Box<[KeyValue]>,
    hold_lost: Box<[KeyValue]>,
    renewal_ok: Box<[KeyValue]>,
    renewal_failed: Box<[KeyValue]>,
    /// Indexed by `LossReason as usize`.
    lost: [Box<[KeyValue]>; LossReason::COUNT],
}

impl AttributeSets {
    fn new(lock: &Arc<str>, provider: &Arc<str>) -> Self {
        let base = [
            KeyValue::new("lockingkit.lock", lock.clone()),
            KeyValue::new("lockingkit.provider", provider.clone()),
        ];
        let with =
            |extra: &[KeyValue]| -> Box<[KeyValue]> { base.iter().chain(extra).cloned().collect() };
        let acquire = MODES.map(|mode| {
            Operation::ALL.map(|operation| {
                Outcome::ALL.map(|outcome| {
                    with(&[
                        KeyValue::new("lockingkit.operation", operation.as_str()),
                        KeyValue::new("lockingkit.lock.mode", mode),
                        KeyValue::new("lockingkit.outcome", outcome.as_str()),
                    ])
                })
            })
        });
        AttributeSets {
            acquire,
            hold_released: with(&[KeyValue::new("lockingkit.end", "released")]),
            hold_lost: with(&[KeyValue::new("lockingkit.end", "lost")]),
            renewal_ok: with(&[KeyValue::new("lockingkit.outcome", "ok")]),
            renewal_failed: with(&[KeyValue::new("lockingkit.outcome", "failed")]),
            lost: LossReason::ALL
                .map(|reason| with(&[KeyValue::new("lockingkit.loss.reason", reason.as_str())])),
            base: with(&[]),
        }
    }
}

/// A keyed digest of lock keys, so that spans and log lines about one key can be correlated
/// without recording the key: the first 8 bytes of HMAC-SHA256 of the key under a secret of
/// the host's, as 16 hex digits, recorded as `lockingkit.key.digest`. Without the secret a
/// digest cannot be matched to a guessed key; with it, whoever holds the secret can.
#[derive(Clone)]
pub(crate) struct KeyDigest(hmac::Hmac<sha2::Sha256>);

impl KeyDigest {
    pub(crate) fn new(secret: &[u8]) -> Self {
        use hmac::Mac;
        // HMAC takes a key of any length, so this cannot fail; the fallback only keeps library
        // code free of panics.
        let mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap_or_else(|_| {
            <hmac::Hmac<sha2::Sha256> as hmac::digest::KeyInit>::new(&Default::default())
        });
        KeyDigest(mac)
    }

    /// The digest of `key`.
    pub(crate) fn of(&self, key: &str) -> Box<str> {
        use hmac::Mac;
        use std::fmt::Write as _;
        let mut mac = self.0.clone();
        mac.update(key.as_bytes());
        let bytes = mac.finalize().into_bytes();
        let mut hex = String::with_capacity(16);
        for byte in bytes.iter().take(8) {
            let _ = write!(hex, "{byte:02x}");
        }
        hex.into()
    }
}

/// What a loss is logged with, of the hold that ended.
#[derive(Clone, Copy)]
pub(crate) struct HoldLabels<'a> {
    pub(crate) fencing_token: u64,
    pub(crate) key_digest: Option<&'a str>,
    /// The caller's span when the lock was taken.
    pub(crate) parent: &'a Span,
}

/// The instruments and span names of one `DistributedLock`.
pub(crate) struct Telemetry {
    lock: Arc<str>,
    provider: Arc<str>,
    /// Off unless the host gave a secret (see [`KeyDigest`]).
    key_digest: Option<KeyDigest>,
    try_acquire_name: Box<str>,
    acquire_name: Box<str>,
    release_name: Box<str>,
    attributes: AttributeSets,
    acquire_duration: Histogram<f64>,
    acquire_attempts: Histogram<u64>,
    hold_duration: Histogram<f64>,
    locks_held: UpDownCounter<i64>,
    waiters: UpDownCounter<i64>,
    renewals: Counter<u64>,
    lost: Counter<u64>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("lock", &self.lock)
            .field("provider", &self.provider)
            .finish_non_exhaustive()
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope::builder(METER_NAME)
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

/// The meter LockingKit uses when the host gives none: the global provider's `lockingkit` meter.
///
/// It is taken when a lock is built, so a host that relies on it installs its global meter
/// provider before building locks; locks built earlier keep recording on the no-op meter.
pub fn global_meter() -> Meter {
    opentelemetry::global::meter_with_scope(scope())
}

/// The `lockingkit` meter of `provider` (named and versioned as LockingKit), for
/// [`DistributedLockBuilder::meter`](crate::DistributedLockBuilder::meter).
pub fn meter<P: MeterProvider + ?Sized>(provider: &P) -> Meter {
    provider.meter_with_scope(scope())
}

impl Telemetry {
    pub(crate) fn new(
        lock: &str,
        provider: &str,
        meter: &Meter,
        key_digest: Option<KeyDigest>,
    ) -> Self {
        let lock: Arc<str> = Arc::from(lock);
        let provider: Arc<str> = Arc::from(provider);
        Telemetry {
            key_digest,
            try_acquire_name: format!("try_acquire {lock}").into(),
            acquire_name: format!("acquire {lock}").into(),
            release_name: format!("release {lock}").into(),
            attributes: AttributeSets::new(&lock, &provider),
            lock,
            provider,
            acquire_duration: meter
                .f64_histogram("lockingkit.acquire.duration")
                .with_unit("s")
                .with_description("How long acquire and try_acquire calls took")
                .build(),
            acquire_attempts: meter
                .u64_histogram("lockingkit.acquire.attempts")
                .with_unit("{attempt}")
                .with_description("Backend attempts made by one acquire or try_acquire call")
                .with_boundaries(vec![0.0, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0])
                .build(),
            hold_duration: meter
                .f64_histogram("lockingkit.hold.duration")
                .with_unit("s")
                .with_description("How long locks were held, until released or lost")
                .build(),
            locks_held: meter
                .i64_up_down_counter("lockingkit.locks.held")
                .with_unit("{lock}")
                .with_description("Locks currently held")
                .build(),
            waiters: meter
                .i64_up_down_counter("lockingkit.waiters")
                .with_unit("{waiter}")
                .with_description("Local callers queued behind another caller for a key")
                .build(),
            renewals: meter
                .u64_counter("lockingkit.renewals")
                .with_unit("{renewal}")
                .with_description("Lease renewals and connection checks")
                .build(),
            lost: meter
                .u64_counter("lockingkit.lost")
                .with_unit("{lock}")
                .with_description("Locks lost while held")
                .build(),
        }
    }

    /// The provider name, shared with whoever reports on this provider besides telemetry.
    pub(crate) fn provider_shared(&self) -> Arc<str> {
        self.provider.clone()
    }

    /// The lock's registration name, shared likewise.
    pub(crate) fn lock_name_shared(&self) -> Arc<str> {
        self.lock.clone()
    }

    pub(crate) fn provider(&self) -> &str {
        &self.provider
    }

    pub(crate) fn lock_name(&self) -> &str {
        &self.lock
    }

    /// The digest of `key`, if the host asked for digests.
    pub(crate) fn key_digest(&self, key: &str) -> Option<Box<str>> {
        self.key_digest.as_ref().map(|digest| digest.of(key))
    }

    /// The span of one acquire call for `key` (recorded as its digest only, and only if the
    /// host asked for digests).
    pub(crate) fn acquire_span(&self, operation: Operation, mode: LockMode, key: &str) -> Span {
        let name: &str = match operation {
            Operation::TryAcquire => &self.try_acquire_name,
            Operation::Acquire => &self.acquire_name,
        };
        let span = tracing::info_span!(
            target: "lockingkit",
            "lockingkit.acquire",
            "otel.name" = name,
            "otel.kind" = "client",
            "otel.status_code" = Empty,
            "lockingkit.lock" = &*self.lock,
            "lockingkit.provider" = &*self.provider,
            "lockingkit.operation" = operation.as_str(),
            "lockingkit.lock.mode" = mode.as_str(),
            "lockingkit.outcome" = Empty,
            "lockingkit.acquire.attempts" = Empty,
            "lockingkit.fencing_token" = Empty,
            "lockingkit.key.digest" = Empty,
            "error.type" = Empty,
            "lockingkit.error.kind" = Empty,
        );
        if !span.is_disabled() {
            if let Some(digest) = self.key_digest(key) {
                span.record("lockingkit.key.digest", &*digest);
            }
        }
        span
    }

    pub(crate) fn release_span(&self, fencing_token: u64, key_digest: Option<&str>) -> Span {
        let span = tracing::info_span!(
            target: "lockingkit",
            "lockingkit.release",
            "otel.name" = &*self.release_name,
            "otel.kind" = "client",
            "otel.status_code" = Empty,
            "lockingkit.lock" = &*self.lock,
            "lockingkit.provider" = &*self.provider,
            "lockingkit.operation" = "release",
            "lockingkit.outcome" = Empty,
            "lockingkit.fencing_token" = Empty,
            "lockingkit.key.digest" = key_digest,
            "error.type" = Empty,
            "lockingkit.error.kind" = Empty,
        );
        record_u64(&span, "lockingkit.fencing_token", fencing_token);
        span
    }

    /// Records the end of an acquire call on its span and in the metrics.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn acquire_finished(
        &self,
        span: &Span,
        operation: Operation,
        mode: LockMode,
        outcome: Outcome,
        error: Option<&LockError>,
        attempts: u64,
        elapsed: Duration,
        fencing_token: Option<u64>,
    ) {
        if !span.is_disabled() {
            span.record("lockingkit.outcome", outcome.as_str());
            record_u64(span, "lockingkit.acquire.attempts", attempts);
            if let Some(token) = fencing_token {
                record_u64(span, "lockingkit.fencing_token", token);
            }
            // Busy and timeout are answers, not faults: only failures carry an error.
            if outcome == Outcome::Failure {
                if let Some(error) = error {
                    record_error(span, error);
                }
            }
        }
        let attrs =
            &self.attributes.acquire[mode_index(mode)][operation as usize][outcome as usize];
        self.acquire_duration.record(elapsed.as_secs_f64(), attrs);
        self.acquire_attempts
            .record(attempts, &self.attributes.base);
    }

    pub(crate) fn release_finished(&self, span: &Span, result: &Result<(), LockError>) {
        if span.is_disabled() {
            return;
        }
        match result {
            Ok(()) => {
                span.record("lockingkit.outcome", "released");
            }
            Err(error) => {
                span.record("lockingkit.outcome", "failure");
                record_error(span, error);
            }
        }
    }

    pub(crate) fn lock_taken(&self) {
        self.locks_held.add(1, &self.attributes.base);
    }

    /// A hold ended after `held_for`, lost for `lost` or released. A loss is logged under
    /// `parent` (the caller's span when the lock was taken, such as its request's), with the
    /// fencing token and the key's digest, so the line can be tied to the work it stopped.
    pub(crate) fn lock_ended(
        &self,
        held_for: Duration,
        lost: Option<LossReason>,
        hold: HoldLabels<'_>,
    ) {
        self.locks_held.add(-1, &self.attributes.base);
        let end = match lost {
            Some(_) => &self.attributes.hold_lost,
            None => &self.attributes.hold_released,
        };
        self.hold_duration.record(held_for.as_secs_f64(), end);
        if let Some(reason) = lost {
            self.lost.add(1, &self.attributes.lost[reason as usize]);
            tracing::warn!(
                target: "lockingkit",
                parent: hold.parent,
                lock = &*self.lock,
                provider = &*self.provider,
                reason = reason.as_str(),
                fencing_token = hold.fencing_token,
                key_digest = hold.key_digest,
                "lock lost while held"
            );
        }
    }

    pub(crate) fn waiter_queued(&self) {
        self.waiters.add(1, &self.attributes.base);
    }

    pub(crate) fn waiter_left(&self) {
        self.waiters.add(-1, &self.attributes.base);
    }

    pub(crate) fn renewal(&self, ok: bool) {
        let attrs = if ok {
            &self.attributes.renewal_ok
        } else {
            &self.attributes.renewal_failed
        };
        self.renewals.add(1, attrs);
    }
}

/// OpenTelemetry integers are `i64`, and `tracing-opentelemetry` turns a `u64` field into a
/// string; recording an `i64` keeps counts and tokens numeric, and the rare value beyond
/// `i64::MAX` stays exact as text.
fn record_u64(span: &Span, field: &str, value: u64) {
    if span.is_disabled() {
        return;
    }
    match i64::try_from(value) {
        Ok(value) => span.record(field, value),
        Err(_) => span.record(field, tracing::field::display(value)),
    };
}

fn record_error(span: &Span, error: &LockError) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", error.error_type());
    span.record("lockingkit.error.kind", error.kind().as_str());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_sets_cover_every_combination_in_index_order() {
        let sets = AttributeSets::new(&Arc::from("Jobs"), &Arc::from("in_memory"));
        let value = |attrs: &[KeyValue], key: &str| {
            attrs
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.as_str().into_owned())
        };
        let modes = [
            LockMode::Exclusive,
            LockMode::Shared,
            LockMode::Semaphore { max_count: 2 },
        ];
        for mode in modes {
            for operation in Operation::ALL {
                for outcome in Outcome::ALL {
                    let attrs =
                        &sets.acquire[mode_index(mode)][operation as usize][outcome as usize];
                    assert_eq!(attrs.len(), 5);
                    assert_eq!(value(attrs, "lockingkit.lock").as_deref(), Some("Jobs"));
                    assert_eq!(
                        value(attrs, "lockingkit.provider").as_deref(),
                        Some("in_memory")
                    );
                    assert_eq!(
                        value(attrs, "lockingkit.operation").as_deref(),
                        Some(operation.as_str())
                    );
                    assert_eq!(
                        value(attrs, "lockingkit.lock.mode").as_deref(),
                        Some(mode.as_str())
                    );
                    assert_eq!(
                        value(attrs, "lockingkit.outcome").as_deref(),
                        Some(outcome.as_str())
                    );
                }
            }
        }
        for reason in LossReason::ALL {
            assert_eq!(
                value(&sets.lost[reason as usize], "lockingkit.loss.reason").as_deref(),
                Some(reason.as_str())
            );
        }
        assert_eq!(sets.base.len(), 2);
    }
}
