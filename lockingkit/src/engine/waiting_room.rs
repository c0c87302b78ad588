//! The local waiting room of one `DistributedLock`: how callers of a key enter, wait, hold and
//! wake one another, in each lock mode.
//!
//! A key has a queue per [`Lane`]: its exclusive lane (plain locks and writers), its readers'
//! lane, and one lane per semaphore count of the semaphore it names. Whoever is at the front of
//! a queue is its *active party*, the only caller of that queue who talks to the backend; the
//! others wait in first-come, first-served order, so twenty local callers make one stream of
//! requests, and when the active party leaves (release, loss, timeout, a dropped future) the
//! turn passes to the next at once, without a backoff sleep. The lanes differ in three answers:
//!
//! | lane | a caller enters | the holder keeps | the front waiter wakes on (besides its backoff and the backend's wait) |
//! |---|---|---|---|
//! | exclusive | the queue's turn when nobody here attempts, holds or waits for the key; else the back of the queue | the queue's turn: nobody else here attempts meanwhile | the turn passing; a local reader's release |
//! | readers | a turn of its own, attempting in parallel with other readers, unless readers here already wait (the key was busy for them): then the back of their queue | a turn of its own; the queue's turn passes on at once, so the next reader attempts | a local exclusive holder's release |
//! | semaphore of N | a turn of its own, unless callers here already wait for the semaphore: then the back of its queue | a turn of its own; the queue's turn passes on at once | a local slot holder's release |
//!
//! A caller on a turn of its own that is answered "busy" (or fails) does not poll on its own:
//! it becomes the front of its lane's queue, or joins its back ([`Turn::wait_here`]).
//!
//! # What a caller that cannot enter is told
//! A caller that finds a queue taken here (`try_acquire`, or a waiter whose time ran out) is
//! told only what there is evidence for. *Contended* needs evidence that someone holds the key:
//! it is held here, or the backend answered the latest attempt "busy". A failed latest attempt
//! is reported as that failure, with its cause. With no answer yet since the active party took
//! its turn, or while a holder's release is on its way, a `try_acquire` (or a waiter whose time
//! ran out) waits for that answer (single flight: it makes no request of its own, and a request
//! of its own would only be refused the same way), for at most the room's *patience*; a request
//! unanswered for longer than that is an outage, not contention. While the backend is failing,
//! the engine refuses such a caller at once instead (see `acquire`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::abandoned::{Abandoned, Gone};
use crate::backend::{BackendError, LockMode};

/// Which queue of a key a caller is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Lane {
    /// Plain locks and writers: one active party at a time, which keeps the turn while it holds.
    Exclusive,
    /// Readers: they hold together, and queue only while the key is busy for them.
    Readers,
    /// Holders of the semaphore of this count named by the key (a namespace of its own).
    Semaphore(u32),
}

impl Lane {
    pub(crate) fn of(mode: LockMode) -> Lane {
        match mode {
            LockMode::Exclusive => Lane::Exclusive,
            LockMode::Shared => Lane::Readers,
            LockMode::Semaphore { max_count } => Lane::Semaphore(max_count),
        }
    }

    /// The lane whose front waiter this lane's holders free something for when they leave.
    fn frees(self) -> Lane {
        match self {
            // A writer leaving lets readers in, and the last reader leaving lets a writer in.
            Lane::Exclusive => Lane::Readers,
            Lane::Readers => Lane::Exclusive,
            // A slot freed is a slot for the semaphore's next caller.
            Lane::Semaphore(count) => Lane::Semaphore(count),
        }
    }
}

#[derive(Debug)]
pub(crate) struct WaitingRoom {
    slots: Mutex<Slots>,
    next_id: AtomicU64,
    /// Turns of their own (readers and semaphore callers outside a queue) that are alive.
    own_turns: AtomicUsize,
    /// How long an attempt may go unanswered before callers that meet it are told the backend
    /// did not answer (the engine's `max_retry_delay`: a backend that answers takes far less).
    patience: Duration,
    /// Attempts whose callers went away, still running.
    abandoned: Arc<Abandoned>,
}

