//! One client's loop. Each round takes one hold, drawn at random:
//!
//! - one of the run's keys, exclusively (or, one time in four, as a reader where the provider
//!   has reader-writer locks);
//! - a slot of the semaphore [`SEMAPHORE_KEY`], which admits [`SEMAPHORE_PERMITS`] holders,
//!   where the provider has semaphores;
//! - two of the run's keys at once, as one multi-key hold;
//! - a term of leadership of [`LEADER_KEY`], won by a campaign.
//!
//! Under the hold the client reads the register with each key's fencing token, works, and
//! writes the value plus one with the same token (a reader or a semaphore holder only reads),
//! then releases. One hold in four repeats its work past the lease, so it is renewed under it.
//! Every step is recorded as an invoke and its completion; a register request's invoke also
//! records whether the lock said it was held.
//!
//! The client does not check that it still holds the lock before writing: the widest window for
//! a stale write is what the register's fencing must close.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lockingkit::providers::memory::MemoryLease;
use lockingkit::{DistributedLock, ErrorKind, Leadership, LockError, LockMode, LockView, Term};
use tokio::sync::{oneshot, watch};

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

/// The semaphore whose slots the clients take (semaphores are named apart from locks).
pub const SEMAPHORE_KEY: &str = "check/semaphore";

/// How many holders the semaphore admits: fewer than the clients, so that they queue for it.
pub const SEMAPHORE_PERMITS: u32 = 2;

/// The key the clients campaign for.
pub const LEADER_KEY: &str = "check/leader";

/// A campaign's pauses between attempts: short, since a client campaigns for one term only;
/// the first longer than a client takes to resign once its term's work returns, so that a
/// campaign seldom wins a second term.
const CAMPAIGN_RETRY: (Duration, Duration) =
    (Duration::from_millis(200), Duration::from_millis(500));

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
    /// Its lease in the store (the first key's, for a multi-key hold): the one lease a long
    /// pause breaks.
    pub lease: Option<MemoryLease>,
}

/// What a simulated process holds, or waits for, now.
#[derive(Clone, Debug, Default)]
pub struct Activity {
    /// What it holds.
    pub holding: Option<Holding>,
    /// The key it is trying to take (the first, for a multi-key hold), while it tries.
    pub wants: Option<String>,
}

/// What a simulated process holds or waits for now, shared with the nemesis.
pub type HoldingSlot = Arc<Mutex<Activity>>;

/// How the nemesis pauses a simulated process (one that is a task, not an OS process): the
/// client stops at its next step while `paused` is true. `holding` says what it holds and
/// wants, so a long pause can make the lease lapse as a frozen process's would, and a slow line
/// can be aimed at a hold that will be renewed while someone waits for it.
#[derive(Clone)]
pub struct PauseGate {
    paused: watch::Receiver<bool>,
    holding: HoldingSlot,
}

impl PauseGate {
    /// A gate, with the sender the nemesis pauses it through and the slot saying what it holds.
    pub fn new() -> (PauseGate, watch::Sender<bool>, HoldingSlot) {
        let (sender, paused) = watch::channel(false);
        let holding = Arc::new(Mutex::new(Activity::default()));
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

    /// Records what it holds now; an attempt that got its lock is over.
    fn hold(&self, holding: Option<Holding>) {
        let mut activity = self.holding.lock().unwrap_or_else(PoisonError::into_inner);
        if holding.is_some() {
            activity.wants = None;
        }
        activity.holding = holding;
    }

    /// Records the key it tries to take now, or that it has stopped trying.
    fn want(&self, key: Option<&str>) {
        self.holding
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .wants = key.map(str::to_string);
    }
}

/// Records each step's invoke and completion.
#[derive(Clone)]
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
            permits: None,
            held: None,
        }
    }

    fn record(&self, event: OpEvent) -> Result<(), CheckError> {
        self.journal.record(event)
    }

    /// Begins one operation on several keys: writes the first key's invoke now and hands back
    /// all of them for [`record_each`](Self::record_each) to finish.
    fn begin_each(&self, invokes: Vec<OpEvent>) -> Result<Vec<OpEvent>, CheckError> {
        if let Some(first) = invokes.first() {
            self.record(first.clone())?;
        }
        Ok(invokes)
    }

    /// Records one operation on several keys, begun at once and finished at once: each key's
    /// invoke (all timed when the operation began; the first one already written then), each
    /// followed by its completion, so that every key reads as an operation of its own.
    fn record_each(
        &self,
        invokes: &[OpEvent],
        complete: impl Fn(&OpEvent) -> OpEvent,
    ) -> Result<(), CheckError> {
        for (i, invoke) in invokes.iter().enumerate() {
            if i > 0 {
                self.record(invoke.clone())?;
            }
            self.record(complete(invoke))?;
        }
        Ok(())
    }
}

