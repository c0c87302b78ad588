//! Queue places: first come, first served across processes, for writers and readers alike.
//!
//! A caller that goes on waiting after a busy answer gets a *place*: a key of its own in the
//! lock's directory (under `w/` for a writer, `r/` for a reader), whose create revision is its
//! place in line, as in etcd's reader-writer recipe:
//!
//! - a **writer's** place holds once no older key of the directory is left (no holder, no
//!   place ahead of it, reader or writer);
//! - a **reader's** place holds once no older *writer* key is left: readers never wait for
//!   readers, and a writer that queued before a reader goes first.
//!
//! Both stay true once true (newer keys only appear behind), so one read decides. A newcomer's
//! first attempt creates its key only where it would hold at once (a writer in an empty
//! directory, a reader where no writer is), so it never overtakes anyone in line, and a busy
//! answer writes nothing. Neither side starves: every caller is served in the order its key was
//! created, and readers in line together hold together.
//!
//! # Whose place is it
//! A place belongs to the **wait** of one engine for one key on one side: the engine's waiting
//! room lets one front waiter per key and lane talk to the backend, and it makes a release
//! hint in that lane's mode before each of its attempts (`release_hint(key, mode)`, then
//! `try_acquire(key, mode)`). So the places of a backend are kept per clone — each
//! `DistributedLock` owns its clone, so another engine never sees them — and per key and side,
//! and a wait lives while a hint of its key and side does. An attempt claims the place
//! exclusively (no other attempt reads or takes it meanwhile). Another engine never sees the
//! place, and its own engine attempts a key in a mode only through its lane's one active
//! party, so whichever attempt of this clone claims it stands where this process queued —
//! including a `try_acquire` right after the wait ended, which would otherwise be told "busy"
//! by a place nobody waits on. Readers attempting side by side while their
//! front waiter stands in line may take its place in turn: whichever holds through it, the
//! others go on in line.
//!
//! Nothing tells the backend that a wait ended: a wait whose hints are all gone for [`GRACE`]
//! has. The local waiter that takes the turn from one that gave up within that instant takes
//! its place in line too, which is where this process stood when it queued.
//!
//! # A place's life
//! The place is made when the wait's hint is first polled after a busy answer (so an attempt
//! that wins costs nothing): one transaction writes the key and reads the key just ahead of
//! it, which the backend's one watch stream then watches. When that key is deleted the waiter
//! is woken, and its next attempt reads whether its place holds now (or which key is ahead of it
//! now). A place made first in line wakes its waiter at once. A wait that ends without its
//! place becoming the hold (timed out, dropped) leaves no hint behind: [`GRACE`] later its place
//! is deleted, which in turn wakes whoever is behind it. The backend keeps its lease alive
//! while it has places (see `lease`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};
use tokio::sync::watch;
use tokio::time::Instant;

use super::attempt::{gets, send_txn};
use super::layout::{entry, range_end, LockDirectory};
use super::lease::LeaseGeneration;
use super::members::Resend;
use super::strays::Stray;
use super::watch::{Interest, Sink};
use super::Inner;
use crate::backend::LockMode;

/// How long a wait with no hint keeps its place: the engine drops a round's hint and makes the
/// next one in the same step, so a wait between two rounds has none only for an instant; one
/// that stays without a hint this long has ended.
pub(super) const GRACE: Duration = Duration::from_millis(100);

/// The side of a reader-writer lock a caller stands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Side {
    Writer,
    Reader,
}

impl Side {
    /// The side of a lock in `mode`; `None` for a semaphore, which has no queue places.
    pub(super) fn of(mode: LockMode) -> Option<Side> {
        match mode {
            LockMode::Exclusive => Some(Side::Writer),
            LockMode::Shared => Some(Side::Reader),
            LockMode::Semaphore { .. } => None,
        }
    }

    /// The keys a place of this side waits for: every older key of the lock for a writer,
    /// every older writer for a reader.
    pub(super) fn ahead_range(self, directory: &LockDirectory) -> &[u8] {
        match self {
            Side::Writer => &directory.all,
            Side::Reader => &directory.writers,
        }
    }

    /// Where this side's keys live.
    pub(super) fn within(self, directory: &LockDirectory) -> &[u8] {
        match self {
            Side::Writer => &directory.writers,
            Side::Reader => &directory.readers,
        }
    }
}