/// The queues of every key, by lane. The exclusive lane has a map of its own: it is the hot
/// path, looked up by `&str` without allocating. The others are created when a caller first
/// waits in them and dropped when empty, so memory follows the waits of now.
#[derive(Debug, Default)]
struct Slots {
    exclusive: HashMap<Arc<str>, Slot>,
    others: HashMap<Lane, HashMap<Arc<str>, Slot>>,
}

impl Slots {
    fn lane(&mut self, lane: Lane) -> Option<&mut HashMap<Arc<str>, Slot>> {
        match lane {
            Lane::Exclusive => Some(&mut self.exclusive),
            other => self.others.get_mut(&other),
        }
    }

    fn lane_or_new(&mut self, lane: Lane) -> &mut HashMap<Arc<str>, Slot> {
        match lane {
            Lane::Exclusive => &mut self.exclusive,
            other => self.others.entry(other).or_default(),
        }
    }

    fn get(&mut self, lane: Lane, key: &str) -> Option<&mut Slot> {
        self.lane(lane)?.get_mut(key)
    }

    /// Forgets the queue of `key` in `lane`, and the lane's map once it is empty.
    fn remove(&mut self, lane: Lane, key: &str) {
        let Some(map) = self.lane(lane) else { return };
        map.remove(key);
        if map.is_empty() && lane != Lane::Exclusive {
            self.others.remove(&lane);
        }
    }

    fn queues(&self) -> impl Iterator<Item = &Slot> {
        self.exclusive
            .values()
            .chain(self.others.values().flat_map(HashMap::values))
    }
}

#[derive(Debug)]
struct Slot {
    active: u64,
    /// What the latest backend attempt of this queue got; `None` before any.
    last_answer: Option<Answer>,
    /// Whether `last_answer` came from a party that has left. The key it took is no longer
    /// held here, so a caller that meets the queue waits for the next party's own answer; a
    /// busy or failed answer stays evidence until then.
    inherited: bool,
    /// When the active party's request in flight (an attempt, or the holder's release) was
    /// sent.
    sent: Option<Instant>,
    /// Whether the active party holds the lock (as opposed to attempting it).
    held: bool,
    queue: VecDeque<Waiter>,
    /// Asks the active party to attempt again now (see [`Turn::nudges`]); made on first use.
    nudge: Option<Arc<Notify>>,
    /// The next answer, for callers waiting for it (see [`Occupied::Pending`]); made on first
    /// use, and dropped when the answer is given or the turn passes, so that they look again.
    answers: Option<watch::Sender<Option<Answer>>>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    wake: Arc<Notify>,
}

/// What a backend attempt got.
#[derive(Clone, Debug)]
pub(crate) enum Answer {
    /// The lock.
    Took,
    /// "Busy".
    Busy,
    /// A failure: reported by the backend (a 5xx, a full lock table) or meeting nothing (see
    /// [`BackendError::reached`]), or a refusal without a request while the backend is failing.
    Failed(BackendError),
}

impl Answer {
    fn evidence(&self) -> WaitEvidence {
        match self {
            Answer::Took | Answer::Busy => WaitEvidence::Contended,
            Answer::Failed(cause) => WaitEvidence::Failing(cause.clone()),
        }
    }
}

/// What is known about a key that a caller could not enter.
#[derive(Clone, Debug)]
pub(crate) enum WaitEvidence {
    /// The lock is held here, or the backend answered the latest attempt that it was busy.
    Contended,
    /// The latest attempt failed, with this cause.
    Failing(BackendError),
    /// No attempt was answered: none finished, or the one in flight has gone unanswered for
    /// longer than the room's patience.
    Unanswered,
}

/// Why a caller could not enter a key, and what to do about it.
pub(crate) enum Occupied {
    /// What is known now.
    Known(WaitEvidence),
    /// Nothing yet: the active party's attempt has not been answered. Wait for that answer.
    Pending(AnswerWait),
}

/// A wait for the answer to the attempt in flight on a key (see [`Occupied::Pending`]).
pub(crate) struct AnswerWait {
    answers: watch::Receiver<Option<Answer>>,
    /// Past this, the attempt counts as unanswered.
    give_up: Instant,
}

