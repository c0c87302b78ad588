//! One client's loop: acquire a key, read the register with the lock's fencing token, write
//! the value plus one with the same token, release; every step recorded as an invoke and its
//! completion.
//!
//! The client does not check that it still holds the lock before writing: the widest window for
//! a stale write is what the register's fencing must close.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lockingkit::DistributedLock;
use tokio::sync::watch;

use crate::clock::monotonic_ns;
use crate::error::CheckError;
use crate::history::{to_line, Access, Event, OpEvent, OpKind, Phase};
use crate::register::{RegisterClient, RegisterFailure, Request};
use crate::rng::SeededRng;

/// How long a client waits for a lock before giving up (and trying another key).
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a client waits for the register's answer before calling the outcome unknown.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a holder works between its read and its write.
///
/// Long enough that a holder cut off mid-update (a reset connection frees a PostgreSQL lock at
/// once) is often still working when the next holder has read: shorter, and a stale write
/// would usually beat the next holder and be accepted, testing nothing.
pub const WORK: Duration = Duration::from_millis(30);

/// How long a client waits after a failed acquire before trying again.
pub const FAILED_ACQUIRE_PAUSE: Duration = Duration::from_millis(50);

/// What a client is.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Its process id in the history.
    pub process: u32,
    /// The keys it picks from.
    pub keys: Vec<String>,
    /// The register's address.
    pub register: SocketAddr,
    /// The seed of its key choices.
    pub seed: u64,
}

/// Where a client's events go.
#[derive(Clone)]
pub enum Journal {
    /// JSON lines on standard output (a client process; the harness keeps the file).
    Stdout,
    /// A list shared with the harness (a simulated process).
    Shared(Arc<Mutex<Vec<Event>>>),
}

impl Journal {
    fn record(&self, event: OpEvent) -> Result<(), CheckError> {
        match self {
            Journal::Stdout => {
                use std::io::Write;
                // One write per line, so a kill cuts at most the last line.
                let mut out = std::io::stdout().lock();
                out.write_all(to_line(&Event::Op(event)).as_bytes())?;
                out.flush()?;
            }
            Journal::Shared(events) => events
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Event::Op(event)),
        }
        Ok(())
    }
}

/// How the nemesis pauses a simulated process (one that is a task, not an OS process): the
/// client stops at its next step while `paused` is true. `holding` names the key it holds, so
/// a long pause can make the lease lapse as a frozen process's would.
#[derive(Clone)]
pub struct PauseGate {
    paused: watch::Receiver<bool>,
    holding: Arc<Mutex<Option<String>>>,
}

impl PauseGate {
    /// A gate, with the sender the nemesis pauses it through and the slot naming the held key.
    pub fn new() -> (PauseGate, watch::Sender<bool>, Arc<Mutex<Option<String>>>) {
        let (sender, paused) = watch::channel(false);
        let holding = Arc::new(Mutex::new(None));
        let gate = PauseGate {
            paused,
            holding: holding.clone(),
        };
        (gate, sender, holding)
    }

    async fn pass(&mut self) {
        // A closed sender means the harness is done with this process: let it run out.
        let _ = self.paused.wait_for(|paused| !paused).await;
    }

    fn hold(&self, key: Option<&str>) {
        *self.holding.lock().unwrap_or_else(PoisonError::into_inner) = key.map(str::to_string);
    }
}

/// Records each step's invoke and completion.
struct Recorder {
    process: u32,
    journal: Journal,
}

impl Recorder {
    fn record(
        &self,
        phase: Phase,
        op: OpKind,
        key: &str,
        token: Option<u64>,
        value: Option<u64>,
        error: Option<String>,
    ) -> Result<(), CheckError> {
        self.journal.record(OpEvent {
            time: monotonic_ns(),
            process: self.process,
            phase,
            op,
            key: key.to_string(),
            token,
            value,
            error,
        })
    }
}