/// The queue places of one clone of the backend, by wait.
#[derive(Default)]
pub(super) struct Line {
    waits: Mutex<HashMap<WaitId, Wait>>,
    sweeping: AtomicBool,
    next_serial: AtomicU64,
    /// Set once this clone is shut down or dropped.
    pub(super) closed: AtomicBool,
}

/// One wait of this clone's engine: a key, and the side it waits on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct WaitId {
    key: String,
    side: Side,
}

impl WaitId {
    /// The wait for `key` on `side`.
    pub(super) fn new(key: &str, side: Side) -> Self {
        WaitId {
            key: key.to_owned(),
            side,
        }
    }

    /// The LockingKit key waited for.
    pub(super) fn key(&self) -> &str {
        &self.key
    }

    /// The side waited on.
    pub(super) fn side(&self) -> Side {
        self.side
    }
}

struct Wait {
    /// Tells this wait from a later one with the same id.
    serial: u64,
    /// Live release hints: one per attempt round of the front waiter (more while readers
    /// attempt side by side).
    hints: usize,
    /// When the last hint went.
    idle_since: Option<Instant>,
    /// Wakes the wait's hint.
    wake: Arc<watch::Sender<()>>,
    /// An attempt of this wait answered busy, so it wants a place.
    wants: bool,
    slot: Slot,
}

enum Slot {
    Absent,
    Making,
    Ready(Place),
    /// An attempt has it.
    Claimed,
}

/// A place in line: the waiter's key, its create revision, its lease.
pub(super) struct Place {
    pub(super) key: Vec<u8>,
    pub(super) revision: i64,
    pub(super) generation: Arc<LeaseGeneration>,
    /// The watch of the key just ahead, if the place has one: its id and that key.
    ahead: Option<(i64, Vec<u8>)>,
}

/// Which slot a place being made is for: its wait (and which one of that id).
struct Making {
    id: WaitId,
    serial: u64,
}

/// A place just written: the key just ahead of it, if any, read at revision `after`.
struct Written {
    place: Place,
    ahead: Option<Vec<u8>>,
    after: i64,
}

/// A place taken by one attempt, to be given back with [`Inner::settle`].
pub(super) struct Claimed {
    pub(super) place: Place,
    wait: WaitId,
    serial: u64,
}

impl Claimed {
    /// The side the place stands on.
    pub(super) fn side(&self) -> Side {
        self.wait.side
    }
}

/// What a queued attempt read.
pub(super) enum Turn {
    /// Nothing is ahead any more: the place is the hold now.
    Held,
    /// `ahead` is the key just ahead; `after` the revision the read saw.
    Waiting { ahead: Vec<u8>, after: i64 },
    /// The place's key is gone (its lease expired): the wait makes a new one.
    PlaceGone,
}

impl Line {
    fn waits(&self) -> MutexGuard<'_, HashMap<WaitId, Wait>> {
        // Every critical section leaves the map consistent.
        self.waits.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Places standing in this clone's line (ready, being read, or being made).
    pub(super) fn places(&self) -> usize {
        self.waits()
            .values()
            .filter(|wait| !matches!(wait.slot, Slot::Absent))
            .count()
    }

    /// Empties the line (its clone shuts down): the ready places, their watches removed, to be
    /// deleted. Places being made or read are deleted by their makers and readers, which find
    /// their waits gone.
    pub(super) fn take_all(&self, backend: &Inner) -> Vec<Place> {
        let waits = std::mem::take(&mut *self.waits());
        let mut places = Vec::new();
        for wait in waits.into_values() {
            if let Slot::Ready(mut place) = wait.slot {
                if let Some((watch, _)) = place.ahead.take() {
                    backend.watches.remove(watch);
                }
                places.push(place);
            }
        }
        places
    }

    /// The wait `id` answered busy: it wants a place.
    pub(super) fn wants_place(&self, id: &WaitId) {
        if let Some(wait) = self.waits().get_mut(id).filter(|w| w.hints > 0) {
            wait.wants = true;
        }
    }
}