impl AnswerWait {
    /// What the attempt found, or [`WaitEvidence::Unanswered`] if it stays unanswered for the
    /// room's patience; `None` if the turn passed on without an answer (look again).
    pub(crate) async fn evidence(mut self) -> Option<WaitEvidence> {
        let answered = self.answers.wait_for(Option::is_some);
        match tokio::time::timeout_at(self.give_up, answered).await {
            Ok(Ok(answer)) => answer.as_ref().map(Answer::evidence),
            Ok(Err(_)) => None,
            Err(_) => Some(WaitEvidence::Unanswered),
        }
    }
}

/// The result of [`WaitingRoom::enter`].
pub(crate) enum Arrival {
    /// Talk to the backend now: the queue's turn, or a turn of its own.
    Attempt(Turn),
    /// Someone here is ahead: wait for the turn.
    Queued(Ticket),
}

/// Where a caller stands after an attempt that did not take the lock.
pub(crate) enum Waiting {
    /// At the front of its queue: back off and attempt again.
    Front(Turn),
    /// Behind others in its queue: wait for the turn, then attempt at once.
    Queued(Ticket),
}

impl WaitingRoom {
    /// A room whose callers consider an attempt unanswered after `patience`.
    pub(crate) fn new(patience: Duration) -> Self {
        WaitingRoom {
            slots: Mutex::default(),
            next_id: AtomicU64::new(0),
            own_turns: AtomicUsize::new(0),
            patience,
            abandoned: Arc::default(),
        }
    }

    /// How long an attempt may go unanswered before it counts as an outage.
    pub(crate) fn patience(&self) -> Duration {
        self.patience
    }

    /// Resolves once no attempt on `key` whose caller went away is still running (or its win
    /// being released), or at `by`: what such an attempt does would be what the next caller of
    /// another lane finds (see `abandoned`).
    pub(crate) async fn abandoned_settled(&self, key: &str, by: Instant) {
        self.abandoned.settled(key, by).await;
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        // The maps are consistent after every statement that touches them, so a panic
        // elsewhere while they were locked cannot leave them half-updated.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn turn(self: &Arc<Self>, key: Arc<str>, id: u64, lane: Lane, place: Place) -> Turn {
        if let Place::Own { .. } = place {
            self.own_turns.fetch_add(1, Ordering::Relaxed);
        }
        Turn {
            room: self.clone(),
            key,
            id,
            lane,
            place,
        }
    }

    fn ticket(self: &Arc<Self>, key: Arc<str>, lane: Lane, slot: &mut Slot) -> Ticket {
        let id = self.new_id();
        let wake = Arc::new(Notify::new());
        slot.queue.push_back(Waiter {
            id,
            wake: wake.clone(),
        });
        Ticket {
            room: self.clone(),
            key,
            id,
            lane,
            wake,
            promoted: false,
        }
    }

    /// For one attempt at `key` in `lane` (`try_acquire`): the queue's turn, or a turn of its
    /// own for readers and semaphore callers, unless callers here are attempting, holding or
    /// waiting in the queue; then what is known about it.
    pub(crate) fn try_enter(self: &Arc<Self>, key: &str, lane: Lane) -> Result<Turn, Occupied> {
        let mut slots = self.slots();
        if lane != Lane::Exclusive {
            if let Some(slot) = slots.get(lane, key) {
                return Err(slot.occupied(self.patience));
            }
            drop(slots);
            return Ok(self.turn(Arc::from(key), self.new_id(), lane, Place::own()));
        }
        let key: Arc<str> = Arc::from(key);
        let id = self.new_id();
        // One hash lookup: the key is allocated up front because the turn needs it anyway.
        match slots.exclusive.entry(key.clone()) {
            std::collections::hash_map::Entry::Occupied(mut occupied) => {
                return Err(occupied.get_mut().occupied(self.patience))
            }
            std::collections::hash_map::Entry::Vacant(vacant) => {
                vacant.insert(Slot::new(id));
            }
        }
        drop(slots);
        Ok(self.turn(key, id, lane, Place::Front))
    }

