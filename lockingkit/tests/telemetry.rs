//! Telemetry as docs/telemetry.md lists it, read back through the OpenTelemetry SDK: spans bridged by
//! `tracing-opentelemetry` into the in-memory span exporter, metrics through a manual reader.
//!
//! Every test runs on a current-thread runtime with its own thread-local subscriber and its own
//! meter provider, so tests never see each other's telemetry. Lease timing runs on paused tokio
//! time, which makes durations exact.

use crate::support;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use lockingkit::backend::{LeaseTiming, LockBackend};
use lockingkit::providers::memory::RenewalFault;
use lockingkit::testing::Intercept;
use lockingkit::{DistributedLock, ErrorKind, LockHandle, LossReason, MemoryBackend, MemoryStore};
use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, Metric, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    InstrumentKind, ManualReader, Pipeline, SdkMeterProvider, Temporality,
};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use support::field_log::FieldLog;
use tracing_subscriber::layer::SubscriberExt as _;

/// A key no telemetry may ever contain; its middle part is searched for on its own too, in case
/// something recorded a fragment or an encoding of it.
const KEY: &str = "customer-7f3a91/orders/secret-5521";
const KEY_FRAGMENT: &str = "7f3a91";

// ---------------------------------------------------------------------------------------------
// Recording fixture
// ---------------------------------------------------------------------------------------------

/// The manual reader, shared between the meter provider (which owns a reader) and the test
/// (which collects from it).
#[derive(Clone, Debug)]
struct SharedReader(Arc<ManualReader>);

impl MetricReader for SharedReader {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline)
    }
    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

/// One test's telemetry pipeline: an SDK tracer and meter provider and a thread-local subscriber.
struct Recording {
    spans: InMemorySpanExporter,
    reader: SharedReader,
    meter_provider: SdkMeterProvider,
    _tracer_provider: SdkTracerProvider,
    log: FieldLog,
    _subscriber: tracing::subscriber::DefaultGuard,
}

impl Recording {
    fn start() -> Self {
        let spans = InMemorySpanExporter::default();
        let tracer_provider = SdkTracerProvider::builder()
            .with_simple_exporter(spans.clone())
            .build();
        let reader = SharedReader(Arc::new(ManualReader::builder().build()));
        let meter_provider = SdkMeterProvider::builder()
            .with_reader(reader.clone())
            .build();
        let log = FieldLog::default();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(tracer_provider.tracer("host")))
            .with(log.clone());
        Recording {
            spans,
            reader,
            meter_provider,
            _tracer_provider: tracer_provider,
            log,
            _subscriber: tracing::subscriber::set_default(subscriber),
        }
    }

    /// A lock named `Jobs` on `backend`, recording on this test's meter provider.
    fn lock_on<B: LockBackend>(&self, backend: B) -> DistributedLock {
        DistributedLock::builder(backend)
            .name("Jobs")
            .meter(lockingkit::telemetry::meter(&self.meter_provider))
            .build()
            .expect("valid options")
    }

    fn lock(&self, store: &MemoryStore) -> DistributedLock {
        self.lock_on(MemoryBackend::new(store.clone()))
    }

    /// A lock with 3 s leases: renewed every second, lost 2.7 s after the last renewal was sent.
    fn short_lease_lock(&self, store: &MemoryStore) -> DistributedLock {
        self.lock_on(MemoryBackend::with_lease(
            store.clone(),
            Duration::from_secs(3),
        ))
    }

    /// A recording, a store and a lock on it ([`Recording::lock`]).
    fn with_lock() -> (Self, MemoryStore, DistributedLock) {
        let (rec, store) = (Recording::start(), MemoryStore::new());
        let locks = rec.lock(&store);
        (rec, store, locks)
    }

    /// A recording, a store and a lock on it with 3 s leases ([`Recording::short_lease_lock`]).
    fn with_short_lease_lock() -> (Self, MemoryStore, DistributedLock) {
        let (rec, store) = (Recording::start(), MemoryStore::new());
        let locks = rec.short_lease_lock(&store);
        (rec, store, locks)
    }

    fn finished_spans(&self) -> Vec<SpanData> {
        self.spans
            .get_finished_spans()
            .expect("span exporter is up")
    }

    /// The one finished span called `name`.
    fn span(&self, name: &str) -> SpanData {
        let mut found: Vec<SpanData> = self
            .finished_spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect();
        assert_eq!(found.len(), 1, "expected one span {name:?}, got {found:#?}");
        found.remove(0)
    }

    fn spans_named(&self, name: &str) -> Vec<SpanData> {
        self.finished_spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }

    fn collect(&self) -> Metrics {
        let mut rm = ResourceMetrics::default();
        self.reader
            .collect(&mut rm)
            .expect("manual reader collects");
        Metrics(rm)
    }
}

// ---------------------------------------------------------------------------------------------
// Reading spans
// ---------------------------------------------------------------------------------------------

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn str_attr(span: &SpanData, key: &str) -> Option<String> {
    attr(span, key).map(|v| v.as_str().into_owned())
}

fn int_attr(span: &SpanData, key: &str) -> Option<i64> {
    match attr(span, key) {
        Some(Value::I64(v)) => Some(*v),
        Some(other) => panic!("{key} should be an integer, is {other:?}"),
        None => None,
    }
}