/// How a key of a round is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Exclusive,
    Reader,
    Semaphore,
}

impl Kind {
    /// The marks its events carry: whether the hold is shared, and among how many holders.
    /// A semaphore slot is shared with the other slots' holders, so the register never fences
    /// one holder's read by another's token: slots number their tokens apart.
    fn marks(self) -> (bool, Option<u32>) {
        match self {
            Kind::Exclusive => (false, None),
            Kind::Reader => (true, None),
            Kind::Semaphore => (true, Some(SEMAPHORE_PERMITS)),
        }
    }
}

/// One key a client works under.
#[derive(Clone)]
struct Held {
    key: String,
    token: u64,
    shared: bool,
    permits: Option<u32>,
}

impl Held {
    fn of(view: &LockView, kind: Kind) -> Held {
        let (shared, permits) = kind.marks();
        Held {
            key: view.key().to_string(),
            token: view.fencing_token(),
            shared,
            permits,
        }
    }

    /// An event of this hold.
    fn event(&self, recorder: &Recorder, phase: Phase, op: OpKind) -> OpEvent {
        OpEvent {
            token: Some(self.token),
            shared: self.shared,
            permits: self.permits,
            ..recorder.event(phase, op, &self.key)
        }
    }
}

/// What a client works with under a hold: its history, the register and its pause gate.
struct Worker {
    recorder: Recorder,
    register: RegisterClient,
    gate: Option<PauseGate>,
}

impl Worker {
    async fn pass(&mut self) {
        if let Some(gate) = &mut self.gate {
            gate.pass().await;
        }
    }

    fn hold(&self, holding: Option<Holding>) {
        if let Some(gate) = &self.gate {
            gate.hold(holding);
        }
    }

    fn want(&self, key: Option<&str>) {
        if let Some(gate) = &self.gate {
            gate.want(key);
        }
    }

    /// The work of one hold: on each key in turn, a read-modify-write (a read for a shared
    /// hold), again and again until `hold_for` has passed, so long holds run through renewals;
    /// stops at a refusal.
    async fn work(
        &mut self,
        holds: &[(Held, LockView)],
        hold_for: Duration,
    ) -> Result<(), CheckError> {
        let until = tokio::time::Instant::now() + hold_for;
        loop {
            for (held, view) in holds {
                self.pass().await;
                let Some(value) = self.access(held, view, Access::Read, 0).await? else {
                    return Ok(());
                };
                // The work between read and write: a hold spends most of its time here, so a
                // pause or partition usually strikes a holder in the middle of its
                // read-modify-write.
                tokio::time::sleep(WORK).await;
                if !held.shared {
                    self.pass().await;
                    let next = value.saturating_add(1);
                    if self
                        .access(held, view, Access::Write, next)
                        .await?
                        .is_none()
                    {
                        return Ok(());
                    }
                }
            }
            if tokio::time::Instant::now() >= until {
                return Ok(());
            }
        }
    }