    /// For a wait at `key` in `lane` (`acquire`): the queue's turn, a turn of its own (readers
    /// and semaphore callers while nobody here waits in their queue), or a place at the back.
    pub(crate) fn enter(self: &Arc<Self>, key: &str, lane: Lane) -> Arrival {
        let mut slots = self.slots();
        let shared_key = slots
            .lane(lane)
            .and_then(|map| map.get_key_value(key).map(|(k, _)| k.clone()));
        if let Some(shared_key) = shared_key {
            if let Some(slot) = slots.get(lane, key) {
                return Arrival::Queued(self.ticket(shared_key, lane, slot));
            }
        }
        let key: Arc<str> = Arc::from(key);
        if lane != Lane::Exclusive {
            drop(slots);
            return Arrival::Attempt(self.turn(key, self.new_id(), lane, Place::own()));
        }
        let id = self.new_id();
        slots.exclusive.insert(key.clone(), Slot::new(id));
        drop(slots);
        Arrival::Attempt(self.turn(key, id, lane, Place::Front))
    }

    /// Gives the turn of `id` in `lane` to the next waiter, or forgets the queue when nobody
    /// waits. A holder that leaves nudges the front waiter of the lane it frees.
    fn pass_on(&self, lane: Lane, key: &Arc<str>, id: u64) {
        let mut slots = self.slots();
        let Some(slot) = slots.get(lane, key) else {
            return;
        };
        if slot.active != id {
            return;
        }
        let was_holding = slot.held;
        match slot.queue.pop_front() {
            Some(next) => {
                slot.active = next.id;
                slot.held = false;
                // The last party's hold says nothing about whether the key is held now; its busy
                // or failed answer still says what the backend last said.
                slot.inherited = true;
                slot.sent = None;
                // Callers waiting for an answer look again.
                slot.answers = None;
                // A nudge meant for the party that left would only cost the next one an
                // attempt: it attempts as soon as it has the turn anyway.
                slot.nudge = None;
                next.wake.notify_one();
            }
            None => slots.remove(lane, key),
        }
        // Only an exclusive queue's front holds; readers and semaphore holders hold on turns of
        // their own, and nudge when those end.
        if was_holding && lane == Lane::Exclusive {
            nudge(&mut slots, lane.frees(), key);
        }
    }

    fn leave_queue(&self, lane: Lane, key: &Arc<str>, id: u64) -> bool {
        let mut slots = self.slots();
        let Some(slot) = slots.get(lane, key) else {
            return false;
        };
        if slot.active == id {
            return true;
        }
        slot.queue.retain(|w| w.id != id);
        false
    }

    fn update(&self, lane: Lane, key: &Arc<str>, id: u64, f: impl FnOnce(&mut Slot)) {
        let mut slots = self.slots();
        if let Some(slot) = slots.get(lane, key) {
            if slot.active == id {
                f(slot);
            }
        }
    }

    /// How many callers hold, attempt or wait for a lock here, each counted once: zero when
    /// nothing is held or going on (for diagnostics and leak checks).
    pub(crate) fn local_callers(&self) -> usize {
        let slots = self.slots();
        let queued: usize = slots.queues().map(|slot| 1 + slot.queue.len()).sum();
        queued + self.own_turns.load(Ordering::Relaxed)
    }

    /// How many callers wait in the exclusive queue of `key`.
    #[cfg(test)]
    pub(crate) fn queued(&self, key: &str) -> usize {
        self.slots()
            .get(Lane::Exclusive, key)
            .map_or(0, |s| s.queue.len())
    }

    /// How many callers are waiting for the lock `key` (writers and readers, not semaphores):
    /// the queues, plus their front callers while they attempt rather than hold.
    pub(crate) fn waiting(&self, key: &str) -> usize {
        let mut slots = self.slots();
        [Lane::Exclusive, Lane::Readers]
            .into_iter()
            .filter_map(|lane| {
                slots
                    .get(lane, key)
                    .map(|s| s.queue.len() + usize::from(!s.held))
            })
            .sum()
    }
}