/// What every LockingKit span carries, whatever happened.
fn assert_common(span: &SpanData, operation: &str) {
    assert_eq!(span.span_kind, SpanKind::Client, "{}", span.name);
    assert_eq!(str_attr(span, "lockingkit.lock").as_deref(), Some("Jobs"));
    assert_eq!(
        str_attr(span, "lockingkit.provider").as_deref(),
        Some("in_memory")
    );
    assert_eq!(
        str_attr(span, "lockingkit.operation").as_deref(),
        Some(operation)
    );
}

/// Outcomes that are answers, not faults: no error status and no error attributes.
fn assert_no_error(span: &SpanData) {
    assert_eq!(span.status, Status::Unset, "{}", span.name);
    assert_eq!(attr(span, "error.type"), None);
    assert_eq!(attr(span, "lockingkit.error.kind"), None);
}

fn assert_error(span: &SpanData, code: &str, kind: &str) {
    assert!(
        matches!(span.status, Status::Error { .. }),
        "{} should have error status, has {:?}",
        span.name,
        span.status
    );
    assert_eq!(
        str_attr(span, "lockingkit.outcome").as_deref(),
        Some("failure")
    );
    assert_eq!(str_attr(span, "error.type").as_deref(), Some(code));
    assert_eq!(
        str_attr(span, "lockingkit.error.kind").as_deref(),
        Some(kind)
    );
}

// ---------------------------------------------------------------------------------------------
// Reading metrics
// ---------------------------------------------------------------------------------------------

struct Metrics(ResourceMetrics);

/// One data point: its full attribute set, and its value (a sum's value, a histogram's sum) and
/// count (1 for a sum).
#[derive(Debug, Clone, PartialEq)]
struct Point {
    attrs: BTreeMap<String, String>,
    value: f64,
    count: u64,
}

fn attr_map<'a>(attrs: impl Iterator<Item = &'a KeyValue>) -> BTreeMap<String, String> {
    attrs
        .map(|kv| (kv.key.to_string(), kv.value.as_str().into_owned()))
        .collect()
}

fn points_of<T: Copy + std::fmt::Debug>(
    data: &MetricData<T>,
    as_f64: impl Fn(T) -> f64,
) -> Vec<Point> {
    match data {
        MetricData::Sum(sum) => sum
            .data_points()
            .map(|p| Point {
                attrs: attr_map(p.attributes()),
                value: as_f64(p.value()),
                count: 1,
            })
            .collect(),
        MetricData::Histogram(h) => h
            .data_points()
            .map(|p| Point {
                attrs: attr_map(p.attributes()),
                value: as_f64(p.sum()),
                count: p.count(),
            })
            .collect(),
        other => panic!("unexpected aggregation {other:?}"),
    }
}

/// The kinds of instrument docs/telemetry.md names.
#[derive(Debug, PartialEq)]
enum Shape {
    F64Histogram,
    U64Histogram,
    UpDownCounter,
    Counter,
}

impl Metrics {
    fn metric(&self, name: &str) -> Option<&Metric> {
        self.0
            .scope_metrics()
            .filter(|scope| scope.scope().name() == "lockingkit")
            .flat_map(|scope| scope.metrics())
            .find(|m| m.name() == name)
    }

    fn shape(&self, name: &str) -> Shape {
        let metric = self
            .metric(name)
            .unwrap_or_else(|| panic!("no metric {name}"));
        match metric.data() {
            AggregatedMetrics::F64(MetricData::Histogram(_)) => Shape::F64Histogram,
            AggregatedMetrics::U64(MetricData::Histogram(_)) => Shape::U64Histogram,
            AggregatedMetrics::I64(MetricData::Sum(s)) if !s.is_monotonic() => Shape::UpDownCounter,
            AggregatedMetrics::U64(MetricData::Sum(s)) if s.is_monotonic() => Shape::Counter,
            other => panic!("{name} has unexpected data {other:?}"),
        }
    }

    fn points(&self, name: &str) -> Vec<Point> {
        let Some(metric) = self.metric(name) else {
            return Vec::new();
        };
        match metric.data() {
            AggregatedMetrics::F64(data) => points_of(data, |v| v),
            AggregatedMetrics::U64(data) => points_of(data, |v| v as f64),
            AggregatedMetrics::I64(data) => points_of(data, |v| v as f64),
        }
    }

    /// The point whose attributes are exactly `lockingkit.lock=Jobs`,
    /// `lockingkit.provider=<provider>` and `extra`.
    fn point_for(&self, name: &str, provider: &str, extra: &[(&str, &str)]) -> Option<Point> {
        let mut want: BTreeMap<String, String> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        want.insert("lockingkit.lock".into(), "Jobs".into());
        want.insert("lockingkit.provider".into(), provider.into());
        self.points(name).into_iter().find(|p| p.attrs == want)
    }

    fn point(&self, name: &str, extra: &[(&str, &str)]) -> Option<Point> {
        self.point_for(name, "in_memory", extra)
    }

    /// A counter's value, 0 when nothing was recorded under these attributes.
    fn value(&self, name: &str, extra: &[(&str, &str)]) -> f64 {
        self.point(name, extra).map_or(0.0, |p| p.value)
    }
}