    /// One register request as an operation; the value read when a read is accepted, the
    /// value written when a write is. Its invoke records whether the client believed it held
    /// the lock.
    async fn access(
        &mut self,
        held: &Held,
        view: &LockView,
        access: Access,
        value: u64,
    ) -> Result<Option<u64>, CheckError> {
        let (op, sent) = match access {
            Access::Read => (OpKind::Read, None),
            Access::Write => (OpKind::Write, Some(value)),
        };
        // Timed before asking: the answer holds at that instant or later.
        let invoke = held.event(&self.recorder, Phase::Invoke, op);
        let believed = view.is_held();
        self.recorder.record(OpEvent {
            value: sent,
            held: Some(believed),
            ..invoke
        })?;
        let request = Request {
            process: self.recorder.process,
            key: held.key.clone(),
            token: held.token,
            access,
            value,
            shared: held.shared,
        };
        let (phase, value, error) = match self.register.request(&request).await {
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
        self.recorder.record(OpEvent {
            value,
            error,
            ..held.event(&self.recorder, phase, op)
        })?;
        Ok(if phase == Phase::Ok { value } else { None })
    }

    /// One term of leadership: its grant, its work, and the release the campaign sends when
    /// the work returns. Dropped where it stands if the term is lost.
    async fn lead(&mut self, term: Term, hold_for: Duration) -> Result<(), CheckError> {
        let view = LockView::clone(&term);
        let held = Held::of(&view, Kind::Exclusive);
        self.hold(Some(Holding {
            key: held.key.clone(),
            since: tokio::time::Instant::now(),
            long: !hold_for.is_zero(),
            lease: view.lease::<MemoryLease>().cloned(),
        }));
        self.recorder
            .record(held.event(&self.recorder, Phase::Ok, OpKind::Acquire))?;
        self.work(&[(held.clone(), view)], hold_for).await?;
        self.recorder
            .record(held.event(&self.recorder, Phase::Invoke, OpKind::Release))
    }
}

/// A campaign's term as the client waits for it: not begun, claimed by the campaign's first
/// term, or given up on by the client.
const TERM_WAITING: u8 = 0;
const TERM_CLAIMED: u8 = 1;
const TERM_ABANDONED: u8 = 2;

/// What the client's first term sends back: that it began, and how its work ended (the sender
/// is dropped with the work when the term is lost).
type TermSlot = (
    oneshot::Sender<()>,
    oneshot::Sender<Result<(), CheckError>>,
    Worker,
);

/// A client: its lock, its choices and its worker.
struct Client {
    locks: DistributedLock,
    /// Whether the provider has semaphores of [`SEMAPHORE_PERMITS`], and reader-writer locks.
    semaphores: bool,
    readers: bool,
    config: ClientConfig,
    rng: SeededRng,
    worker: Worker,
}

/// Runs the client until its task is cancelled or its process killed; returns only on an
/// error of the harness itself (its history cannot be written).
pub async fn run(
    locks: DistributedLock,
    config: ClientConfig,
    journal: Journal,
    gate: Option<PauseGate>,
) -> Result<(), CheckError> {
    if config.keys.is_empty() {
        return Err(CheckError::Usage("a client needs at least one key".into()));
    }
    let mut client = Client {
        worker: Worker {
            recorder: Recorder {
                process: config.process,
                journal,
            },
            register: RegisterClient::new(config.register, REGISTER_TIMEOUT),
            gate,
        },
        rng: SeededRng::new(config.seed),
        semaphores: locks.supports(LockMode::Semaphore {
            max_count: SEMAPHORE_PERMITS,
        }),
        readers: locks.supports(LockMode::Shared),
        locks,
        config,
    };
    loop {
        client.round().await?;
    }
}

impl Client {
    /// One hold, of a kind drawn at random: four rounds in ten a semaphore slot (where the
    /// provider has semaphores), one a multi-key hold, one a leader's term, the rest one key.
    async fn round(&mut self) -> Result<(), CheckError> {
        self.worker.pass().await;
        let hold_for = if self.rng.below(4) == 0 {
            self.config.long_hold
        } else {
            Duration::ZERO
        };
        match self.rng.below(10) {
            0..=3 if self.semaphores => self.single(Kind::Semaphore, SEMAPHORE_KEY, hold_for).await,
            4 if self.config.keys.len() >= 2 => self.multi(hold_for).await,
            5 => self.campaign(hold_for).await,
            _ => {
                let index = self.pick_key();
                let key = self.config.keys[index].clone();
                let shared = self.readers && self.rng.below(4) == 0;
                let kind = if shared {
                    Kind::Reader
                } else {
                    Kind::Exclusive
                };
                self.single(kind, &key, hold_for).await
            }
        }
    }

    /// One of the run's keys, by its index.
    fn pick_key(&mut self) -> usize {
        self.rng.below(self.config.keys.len() as u64) as usize
    }

    /// Records that an acquire of each of `attempts` failed, and pauses: an outage answers at
    /// once, and without a pause the history fills with refusals.
    async fn refused(&self, attempts: &[OpEvent], error: &LockError) -> Result<(), CheckError> {
        let recorder = &self.worker.recorder;
        recorder.record_each(attempts, |attempt| OpEvent {
            error: Some(error.to_string()),
            shared: attempt.shared,
            permits: attempt.permits,
            ..recorder.event(Phase::Fail, OpKind::Acquire, &attempt.key)
        })?;
        self.worker.want(None);
        tokio::time::sleep(FAILED_ACQUIRE_PAUSE).await;
        Ok(())
    }