/// Asks the front waiter of `key` in `lane` to attempt again now, if it listens for that.
fn nudge(slots: &mut Slots, lane: Lane, key: &str) {
    if let Some(nudge) = slots.get(lane, key).and_then(|slot| slot.nudge.as_ref()) {
        // A permit is kept if the party is not waiting yet, so a nudge is never lost.
        nudge.notify_one();
    }
}

impl Slot {
    /// Held here (the latest attempt took it) or answered "busy": contention. A failed latest
    /// attempt: that failure. No answer yet, or an attempt in flight for longer than
    /// `patience`: unanswered.
    fn evidence(&self, patience: Duration) -> WaitEvidence {
        // An attempt, or a holder's release, on its way for longer than a backend that answers
        // takes: nothing is known, and a holder whose release hangs is no evidence of contention.
        if self.sent.is_some_and(|sent| sent.elapsed() >= patience) {
            return WaitEvidence::Unanswered;
        }
        match &self.last_answer {
            Some(answer) => answer.evidence(),
            None => WaitEvidence::Unanswered,
        }
    }

    /// What a caller that cannot enter learns now, or the answer it should wait for.
    fn occupied(&mut self, patience: Duration) -> Occupied {
        let released = self.inherited && matches!(self.last_answer, Some(Answer::Took));
        // A holder whose release is on its way is giving the key up: what the caller should be
        // told comes after the release's answer, like an attempt's.
        let releasing = self.held && self.sent.is_some();
        if !releasing && (self.held || (self.last_answer.is_some() && !released)) {
            return Occupied::Known(self.evidence(patience));
        }
        let now = Instant::now();
        let give_up = crate::clock::after(self.sent.unwrap_or(now), patience);
        if give_up <= now {
            return Occupied::Known(WaitEvidence::Unanswered);
        }
        let answers = self
            .answers
            .get_or_insert_with(|| watch::channel(None).0)
            .subscribe();
        Occupied::Pending(AnswerWait { answers, give_up })
    }

    fn new(active: u64) -> Self {
        Slot {
            active,
            last_answer: None,
            inherited: false,
            sent: None,
            held: false,
            queue: VecDeque::new(),
            nudge: None,
            answers: None,
        }
    }
}

/// Where a turn stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// The active party of its lane's queue for the key.
    Front,
    /// A turn of its own, outside the queue: a reader or a semaphore caller attempting in
    /// parallel, or holding. A holder that leaves nudges the front waiter of the lane it frees.
    Own { holding: bool },
}

impl Place {
    fn own() -> Place {
        Place::Own { holding: false }
    }
}

/// The right to talk to the backend about a key in a lane, and later to hold it.
///
/// Dropping a `Turn` passes it to the next local waiter.
#[derive(Debug)]
pub(crate) struct Turn {
    room: Arc<WaitingRoom>,
    key: Arc<str>,
    id: u64,
    lane: Lane,
    place: Place,
}

impl Turn {
    pub(crate) fn key(&self) -> &Arc<str> {
        &self.key
    }

    /// After an attempt that did not take the lock: a queue's front stays there; a caller on a
    /// turn of its own becomes the front of its lane's queue, or joins its back, so that the
    /// callers here of a busy key make one stream of attempts.
    pub(crate) fn wait_here(self) -> Waiting {
        if self.place == Place::Front {
            return Waiting::Front(self);
        }
        let room = self.room.clone();
        let (key, lane) = (self.key.clone(), self.lane);
        let mut slots = room.slots();
        let map = slots.lane_or_new(lane);
        let waiting = match map.get_mut(&key) {
            Some(slot) => Waiting::Queued(room.ticket(key, lane, slot)),
            None => {
                let id = room.new_id();
                map.insert(key.clone(), Slot::new(id));
                Waiting::Front(room.turn(key, id, lane, Place::Front))
            }
        };
        drop(slots);
        // This turn of its own ends here; a caller that was not holding nudges nobody.
        drop(self);
        waiting
    }