// ---------------------------------------------------------------------------------------------
// Driving the lock
// ---------------------------------------------------------------------------------------------

/// Polls `future` once, so an acquire runs up to its first wait (queued or backing off).
async fn poll_once<F: Future>(mut future: Pin<&mut F>) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match future.as_mut().poll(cx) {
            Poll::Ready(output) => Some(output),
            Poll::Pending => None,
        })
    })
    .await
}

/// Waits until the keeper has declared `handle` lost and ended the hold (the hold's end, which
/// records the loss, is what frees the key in the provider's waiting room).
async fn loss_recorded(locks: &DistributedLock, handle: &LockHandle) {
    handle.lost_token().cancelled().await;
    for _ in 0..1000 {
        if locks.local_callers() == 0 {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the hold never ended after the loss");
}

/// Another "process" on the same store.
fn other_process(store: &MemoryStore) -> DistributedLock {
    DistributedLock::in_memory_shared(store)
}

/// A session-held backend (like PostgreSQL): the in-memory store checked every second, so a
/// failed check is `connection_lost`, under a provider name of its own.
fn session_store(store: &MemoryStore) -> Intercept<MemoryBackend> {
    Intercept::new(MemoryBackend::new(store.clone()))
        .provider("session_store")
        .timing(LeaseTiming::ConnectionHeld(Duration::from_secs(1)))
}

// ---------------------------------------------------------------------------------------------
// Spans
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn try_acquire_and_release_are_client_spans_named_after_the_lock() {
    let (rec, _store, locks) = Recording::with_lock();

    let handle = locks.try_acquire(KEY).await.expect("free");
    let token = handle.fencing_token();
    let span = rec.span("try_acquire Jobs");
    assert_common(&span, "try_acquire");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("acquired")
    );
    assert_eq!(int_attr(&span, "lockingkit.acquire.attempts"), Some(1));
    assert_eq!(
        int_attr(&span, "lockingkit.fencing_token"),
        Some(i64::try_from(token).expect("small token"))
    );

    handle.release().await.expect("confirmed");
    let span = rec.span("release Jobs");
    assert_common(&span, "release");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("released")
    );
    assert_eq!(
        int_attr(&span, "lockingkit.fencing_token"),
        Some(i64::try_from(token).expect("small token"))
    );
    assert_eq!(attr(&span, "lockingkit.acquire.attempts"), None);
}

#[tokio::test(start_paused = true)]
async fn readers_and_semaphore_holders_are_recorded_with_their_mode() {
    let (rec, _store, locks) = Recording::with_lock();

    let writer = locks.try_acquire(KEY).await.expect("free");
    let span = rec.span("try_acquire Jobs");
    assert_eq!(
        str_attr(&span, "lockingkit.lock.mode").as_deref(),
        Some("exclusive")
    );
    writer.release().await.expect("confirmed");

    let reader = locks
        .reader_writer(KEY)
        .expect("in-memory locks can be shared")
        .read(Duration::from_secs(1))
        .await
        .expect("free");
    let span = rec.span("acquire Jobs");
    assert_common(&span, "acquire");
    assert_eq!(
        str_attr(&span, "lockingkit.lock.mode").as_deref(),
        Some("shared")
    );
    reader.release().await.expect("confirmed");

    let slot = locks
        .semaphore(KEY, 2)
        .expect("in-memory semaphores")
        .try_acquire()
        .await
        .expect("a free slot");
    slot.release().await.expect("confirmed");

    let metrics = rec.collect();
    for (operation, mode) in [
        ("try_acquire", "exclusive"),
        ("acquire", "shared"),
        ("try_acquire", "semaphore"),
    ] {
        let point = metrics
            .point(
                "lockingkit.acquire.duration",
                &[
                    ("lockingkit.lock.mode", mode),
                    ("lockingkit.operation", operation),
                    ("lockingkit.outcome", "acquired"),
                ],
            )
            .unwrap_or_else(|| panic!("no {mode} {operation} duration"));
        assert_eq!(point.count, 1, "{mode}");
    }
}

#[tokio::test(start_paused = true)]
async fn acquire_span_records_attempts_and_token_of_a_wait_that_succeeds() {
    let (rec, store, locks) = Recording::with_lock();
    let holder = other_process(&store).try_acquire(KEY).await.expect("free");

    let before = store.attempts();
    let waiter = locks.acquire(KEY, Duration::from_secs(10));
    tokio::pin!(waiter);
    assert!(poll_once(waiter.as_mut()).await.is_none(), "busy at first");
    holder.release().await.expect("confirmed");
    let handle = waiter.await.expect("acquired once free");
    let attempts = store.attempts() - before;
    assert!(attempts >= 2, "one busy attempt and one that won");

    let span = rec.span("acquire Jobs");
    assert_common(&span, "acquire");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("acquired")
    );
    assert_eq!(
        int_attr(&span, "lockingkit.acquire.attempts"),
        Some(attempts as i64)
    );
    assert_eq!(
        int_attr(&span, "lockingkit.fencing_token"),
        Some(handle.fencing_token() as i64)
    );

    let metrics = rec.collect();
    let recorded = metrics
        .point("lockingkit.acquire.attempts", &[])
        .expect("attempts histogram");
    assert_eq!((recorded.count, recorded.value), (1, attempts as f64));
}

