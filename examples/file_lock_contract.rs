//! The example's file-lock backend (`file_lock.rs`) against LockingKit's contract kit, built
//! the way an application builds it: a `file` section in the configuration, bound by the
//! registry through the custom provider factory.

mod file_lock;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use file_lock::{FileLockBackend, FileLockOptions, PROVIDER};
use lockingkit::backend::LockBackend;
use lockingkit::config::format_duration;
use lockingkit::testing::ContractBackend;
use lockingkit::{DistributedLock, ErrorKind, LockMode, LockOptions, Locking, LockingConfig};
use serde_json::json;

/// Long enough that a busy 2-core machine never delays a renewal past the loss deadline.
const LEASE: Duration = Duration::from_secs(1);

/// A lock directory of its own for each test, removed afterwards.
struct FileLocks {
    directory: PathBuf,
}

impl FileLocks {
    fn new() -> FileLocks {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let directory = std::env::temp_dir().join(format!(
            "lockingkit-file-contract-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        FileLocks { directory }
    }

    fn options(&self) -> FileLockOptions {
        FileLockOptions {
            directory: self.directory.clone(),
            lease_duration: LEASE,
        }
    }
}

impl Drop for FileLocks {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

impl ContractBackend for FileLocks {
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        let mut section = json!({
            "provider": PROVIDER,
            "directory": self.directory,
            "lease_duration": format_duration(LEASE),
            "min_retry_delay": format_duration(options.min_retry_delay),
            "max_retry_delay": format_duration(options.max_retry_delay),
            "release_timeout": format_duration(options.release_timeout),
        });
        if let Some(every) = options.renew_every {
            section["renew_every"] = json!(format_duration(every));
        }
        let locking = Locking::builder()
            .custom_provider(PROVIDER, FileLockBackend::from_section)
            .config(LockingConfig::new().with_section("Default", section))
            .build()
            .expect("the contract's options are valid");
        assert_eq!(locking.default_lock().provider(), PROVIDER);
        locking.default_lock().clone()
    }

    fn lease_period(&self) -> Duration {
        LEASE
    }
}

// File locks here are exclusive only: the suite checks that readers and semaphores are refused.
lockingkit::contract_tests!(async { FileLocks::new() }, without: [readers, semaphores]);

/// A holder that stops renewing (a crashed process) loses the lock when its lease runs out,
/// not before, and the next holder's token is higher.
#[tokio::test]
async fn an_abandoned_lease_expires_and_the_next_token_is_higher() {
    let locks = FileLocks::new();
    let crashed = FileLockBackend::open(&locks.options()).unwrap();
    let survivor = FileLockBackend::open(&locks.options()).unwrap();
    let abandoned = crashed
        .try_acquire("jobs/nightly", LockMode::Exclusive)
        .await
        .unwrap()
        .unwrap();
    assert!(survivor
        .try_acquire("jobs/nightly", LockMode::Exclusive)
        .await
        .unwrap()
        .is_none());

    tokio::time::sleep(LEASE + Duration::from_millis(50)).await;
    let next = survivor
        .try_acquire("jobs/nightly", LockMode::Exclusive)
        .await
        .unwrap()
        .unwrap();
    assert!(next.fencing_token > abandoned.fencing_token);
    // The old holder finds out at its next renewal.
    let gone = crashed.renew(&abandoned.lease).await.unwrap_err();
    assert_eq!(
        gone.kind(),
        lockingkit::backend::BackendErrorKind::LeaseGone
    );
}

/// Fencing tokens live in the lock files, so a restarted process continues above them.
#[tokio::test]
async fn fencing_tokens_survive_a_restart() {
    let locks = FileLocks::new();
    let before = {
        let backend = FileLockBackend::open(&locks.options()).unwrap();
        let held = backend
            .try_acquire("orders/42", LockMode::Exclusive)
            .await
            .unwrap()
            .unwrap();
        backend.release(&held.lease).await.unwrap();
        held.fencing_token
    };
    let restarted = FileLockBackend::open(&locks.options()).unwrap();
    let held = restarted
        .try_acquire("orders/42", LockMode::Exclusive)
        .await
        .unwrap()
        .unwrap();
    assert!(held.fencing_token > before);
}

/// A record that cannot be read is a backend failure, never a silent restart of the tokens.
#[tokio::test]
async fn a_corrupt_lock_file_fails_instead_of_restarting_tokens() {
    let locks = FileLocks::new();
    let lock = Locking::builder()
        .backend(
            "Default",
            FileLockBackend::open(&locks.options()).unwrap(),
            LockOptions::default(),
        )
        .build()
        .unwrap();
    std::fs::write(
        FileLockBackend::lock_file_in(&locks.directory, "orders/7"),
        "not a record",
    )
    .unwrap();
    let error = lock
        .default_lock()
        .try_acquire("orders/7")
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Backend, "{error}");
}

/// Problems with the section are reported at startup, all at once.
#[test]
fn bad_file_sections_fail_the_build_with_every_problem() {
    let error = Locking::builder()
        .custom_provider(PROVIDER, FileLockBackend::from_section)
        .config(LockingConfig::new().with_section(
            "Default",
            json!({"provider": "File", "directory": "", "lease_duration": "10ms", "colour": "red"}),
        ))
        .build()
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    let shown = error.to_string();
    assert!(
        shown.contains("Locking.Default.colour is not a setting of the File provider"),
        "{shown}"
    );
    let error = Locking::builder()
        .custom_provider(PROVIDER, FileLockBackend::from_section)
        .config(LockingConfig::new().with_section(
            "Default",
            json!({"provider": "file", "directory": "", "lease_duration": "10ms"}),
        ))
        .build()
        .unwrap_err();
    let shown = error.to_string();
    assert!(
        shown.contains("Locking.Default.directory must not be empty"),
        "{shown}"
    );
    assert!(
        shown.contains("Locking.Default.lease_duration must be at least 100ms"),
        "{shown}"
    );
}