    /// After an attempt that took the lock: what the holder keeps. An exclusive holder keeps
    /// the queue's turn; a reader or semaphore holder keeps a turn of its own, and the queue's
    /// turn passes on, so the next caller here attempts at once.
    pub(crate) fn into_holder(self) -> Turn {
        match (self.lane, self.place) {
            (Lane::Exclusive, _) => self,
            (lane, _) => {
                let holder = self.room.turn(
                    self.key.clone(),
                    self.room.new_id(),
                    lane,
                    Place::Own { holding: true },
                );
                drop(self);
                holder
            }
        }
    }

    /// The signal that asks this turn's holder, the front of its queue, to attempt again now
    /// (a local release that freed what it waits for). Made on first use; a nudge given before
    /// the holder waits is kept. `None` for a turn of its own, which never waits on it.
    pub(crate) fn nudges(&self) -> Option<Arc<Notify>> {
        if self.place != Place::Front {
            return None;
        }
        let mut slots = self.room.slots();
        let slot = slots.get(self.lane, &self.key)?;
        Some(
            slot.nudge
                .get_or_insert_with(|| Arc::new(Notify::new()))
                .clone(),
        )
    }

    /// Records that an attempt (or the holder's release) is on its way, for callers that meet
    /// it (see [`Occupied`]).
    pub(crate) fn note_sent(&self, at: Instant) {
        if self.place != Place::Front {
            return;
        }
        self.room
            .update(self.lane, &self.key, self.id, |slot| slot.sent = Some(at));
    }

    /// What the caller of this turn's attempt in flight leaves behind if it goes away before
    /// the answer (see [`CallerLeaving`]).
    pub(crate) fn leaving(&self, gone: Arc<Gone>) -> CallerLeaving {
        CallerLeaving {
            room: self.room.clone(),
            key: self.key.clone(),
            id: self.id,
            lane: self.lane,
            front: self.place == Place::Front,
            gone,
            armed: true,
        }
    }

    /// Records the answer to an attempt whose caller went away before it came: the key's state
    /// is recorded (held or not), but the answer is no evidence for anyone. It was read before
    /// callers waiting now arrived, and their own attempt, when the turn reaches them, tells
    /// them the truth; a release elsewhere since then would make it stale.
    pub(crate) fn note_abandoned_attempt(&self, answer: &Answer) {
        if self.place != Place::Front {
            return;
        }
        self.room.update(self.lane, &self.key, self.id, |slot| {
            // A lock won for nobody is released at once: callers that meet the key wait for
            // that release's answer, as for a holder's.
            slot.held = matches!(answer, Answer::Took);
            slot.sent = slot.held.then(Instant::now);
            // Callers waiting for an answer look again: the turn reaches them next.
            slot.answers = None;
            slot.last_answer = None;
            slot.inherited = false;
        });
    }

    /// Records the answer to the latest attempt, for callers that meet the key and queued
    /// waiters that time out, and whether the key is now held here. One lookup, since this
    /// runs on every attempt.
    pub(crate) fn note_attempt(&self, answer: Answer) {
        if self.place != Place::Front {
            return;
        }
        self.room.update(self.lane, &self.key, self.id, |slot| {
            slot.held = matches!(answer, Answer::Took);
            slot.sent = None;
            // Callers waiting for this answer get it; later ones wait for the next.
            if let Some(answers) = slot.answers.take() {
                answers.send_replace(Some(answer.clone()));
            }
            slot.last_answer = Some(answer);
            slot.inherited = false;
        });
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        match self.place {
            Place::Front => self.room.pass_on(self.lane, &self.key, self.id),
            Place::Own { holding } => {
                self.room.own_turns.fetch_sub(1, Ordering::Relaxed);
                if holding {
                    nudge(&mut self.room.slots(), self.lane.frees(), &self.key);
                }
            }
        }
    }
}

/// A place in the queue of a key.
///
/// Dropping a ticket leaves the queue; if the turn had already passed to it, the turn moves on.
#[derive(Debug)]
pub(crate) struct Ticket {
    room: Arc<WaitingRoom>,
    key: Arc<str>,
    id: u64,
    lane: Lane,
    wake: Arc<Notify>,
    /// Set once the turn has been taken, so dropping the ticket leaves the queue alone.
    promoted: bool,
}