#[tokio::test(start_paused = true)]
async fn a_semaphore_wait_records_every_attempt() {
    let (rec, store, locks) = Recording::with_lock();
    let holder = other_process(&store)
        .semaphore(KEY, 1)
        .expect("in-memory semaphores")
        .try_acquire()
        .await
        .expect("free");

    let before = store.attempts();
    let semaphore = locks.semaphore(KEY, 1).expect("in-memory semaphores");
    let waiter = semaphore.acquire(Duration::from_secs(10));
    tokio::pin!(waiter);
    assert!(poll_once(waiter.as_mut()).await.is_none(), "full at first");
    holder.release().await.expect("confirmed");
    let _slot = waiter.await.expect("a slot once one is free");
    let attempts = store.attempts() - before;
    assert!(attempts >= 2, "one answered 'full' and one that won");
    let span = rec.span("acquire Jobs");
    assert_eq!(
        int_attr(&span, "lockingkit.acquire.attempts"),
        Some(attempts as i64)
    );
}

#[tokio::test(start_paused = true)]
async fn busy_is_an_outcome_not_an_error() {
    let (rec, store, locks) = Recording::with_lock();
    let _elsewhere = other_process(&store).try_acquire(KEY).await.expect("free");

    let err = locks.try_acquire(KEY).await.expect_err("held elsewhere");
    assert_eq!(err.kind(), ErrorKind::Busy);
    let span = rec.span("try_acquire Jobs");
    assert_common(&span, "try_acquire");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("busy")
    );
    assert_eq!(int_attr(&span, "lockingkit.acquire.attempts"), Some(1));
    assert_eq!(attr(&span, "lockingkit.fencing_token"), None);
}

#[tokio::test(start_paused = true)]
async fn busy_through_the_same_lock_makes_no_backend_attempt() {
    let (rec, _store, locks) = Recording::with_lock();
    let _held = locks.try_acquire(KEY).await.expect("free");

    let err = locks.try_acquire(KEY).await.expect_err("not reentrant");
    assert_eq!(err.kind(), ErrorKind::Busy);
    let spans = rec.spans_named("try_acquire Jobs");
    let busy = spans
        .iter()
        .find(|s| str_attr(s, "lockingkit.outcome").as_deref() == Some("busy"))
        .expect("a busy span");
    assert_no_error(busy);
    assert_eq!(int_attr(busy, "lockingkit.acquire.attempts"), Some(0));
}

#[tokio::test(start_paused = true)]
async fn timeout_is_an_outcome_not_an_error() {
    let (rec, store, locks) = Recording::with_lock();
    let _elsewhere = other_process(&store).try_acquire(KEY).await.expect("free");

    let before = store.attempts();
    let err = locks
        .acquire(KEY, Duration::from_secs(1))
        .await
        .expect_err("stays busy");
    assert_eq!(err.kind(), ErrorKind::Timeout);
    let attempts = store.attempts() - before;

    let span = rec.span("acquire Jobs");
    assert_common(&span, "acquire");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("timeout")
    );
    assert_eq!(
        int_attr(&span, "lockingkit.acquire.attempts"),
        Some(attempts as i64)
    );
    assert!(attempts >= 2, "it retried: {attempts}");

    let metrics = rec.collect();
    let duration = metrics
        .point(
            "lockingkit.acquire.duration",
            &[
                ("lockingkit.lock.mode", "exclusive"),
                ("lockingkit.operation", "acquire"),
                ("lockingkit.outcome", "timeout"),
            ],
        )
        .expect("duration of the timed-out wait");
    assert_eq!(duration.count, 1);
    assert!(
        (duration.value - 1.0).abs() < 1e-3,
        "waited the whole timeout on the paused clock: {}",
        duration.value
    );
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_backend_is_a_failure_with_error_type_and_kind() {
    let (rec, store, locks) = Recording::with_lock();
    store.set_unavailable(true);

    let err = locks.try_acquire(KEY).await.expect_err("down");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    let span = rec.span("try_acquire Jobs");
    assert_common(&span, "try_acquire");
    assert_error(&span, "locking.unavailable", "unavailable");
    assert_eq!(int_attr(&span, "lockingkit.acquire.attempts"), Some(1));
    assert_eq!(attr(&span, "lockingkit.fencing_token"), None);

    let err = locks
        .acquire(KEY, Duration::from_secs(1))
        .await
        .expect_err("down for the whole wait");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    let span = rec.span("acquire Jobs");
    assert_common(&span, "acquire");
    assert_error(&span, "locking.unavailable", "unavailable");

    let metrics = rec.collect();
    for operation in ["try_acquire", "acquire"] {
        let point = metrics
            .point(
                "lockingkit.acquire.duration",
                &[
                    ("lockingkit.lock.mode", "exclusive"),
                    ("lockingkit.operation", operation),
                    ("lockingkit.outcome", "failure"),
                ],
            )
            .expect("failure duration");
        assert_eq!(point.count, 1, "{operation}");
    }
}

