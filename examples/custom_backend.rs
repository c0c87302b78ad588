//! Your own lock backend, end to end: lock files on the local filesystem (see `file_lock.rs`),
//! registered as the provider `file`, selected by configuration and used through
//! `DistributedLock` like any built-in provider.
//!
//! ```text
//! cargo run -p lockingkit-examples --example custom_backend
//! ```
//!
//! The backend only answers one attempt, renew and release. Waiting, renewal in the
//! background, loss detection, release on drop, errors and telemetry all come from the engine.
//! A second operating-system process takes part too: it takes a lock and exits without
//! releasing, and its lease simply runs out.

mod file_lock;

use std::error::Error;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use config::{Config, File, FileFormat};
use file_lock::{FileLockBackend, PROVIDER};
use lockingkit::{ErrorKind, Locking, LockingConfig};

/// The lease is short so the example shows renewals and expiry within seconds.
fn configuration(directory: &Path) -> String {
    format!(
        r#"
[Locking.Default]
provider = "file"
directory = '{}'
lease_duration = "2s"
min_retry_delay = "20ms"
max_retry_delay = "200ms"
"#,
        directory.display()
    )
}

/// One "process": a registry whose Default provider is the file backend.
fn start(directory: &Path) -> Result<Locking, Box<dyn Error>> {
    let config: LockingConfig = Config::builder()
        .add_source(File::from_str(&configuration(directory), FileFormat::Toml))
        .build()?
        .get("Locking")?;
    let locking = Locking::builder()
        .custom_provider(PROVIDER, FileLockBackend::from_section)
        .config(config)
        .build()?;
    Ok(locking)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    if let (Some(role), Some(directory)) = (args.next(), args.next()) {
        if role == "hold-and-vanish" {
            return hold_and_vanish(Path::new(&directory)).await;
        }
    }

    let directory =
        std::env::temp_dir().join(format!("lockingkit-custom-backend-{}", std::process::id()));
    let result = tour(&directory).await;
    let _ = std::fs::remove_dir_all(&directory);
    result
}

async fn tour(directory: &Path) -> Result<(), Box<dyn Error>> {
    // Two registries on one directory behave like two service instances.
    let worker_a = start(directory)?;
    let worker_b = start(directory)?;
    let a = worker_a.default_lock();
    let b = worker_b.default_lock();
    println!("provider {} on {}", a.name(), a.provider());

    // 1. One attempt: held, or busy for everyone else.
    let report = a.try_acquire("reports/daily").await?;
    let lock_file = FileLockBackend::lock_file_in(directory, "reports/daily");
    println!(
        "A holds reports/daily (fencing token {}), record: {}",
        report.fencing_token(),
        std::fs::read_to_string(&lock_file)?.trim()
    );
    match b.try_acquire("reports/daily").await {
        Err(e) if e.kind() == ErrorKind::Busy => println!("B: {e}"),
        other => println!("B: unexpected {other:?}"),
    }

    // 2. The engine renews the 2 s lease in the background while A works for 5 s, and B
    //    waits; when A releases, B gets the lock with a higher token.
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.acquire("reports/daily", Duration::from_secs(30)).await }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!(
        "after 5 s (2.5 leases) A still holds it: {}",
        report.is_held()
    );
    let first = report.fencing_token();
    report.release().await?;
    let report = waiter.await??;
    println!(
        "B got it after A released: token {} > {first}",
        report.fencing_token()
    );
    report.release().await?;

    // 3. A holder that vanishes without releasing: its lease runs out and the lock is free
    //    again, with a higher fencing token.
    let status = Command::new(std::env::current_exe()?)
        .arg("hold-and-vanish")
        .arg(directory)
        .status()?;
    println!("the other process exited ({status}) holding exports/weekly");
    let started = Instant::now();
    let export = a.acquire("exports/weekly", Duration::from_secs(10)).await?;
    println!(
        "A got exports/weekly {:.1?} later, once the lease ran out (token {})",
        started.elapsed(),
        export.fencing_token()
    );
    export.release().await?;

    // 4. Bad options are found at startup, all at once, never on first use.
    let broken = LockingConfig::new().with_section(
        "Default",
        serde_json::json!({
            "provider": "file",
            "directory": "",
            "lease_duration": "10ms",
            "max_retry_delay": "1ms",
        }),
    );
    let error = Locking::builder()
        .custom_provider(PROVIDER, FileLockBackend::from_section)
        .config(broken)
        .build()
        .err()
        .ok_or("the broken configuration was accepted")?;
    println!("a broken configuration: {error}");
    Ok(())
}

/// The other process: takes a lock and exits without releasing it.
async fn hold_and_vanish(directory: &Path) -> Result<(), Box<dyn Error>> {
    let locking = start(directory)?;
    let held = locking.default_lock().try_acquire("exports/weekly").await?;
    println!(
        "the other process holds exports/weekly (token {}) and exits",
        held.fencing_token()
    );
    // Exiting skips every destructor: no release is sent, renewals stop.
    std::process::exit(0)
}