    /// An acquire's invoke for each of `keys`, timed now; the first one is written.
    fn attempts(&self, keys: &[&str], kind: Kind) -> Result<Vec<OpEvent>, CheckError> {
        let (shared, permits) = kind.marks();
        let recorder = &self.worker.recorder;
        let attempts: Vec<OpEvent> = keys
            .iter()
            .map(|key| OpEvent {
                shared,
                permits,
                ..recorder.event(Phase::Invoke, OpKind::Acquire, key)
            })
            .collect();
        let attempts = recorder.begin_each(attempts)?;
        self.worker.want(keys.first().copied());
        Ok(attempts)
    }

    /// One key held as `kind`: acquire, work, release.
    async fn single(
        &mut self,
        kind: Kind,
        key: &str,
        hold_for: Duration,
    ) -> Result<(), CheckError> {
        let attempts = self.attempts(&[key], kind)?;
        let acquired = match kind {
            Kind::Exclusive => self.locks.acquire(key, ACQUIRE_TIMEOUT).await,
            Kind::Reader => match self.locks.reader_writer(key) {
                Ok(lock) => lock.read(ACQUIRE_TIMEOUT).await,
                Err(error) => Err(error),
            },
            Kind::Semaphore => match self.locks.semaphore(key, SEMAPHORE_PERMITS) {
                Ok(semaphore) => semaphore.acquire(ACQUIRE_TIMEOUT).await,
                Err(error) => Err(error),
            },
        };
        let handle = match acquired {
            Ok(handle) => handle,
            Err(error) => return self.refused(&attempts, &error).await,
        };
        let held = Held::of(&handle, kind);
        let lease = handle.lease::<MemoryLease>().cloned();
        self.held_each(&[], std::slice::from_ref(&held), hold_for, lease)?;
        self.worker
            .work(&[(held.clone(), handle.view())], hold_for)
            .await?;
        self.worker.pass().await;
        let releases = self.releases(std::slice::from_ref(&held))?;
        let released = handle.release().await;
        self.released(&[held], &releases, released)
    }

    /// Two of the run's keys as one multi-key hold, each worked on under its own token.
    async fn multi(&mut self, hold_for: Duration) -> Result<(), CheckError> {
        // Two different keys: the second is one of the others (there are at least two).
        let count = self.config.keys.len();
        let first = self.pick_key();
        let second = (first + 1 + self.rng.below(count as u64 - 1) as usize) % count;
        let mut keys = [
            self.config.keys[first].clone(),
            self.config.keys[second].clone(),
        ];
        // In the order they are taken, so the history's order matches the backend's.
        keys.sort();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let attempts = self.attempts(&key_refs, Kind::Exclusive)?;
        let handle = match self.locks.acquire_all(&key_refs, ACQUIRE_TIMEOUT).await {
            Ok(handle) => handle,
            Err(error) => return self.refused(&attempts, &error).await,
        };
        let holds: Vec<(Held, LockView)> = handle
            .members()
            .iter()
            .map(|view| (Held::of(view, Kind::Exclusive), view.clone()))
            .collect();
        let helds: Vec<Held> = holds.iter().map(|(held, _)| held.clone()).collect();
        let lease = handle
            .members()
            .first()
            .and_then(|view| view.lease::<MemoryLease>().cloned());
        self.held_each(&attempts, &helds, hold_for, lease)?;
        self.worker.work(&holds, hold_for).await?;
        self.worker.pass().await;
        let releases = self.releases(&helds)?;
        let released = handle.release().await;
        self.released(&helds, &releases, released)
    }

