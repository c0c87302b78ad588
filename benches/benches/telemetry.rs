//! What LockingKit's telemetry costs when nobody listens, and when someone does.
//!
//! ```text
//! cargo bench -p lockingkit-benches --bench telemetry
//! ```
//!
//! # Method
//! The workload is an in-memory `try_acquire` + `release` pair on a current-thread runtime: the
//! cheapest full trip through the engine (waiting room, attempt, keeper task spawn, release), so
//! any fixed telemetry cost shows up at its largest relative size. Real backends add 100 µs
//! (PostgreSQL) to milliseconds (Azure) per pair, against which the numbers below vanish.
//!
//! The engine has no uninstrumented build to compare against, so the no-listener cost is
//! measured two ways:
//! 1. **off**: pairs/s with no meter provider (the global no-op meter) and no `tracing`
//!    subscriber, which is what every user without telemetry runs;
//! 2. **calls alone**: the exact telemetry work the engine does per pair — two spans built with
//!    the same fields and recorded on, five measurements on the no-op instruments with the
//!    precomputed attribute sets, the clock reads — replayed in a tight loop with nothing else.
//!    Subtracting it from (1) gives the uninstrumented pair; its share of (1) is the overhead,
//!    and it is compared with the spread between samples of (1), the run-to-run noise.
//!
//! (1) and (2) run interleaved, sample after sample, so drift on this shared machine hits them
//! alike; medians are reported. They run before any subscriber exists, because `tracing` keeps
//! a callsite's interest until the next subscriber registers, and a program that never installs
//! one always takes the "nobody listens" fast path.
//!
//! For scale, **on** then measures pairs/s with an SDK meter provider (manual reader,
//! aggregation only) and a `tracing-opentelemetry` subscriber whose spans go to an exporter
//! that drops them, so it counts building and ending spans, not shipping them.
//!
//! Without `--bench` (`cargo test --all-targets`) it runs a few pairs of each mode as a smoke
//! test; it lists no tests to nextest.

use std::hint::black_box;
use std::time::Instant;

use lockingkit::{DistributedLock, MemoryBackend, MemoryStore};
use lockingkit_benches::mode::BenchMode;
use opentelemetry::metrics::{Histogram, UpDownCounter};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::{ManualReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing::field::Empty;
use tracing_subscriber::layer::SubscriberExt as _;

const KEY: &str = "bench/telemetry";

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let (pairs, samples) = mode.pick((20_000, 15), (200, 2));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime");

    let off_lock = DistributedLock::builder(MemoryBackend::new(MemoryStore::new()))
        .name("Jobs")
        .build()
        .expect("valid options");

    let replay = Replay::new();
    let mut off = Vec::new();
    let mut calls = Vec::new();
    let mut clock = Vec::new();
    for _ in 0..samples {
        off.push(runtime.block_on(pairs_per_second(&off_lock, pairs)));
        calls.push(runtime.block_on(async { replay.nanos_per_pair(pairs * 10) }));
        clock.push(runtime.block_on(async { clock_read_nanos(pairs * 10) }));
    }

    let tracer_provider = SdkTracerProvider::builder()
        .with_simple_exporter(Discard)
        .build();
    let meter_provider = SdkMeterProvider::builder()
        .with_reader(ManualReader::builder().build())
        .build();
    let on_lock = DistributedLock::builder(MemoryBackend::new(MemoryStore::new()))
        .name("Jobs")
        .meter(lockingkit::telemetry::meter(&meter_provider))
        .build()
        .expect("valid options");
    let on_subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(tracer_provider.tracer("bench")));

    let mut on = Vec::new();
    let _listening = tracing::subscriber::set_default(on_subscriber);
    for _ in 0..samples {
        on.push(runtime.block_on(pairs_per_second(&on_lock, pairs)));
    }

    let off_median = median(&mut off);
    let on_median = median(&mut on);
    let calls_median = median(&mut calls);
    let clock_median = median(&mut clock);
    let pair_ns = 1e9 / off_median;
    let spread = (off[off.len() - 1] - off[0]) / 2.0 / off_median * 100.0;
    println!(
        "telemetry bench: in-memory try_acquire+release pairs, current-thread runtime, \
         median of {samples} samples x {pairs} pairs"
    );
    println!(
        "  off (no meter provider, no subscriber): {:>9.0} pairs/s  ({pair_ns:.0} ns/pair, \
         samples within +/-{spread:.1}%)",
        off_median
    );
    println!(
        "  telemetry calls alone, nobody listening: {calls_median:>8.1} ns/pair  \
         ({:.2}% of a pair; uninstrumented ~ {:.0} pairs/s)",
        calls_median / pair_ns * 100.0,
        1e9 / (pair_ns - calls_median)
    );
    println!(
        "    of which {CLOCK_READS} clock reads for the durations: {:.1} ns \
         (one tokio::time::Instant::now() costs {clock_median:.1} ns here)",
        clock_median * f64::from(CLOCK_READS)
    );
    println!(
        "  on (SDK meter + tracing-opentelemetry): {:>9.0} pairs/s  ({:+.1}% vs off)",
        on_median,
        (on_median / off_median - 1.0) * 100.0
    );

    let _ = tracer_provider.shutdown();
    let _ = meter_provider.shutdown();
}

