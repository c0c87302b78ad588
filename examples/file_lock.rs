//! A small, real lock backend on the local filesystem: the custom backend of
//! `custom_backend.rs`, also run through the contract kit by `file_lock_contract.rs`.
//!
//! Each key has a lock file in one directory, named by the SHA-256 of the key (keys may hold
//! any character and be 512 long; a hash is a safe, fixed-length file name). The file holds
//! one fixed-width record: the last fencing token handed out for the key, the holder's lease
//! id, and when that lease expires (Unix milliseconds). Every read-modify-write of a record
//! happens under an exclusive OS file lock (`flock`) held for microseconds, so processes on
//! this machine see each change whole. The OS lock is *not* the lease: it is dropped after
//! each step, and a holder that dies simply stops renewing, so its lease expires like an Azure
//! Blob lease does.
//!
//! What the backend does — and all it does — is one attempt, renew and release; waiting,
//! backoff, renewal scheduling, loss detection, release on drop and telemetry come from
//! LockingKit's engine.
//!
//! Caveats, as for any lease lock: expiry uses the wall clock, so a clock jumping forward by
//! more than a lease can end a lease early; the fencing counter lives in the lock file, so
//! deleting lock files restarts tokens at 1. Only processes on one machine (or a filesystem
//! with working `flock`, which excludes most network filesystems) can share a directory.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{ErrorKind as IoErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::config::Problem;
use lockingkit::registry::ProviderSection;
use lockingkit::{LockError, LockMode};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The provider name this backend reports in telemetry and registers under.
pub const PROVIDER: &str = "file";

/// How long one step may wait for another process's step on the same lock file.
const STEP_WAIT: Duration = Duration::from_secs(2);

/// Options of the file-lock provider, bound from a `Locking.{name}` section.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLockOptions {
    /// The directory that holds the lock files; created if missing.
    pub directory: PathBuf,
    /// How long a lease lasts unless renewed.
    #[serde(default = "default_lease", with = "lockingkit::config::duration")]
    pub lease_duration: Duration,
}

fn default_lease() -> Duration {
    Duration::from_secs(15)
}

impl FileLockOptions {
    /// Lists every problem with these options, each about one of their settings.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.directory.as_os_str().is_empty() {
            problems.push(Problem::new("directory", "must not be empty"));
        }
        if self.lease_duration < Duration::from_millis(100) {
            problems.push(Problem::new("lease_duration", "must be at least 100ms"));
        }
        problems
    }
}

/// The file-lock [`LockBackend`].
#[derive(Debug)]
pub struct FileLockBackend {
    directory: PathBuf,
    lease: Duration,
    /// Distinguishes this backend's leases from every other process's.
    instance: u64,
    next_lease: AtomicU64,
}

/// A lease on one lock file.
#[derive(Debug)]
pub struct FileLease {
    path: Arc<Path>,
    id: u128,
}

/// The fixed-width record in a lock file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Record {
    fencing: u64,
    /// 0 when nobody holds the lock.
    holder: u128,
    expires_ms: u64,
}

const RECORD_LEN: usize = 80;

impl Record {
    fn encode(&self) -> [u8; RECORD_LEN] {
        // One short write of a constant length: a later, shorter record can never leave the
        // tail of an earlier one behind.
        let text = format!(
            "{:020} {:032x} {:020}",
            self.fencing, self.holder, self.expires_ms
        );
        let mut out = [b'\n'; RECORD_LEN];
        out[..text.len()].copy_from_slice(text.as_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Record> {
        if bytes.is_empty() {
            return Some(Record::default());
        }
        let text = std::str::from_utf8(bytes).ok()?;
        let mut parts = text.split_whitespace();
        let record = Record {
            fencing: parts.next()?.parse().ok()?,
            holder: u128::from_str_radix(parts.next()?, 16).ok()?,
            expires_ms: parts.next()?.parse().ok()?,
        };
        parts.next().is_none().then_some(record)
    }

    fn is_live(&self, now_ms: u64) -> bool {
        self.holder != 0 && self.expires_ms > now_ms
    }
}

impl FileLockBackend {
    /// Opens (creating if needed) the lock directory and checks that it is writable, so a
    /// wrong path fails at startup rather than on the first lock.
    pub fn open(options: &FileLockOptions) -> Result<Self, LockError> {
        let misconfigured = |what: &str, error: std::io::Error| {
            LockError::misconfigured([format!("the lock directory {what}: {error}")])
        };
        std::fs::create_dir_all(&options.directory)
            .map_err(|e| misconfigured("cannot be created", e))?;
        let probe = options.directory.join(".lockingkit-write-probe");
        File::create(&probe).map_err(|e| misconfigured("is not writable", e))?;
        let _ = std::fs::remove_file(&probe);
        Ok(FileLockBackend {
            directory: options.directory.clone(),
            lease: options.lease_duration,
            instance: random_u64(),
            next_lease: AtomicU64::new(1),
        })
    }

    /// The factory to register under [`PROVIDER`]: binds [`FileLockOptions`] from the
    /// section, checks them and opens the directory.
    pub fn from_section(section: &ProviderSection) -> Result<Self, LockError> {
        // Binding and the options' own checks report together, placed in the section.
        let options: FileLockOptions = section.bind_checked(FileLockOptions::problems)?;
        Self::open(&options)
    }

    /// The lock file of `key` in `directory`, for operators and tests.
    pub fn lock_file_in(directory: &Path, key: &str) -> PathBuf {
        let digest = Sha256::digest(key.as_bytes());
        let name: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        directory.join(format!("{name}.lock"))
    }

    fn new_lease_id(&self) -> u128 {
        let sequence = self.next_lease.fetch_add(1, Ordering::Relaxed);
        (u128::from(self.instance) << 64) | u128::from(sequence)
    }

    /// Runs one read-modify-write step on a lock file, off the async runtime.
    async fn step<T: Send + 'static>(
        path: Arc<Path>,
        change: impl FnOnce(&mut Record, u64) -> T + Send + 'static,
    ) -> Result<T, BackendError> {
        tokio::task::spawn_blocking(move || locked_step(&path, change))
            .await
            .map_err(|e| BackendError::permanent("a lock file step panicked").with_source(e))?
    }
}

/// Reads the record under the OS lock, lets `change` edit it, and writes it back if it did.
fn locked_step<T>(
    path: &Path,
    change: impl FnOnce(&mut Record, u64) -> T,
) -> Result<T, BackendError> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io_error)?;
    lock_briefly(&file)?;
    let mut bytes = Vec::with_capacity(RECORD_LEN);
    file.read_to_end(&mut bytes).map_err(io_error)?;
    let Some(mut record) = Record::decode(&bytes) else {
        // Never restart fencing tokens from a record we cannot read.
        return Err(BackendError::permanent(format!(
            "the lock file {} is corrupt",
            path.display()
        )));
    };
    let before = record;
    let out = change(&mut record, now_ms());
    if record != before {
        file.seek(SeekFrom::Start(0)).map_err(io_error)?;
        file.write_all(&record.encode()).map_err(io_error)?;
        if record.fencing != before.fencing {
            // A token handed out must survive a crash, or the next holder could repeat it.
            file.sync_data().map_err(io_error)?;
        }
    }
    Ok(out)
    // Dropping `file` releases the OS lock.
}