    /// Records each key's grant (after its invoke, for every key but the first when `attempts`
    /// are given), and tells the nemesis the first key held and its `lease` (if known).
    fn held_each(
        &self,
        attempts: &[OpEvent],
        helds: &[Held],
        hold_for: Duration,
        lease: Option<MemoryLease>,
    ) -> Result<(), CheckError> {
        let recorder = &self.worker.recorder;
        for (i, held) in helds.iter().enumerate() {
            if let Some(attempt) = attempts.get(i).filter(|_| i > 0) {
                recorder.record(attempt.clone())?;
            }
            recorder.record(held.event(recorder, Phase::Ok, OpKind::Acquire))?;
        }
        if let Some(first) = helds.first() {
            self.worker.hold(Some(Holding {
                key: first.key.clone(),
                since: tokio::time::Instant::now(),
                long: !hold_for.is_zero(),
                lease,
            }));
        }
        Ok(())
    }

    /// The release invokes of `helds`, timed now; the first one is written.
    fn releases(&self, helds: &[Held]) -> Result<Vec<OpEvent>, CheckError> {
        let recorder = &self.worker.recorder;
        let releases: Vec<OpEvent> = helds
            .iter()
            .map(|held| held.event(recorder, Phase::Invoke, OpKind::Release))
            .collect();
        recorder.begin_each(releases)
    }

    /// Records how the release of `helds` ended.
    fn released(
        &self,
        helds: &[Held],
        releases: &[OpEvent],
        released: Result<(), LockError>,
    ) -> Result<(), CheckError> {
        self.worker.hold(None);
        let recorder = &self.worker.recorder;
        recorder.record_each(releases, |release| {
            let held = helds.iter().find(|h| h.key == release.key);
            let done = |phase| match held {
                Some(held) => held.event(recorder, phase, OpKind::Release),
                None => recorder.event(phase, OpKind::Release, &release.key),
            };
            match &released {
                Ok(()) => done(Phase::Ok),
                Err(error) => OpEvent {
                    error: Some(error.to_string()),
                    ..done(Phase::Fail)
                },
            }
        })
    }