#[tokio::test(start_paused = true)]
async fn an_invalid_key_is_a_failure_without_attempts() {
    let rec = Recording::start();
    let locks = rec.lock(&MemoryStore::new());

    let err = locks.try_acquire("").await.expect_err("empty key");
    assert_eq!(err.kind(), ErrorKind::InvalidKey);
    let span = rec.span("try_acquire Jobs");
    assert_error(&span, "locking.invalid_key", "invalid_key");
    assert_eq!(int_attr(&span, "lockingkit.acquire.attempts"), Some(0));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_acquire_queued_behind_a_local_holder_is_cancelled() {
    let (rec, _store, locks) = Recording::with_lock();
    let _held = locks.try_acquire(KEY).await.expect("free");

    {
        let waiter = locks.acquire(KEY, Duration::from_secs(30));
        tokio::pin!(waiter);
        assert!(poll_once(waiter.as_mut()).await.is_none(), "queued");
        assert_eq!(rec.collect().value("lockingkit.waiters", &[]), 1.0);
    }

    let span = rec.span("acquire Jobs");
    assert_common(&span, "acquire");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("cancelled")
    );
    assert_eq!(int_attr(&span, "lockingkit.acquire.attempts"), Some(0));

    let metrics = rec.collect();
    assert_eq!(metrics.value("lockingkit.waiters", &[]), 0.0);
    let cancelled = metrics
        .point(
            "lockingkit.acquire.duration",
            &[
                ("lockingkit.lock.mode", "exclusive"),
                ("lockingkit.operation", "acquire"),
                ("lockingkit.outcome", "cancelled"),
            ],
        )
        .expect("cancelled duration");
    assert_eq!(cancelled.count, 1);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_acquire_that_was_retrying_is_cancelled_with_its_attempts() {
    let (rec, store, locks) = Recording::with_lock();
    let _elsewhere = other_process(&store).try_acquire(KEY).await.expect("free");

    let before = store.attempts();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(500),
        locks.acquire(KEY, Duration::from_secs(30)),
    )
    .await;
    assert!(gave_up.is_err(), "the caller's own timeout dropped it");
    let attempts = store.attempts() - before;
    assert!(attempts >= 2, "it had retried: {attempts}");

    let span = rec.span("acquire Jobs");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("cancelled")
    );
    assert_eq!(
        int_attr(&span, "lockingkit.acquire.attempts"),
        Some(attempts as i64)
    );
    let metrics = rec.collect();
    let histogram = metrics
        .point("lockingkit.acquire.attempts", &[])
        .expect("attempts histogram");
    assert_eq!((histogram.count, histogram.value), (1, attempts as f64));
}

#[tokio::test(start_paused = true)]
async fn a_release_the_backend_refuses_is_a_failure_span() {
    let (rec, store, locks) = Recording::with_lock();
    let handle = locks.try_acquire(KEY).await.expect("free");
    assert!(store.break_lease(KEY));

    let err = handle.release().await.expect_err("lease was broken");
    assert_eq!(err.kind(), ErrorKind::Lost);
    let span = rec.span("release Jobs");
    assert_common(&span, "release");
    assert_error(&span, "locking.lost", "lost");
}

#[tokio::test(start_paused = true)]
async fn releasing_a_lock_already_lost_is_a_failure_span() {
    let (rec, store, locks) = Recording::with_short_lease_lock();
    let handle = locks.try_acquire(KEY).await.expect("free");
    assert!(store.break_lease(KEY));
    loss_recorded(&locks, &handle).await;

    let err = handle.release().await.expect_err("already lost");
    assert_eq!(err.kind(), ErrorKind::Lost);
    let span = rec.span("release Jobs");
    assert_common(&span, "release");
    assert_error(&span, "locking.lost", "lost");
}