/// Runs the client until its task is cancelled or its process killed; returns only on an
/// error of the harness itself (its history cannot be written).
pub async fn run(
    locks: DistributedLock,
    config: ClientConfig,
    journal: Journal,
    mut gate: Option<PauseGate>,
) -> Result<(), CheckError> {
    let recorder = Recorder {
        process: config.process,
        journal,
    };
    let mut register = RegisterClient::new(config.register, REGISTER_TIMEOUT);
    let mut rng = SeededRng::new(config.seed);
    loop {
        pass(&mut gate).await;
        let Some(key) = config
            .keys
            .get(rng.below(config.keys.len() as u64) as usize)
        else {
            return Err(CheckError::Usage("a client needs at least one key".into()));
        };
        recorder.record(Phase::Invoke, OpKind::Acquire, key, None, None, None)?;
        let handle = match locks.acquire(key, ACQUIRE_TIMEOUT).await {
            Ok(handle) => handle,
            Err(error) => {
                let error = Some(error.to_string());
                recorder.record(Phase::Fail, OpKind::Acquire, key, None, None, error)?;
                // An outage answers at once: without a pause the history fills with refusals.
                tokio::time::sleep(FAILED_ACQUIRE_PAUSE).await;
                continue;
            }
        };
        let token = Some(handle.fencing_token());
        if let Some(gate) = &gate {
            gate.hold(Some(key));
        }
        recorder.record(Phase::Ok, OpKind::Acquire, key, token, None, None)?;

        pass(&mut gate).await;
        let read = access(&recorder, &mut register, key, token, Access::Read, 0).await?;
        if let Some(value) = read {
            // The work between read and write: a hold spends most of its time here, so a pause
            // or partition usually strikes a holder in the middle of its read-modify-write.
            tokio::time::sleep(WORK).await;
            pass(&mut gate).await;
            let next = value.saturating_add(1);
            access(&recorder, &mut register, key, token, Access::Write, next).await?;
        }

        pass(&mut gate).await;
        recorder.record(Phase::Invoke, OpKind::Release, key, token, None, None)?;
        let released = handle.release().await;
        if let Some(gate) = &gate {
            gate.hold(None);
        }
        match released {
            Ok(()) => recorder.record(Phase::Ok, OpKind::Release, key, token, None, None)?,
            Err(e) => {
                let error = Some(e.to_string());
                recorder.record(Phase::Fail, OpKind::Release, key, token, None, error)?;
            }
        }
    }
}

async fn pass(gate: &mut Option<PauseGate>) {
    if let Some(gate) = gate {
        gate.pass().await;
    }
}

/// One register request as an operation; the value read when a read is accepted.
async fn access(
    recorder: &Recorder,
    register: &mut RegisterClient,
    key: &str,
    token: Option<u64>,
    access: Access,
    value: u64,
) -> Result<Option<u64>, CheckError> {
    let (op, sent) = match access {
        Access::Read => (OpKind::Read, None),
        Access::Write => (OpKind::Write, Some(value)),
    };
    recorder.record(Phase::Invoke, op, key, token, sent, None)?;
    let request = Request {
        process: recorder.process,
        key: key.to_string(),
        token: token.unwrap_or(0),
        access,
        value,
    };
    match register.request(&request).await {
        Ok(reply) if reply.accepted => {
            let value = match access {
                Access::Read => reply.value,
                Access::Write => value,
            };
            recorder.record(Phase::Ok, op, key, token, Some(value), None)?;
            Ok(Some(value))
        }
        Ok(reply) => {
            let error = Some(format!("stale token; highest {}", reply.highest));
            recorder.record(Phase::Fail, op, key, token, sent, error)?;
            Ok(None)
        }
        Err(failure @ (RegisterFailure::TimedOut | RegisterFailure::Io(_))) => {
            recorder.record(Phase::Info, op, key, token, sent, Some(failure.to_string()))?;
            Ok(None)
        }
    }
}
