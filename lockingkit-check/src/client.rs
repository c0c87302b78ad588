//! One client's loop: acquire a key (exclusively, or one hold in four as a reader), read the
//! register with the lock's fencing token, write the value plus one with the same token (a
//! reader only reads), release; one hold in four repeats its work past the lease, so it is
//! renewed under it. Every step is recorded as an invoke and its completion; a register
//! request's invoke also records whether the lock said it was held.
//!
//! The client does not check that it still holds the lock before writing: the widest window for
//! a stale write is what the register's fencing must close.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lockingkit::{DistributedLock, LockHandle};
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
    /// Whether one hold in four is a reader's (the provider supports reader-writer locks).
    pub readers: bool,
    /// How long one hold in four keeps working (longer than the lease, so it is renewed).
    pub long_hold: Duration,
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

/// What a simulated process holds now, for the nemesis.
#[derive(Clone, Debug)]
pub struct Holding {
    /// The key.
    pub key: String,
    /// When the hold began.
    pub since: tokio::time::Instant,
    /// Whether it is a long hold (renewed under it).
    pub long: bool,
}

/// What a simulated process holds now, shared with the nemesis.
pub type HoldingSlot = Arc<Mutex<Option<Holding>>>;

/// How the nemesis pauses a simulated process (one that is a task, not an OS process): the
/// client stops at its next step while `paused` is true. `holding` says what it holds, so a
/// long pause can make the lease lapse as a frozen process's would, and a slow line can be
/// aimed at a hold that will be renewed.
#[derive(Clone)]
pub struct PauseGate {
    paused: watch::Receiver<bool>,
    holding: HoldingSlot,
}

impl PauseGate {
    /// A gate, with the sender the nemesis pauses it through and the slot saying what it holds.
    pub fn new() -> (PauseGate, watch::Sender<bool>, HoldingSlot) {
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

    fn hold(&self, holding: Option<Holding>) {
        *self.holding.lock().unwrap_or_else(PoisonError::into_inner) = holding;
    }
}

/// Records each step's invoke and completion.
struct Recorder {
    process: u32,
    journal: Journal,
}

impl Recorder {
    /// An event of this process, timed now, with nothing but its phase, operation and key.
    fn event(&self, phase: Phase, op: OpKind, key: &str) -> OpEvent {
        OpEvent {
            time: monotonic_ns(),
            process: self.process,
            phase,
            op,
            key: key.to_string(),
            token: None,
            value: None,
            error: None,
            shared: false,
            held: None,
        }
    }

    fn record(&self, event: OpEvent) -> Result<(), CheckError> {
        self.journal.record(event)
    }
}

/// The hold a client works under.
struct Held<'a> {
    key: &'a str,
    token: u64,
    shared: bool,
}

impl Held<'_> {
    /// An event of this hold.
    fn event(&self, recorder: &Recorder, phase: Phase, op: OpKind) -> OpEvent {
        OpEvent {
            token: Some(self.token),
            shared: self.shared,
            ..recorder.event(phase, op, self.key)
        }
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
        let shared = config.readers && rng.below(4) == 0;
        let hold_for = if rng.below(4) == 0 {
            config.long_hold
        } else {
            Duration::ZERO
        };
        recorder.record(OpEvent {
            shared,
            ..recorder.event(Phase::Invoke, OpKind::Acquire, key)
        })?;
        let handle = match acquire(&locks, key, shared).await {
            Ok(handle) => handle,
            Err(error) => {
                recorder.record(OpEvent {
                    shared,
                    error: Some(error.to_string()),
                    ..recorder.event(Phase::Fail, OpKind::Acquire, key)
                })?;
                // An outage answers at once: without a pause the history fills with refusals.
                tokio::time::sleep(FAILED_ACQUIRE_PAUSE).await;
                continue;
            }
        };
        let held = Held {
            key,
            token: handle.fencing_token(),
            shared,
        };
        if let Some(gate) = &gate {
            gate.hold(Some(Holding {
                key: key.clone(),
                since: tokio::time::Instant::now(),
                long: !hold_for.is_zero(),
            }));
        }
        recorder.record(held.event(&recorder, Phase::Ok, OpKind::Acquire))?;
        let hold = (&held, &handle);
        work(&recorder, &mut register, hold, hold_for, &mut gate).await?;

        pass(&mut gate).await;
        recorder.record(held.event(&recorder, Phase::Invoke, OpKind::Release))?;
        let released = handle.release().await;
        if let Some(gate) = &gate {
            gate.hold(None);
        }
        let done = match released {
            Ok(()) => held.event(&recorder, Phase::Ok, OpKind::Release),
            Err(e) => OpEvent {
                error: Some(e.to_string()),
                ..held.event(&recorder, Phase::Fail, OpKind::Release)
            },
        };
        recorder.record(done)?;
    }
}