#[tokio::test(start_paused = true)]
async fn dropping_a_handle_records_the_background_release() {
    let (rec, _store, locks) = Recording::with_lock();
    let handle = locks.try_acquire(KEY).await.expect("free");
    let token = handle.fencing_token();
    drop(handle);

    // The next local waiter gets its turn only once the background release has finished.
    let next = locks
        .acquire(KEY, Duration::from_secs(5))
        .await
        .expect("free after the release");
    let span = rec.span("release Jobs");
    assert_common(&span, "release");
    assert_no_error(&span);
    assert_eq!(
        str_attr(&span, "lockingkit.outcome").as_deref(),
        Some("released")
    );
    assert_eq!(
        int_attr(&span, "lockingkit.fencing_token"),
        Some(token as i64)
    );
    drop(next);
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn every_instrument_has_the_specified_name_shape_and_unit() {
    let (rec, store, locks) = Recording::with_short_lease_lock();
    let handle = locks.try_acquire(KEY).await.expect("free");
    {
        let waiter = locks.acquire(KEY, Duration::from_secs(30));
        tokio::pin!(waiter);
        assert!(poll_once(waiter.as_mut()).await.is_none(), "queued");
    }
    tokio::time::sleep(Duration::from_millis(1500)).await; // one renewal
    assert!(store.break_lease(KEY));
    loss_recorded(&locks, &handle).await;

    let metrics = rec.collect();
    let expected = [
        ("lockingkit.acquire.duration", Shape::F64Histogram, "s"),
        (
            "lockingkit.acquire.attempts",
            Shape::U64Histogram,
            "{attempt}",
        ),
        ("lockingkit.hold.duration", Shape::F64Histogram, "s"),
        ("lockingkit.locks.held", Shape::UpDownCounter, "{lock}"),
        ("lockingkit.waiters", Shape::UpDownCounter, "{waiter}"),
        ("lockingkit.renewals", Shape::Counter, "{renewal}"),
        ("lockingkit.lost", Shape::Counter, "{lock}"),
    ];
    for (name, shape, unit) in &expected {
        let metric = metrics.metric(name).unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(&metrics.shape(name), shape, "{name}");
        assert_eq!(metric.unit(), *unit, "{name}");
        assert!(!metric.description().is_empty(), "{name} is described");
        for point in metrics.points(name) {
            assert_eq!(point.attrs["lockingkit.lock"], "Jobs", "{name}");
            assert_eq!(point.attrs["lockingkit.provider"], "in_memory", "{name}");
        }
    }
    let names: Vec<&str> = metrics
        .0
        .scope_metrics()
        .flat_map(|s| s.metrics())
        .map(|m| m.name())
        .collect();
    assert_eq!(
        names.len(),
        expected.len(),
        "no unlisted metrics: {names:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_released_hold_is_measured_and_leaves_locks_held() {
    let (rec, _store, locks) = Recording::with_lock();

    let handle = locks.try_acquire(KEY).await.expect("free");
    let metrics = rec.collect();
    assert_eq!(metrics.value("lockingkit.locks.held", &[]), 1.0);
    let acquired = metrics
        .point(
            "lockingkit.acquire.duration",
            &[
                ("lockingkit.lock.mode", "exclusive"),
                ("lockingkit.operation", "try_acquire"),
                ("lockingkit.outcome", "acquired"),
            ],
        )
        .expect("acquire duration");
    assert_eq!(acquired.count, 1);
    assert_eq!(acquired.value, 0.0, "no time passes on the paused clock");
    assert_eq!(metrics.points("lockingkit.hold.duration"), vec![]);

    tokio::time::sleep(Duration::from_secs(5)).await;
    handle.release().await.expect("confirmed");

    let metrics = rec.collect();
    assert_eq!(metrics.value("lockingkit.locks.held", &[]), 0.0);
    let hold = metrics
        .point(
            "lockingkit.hold.duration",
            &[("lockingkit.end", "released")],
        )
        .expect("hold duration");
    assert_eq!(hold.count, 1);
    assert!((hold.value - 5.0).abs() < 1e-6, "held 5 s: {}", hold.value);
    assert_eq!(
        metrics.point("lockingkit.hold.duration", &[("lockingkit.end", "lost")]),
        None
    );
    assert_eq!(metrics.points("lockingkit.lost"), vec![]);
    assert_eq!(
        metrics.points("lockingkit.renewals"),
        vec![],
        "a 30 s lease is first renewed at 10 s"
    );
}

#[tokio::test(start_paused = true)]
async fn waiters_counts_local_callers_queued_for_a_key() {
    let (rec, _store, locks) = Recording::with_lock();
    let holder = locks.try_acquire(KEY).await.expect("free");

    let first = locks.acquire(KEY, Duration::from_secs(30));
    let second = locks.acquire(KEY, Duration::from_secs(30));
    tokio::pin!(first, second);
    assert!(poll_once(first.as_mut()).await.is_none());
    assert!(poll_once(second.as_mut()).await.is_none());
    assert_eq!(rec.collect().value("lockingkit.waiters", &[]), 2.0);

    holder.release().await.expect("confirmed");
    let handle = first.await.expect("next in line");
    assert_eq!(rec.collect().value("lockingkit.waiters", &[]), 1.0);

    handle.release().await.expect("confirmed");
    let last = second.await.expect("last in line");
    let metrics = rec.collect();
    assert_eq!(metrics.value("lockingkit.waiters", &[]), 0.0);
    assert_eq!(metrics.value("lockingkit.locks.held", &[]), 1.0);
    drop(last);
}

#[tokio::test(start_paused = true)]
async fn renewals_are_counted_and_failing_renewals_end_in_a_deadline_loss() {
    let (rec, store, locks) = Recording::with_short_lease_lock();
    let handle = locks.try_acquire(KEY).await.expect("free");

    // Renewals at 1 s and 2 s succeed; from 2.5 s on they fail, so the lock is lost 2.7 s
    // after the last successful renewal was sent: at 4.7 s.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        rec.collect()
            .value("lockingkit.renewals", &[("lockingkit.outcome", "ok")]),
        2.0
    );
    store.set_renewal_fault(RenewalFault::Fail);
    loss_recorded(&locks, &handle).await;
    assert_eq!(handle.loss_reason(), Some(LossReason::Deadline));

    let metrics = rec.collect();
    assert_eq!(
        metrics.value("lockingkit.renewals", &[("lockingkit.outcome", "ok")]),
        2.0
    );
    assert!(metrics.value("lockingkit.renewals", &[("lockingkit.outcome", "failed")]) >= 1.0);
    assert_eq!(
        metrics.value("lockingkit.lost", &[("lockingkit.loss.reason", "deadline")]),
        1.0
    );
    assert_eq!(
        metrics.points("lockingkit.lost").len(),
        1,
        "one reason only"
    );
    let hold = metrics
        .point("lockingkit.hold.duration", &[("lockingkit.end", "lost")])
        .expect("hold ended by loss");
    assert_eq!(hold.count, 1);
    assert!(
        (hold.value - 4.7).abs() < 1e-6,
        "lost at 4.7 s: {}",
        hold.value
    );
    assert_eq!(metrics.value("lockingkit.locks.held", &[]), 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_hung_renewal_is_lost_at_the_deadline_and_counted_as_failed() {
    let (rec, store, locks) = Recording::with_short_lease_lock();
    store.set_renewal_fault(RenewalFault::Hang);
    let handle = locks.try_acquire(KEY).await.expect("free");

    loss_recorded(&locks, &handle).await;
    let metrics = rec.collect();
    assert_eq!(
        metrics.value("lockingkit.renewals", &[("lockingkit.outcome", "failed")]),
        1.0,
        "the renewal sent at 1 s never answered"
    );
    assert_eq!(
        metrics.value("lockingkit.renewals", &[("lockingkit.outcome", "ok")]),
        0.0
    );
    assert_eq!(
        metrics.value("lockingkit.lost", &[("lockingkit.loss.reason", "deadline")]),
        1.0
    );
    let hold = metrics
        .point("lockingkit.hold.duration", &[("lockingkit.end", "lost")])
        .expect("hold ended by loss");
    assert!(
        (hold.value - 2.7).abs() < 1e-6,
        "lost at 2.7 s: {}",
        hold.value
    );
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_backend_while_held_is_a_deadline_loss() {
    let (rec, store, locks) = Recording::with_short_lease_lock();
    let handle = locks.try_acquire(KEY).await.expect("free");
    store.set_unavailable(true);

    loss_recorded(&locks, &handle).await;
    let metrics = rec.collect();
    assert_eq!(
        metrics.value("lockingkit.lost", &[("lockingkit.loss.reason", "deadline")]),
        1.0
    );
    assert!(metrics.value("lockingkit.renewals", &[("lockingkit.outcome", "failed")]) >= 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_broken_lease_is_lost_with_reason_lease_gone() {
    let (rec, store, locks) = Recording::with_short_lease_lock();
    let handle = locks.try_acquire(KEY).await.expect("free");
    assert!(store.break_lease(KEY));

    loss_recorded(&locks, &handle).await;
    assert_eq!(handle.loss_reason(), Some(LossReason::LeaseGone));
    let metrics = rec.collect();
    assert_eq!(
        metrics.value(
            "lockingkit.lost",
            &[("lockingkit.loss.reason", "lease_gone")]
        ),
        1.0
    );
    assert_eq!(
        metrics.value("lockingkit.renewals", &[("lockingkit.outcome", "failed")]),
        1.0
    );
    let hold = metrics
        .point("lockingkit.hold.duration", &[("lockingkit.end", "lost")])
        .expect("hold ended by loss");
    assert!(
        (hold.value - 1.0).abs() < 1e-6,
        "lost at the first renewal: {}",
        hold.value
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_connection_check_is_lost_with_reason_connection_lost() {
    let rec = Recording::start();
    let store = MemoryStore::new();
    let locks = rec.lock_on(session_store(&store));
    let handle = locks.try_acquire(KEY).await.expect("free");
    tokio::time::sleep(Duration::from_millis(1500)).await; // one good check
    store.set_unavailable(true);

    loss_recorded(&locks, &handle).await;
    assert_eq!(handle.loss_reason(), Some(LossReason::ConnectionLost));
    let metrics = rec.collect();
    let lost = metrics
        .point_for(
            "lockingkit.lost",
            "session_store",
            &[("lockingkit.loss.reason", "connection_lost")],
        )
        .expect("connection_lost recorded under the backend's provider name");
    assert_eq!(lost.value, 1.0);
    let checks = |outcome| {
        metrics
            .point_for(
                "lockingkit.renewals",
                "session_store",
                &[("lockingkit.outcome", outcome)],
            )
            .map(|p| p.value)
    };
    assert_eq!(checks("ok"), Some(1.0));
    assert_eq!(checks("failed"), Some(1.0));
}

// ---------------------------------------------------------------------------------------------
// Keys are never recorded
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn the_key_appears_in_no_span_event_or_metric() {
    let (rec, store, locks) = Recording::with_short_lease_lock();
    let elsewhere = other_process(&store);

    // acquired, busy (local and remote), timeout, cancelled, failure, released, dropped,
    // renewed, lost (lease gone, deadline), release of a lost lock.
    let handle = locks.try_acquire(KEY).await.expect("free");
    let _ = locks.try_acquire(KEY).await.expect_err("busy locally");
    {
        let waiter = locks.acquire(KEY, Duration::from_secs(30));
        tokio::pin!(waiter);
        assert!(poll_once(waiter.as_mut()).await.is_none());
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    handle.release().await.expect("confirmed");

    let remote = elsewhere.try_acquire(KEY).await.expect("free");
    let _ = locks.try_acquire(KEY).await.expect_err("busy remotely");
    let _ = locks
        .acquire(KEY, Duration::from_millis(300))
        .await
        .expect_err("timeout");
    remote.release().await.expect("confirmed");

    let dropped = locks.try_acquire(KEY).await.expect("free");
    drop(dropped);
    let handle = locks
        .acquire(KEY, Duration::from_secs(1))
        .await
        .expect("free after the background release");
    assert!(store.break_lease(KEY));
    loss_recorded(&locks, &handle).await;
    let _ = handle.release().await.expect_err("already lost");

    let handle = locks.try_acquire(KEY).await.expect("free");
    store.set_renewal_fault(RenewalFault::Fail);
    loss_recorded(&locks, &handle).await;
    store.set_renewal_fault(RenewalFault::None);

    store.set_unavailable(true);
    let _ = locks.try_acquire(KEY).await.expect_err("down");
    store.set_unavailable(false);

    let mut recorded = format!("{:#?}", rec.finished_spans());
    recorded.push_str(&format!("{:#?}", rec.collect().0));
    recorded.push_str(&rec.log.text());

    // The dump really holds what happened, so the search below cannot pass on an empty string.
    for expected in [
        "try_acquire Jobs",
        "acquire Jobs",
        "release Jobs",
        "\"cancelled\"",
        "\"timeout\"",
        "\"busy\"",
        "locking.unavailable",
        "lease_gone",
        "deadline",
        "lock lost while held",
        "renewal failed",
        "lockingkit.hold.duration",
    ] {
        assert!(recorded.contains(expected), "dump lacks {expected:?}");
    }
    assert!(!recorded.contains(KEY), "the key was recorded");
    assert!(
        !recorded.contains(KEY_FRAGMENT),
        "part of the key was recorded"
    );
}

/// The digest of `key` under `secret` as the docs define it: the first 8 bytes of
/// HMAC-SHA256, as 16 lowercase hex digits.
fn reference_digest(secret: &[u8], key: &str) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("any key length");
    mac.update(key.as_bytes());
    mac.finalize().into_bytes()[..8]
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn key_digests_correlate_spans_and_loss_lines_without_recording_the_key() {
    let rec = Recording::start();
    let store = MemoryStore::new();
    let locks = DistributedLock::builder(MemoryBackend::with_lease(
        store.clone(),
        Duration::from_secs(3),
    ))
    .name("Jobs")
    .meter(lockingkit::telemetry::meter(&rec.meter_provider))
    .key_digests("correlation-secret")
    .build()
    .expect("valid options");
    let digest = reference_digest(b"correlation-secret", KEY);
    assert_eq!(digest.len(), 16);

    let handle = locks.try_acquire(KEY).await.expect("free");
    assert_eq!(handle.key_digest(), Some(digest.as_str()));
    assert!(store.break_lease(KEY));
    loss_recorded(&locks, &handle).await;
    let spans = rec.finished_spans();
    let acquire = spans
        .iter()
        .find(|span| span.name == "try_acquire Jobs")
        .expect("the acquire span");
    assert_eq!(
        str_attr(acquire, "lockingkit.key.digest").as_deref(),
        Some(digest.as_str())
    );
    let log = rec.log.text();
    let loss = log
        .lines()
        .find(|line| line.contains("lock lost while held"))
        .expect("the loss line");
    assert!(loss.contains(&format!("key_digest=\"{digest}\"")), "{loss}");
    assert!(
        loss.contains(&format!("fencing_token={}", handle.fencing_token())),
        "{loss}"
    );
    let recorded = format!("{spans:#?}{log}");
    assert!(!recorded.contains(KEY) && !recorded.contains(KEY_FRAGMENT));

    // Without a secret nothing is recorded: the digest is opt-in.
    let plain = rec.lock(&store);
    let handle = plain.try_acquire("other").await.expect("free");
    assert_eq!(handle.key_digest(), None);
}

/// The level of each event and the name of the span it was logged in, for tests of where a
/// line belongs.
#[derive(Clone, Default)]
struct EventSpans(Arc<std::sync::Mutex<Vec<EventSpan>>>);

/// An event's level and the name of its span.
type EventSpan = (tracing::Level, Option<String>);

impl<S> tracing_subscriber::Layer<S> for EventSpans
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let span = ctx.event_span(event).map(|span| span.name().to_owned());
        self.0
            .lock()
            .expect("event log")
            .push((*event.metadata().level(), span));
    }
}

#[tokio::test(start_paused = true)]
async fn a_loss_is_logged_in_the_span_the_lock_was_taken_in() {
    use tracing::Instrument;

    let events = EventSpans::default();
    let _subscriber = tracing::subscriber::set_default(
        tracing_subscriber::registry()
            .with(events.clone())
            .with(tracing_subscriber::filter::LevelFilter::INFO),
    );
    let store = MemoryStore::new();
    let locks = DistributedLock::builder(MemoryBackend::with_lease(
        store.clone(),
        Duration::from_secs(3),
    ))
    .build()
    .expect("valid options");
    let request = tracing::info_span!("request");
    let handle = locks
        .try_acquire("k")
        .instrument(request.clone())
        .await
        .expect("free");
    drop(request);
    assert!(store.break_lease("k"));
    loss_recorded(&locks, &handle).await;
    // The keeper that declares the loss runs in a task of its own, outside any span: the line
    // is tied to the request through the span the lock was taken in.
    let events = events.0.lock().expect("event log").clone();
    let warnings: Vec<_> = events
        .iter()
        .filter(|(level, _)| *level == tracing::Level::WARN)
        .collect();
    assert_eq!(
        warnings,
        [&(tracing::Level::WARN, Some("request".to_owned()))],
        "{events:?}"
    );
}
