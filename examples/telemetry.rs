//! A host wiring LockingKit's telemetry: `tracing` spans bridged to OpenTelemetry by
//! `tracing-opentelemetry`, metrics on the OpenTelemetry meter `lockingkit`, and both printed by
//! the stdout exporters. Swap the exporters for OTLP ones in production; nothing else changes.
//!
//! ```text
//! cargo run -p lockingkit-examples --example telemetry
//! ```
//!
//! The spans (`try_acquire Jobs`, `acquire Jobs`, `release Jobs`) and the metrics
//! (`lockingkit.acquire.duration`, `lockingkit.locks.held`, …) never carry the lock key.

use std::time::Duration;

use lockingkit::{DistributedLock, ErrorKind, MemoryBackend, MemoryStore};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::Instrument as _;
use tracing_subscriber::layer::SubscriberExt as _;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let resource = Resource::builder()
        .with_service_name("lockingkit-telemetry-example")
        .build();
    let tracer_provider = SdkTracerProvider::builder()
        .with_resource(resource.clone())
        .with_simple_exporter(opentelemetry_stdout::SpanExporter::default())
        .build();
    let meter_provider = SdkMeterProvider::builder()
        .with_resource(resource)
        .with_periodic_exporter(opentelemetry_stdout::MetricExporter::default())
        .build();

    // Spans: LockingKit emits them through `tracing`; the bridge turns them into OpenTelemetry
    // client spans, nested under whatever span the caller is in.
    let subscriber = tracing_subscriber::registry().with(
        tracing_opentelemetry::layer().with_tracer(tracer_provider.tracer("telemetry-example")),
    );
    tracing::subscriber::set_global_default(subscriber)?;

    // Metrics: either install the global provider *before* building locks (they take the
    // global `lockingkit` meter when built) …
    opentelemetry::global::set_meter_provider(meter_provider.clone());
    let store = MemoryStore::new();
    let worker_a = DistributedLock::in_memory_shared(&store);
    // … or hand a lock its meter explicitly, which also lets a library keep its own provider.
    let worker_b = DistributedLock::builder(MemoryBackend::new(store.clone()))
        .name("Jobs")
        .meter(lockingkit::telemetry::meter(&meter_provider))
        .build()?;

    async {
        // acquired
        let export = worker_b
            .acquire("jobs/nightly-export", Duration::from_secs(5))
            .await?;
        eprintln!("B holds the lock, fencing token {}", export.fencing_token());

        // busy through another "process", then a timed-out wait: outcomes, not errors
        let busy = worker_a.try_acquire("jobs/nightly-export").await;
        eprintln!(
            "A try_acquire: {:?}",
            busy.map(|_| ()).map_err(|e| e.kind())
        );
        let waited = worker_a
            .acquire("jobs/nightly-export", Duration::from_millis(200))
            .await;
        assert!(matches!(waited, Err(ref e) if e.kind() == ErrorKind::Timeout));
        eprintln!("A acquire: timed out");

        // confirmed release, then a handle dropped without release (released in the background)
        export.release().await?;
        let dropped = worker_a.try_acquire("jobs/nightly-export").await?;
        drop(dropped);

        // a wait dropped by the caller's own timeout: outcome `cancelled`
        let _held = worker_b.try_acquire("orders/42").await?;
        let cancelled = tokio::time::timeout(
            Duration::from_millis(100),
            worker_b.acquire("orders/42", Duration::from_secs(30)),
        )
        .await;
        eprintln!(
            "B acquire of a key B holds, dropped: {}",
            cancelled.is_err()
        );
        Ok::<_, lockingkit::LockError>(())
    }
    .instrument(tracing::info_span!("nightly_export"))
    .await?;

    // Flush before exit: the span exporter is synchronous, the metric reader exports its last
    // collection on shutdown.
    tracer_provider.shutdown()?;
    meter_provider.shutdown()?;
    Ok(())
}