/// A reader's or an exclusive hold of `key`.
async fn acquire(
    locks: &DistributedLock,
    key: &str,
    shared: bool,
) -> Result<LockHandle, lockingkit::LockError> {
    if shared {
        locks.reader_writer(key)?.read(ACQUIRE_TIMEOUT).await
    } else {
        locks.acquire(key, ACQUIRE_TIMEOUT).await
    }
}

/// The work of one hold: a read-modify-write (a read for a reader), again and again until
/// `hold_for` has passed, so long holds run through renewals; stops at a refusal.
async fn work(
    recorder: &Recorder,
    register: &mut RegisterClient,
    hold: (&Held<'_>, &LockHandle),
    hold_for: Duration,
    gate: &mut Option<PauseGate>,
) -> Result<(), CheckError> {
    let until = tokio::time::Instant::now() + hold_for;
    let held = hold.0;
    loop {
        pass(gate).await;
        let Some(value) = access(recorder, register, hold, Access::Read, 0).await? else {
            return Ok(());
        };
        // The work between read and write: a hold spends most of its time here, so a pause or
        // partition usually strikes a holder in the middle of its read-modify-write.
        tokio::time::sleep(WORK).await;
        if !held.shared {
            pass(gate).await;
            let next = value.saturating_add(1);
            if access(recorder, register, hold, Access::Write, next)
                .await?
                .is_none()
            {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= until {
            return Ok(());
        }
    }
}

async fn pass(gate: &mut Option<PauseGate>) {
    if let Some(gate) = gate {
        gate.pass().await;
    }
}

/// One register request as an operation; the value read when a read is accepted, the value
/// written when a write is. Its invoke records whether the client believed it held the lock.
async fn access(
    recorder: &Recorder,
    register: &mut RegisterClient,
    (held, handle): (&Held<'_>, &LockHandle),
    access: Access,
    value: u64,
) -> Result<Option<u64>, CheckError> {
    let (op, sent) = match access {
        Access::Read => (OpKind::Read, None),
        Access::Write => (OpKind::Write, Some(value)),
    };
    // Timed before asking: the answer holds at that instant or later.
    let invoke = held.event(recorder, Phase::Invoke, op);
    let believed = handle.is_held();
    recorder.record(OpEvent {
        value: sent,
        held: Some(believed),
        ..invoke
    })?;
    let request = Request {
        process: recorder.process,
        key: held.key.to_string(),
        token: held.token,
        access,
        value,
        shared: held.shared,
    };
    let (phase, value, error) = match register.request(&request).await {
        Ok(reply) if reply.accepted => {
            let value = match access {
                Access::Read => reply.value,
                Access::Write => value,
            };
            (Phase::Ok, Some(value), None)
        }
        Ok(reply) => (
            Phase::Fail,
            sent,
            Some(format!("stale token; highest {}", reply.highest)),
        ),
        Err(failure @ (RegisterFailure::TimedOut | RegisterFailure::Io(_))) => {
            (Phase::Info, sent, Some(failure.to_string()))
        }
    };
    recorder.record(OpEvent {
        value,
        error,
        ..held.event(recorder, phase, op)
    })?;
    Ok(if phase == Phase::Ok { value } else { None })
}