async fn pairs_per_second(locks: &DistributedLock, pairs: u32) -> f64 {
    let started = Instant::now();
    for _ in 0..pairs {
        let handle = locks.try_acquire(KEY).await.expect("free");
        handle.release().await.expect("confirmed");
    }
    f64::from(pairs) / started.elapsed().as_secs_f64()
}

/// Clock reads the engine makes only for telemetry: the start and end of an acquire call, and
/// the end of a hold (its start reuses the instant the acquiring request was sent).
const CLOCK_READS: u32 = 3;

fn clock_read_nanos(reads: u32) -> f64 {
    let started = Instant::now();
    for _ in 0..reads {
        black_box(tokio::time::Instant::now());
    }
    started.elapsed().as_nanos() as f64 / f64::from(reads)
}

/// A span exporter that drops what it is given.
#[derive(Debug)]
struct Discard;

impl SpanExporter for Discard {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        drop(batch);
        std::future::ready(Ok(()))
    }
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The telemetry work of one pair, as `lockingkit::telemetry` does it, on the global no-op
/// meter and with no subscriber.
struct Replay {
    base: Box<[KeyValue]>,
    acquired: Box<[KeyValue]>,
    released: Box<[KeyValue]>,
    acquire_duration: Histogram<f64>,
    acquire_attempts: Histogram<u64>,
    hold_duration: Histogram<f64>,
    locks_held: UpDownCounter<i64>,
}

impl Replay {
    fn new() -> Self {
        let meter = lockingkit::telemetry::global_meter();
        let base: Box<[KeyValue]> = Box::new([
            KeyValue::new("lockingkit.lock", "Jobs"),
            KeyValue::new("lockingkit.provider", "in_memory"),
        ]);
        let with = |extra: &[KeyValue]| base.iter().chain(extra).cloned().collect();
        Replay {
            acquired: with(&[
                KeyValue::new("lockingkit.operation", "try_acquire"),
                KeyValue::new("lockingkit.outcome", "acquired"),
            ]),
            released: with(&[KeyValue::new("lockingkit.end", "released")]),
            base,
            acquire_duration: meter.f64_histogram("lockingkit.acquire.duration").build(),
            acquire_attempts: meter.u64_histogram("lockingkit.acquire.attempts").build(),
            hold_duration: meter.f64_histogram("lockingkit.hold.duration").build(),
            locks_held: meter.i64_up_down_counter("lockingkit.locks.held").build(),
        }
    }

    fn nanos_per_pair(&self, pairs: u32) -> f64 {
        let started = Instant::now();
        for _ in 0..pairs {
            self.one_pair();
        }
        started.elapsed().as_nanos() as f64 / f64::from(pairs)
    }

    fn one_pair(&self) {
        // try_acquire: span, clock, outcome, two measurements, hold starts.
        let began = tokio::time::Instant::now();
        let span = tracing::info_span!(
            target: "lockingkit",
            "lockingkit.acquire",
            "otel.name" = black_box("try_acquire Jobs"),
            "otel.kind" = "client",
            "otel.status_code" = Empty,
            "lockingkit.lock" = "Jobs",
            "lockingkit.provider" = "in_memory",
            "lockingkit.operation" = "try_acquire",
            "lockingkit.outcome" = Empty,
            "lockingkit.acquire.attempts" = Empty,
            "lockingkit.fencing_token" = Empty,
            "error.type" = Empty,
            "lockingkit.error.kind" = Empty,
        );
        let record = black_box(span.clone());
        let _entered = span.enter();
        if !record.is_disabled() {
            record.record("lockingkit.outcome", "acquired");
        }
        drop(_entered);
        self.acquire_duration
            .record(began.elapsed().as_secs_f64(), black_box(&self.acquired));
        self.acquire_attempts.record(1, black_box(&self.base));
        let taken_at = began;
        self.locks_held.add(1, black_box(&self.base));

        // release: span, outcome, hold ends.
        let release = tracing::info_span!(
            target: "lockingkit",
            "lockingkit.release",
            "otel.name" = black_box("release Jobs"),
            "otel.kind" = "client",
            "otel.status_code" = Empty,
            "lockingkit.lock" = "Jobs",
            "lockingkit.provider" = "in_memory",
            "lockingkit.operation" = "release",
            "lockingkit.outcome" = Empty,
            "lockingkit.fencing_token" = Empty,
            "error.type" = Empty,
            "lockingkit.error.kind" = Empty,
        );
        if !release.is_disabled() {
            release.record("lockingkit.outcome", "released");
        }
        self.locks_held.add(-1, black_box(&self.base));
        self.hold_duration
            .record(taken_at.elapsed().as_secs_f64(), black_box(&self.released));
        black_box((span, release));
    }
}