impl Ticket {
    /// Waits until the turn passes to this ticket.
    pub(crate) async fn turn(mut self) -> Turn {
        loop {
            self.wake.notified().await;
            let mut slots = self.room.slots();
            if slots
                .get(self.lane, &self.key)
                .is_some_and(|s| s.active == self.id)
            {
                drop(slots);
                // The turn now owns the place; the ticket must not leave the queue again.
                self.promoted = true;
                return Turn {
                    room: self.room.clone(),
                    key: self.key.clone(),
                    id: self.id,
                    lane: self.lane,
                    place: Place::Front,
                };
            }
        }
    }

    /// A probe that tells, even after the ticket is gone, what is known about the key.
    pub(crate) fn evidence_handle(&self) -> EvidenceProbe {
        EvidenceProbe {
            room: self.room.clone(),
            key: self.key.clone(),
            lane: self.lane,
        }
    }
}

/// Reads what is known about a key, for a waiter that gives up.
pub(crate) struct EvidenceProbe {
    room: Arc<WaitingRoom>,
    key: Arc<str>,
    lane: Lane,
}

impl EvidenceProbe {
    /// For a waiter whose time ran out: what is known about the key, or the answer in flight
    /// to wait for (see [`Occupied`]).
    pub(crate) fn at_deadline(&self) -> Occupied {
        let patience = self.room.patience;
        let mut slots = self.room.slots();
        match slots.get(self.lane, &self.key) {
            Some(slot) => slot.occupied(patience),
            None => Occupied::Known(WaitEvidence::Contended),
        }
    }
}

/// Held by the caller while its attempt is in flight. If the caller goes away first (dropped,
/// or gave up on an unanswered attempt), the answers it had recorded for the key stop being
/// evidence for callers arriving later, and the attempt, finishing in the background, records
/// its answer with [`Turn::note_abandoned_attempt`].
pub(crate) struct CallerLeaving {
    room: Arc<WaitingRoom>,
    key: Arc<str>,
    id: u64,
    lane: Lane,
    front: bool,
    gone: Arc<Gone>,
    armed: bool,
}

impl CallerLeaving {
    /// The caller took the answer: nothing is left behind.
    pub(crate) fn stayed(mut self) {
        self.armed = false;
    }
}

