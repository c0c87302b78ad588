//! The per-key queue of local callers inside one `DistributedLock`.
//!
//! Each key has at most one *active* party: the caller attempting it at the backend, or the
//! handle holding it. Everyone else waits in first-come, first-served order and never talks to
//! the backend, so twenty local callers make one stream of requests. When the active party
//! leaves (release, loss, timeout or a dropped future) the turn passes to the next waiter at
//! once, without a backoff sleep.
//!
//! # What a caller that cannot enter is told
//! A caller that finds the key taken here (`try_acquire`, or a waiter whose time ran out) is
//! told only what there is evidence for. *Contended* needs evidence that someone holds the key:
//! it is held here, or the backend answered the latest attempt "busy". A failed latest attempt
//! is reported as that failure, with its cause. With no answer yet since the active party took
//! its turn, or while a holder's release is on its way, a `try_acquire` waits for that answer
//! (single flight: it makes no request of its own, and a request of its own would only be
//! refused the same way), for at most the room's *patience*; a request unanswered for longer
//! than that is an outage, not contention.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::backend::BackendError;

#[derive(Debug)]
pub(crate) struct WaitingRoom {
    slots: Mutex<HashMap<Arc<str>, Slot>>,
    next_id: AtomicU64,
    /// Turns of their own lane (see [`WaitingRoom::own_lane`]) that are still alive.
    lanes: AtomicUsize,
    /// How long an attempt may go unanswered before callers that meet it are told the backend
    /// did not answer (the engine's `max_retry_delay`: a backend that answers takes far less).
    patience: Duration,
}