impl Inner {
    /// The release hint of `key` in `mode` for this clone's wait (see the module docs). A
    /// semaphore's never resolves: its waiters poll.
    pub(super) fn hint(
        self: &Arc<Self>,
        line: &Arc<Line>,
        key: &str,
        mode: LockMode,
    ) -> impl Future<Output = ()> + Send + 'static {
        let hint = Side::of(mode).map(|side| self.wait_hint(line, WaitId::new(key, side)));
        async move {
            match hint {
                Some(hint) => hint.await,
                None => std::future::pending().await,
            }
        }
    }

    /// The hint of the wait `id`: counts as one live hint of the wait until dropped, makes the
    /// places the wait wants when first polled, and resolves when its place is woken.
    fn wait_hint(
        self: &Arc<Self>,
        line: &Arc<Line>,
        id: WaitId,
    ) -> impl Future<Output = ()> + Send + 'static {
        let mut receiver = {
            let mut waits = line.waits();
            let wait = waits.entry(id.clone()).or_insert_with(|| Wait {
                serial: line.next_serial.fetch_add(1, Ordering::Relaxed),
                hints: 0,
                idle_since: None,
                wake: Arc::new(watch::channel(()).0),
                wants: false,
                slot: Slot::Absent,
            });
            wait.hints = wait.hints.saturating_add(1);
            wait.idle_since = None;
            wait.wake.subscribe()
        };
        let guard = HintGuard {
            backend: Arc::downgrade(self),
            line: line.clone(),
            id,
        };
        let backend = self.clone();
        async move {
            backend.make_wanted_places(&guard.line, &guard.id);
            drop(backend);
            if receiver.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            drop(guard);
        }
    }

    /// Starts making the place the wait `id` wants, if it has none.
    fn make_wanted_places(self: &Arc<Self>, line: &Arc<Line>, id: &WaitId) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut waits = line.waits();
        let Some(wait) = waits.get_mut(id) else {
            return;
        };
        if wait.wants && matches!(wait.slot, Slot::Absent) {
            wait.slot = Slot::Making;
            let ticket = Making {
                id: id.clone(),
                serial: wait.serial,
            };
            runtime.spawn(self.clone().make_place(line.clone(), ticket));
        }
    }

    /// Writes a place and stands it in line, or deletes it if its wait ended meanwhile.
    async fn make_place(self: Arc<Self>, line: Arc<Line>, ticket: Making) {
        let directory = LockDirectory::new(&self.key_prefix, &ticket.id.key);
        let orphan = match self.write_place(&directory, ticket.id.side).await {
            Some(written) => self.stand_in_line(&line, &ticket, written),
            None => {
                self.unmake(&line, &ticket);
                None
            }
        };
        if let Some(place) = orphan {
            self.delete_place(place).await;
        }
    }

    /// The place, written; `None` if it could not be (left to the background deletes if it may
    /// have been).
    async fn write_place(
        self: &Arc<Self>,
        directory: &LockDirectory,
        side: Side,
    ) -> Option<Written> {
        let generation = self.lease.fresh(&self.members).await.ok()?;
        let key = entry(side.within(directory), &generation.next_entry_id());
        let ahead = side.ahead_range(directory);
        let newest = GetOptions::new()
            .with_range(range_end(ahead))
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1)
            .with_keys_only();
        let txn = Txn::new().and_then([
            TxnOp::get(ahead.to_vec(), Some(newest)),
            TxnOp::put(
                key.clone(),
                Vec::new(),
                Some(PutOptions::new().with_lease(generation.id)),
            ),
        ]);
        // Not sent again after a lost answer: a second put would be read as a place of its own.
        let answer = match send_txn(&self.members, "queue place", Resend::IfUnapplied, txn).await {
            Ok(answer) => answer,
            Err(failure) => {
                if failure.error.kind() == crate::BackendErrorKind::LeaseGone {
                    generation.mark_gone();
                } else if !failure.had_no_effect() {
                    self.delete_later(Stray {
                        key,
                        generation,
                        created: None,
                    });
                }
                return None;
            }
        };
        // The put is the transaction's only write: the key's create revision is its revision.
        let revision = answer.header().map_or(0, |h| h.revision());
        let ahead = gets(&answer)
            .first()
            .and_then(|newest| newest.first())
            .map(|kv| kv.key().to_vec());
        let place = Place {
            key,
            revision,
            generation,
            ahead: None,
        };
        if revision <= 0 {
            self.delete_later(place.into_stray());
            return None;
        }
        Some(Written {
            place,
            ahead,
            after: revision,
        })
    }

    /// Records a written place if its wait goes on, watching the key ahead (or waking the
    /// waiter if none is); returns it to be deleted if the wait ended meanwhile.
    fn stand_in_line(
        self: &Arc<Self>,
        line: &Arc<Line>,
        ticket: &Making,
        written: Written,
    ) -> Option<Place> {
        let Written {
            mut place,
            ahead,
            after,
        } = written;
        let mut waits = line.waits();
        let Some(wait) = waits
            .get_mut(&ticket.id)
            .filter(|w| w.serial == ticket.serial && matches!(w.slot, Slot::Making))
        else {
            return Some(place);
        };
        match ahead {
            Some(ahead) => self.watch_ahead(&mut place, &wait.wake, ahead, after),
            None => {
                // First in line already: the next attempt holds.
                wait.wake.send_replace(());
            }
        }
        wait.slot = Slot::Ready(place);
        drop(waits);
        self.places_changed();
        None
    }

    /// A place could not be made: the slot is free for the next round to try again, and the
    /// waiter polls meanwhile.
    fn unmake(&self, line: &Line, ticket: &Making) {
        let mut waits = line.waits();
        if let Some(wait) = waits
            .get_mut(&ticket.id)
            .filter(|w| w.serial == ticket.serial)
        {
            if matches!(wait.slot, Slot::Making) {
                wait.slot = Slot::Absent;
            }
        }
    }

    /// Watches `ahead` for its deletion after revision `after`, waking the wait with `wake`.
    fn watch_ahead(
        &self,
        place: &mut Place,
        wake: &Arc<watch::Sender<()>>,
        ahead: Vec<u8>,
        after: i64,
    ) {
        if place.ahead.as_ref().is_some_and(|(_, key)| *key == ahead) {
            return;
        }
        if let Some((old, _)) = place.ahead.take() {
            self.watches.remove(old);
        }
        let id = self.watches.add(Interest {
            key: ahead.clone(),
            from_revision: after.saturating_add(1),
            sink: Sink::Wake(wake.clone()),
        });
        place.ahead = Some((id, ahead));
    }

    /// Takes the place of the wait `id`, exclusively, if it has a place on `generation` (see
    /// the module documentation). A wait with no hint left has ended, or is between two
    /// rounds; in neither case does its engine attempt the key in that mode meanwhile except
    /// through the attempt asking here (its waiting room lets one party of a lane talk to the
    /// backend), so that attempt stands where this process queued. Refusing it would answer
    /// "busy" for a key nobody holds until [`GRACE`] deleted the place.
    pub(super) fn claim(
        self: &Arc<Self>,
        line: &Line,
        id: &WaitId,
        generation: &LeaseGeneration,
    ) -> Option<Claimed> {
        let mut waits = line.waits();
        let wait = waits.get_mut(id)?;
        let slot = &mut wait.slot;
        match std::mem::replace(slot, Slot::Claimed) {
            Slot::Ready(place) if place.generation.id == generation.id => Some(Claimed {
                place,
                wait: id.clone(),
                serial: wait.serial,
            }),
            Slot::Ready(mut place) => {
                // Its lease is gone, and the place with it.
                *slot = Slot::Absent;
                if let Some((watch, _)) = place.ahead.take() {
                    self.watches.remove(watch);
                }
                drop(waits);
                self.places_changed();
                None
            }
            other => {
                *slot = other;
                None
            }
        }
    }

    /// Gives a claimed place back after its attempt read `turn` (`None`: the read failed).
    /// Returns the place when it is the hold now; a place whose wait ended meanwhile is
    /// returned to the caller to delete through `orphan`.
    pub(super) fn settle(
        self: &Arc<Self>,
        line: &Line,
        claimed: Claimed,
        turn: Option<&Turn>,
        orphan: &mut Option<Place>,
    ) -> Option<Place> {
        let Claimed {
            mut place,
            wait,
            serial,
        } = claimed;
        let mut waits = line.waits();
        let current = waits.get_mut(&wait).filter(|w| w.serial == serial);
        let held = matches!(turn, Some(Turn::Held));
        let gone = matches!(turn, Some(Turn::PlaceGone));
        if held || gone || current.is_none() {
            if let Some(wait) = current {
                wait.slot = Slot::Absent;
                wait.wants &= gone;
            }
            drop(waits);
            if let Some((watch, _)) = place.ahead.take() {
                self.watches.remove(watch);
            }
            self.places_changed();
            return match (held, gone) {
                (true, _) => Some(place),
                (false, true) => None,
                (false, false) => {
                    *orphan = Some(place);
                    None
                }
            };
        }
        if let Some(wait) = current {
            if let Some(Turn::Waiting { ahead, after }) = turn {
                self.watch_ahead(&mut place, &wait.wake, ahead.clone(), *after);
            }
            wait.slot = Slot::Ready(place);
        }
        None
    }

    /// A newcomer attempt of the wait `id` won: a place it was making or had made is not
    /// needed any more.
    pub(super) fn won_without_place(self: &Arc<Self>, line: &Line, id: &WaitId) -> Option<Place> {
        let mut waits = line.waits();
        let wait = waits.get_mut(id)?;
        wait.wants = false;
        match std::mem::replace(&mut wait.slot, Slot::Absent) {
            Slot::Ready(mut place) => {
                drop(waits);
                if let Some((watch, _)) = place.ahead.take() {
                    self.watches.remove(watch);
                }
                self.places_changed();
                Some(place)
            }
            // Its maker finds the slot gone and deletes it.
            Slot::Making | Slot::Absent => None,
            Slot::Claimed => {
                wait.slot = Slot::Claimed;
                None
            }
        }
    }

    /// Deletes a place that is not needed any more (now, or in the background).
    pub(super) async fn delete_place(self: &Arc<Self>, place: Place) {
        self.delete_or_later(place.into_stray()).await;
    }

    /// The line's places changed: the lease keeper runs while there are any.
    fn places_changed(self: &Arc<Self>) {
        if self.places() > 0 {
            self.keep_places_alive();
        }
    }

    /// Removes, [`GRACE`] after their last hint went, the waits that made no new one, and
    /// deletes their places. One sweeper per clone, while any wait is idle.
    fn sweep_later(self: &Arc<Self>, line: &Arc<Line>) {
        if line.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            line.sweeping.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(sweep(Arc::downgrade(self), line.clone()));
    }
}