    /// Campaigns for [`LEADER_KEY`] and leads one term: the term's grant, its work and its
    /// release are recorded as a hold's are. A campaign that wins no term within
    /// [`ACQUIRE_TIMEOUT`] is resigned and recorded as a failed acquire.
    async fn campaign(&mut self, hold_for: Duration) -> Result<(), CheckError> {
        let attempts = self.attempts(&[LEADER_KEY], Kind::Exclusive)?;
        let claim = Arc::new(AtomicU8::new(TERM_WAITING));
        let (started_tx, started) = oneshot::channel();
        let (done_tx, done) = oneshot::channel();
        let term_worker = Worker {
            recorder: self.worker.recorder.clone(),
            register: RegisterClient::new(self.config.register, REGISTER_TIMEOUT),
            gate: self.worker.gate.clone(),
        };
        let slot = (started_tx, done_tx, term_worker);
        let work = first_term(claim.clone(), slot, hold_for);
        let campaign = self.locks.leader(LEADER_KEY).and_then(|campaign| {
            campaign
                .retry_delays(CAMPAIGN_RETRY.0, CAMPAIGN_RETRY.1)
                .start(work)
        });
        let leadership = match campaign {
            Ok(leadership) => leadership,
            Err(error) => return self.refused(&attempts, &error).await,
        };
        let began = match tokio::time::timeout(ACQUIRE_TIMEOUT, started).await {
            Ok(began) => began.is_ok(),
            // A term that began as the wait ran out is led all the same.
            Err(_) => claim
                .compare_exchange(
                    TERM_WAITING,
                    TERM_ABANDONED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err(),
        };
        if !began {
            let lost = claim.load(Ordering::Acquire) == TERM_CLAIMED;
            return self.no_term(&attempts, lost, leadership).await;
        }
        let recorder = &self.worker.recorder;
        match done.await {
            // The term's work returned and recorded the release's invoke.
            Ok(outcome) => outcome?,
            // The term was lost and its work dropped: the campaign gives the lock up now.
            Err(_) => {
                recorder.record(recorder.event(Phase::Invoke, OpKind::Release, LEADER_KEY))?
            }
        }
        let resigned = leadership.resign().await;
        self.worker.hold(None);
        self.worker.want(None);
        let done = match resigned {
            Ok(()) => recorder.event(Phase::Ok, OpKind::Release, LEADER_KEY),
            Err(error) => OpEvent {
                error: Some(error.to_string()),
                ..recorder.event(Phase::Fail, OpKind::Release, LEADER_KEY)
            },
        };
        recorder.record(done)
    }

    /// Resigns a campaign whose term's work never ran, and records its acquire: failed when no
    /// term began, unknown when one began and was `lost` before its work ran.
    async fn no_term(
        &self,
        attempts: &[OpEvent],
        lost: bool,
        leadership: Leadership,
    ) -> Result<(), CheckError> {
        let resigned = leadership.resign().await;
        self.worker.want(None);
        if lost {
            let recorder = &self.worker.recorder;
            let error = match resigned {
                Err(error) => error.to_string(),
                Ok(()) => "a term began and was lost before its work ran".to_string(),
            };
            return recorder.record(OpEvent {
                error: Some(error),
                ..recorder.event(Phase::Info, OpKind::Acquire, LEADER_KEY)
            });
        }
        let error = resigned.err().unwrap_or_else(|| {
            LockError::new(
                ErrorKind::Timeout,
                "no term began within the acquire timeout",
            )
        });
        self.refused(attempts, &error).await
    }
}

/// What a campaign runs with each term it wins: the first term takes `slot` and does the
/// round's work; a later one (won again before the client resigned) returns at once, which
/// releases it.
fn first_term(
    claim: Arc<AtomicU8>,
    slot: TermSlot,
    hold_for: Duration,
) -> impl FnMut(Term) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + 'static {
    let mut slot = Some(slot);
    move |term: Term| {
        let first = claim
            .compare_exchange(
                TERM_WAITING,
                TERM_CLAIMED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        let taken = if first { slot.take() } else { None };
        Box::pin(async move {
            let Some((started, done, mut worker)) = taken else {
                return;
            };
            let _ = started.send(());
            let _ = done.send(worker.lead(term, hold_for).await);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::{self, ViolationKind};
    use crate::register::Register;
    use lockingkit::MemoryStore;

    /// Whether `events` hold a granted hold of each kind: a key (exclusive or reader), a
    /// semaphore slot, a term, and a multi-key hold, whose grants are recorded as the first
    /// key's grant, the second key's invoke and its grant, nothing in between.
    fn every_kind(events: &[Event]) -> bool {
        let grant = |e: &Event| match e {
            Event::Op(op) if op.op == OpKind::Acquire && op.phase == Phase::Ok => Some(op.clone()),
            _ => None,
        };
        let grants: Vec<OpEvent> = events.iter().filter_map(grant).collect();
        let slot = grants.iter().any(|g| g.permits == Some(SEMAPHORE_PERMITS));
        let term = grants.iter().any(|g| g.key == LEADER_KEY);
        let key = grants
            .iter()
            .any(|g| g.permits.is_none() && g.key != LEADER_KEY);
        let multi = events.windows(3).any(|three| {
            let second_invoke = matches!(&three[1], Event::Op(op)
                if op.op == OpKind::Acquire && op.phase == Phase::Invoke);
            match (grant(&three[0]), grant(&three[2])) {
                (Some(first), Some(second)) => {
                    second_invoke && first.key < second.key && first.process == second.process
                }
                _ => false,
            }
        });
        slot && term && key && multi
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_records_every_kind_of_hold_as_operations_the_checker_passes(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let register = Register::start().await?;
        let events = Arc::new(Mutex::new(Vec::new()));
        let config = ClientConfig {
            process: 1,
            keys: crate::run::keys(3),
            register: register.address(),
            seed: 3,
            long_hold: Duration::from_millis(50),
        };
        let locks = DistributedLock::in_memory_shared(&MemoryStore::new());
        let journal = Journal::Shared(events.clone());
        let client = tokio::spawn(run(locks, config, journal, None));
        let snapshot = || {
            events
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        };
        // One client, no contention: a round takes tens of milliseconds, so every kind comes
        // within a few seconds; the bound only stops a broken client from hanging the test.
        let seen = tokio::time::timeout(Duration::from_secs(60), async {
            while !every_kind(&snapshot()) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        client.abort();
        let _ = client.await;
        assert!(
            seen.is_ok(),
            "not every kind of hold came: {:?}",
            snapshot().len()
        );
        let mut history = snapshot();
        history.extend(register.history());
        let report = checker::check(&history);
        assert!(report.passed(), "{:?}", report.violations);
        let writes = report
            .tally
            .ops
            .get(&("write".to_string(), "ok".to_string()));
        assert!(writes.is_some_and(|&n| n > 0));
        assert_eq!(report.count(ViolationKind::TokenOrder), 0);
        Ok(())
    }
}