/// Takes the OS lock, waiting at most [`STEP_WAIT`] for another process's step.
fn lock_briefly(file: &File) -> Result<(), BackendError> {
    let give_up = Instant::now() + STEP_WAIT;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(()),
            Err(TryLockError::WouldBlock) if Instant::now() < give_up => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryLockError::WouldBlock) => {
                return Err(BackendError::unreachable(
                    "another process kept the lock file busy",
                ))
            }
            Err(TryLockError::Error(error)) => return Err(io_error(error)),
        }
    }
}

fn io_error(error: std::io::Error) -> BackendError {
    match error.kind() {
        IoErrorKind::NotFound | IoErrorKind::PermissionDenied | IoErrorKind::ReadOnlyFilesystem => {
            BackendError::misconfigured("the lock directory is missing or not writable")
                .with_source(error)
        }
        _ => BackendError::unreachable("the lock file could not be read or written")
            .with_source(error),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    // Lease id 0 means "free", so an instance never starts at 0.
    hasher.finish() | 1
}

impl LockBackend for FileLockBackend {
    type Lease = FileLease;

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::Expiring(self.lease)
    }

    // Exclusive locks only: the default `supports` keeps the engine from asking for others.
    async fn try_acquire(
        &self,
        key: &str,
        _mode: LockMode,
    ) -> Result<Option<Acquired<FileLease>>, BackendError> {
        let path: Arc<Path> = Self::lock_file_in(&self.directory, key).into();
        let id = self.new_lease_id();
        let lease_ms = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        let token = Self::step(path.clone(), move |record, now| {
            if record.is_live(now) {
                return None;
            }
            record.fencing += 1;
            record.holder = id;
            record.expires_ms = now.saturating_add(lease_ms);
            Some(record.fencing)
        })
        .await?;
        Ok(token.map(|fencing_token| Acquired {
            lease: FileLease { path, id },
            fencing_token,
        }))
    }

    async fn renew(&self, lease: &FileLease) -> Result<(), BackendError> {
        let id = lease.id;
        let lease_ms = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        let renewed = Self::step(lease.path.clone(), move |record, now| {
            // An expired lease is never revived: someone may have read it as free already.
            let ours = record.holder == id && record.is_live(now);
            if ours {
                record.expires_ms = now.saturating_add(lease_ms);
            }
            ours
        })
        .await?;
        if renewed {
            Ok(())
        } else {
            Err(BackendError::lease_gone(
                "the lease expired or was taken over",
            ))
        }
    }

    async fn release(&self, lease: &FileLease) -> Result<(), BackendError> {
        let id = lease.id;
        let was_live = Self::step(lease.path.clone(), move |record, now| {
            if record.holder != id {
                return None;
            }
            let live = record.is_live(now);
            record.holder = 0;
            record.expires_ms = 0;
            Some(live)
        })
        .await?;
        match was_live {
            Some(true) => Ok(()),
            Some(false) => Err(BackendError::lease_gone("the lease had expired")),
            None => Err(BackendError::lease_gone(
                "the lease expired or was taken over",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Record;

    #[test]
    fn records_round_trip_at_a_fixed_width() {
        let record = Record {
            fencing: 42,
            holder: u128::MAX,
            expires_ms: 1_700_000_000_000,
        };
        let bytes = record.encode();
        assert_eq!(Record::decode(&bytes), Some(record));
        assert_eq!(Record::decode(b""), Some(Record::default()));
        assert_eq!(Record::decode(b"12 zz 3"), None);
    }
}
