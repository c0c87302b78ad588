//! Named lock providers from a TOML file and environment variables, bound with the `config`
//! crate and validated once at startup.
//!
//! ```text
//! cargo run -p lockingkit-examples --example config
//! LOCKING__DEFAULT__LEASE_DURATION=10s cargo run -p lockingkit-examples --example config
//! ```
//!
//! LockingKit itself reads no files and no environment: it takes a [`LockingConfig`], which
//! any serde-based configuration crate can produce. Here the file comes first and the
//! environment is laid over it, setting by setting. Try a broken configuration to see every
//! problem reported together, before any lock is taken:
//!
//! ```text
//! LOCKING__DEFAULT__LEASE_DURATION=0s LOCKING__JOBS__MIN_RETRY_DELAY=5s \
//! LOCKING__REPORTS__PROVIDER=carrier_pigeon cargo run -p lockingkit-examples --example config
//! ```

use std::error::Error;
use std::time::Duration;

use config::{Config, Environment, File};
use lockingkit::{Locking, LockingConfig};

/// Where the sample configuration lives.
const CONFIG_FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/locking.toml");

/// Builds the registry from the file and the `LOCKING__…` environment variables.
fn load_locking() -> Result<Locking, Box<dyn Error>> {
    // The file's `[Locking.*]` tables.
    let file: LockingConfig = Config::builder()
        .add_source(File::with_name(CONFIG_FILE))
        .build()?
        .get("Locking")?;
    // `LOCKING__JOBS__MAX_RETRY_DELAY=5s` becomes `jobs.max_retry_delay`. The `config` crate
    // lower-cases environment keys but not file keys, which is why the two sources are bound
    // separately and merged by LockingKit, which matches names ignoring case.
    let environment: LockingConfig = Config::builder()
        .add_source(Environment::with_prefix("LOCKING").separator("__"))
        .build()?
        .try_deserialize()?;

    let locking = Locking::builder()
        .config(file)
        .config(environment)
        // This application takes locks through `Jobs`: its absence should stop the start.
        .required("Jobs")
        .build()?;
    Ok(locking)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let locking = match load_locking() {
        Ok(locking) => locking,
        Err(error) => {
            // One error lists every problem; no secret is ever part of it.
            eprintln!("cannot start: {error}");
            std::process::exit(2);
        }
    };
    for lock in locking.iter() {
        println!("provider {:<8} on {}", lock.name(), lock.provider());
    }

    let jobs = locking.require("Jobs")?;
    let export = jobs
        .acquire("jobs/nightly-export", Duration::from_secs(5))
        .await?;
    println!(
        "Jobs holds jobs/nightly-export with fencing token {}",
        export.fencing_token()
    );
    export.release().await?;

    // Providers are separate: the same key on Default is another lock.
    let default = locking
        .default_lock()
        .try_acquire("jobs/nightly-export")
        .await?;
    println!("Default holds its own jobs/nightly-export too");
    default.release().await?;
    Ok(())
}