impl Place {
    fn into_stray(self) -> Stray {
        Stray {
            key: self.key,
            generation: self.generation,
            created: Some(self.revision),
        }
    }
}

async fn sweep(backend: Weak<Inner>, line: Arc<Line>) {
    loop {
        tokio::time::sleep(GRACE).await;
        let (ended, idle_left) = ended_waits(&line);
        let Some(backend) = backend.upgrade() else {
            line.sweeping.store(false, Ordering::Release);
            return;
        };
        for mut place in ended {
            if let Some((watch, _)) = place.ahead.take() {
                backend.watches.remove(watch);
            }
            backend.delete_place(place).await;
        }
        backend.places_changed();
        if !idle_left {
            line.sweeping.store(false, Ordering::Release);
            // A wait that went idle since the check starts a sweeper of its own.
            if line.waits().values().any(|w| w.hints == 0) {
                backend.sweep_later(&line);
            }
            return;
        }
    }
}

/// Removes the waits idle for [`GRACE`] or more; returns their ready places, and whether any
/// idle wait is left for a later sweep. A place being made or read is left to its maker or
/// reader, which find the wait gone.
fn ended_waits(line: &Line) -> (Vec<Place>, bool) {
    let now = Instant::now();
    let mut waits = line.waits();
    let ended: Vec<WaitId> = waits
        .iter()
        .filter(|(_, w)| w.hints == 0 && w.idle_since.is_some_and(|at| now - at >= GRACE))
        .map(|(id, _)| id.clone())
        .collect();
    let mut places = Vec::new();
    for id in ended {
        if let Some(Slot::Ready(place)) = waits.remove(&id).map(|wait| wait.slot) {
            places.push(place);
        }
    }
    let idle_left = waits.values().any(|w| w.hints == 0);
    (places, idle_left)
}

/// Held by each hint: when the last one of a wait goes, the wait may have ended.
struct HintGuard {
    backend: Weak<Inner>,
    line: Arc<Line>,
    id: WaitId,
}

impl Drop for HintGuard {
    fn drop(&mut self) {
        let idle = {
            let mut waits = self.line.waits();
            match waits.get_mut(&self.id) {
                Some(wait) => {
                    wait.hints = wait.hints.saturating_sub(1);
                    if wait.hints == 0 {
                        wait.idle_since = Some(Instant::now());
                    }
                    wait.hints == 0
                }
                None => false,
            }
        };
        if let (true, Some(backend)) = (idle, self.backend.upgrade()) {
            backend.sweep_later(&self.line);
        }
    }
}