impl Drop for CallerLeaving {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.gone.leave(self.room.abandoned.start(&self.key));
        if self.front {
            self.room.update(self.lane, &self.key, self.id, |slot| {
                slot.last_answer = None;
                slot.inherited = false;
            });
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.promoted {
            return;
        }
        if self.room.leave_queue(self.lane, &self.key, self.id) {
            // The turn reached us as we were leaving: hand it on so nobody waits forever.
            self.room.pass_on(self.lane, &self.key, self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room() -> Arc<WaitingRoom> {
        Arc::new(WaitingRoom::new(Duration::from_secs(1)))
    }

    /// The turn of `ticket`, failing the test (on paused time, at once) if it never comes.
    async fn turn_of(ticket: Ticket) -> Turn {
        match tokio::time::timeout(Duration::from_secs(60), ticket.turn()).await {
            Ok(turn) => turn,
            Err(_) => panic!("the turn never reached a waiter"),
        }
    }

    fn front(arrival: Arrival) -> Turn {
        match arrival {
            Arrival::Attempt(turn) => turn,
            Arrival::Queued(_) => panic!("expected the turn"),
        }
    }

    fn queued(arrival: Arrival) -> Ticket {
        match arrival {
            Arrival::Queued(ticket) => ticket,
            Arrival::Attempt(_) => panic!("expected a place in the queue"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn turns_pass_in_arrival_order() {
        let room = room();
        let first = front(room.enter("k", Lane::Exclusive));
        let tickets: Vec<Ticket> = (0..3)
            .map(|_| queued(room.enter("k", Lane::Exclusive)))
            .collect();
        assert_eq!(room.queued("k"), 3);
        assert!(
            room.try_enter("k", Lane::Exclusive).is_err(),
            "try_enter must not jump the queue"
        );
        let ids: Vec<u64> = tickets.iter().map(|t| t.id).collect();
        drop(first);
        let mut served = Vec::new();
        for ticket in tickets {
            let turn = turn_of(ticket).await;
            served.push(turn.id);
        }
        assert_eq!(served, ids);
        assert_eq!(room.local_callers(), 0, "the last turn forgets the key");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_leaves_the_queue_takes_nothing_from_the_holder_or_the_others() {
        let room = room();
        let holder = front(room.enter("k", Lane::Exclusive));
        holder.note_attempt(Answer::Took);
        let leaving = queued(room.enter("k", Lane::Exclusive));
        let staying = queued(room.enter("k", Lane::Exclusive));
        drop(leaving);
        assert_eq!(room.queued("k"), 1);
        assert_eq!(room.waiting("k"), 1, "the holder still holds; one waits");
        let early = tokio::time::timeout(Duration::from_secs(1), staying.turn()).await;
        assert!(early.is_err(), "the turn stays with the holder");
        drop(holder);
        assert_eq!(room.local_callers(), 0, "the one waiter left too");
    }

    #[tokio::test(start_paused = true)]
    async fn a_ticket_dropped_after_the_turn_reached_it_hands_the_turn_on() {
        let room = room();
        let first = front(room.enter("k", Lane::Exclusive));
        let second = queued(room.enter("k", Lane::Exclusive));
        let third = queued(room.enter("k", Lane::Exclusive));
        drop(first); // the turn moves to `second`, which never looks
        drop(second);
        let turn = turn_of(third).await;
        drop(turn);
        assert_eq!(room.local_callers(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn readers_attempt_together_until_one_is_answered_busy_then_queue_behind_it() {
        let room = room();
        let a = front(room.enter("k", Lane::Readers));
        let b = front(room.enter("k", Lane::Readers));
        assert_eq!(
            room.local_callers(),
            2,
            "two readers attempting in parallel"
        );
        // `a` is answered busy: it becomes the front of the readers' queue; `b` too, behind it.
        let Waiting::Front(a) = a.wait_here() else {
            panic!("the first busy reader fronts the queue")
        };
        a.note_attempt(Answer::Busy);
        let Waiting::Queued(b) = b.wait_here() else {
            panic!("the second queues")
        };
        // A new reader queues too, and a try is told what the front found.
        let c = queued(room.enter("k", Lane::Readers));
        assert!(matches!(
            room.try_enter("k", Lane::Readers),
            Err(Occupied::Known(WaitEvidence::Contended))
        ));
        // The front takes the key: it holds on a turn of its own, and `b` attempts at once.
        let holder = a.into_holder();
        let b = turn_of(b).await;
        assert_eq!(
            room.local_callers(),
            3,
            "the holder, the front and one queued"
        );
        drop((holder, b, c));
        assert_eq!(room.local_callers(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_leaving_nudges_the_front_waiter_of_the_lane_it_frees() {
        let room = room();
        let writer = front(room.enter("k", Lane::Exclusive));
        writer.note_attempt(Answer::Took);
        let reader = front(room.enter("k", Lane::Readers));
        let Waiting::Front(reader) = reader.wait_here() else {
            panic!("front")
        };
        let nudged = reader.nudges().expect("a front waiter listens");
        drop(writer);
        tokio::time::timeout(Duration::from_secs(1), nudged.notified())
            .await
            .expect("the writer's release nudges the readers' front");

        // A slot holder leaving nudges the semaphore's front waiter.
        let holder = front(room.enter("s", Lane::Semaphore(2))).into_holder();
        let waiter = front(room.enter("s", Lane::Semaphore(2)));
        let Waiting::Front(waiter) = waiter.wait_here() else {
            panic!("front")
        };
        let nudged = waiter.nudges().expect("listens");
        drop(holder);
        tokio::time::timeout(Duration::from_secs(1), nudged.notified())
            .await
            .expect("a freed slot nudges the semaphore's front");
        // Semaphores of another count share nothing.
        assert!(room.try_enter("s", Lane::Semaphore(3)).is_ok());
    }
}