#[derive(Debug)]
struct Slot {
    active: u64,
    /// What the latest backend attempt for this key got; `None` before any.
    last_answer: Option<Answer>,
    /// Whether `last_answer` came from a party that has left. The key it took is no longer
    /// held here, so a caller that meets the key waits for the next party's own answer; a
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
    /// use, and dropped when the turn passes so that they look again.
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

impl WaitingRoom {
    /// A room whose callers consider an attempt unanswered after `patience`.
    pub(crate) fn new(patience: Duration) -> Self {
        WaitingRoom {
            slots: Mutex::default(),
            next_id: AtomicU64::new(0),
            lanes: AtomicUsize::new(0),
            patience,
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<Arc<str>, Slot>> {
        // The map is consistent after every statement that touches it, so a panic elsewhere
        // while it was locked cannot leave it half-updated.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes the turn for `key` if nobody here is attempting, holding or waiting for it;
    /// otherwise says what is known about the key.
    pub(crate) fn try_enter(self: &Arc<Self>, key: &str) -> Result<Turn, Occupied> {
        let key: Arc<str> = Arc::from(key);
        let id = self.new_id();
        // One hash lookup: the key is allocated up front because the turn needs it anyway.
        match self.slots().entry(key.clone()) {
            std::collections::hash_map::Entry::Occupied(mut occupied) => {
                return Err(occupied.get_mut().occupied(self.patience))
            }
            std::collections::hash_map::Entry::Vacant(vacant) => {
                vacant.insert(Slot::new(id));
            }
        }
        Ok(Turn {
            room: self.clone(),
            key,
            id,
            own_lane: false,
            nudges: None,
        })
    }

    /// A turn outside the key's queue, for a party that does not exclude the others: a reader,
    /// or a semaphore holder. Readers never wait for each other here, and how many semaphore
    /// holders fit is the backend's answer; the turn only counts the party as active until it
    /// is dropped.
    pub(crate) fn own_lane(self: &Arc<Self>, key: &str) -> Turn {
        self.lanes.fetch_add(1, Ordering::Relaxed);
        Turn {
            room: self.clone(),
            key: Arc::from(key),
            id: self.new_id(),
            own_lane: true,
            nudges: None,
        }
    }

    /// Takes the turn for `key` at once, or joins the back of its queue.
    pub(crate) fn enter(self: &Arc<Self>, key: &str) -> Arrival {
        let mut slots = self.slots();
        let id = self.new_id();
        let shared_key = slots.get_key_value(key).map(|(k, _)| k.clone());
        if let Some((key, slot)) = shared_key.and_then(|k| slots.get_mut(&k).map(|s| (k, s))) {
            let wake = Arc::new(Notify::new());
            slot.queue.push_back(Waiter {
                id,
                wake: wake.clone(),
            });
            return Arrival::Queued(Ticket {
                room: self.clone(),
                key: key.clone(),
                id,
                wake,
                promoted: false,
            });
        }
        let key: Arc<str> = Arc::from(key);
        slots.insert(key.clone(), Slot::new(id));
        Arrival::Front(Turn {
            room: self.clone(),
            key,
            id,
            own_lane: false,
            nudges: None,
        })
    }

    /// Gives the turn of `id` to the next waiter, or forgets the key when nobody waits.
    fn pass_on(&self, key: &Arc<str>, id: u64) {
        let mut slots = self.slots();
        let std::collections::hash_map::Entry::Occupied(mut occupied) = slots.entry(key.clone())
        else {
            return;
        };
        let slot = occupied.get_mut();
        if slot.active != id {
            return;
        }
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
            None => {
                occupied.remove();
            }
        }
    }

    fn leave_queue(&self, key: &Arc<str>, id: u64) -> bool {
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(key) else {
            return false;
        };
        if slot.active == id {
            return true;
        }
        slot.queue.retain(|w| w.id != id);
        false
    }

    fn update(&self, key: &Arc<str>, id: u64, f: impl FnOnce(&mut Slot)) {
        let mut slots = self.slots();
        if let Some(slot) = slots.get_mut(key) {
            if slot.active == id {
                f(slot);
            }
        }
    }

    fn evidence(&self, key: &Arc<str>) -> WaitEvidence {
        let slots = self.slots();
        match slots.get(key) {
            Some(slot) => slot.evidence(self.patience),
            // The key was freed in the instant before we looked: it was contended until then.
            None => WaitEvidence::Contended,
        }
    }

    /// What is known about `key` if a caller here is attempting, holding or waiting for it.
    pub(crate) fn occupied(&self, key: &str) -> Option<Occupied> {
        self.slots()
            .get_mut(key)
            .map(|slot| slot.occupied(self.patience))
    }

    /// Asks the active party of `key` to attempt again now, if it listens for that.
    fn nudge(&self, key: &str) {
        let nudge = self.slots().get(key).and_then(|slot| slot.nudge.clone());
        if let Some(nudge) = nudge {
            // A permit is kept if the party is not waiting yet, so a nudge is never lost.
            nudge.notify_one();
        }
    }

    /// How many keys have an active party or waiters, plus the parties in lanes of their own
    /// (for tests and leak checks).
    pub(crate) fn active_keys(&self) -> usize {
        self.slots().len() + self.lanes.load(Ordering::Relaxed)
    }

    /// How many callers wait in the queue of `key`.
    #[cfg(test)]
    pub(crate) fn queued(&self, key: &str) -> usize {
        self.slots().get(key).map_or(0, |s| s.queue.len())
    }

    /// How many callers are waiting for `key`: the queue, plus the front caller while it is
    /// still attempting rather than holding.
    pub(crate) fn waiting(&self, key: &str) -> usize {
        self.slots()
            .get(key)
            .map_or(0, |s| s.queue.len() + usize::from(!s.held))
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

/// The result of [`WaitingRoom::enter`].
pub(crate) enum Arrival {
    /// Nobody else had the key: talk to the backend.
    Front(Turn),
    /// Someone here has the key: wait for the turn.
    Queued(Ticket),
}

/// The right to talk to the backend about a key, and later to hold it.
///
/// Dropping a `Turn` passes it to the next local waiter.
#[derive(Debug)]
pub(crate) struct Turn {
    room: Arc<WaitingRoom>,
    key: Arc<str>,
    id: u64,
    /// A turn of its own lane, outside the key's queue.
    own_lane: bool,
    /// The room, and the key in it, whose active party this turn nudges when it ends.
    nudges: Option<(Arc<WaitingRoom>, Arc<str>)>,
}

impl Turn {
    pub(crate) fn key(&self) -> &Arc<str> {
        &self.key
    }

    /// Makes this turn, when it ends, nudge whoever is active for `key` in `room`: a semaphore
    /// holder that leaves tells the local waiter polling that semaphore to try now.
    pub(crate) fn nudging(mut self, room: Arc<WaitingRoom>, key: Arc<str>) -> Turn {
        self.nudges = Some((room, key));
        self
    }

    /// The signal another party's [`nudging`](Self::nudging) turn gives this turn's holder
    /// when it ends. Made on first use; a nudge given before the holder waits is kept.
    /// Only the key's active party asks for it.
    pub(crate) fn nudges(&self) -> Arc<Notify> {
        let mut slots = self.room.slots();
        match slots.get_mut(&self.key) {
            Some(slot) => slot
                .nudge
                .get_or_insert_with(|| Arc::new(Notify::new()))
                .clone(),
            // The key is forgotten only once its active party has gone: nothing nudges it.
            None => Arc::new(Notify::new()),
        }
    }

    /// Records that an attempt (or the holder's release) is on its way, for callers that meet
    /// it (see [`Occupied`]).
    pub(crate) fn note_sent(&self, at: Instant) {
        if self.own_lane {
            return;
        }
        self.room
            .update(&self.key, self.id, |slot| slot.sent = Some(at));
    }

    /// Records the answer to the latest attempt, for callers that meet the key and queued
    /// waiters that time out, and whether the key is now held here. One lookup, since this
    /// runs on every attempt.
    pub(crate) fn note_attempt(&self, answer: Answer) {
        if self.own_lane {
            return;
        }
        self.room.update(&self.key, self.id, |slot| {
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
        if self.own_lane {
            self.room.lanes.fetch_sub(1, Ordering::Relaxed);
        } else {
            self.room.pass_on(&self.key, self.id);
        }
        if let Some((room, key)) = &self.nudges {
            room.nudge(key);
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
                .get_mut(&self.key)
                .is_some_and(|s| s.active == self.id)
            {
                drop(slots);
                let turn = Turn {
                    room: self.room.clone(),
                    key: self.key.clone(),
                    id: self.id,
                    own_lane: false,
                    nudges: None,
                };
                // The turn now owns the place; the ticket must not leave the queue again.
                self.promoted = true;
                return turn;
            }
        }
    }

    /// A probe that tells, even after the ticket is gone, what is known about the key.
    pub(crate) fn evidence_handle(&self) -> EvidenceProbe {
        EvidenceProbe {
            room: self.room.clone(),
            key: self.key.clone(),
        }
    }
}

/// Reads what is known about a key, for a waiter that gives up.
pub(crate) struct EvidenceProbe {
    room: Arc<WaitingRoom>,
    key: Arc<str>,
}

impl EvidenceProbe {
    pub(crate) fn read(&self) -> WaitEvidence {
        self.room.evidence(&self.key)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.promoted {
            return;
        }
        if self.room.leave_queue(&self.key, self.id) {
            // The turn reached us as we were leaving: hand it on so nobody waits forever.
            self.room.pass_on(&self.key, self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The turn of `ticket`, failing the test (on paused time, at once) if it never comes.
    async fn turn_of(ticket: Ticket) -> Turn {
        match tokio::time::timeout(std::time::Duration::from_secs(60), ticket.turn()).await {
            Ok(turn) => turn,
            Err(_) => panic!("the turn never reached a waiter"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn turns_pass_in_arrival_order() {
        let room = Arc::new(WaitingRoom::new(std::time::Duration::from_secs(1)));
        let Arrival::Front(first) = room.enter("k") else {
            panic!("the first caller must be in front")
        };
        let mut tickets = Vec::new();
        for _ in 0..3 {
            match room.enter("k") {
                Arrival::Queued(t) => tickets.push(t),
                Arrival::Front(_) => panic!("later callers must queue"),
            }
        }
        assert_eq!(room.queued("k"), 3);
        assert!(
            room.try_enter("k").is_err(),
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
        assert_eq!(room.active_keys(), 0, "the last turn forgets the key");
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_leaves_the_queue_takes_nothing_from_the_holder_or_the_others() {
        let room = Arc::new(WaitingRoom::new(std::time::Duration::from_secs(1)));
        let Arrival::Front(holder) = room.enter("k") else {
            panic!("front")
        };
        holder.note_attempt(Answer::Took);
        let Arrival::Queued(leaving) = room.enter("k") else {
            panic!("queued")
        };
        let Arrival::Queued(staying) = room.enter("k") else {
            panic!("queued")
        };
        drop(leaving);
        assert_eq!(room.queued("k"), 1);
        assert_eq!(room.waiting("k"), 1, "the holder still holds; one waits");
        let early = tokio::time::timeout(std::time::Duration::from_secs(1), staying.turn()).await;
        assert!(early.is_err(), "the turn stays with the holder");
        drop(holder);
        assert_eq!(room.active_keys(), 0, "the one waiter left too");
    }

    #[tokio::test(start_paused = true)]
    async fn a_ticket_dropped_after_the_turn_reached_it_hands_the_turn_on() {
        let room = Arc::new(WaitingRoom::new(std::time::Duration::from_secs(1)));
        let Arrival::Front(first) = room.enter("k") else {
            panic!("front")
        };
        let Arrival::Queued(second) = room.enter("k") else {
            panic!("queued")
        };
        let Arrival::Queued(third) = room.enter("k") else {
            panic!("queued")
        };
        drop(first); // the turn moves to `second`, which never looks
        drop(second);
        let turn = turn_of(third).await;
        drop(turn);
        assert_eq!(room.active_keys(), 0);
    }
}
