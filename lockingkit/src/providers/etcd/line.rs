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
//! attempt creates its key only where it would hold at once (a writer in an empty directory, a
//! reader where no writer is), so it never overtakes anyone in line, and a busy answer writes
//! nothing. Neither side starves: every caller is served in the order its key was created, and
//! readers in line together hold together.
//!
//! # Whose place is it
//! A place belongs to one [`EtcdWait`](super::wait::EtcdWait): the engine opens the wait at its
//! caller's first busy answer and drops it when the caller leaves. The wait wants a place from
//! the start; it is made when the engine first listens for a change, so a caller that wins
//! on its next attempt may never need one. Only the wait's own attempts read or take its place;
//! any other attempt of the process (a `try_acquire`, a reader on a turn of its own) is a
//! newcomer.
//!
//! # A place's life
//! One transaction writes the key and reads the key just ahead of it, which the backend's one
//! watch stream then watches. When that key is deleted the wait is woken, and its next attempt
//! reads whether its place holds now (or which key is ahead of it now). A place made first in
//! line wakes its wait at once. A place whose read holds becomes the hold as it is.
//!
//! A wait dropped with a place (timed out, cancelled, or won without it) has the place
//! deleted at once — by a task of its own, or by the maker or the attempt that has the place
//! in hand — which in turn wakes whoever is behind it. Until that delete is answered, every
//! attempt of this clone for the key waits for it (see [`Line::settled`]), so a caller that
//! tries right after its wait ended is never told "busy" by the place it left. The backend
//! keeps its lease alive while it has places (see `lease`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use etcd_client::{GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};
use tokio::sync::watch;

use super::attempt::{gets, send_txn};
use super::layout::{entry, range_end, LockDirectory};
use super::lease::LeaseGeneration;
use super::members::Resend;
use super::strays::Stray;
use super::watch::{Interest, Sink};
use super::Inner;
use crate::backend::LockMode;

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

/// The open waits of one clone of the backend and their places, and the deletes of places
/// that waits left behind.
#[derive(Default)]
pub(super) struct Line {
    waits: Mutex<HashMap<u64, Wait>>,
    next_serial: AtomicU64,
    /// Per LockingKit key: places of ended waits whose delete is not answered yet.
    leaving: Mutex<HashMap<String, watch::Sender<usize>>>,
    /// Set once this clone is shut down or dropped.
    pub(super) closed: AtomicBool,
}

/// A key and the side it is waited for on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct WaitId {
    key: String,
    side: Side,
}

impl WaitId {
    /// `key` waited for on `side`.
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

/// One wait of this clone's engine, by its serial in [`Line`].
struct Wait {
    id: WaitId,
    /// Whether the engine still has it; an ended wait stays until the maker or the attempt
    /// that has its place in hand deletes the place.
    open: bool,
    /// Wakes the wait.
    wake: Arc<watch::Sender<()>>,
    /// The wait has no place yet and wants one.
    wants: bool,
    slot: Slot,
}

enum Slot {
    Absent,
    /// Being written; `discard` is set once nobody wants it any more.
    Making {
        discard: Option<Leaving>,
    },
    Ready(Place),
    /// An attempt has it; `discard` is set once its wait ended.
    Claimed {
        discard: Option<Leaving>,
    },
}

/// A place in line: the waiter's key, its create revision, its lease.
pub(super) struct Place {
    pub(super) key: Vec<u8>,
    pub(super) revision: i64,
    pub(super) generation: Arc<LeaseGeneration>,
    /// The watch of the key just ahead, if the place has one: its id and that key.
    ahead: Option<(i64, Vec<u8>)>,
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
    side: Side,
    serial: u64,
}

impl Claimed {
    /// The side the place stands on.
    pub(super) fn side(&self) -> Side {
        self.side
    }
}

/// A place nobody waits on any more, to delete; attempts for its key wait until it is.
pub(super) struct Orphan {
    pub(super) place: Place,
    pub(super) leaving: Option<Leaving>,
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

/// Counts one place being deleted for its key until dropped (see [`Line::settled`]).
pub(super) struct Leaving {
    counter: watch::Sender<usize>,
}

impl Drop for Leaving {
    fn drop(&mut self) {
        self.counter
            .send_modify(|count| *count = count.saturating_sub(1));
    }
}

impl Line {
    fn waits(&self) -> MutexGuard<'_, HashMap<u64, Wait>> {
        // Every critical section leaves the map consistent.
        self.waits.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn leaving_counters(&self) -> MutexGuard<'_, HashMap<String, watch::Sender<usize>>> {
        self.leaving.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a place of `key` as being deleted until the returned guard is dropped.
    fn leaving(&self, key: &str) -> Leaving {
        let mut counters = self.leaving_counters();
        counters.retain(|_, counter| *counter.borrow() > 0);
        let counter = counters
            .entry(key.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .clone();
        counter.send_modify(|count| *count = count.saturating_add(1));
        Leaving { counter }
    }

    /// Resolves once no place an ended wait left for `key` is still being deleted. Each such
    /// delete is one request (or is handed to the background deletes when it fails), so this
    /// is bounded by the request timeout.
    pub(super) async fn settled(&self, key: &str) {
        let counter = self
            .leaving_counters()
            .get(key)
            .map(watch::Sender::subscribe);
        if let Some(mut counter) = counter {
            // The sender lives in the map or in a guard while the count is above zero.
            let _ = counter.wait_for(|count| *count == 0).await;
        }
    }

    /// The count of places of `key` still being deleted, to wait for, if there are any.
    pub(super) fn leaving_now(&self, key: &str) -> Option<watch::Receiver<usize>> {
        self.leaving_counters()
            .get(key)
            .filter(|counter| *counter.borrow() > 0)
            .map(watch::Sender::subscribe)
    }

    /// Places standing in this clone's line (ready, being read, or being made).
    pub(super) fn places(&self) -> usize {
        self.waits()
            .values()
            .filter(|wait| !matches!(wait.slot, Slot::Absent))
            .count()
    }

    /// Opens a wait for `id`: its serial, and what wakes it. A wait for a lock wants a place
    /// from the start, since the engine opens it at a busy answer.
    pub(super) fn open(&self, id: WaitId) -> (u64, watch::Receiver<()>) {
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let wake = Arc::new(watch::channel(()).0);
        let receiver = wake.subscribe();
        self.waits().insert(
            serial,
            Wait {
                id,
                open: true,
                wake,
                wants: true,
                slot: Slot::Absent,
            },
        );
        (serial, receiver)
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

    /// The wait `serial` answered busy without a place: it wants one.
    pub(super) fn wants_place(&self, serial: u64) {
        if let Some(wait) = self.waits().get_mut(&serial).filter(|w| w.open) {
            wait.wants = true;
        }
    }
}

impl Inner {
    /// Ends the wait `serial` (its engine dropped it): a ready place is deleted now, by a task
    /// of its own; a place being made or read is deleted by its maker or reader.
    pub(super) fn close_wait(self: &Arc<Self>, line: &Arc<Line>, serial: u64) {
        let mut waits = line.waits();
        let Some(wait) = waits.get_mut(&serial) else {
            return;
        };
        wait.open = false;
        wait.wants = false;
        // The place counts as leaving from the moment the wait ends.
        let leaving = line.leaving(&wait.id.key);
        match &mut wait.slot {
            Slot::Making { discard } | Slot::Claimed { discard } => {
                *discard = Some(leaving);
                return;
            }
            Slot::Absent | Slot::Ready(_) => {}
        }
        let Some(Wait {
            slot: Slot::Ready(mut place),
            ..
        }) = waits.remove(&serial)
        else {
            return;
        };
        drop(waits);
        self.unwatch_place(&mut place);
        self.places_changed();
        self.delete_orphan_soon(Orphan {
            place,
            leaving: Some(leaving),
        });
    }

    /// Starts making the place the wait `serial` wants, if it has none.
    pub(super) fn make_wanted_place(self: &Arc<Self>, line: &Arc<Line>, serial: u64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut waits = line.waits();
        let Some(wait) = waits.get_mut(&serial) else {
            return;
        };
        if wait.open && wait.wants && matches!(wait.slot, Slot::Absent) {
            wait.slot = Slot::Making { discard: None };
            let (id, serial) = (wait.id.clone(), serial);
            runtime.spawn(self.clone().make_place(line.clone(), id, serial));
        }
    }

    /// Writes a place and stands it in line, or deletes it if nobody wants it any more.
    async fn make_place(self: Arc<Self>, line: Arc<Line>, id: WaitId, serial: u64) {
        let directory = LockDirectory::new(&self.key_prefix, &id.key);
        match self.write_place(&directory, id.side).await {
            Some(written) => {
                if let Some(orphan) = self.stand_in_line(&line, serial, written) {
                    self.delete_orphan(orphan).await;
                }
            }
            None => self.unmake(&line, serial),
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
                if failure.error.kind() == crate::backend::BackendErrorKind::LeaseGone {
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

    /// Records a written place if its wait still wants it, watching the key ahead (or waking
    /// the wait if none is); returns it to be deleted otherwise.
    fn stand_in_line(
        self: &Arc<Self>,
        line: &Arc<Line>,
        serial: u64,
        written: Written,
    ) -> Option<Orphan> {
        let Written {
            mut place,
            ahead,
            after,
        } = written;
        let mut waits = line.waits();
        let Some(wait) = waits.get_mut(&serial) else {
            // The clone shut down.
            return Some(Orphan {
                place,
                leaving: None,
            });
        };
        match std::mem::replace(&mut wait.slot, Slot::Absent) {
            Slot::Making { discard: None } => {}
            Slot::Making { discard } => {
                if !wait.open {
                    waits.remove(&serial);
                }
                return Some(Orphan {
                    place,
                    leaving: discard,
                });
            }
            other => {
                wait.slot = other;
                return Some(Orphan {
                    place,
                    leaving: None,
                });
            }
        }
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

    /// A place could not be made: the slot is free for the wait to want one again, and it
    /// polls meanwhile.
    fn unmake(&self, line: &Line, serial: u64) {
        let mut waits = line.waits();
        let Some(wait) = waits.get_mut(&serial) else {
            return;
        };
        if matches!(wait.slot, Slot::Making { .. }) {
            wait.slot = Slot::Absent;
            if !wait.open {
                waits.remove(&serial);
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

    /// Takes the place of the wait `serial`, exclusively, if it has one on `generation`.
    pub(super) fn claim(
        self: &Arc<Self>,
        line: &Line,
        serial: u64,
        generation: &LeaseGeneration,
    ) -> Option<Claimed> {
        let mut waits = line.waits();
        let wait = waits.get_mut(&serial)?;
        let side = wait.id.side;
        match std::mem::replace(&mut wait.slot, Slot::Claimed { discard: None }) {
            Slot::Ready(place) if place.generation.id == generation.id => Some(Claimed {
                place,
                side,
                serial,
            }),
            Slot::Ready(mut place) => {
                // Its lease is gone, and the place with it: the wait wants a new one.
                wait.slot = Slot::Absent;
                wait.wants = wait.open;
                if let Some((watch, _)) = place.ahead.take() {
                    self.watches.remove(watch);
                }
                drop(waits);
                self.places_changed();
                None
            }
            other => {
                wait.slot = other;
                None
            }
        }
    }

    /// Gives a claimed place back after its attempt read `turn` (`None`: the read failed).
    /// Returns the place when it is the hold now — with what keeps the clone's attempts for the
    /// key waiting, if the wait ended meanwhile: that hold is released at once by the engine,
    /// and is what the wait left. A place whose wait ended meanwhile and that does not hold is
    /// left in `orphan`, to delete.
    pub(super) fn settle(
        self: &Arc<Self>,
        line: &Line,
        claimed: Claimed,
        turn: Option<&Turn>,
        orphan: &mut Option<Orphan>,
    ) -> Option<(Place, Option<Leaving>)> {
        let Claimed {
            mut place, serial, ..
        } = claimed;
        let held = matches!(turn, Some(Turn::Held));
        let gone = matches!(turn, Some(Turn::PlaceGone));
        let mut waits = line.waits();
        let Some(wait) = waits.get_mut(&serial) else {
            // The clone shut down.
            drop(waits);
            self.unwatch_place(&mut place);
            if held {
                return Some((place, None));
            }
            if !gone {
                *orphan = Some(Orphan {
                    place,
                    leaving: None,
                });
            }
            return None;
        };
        let discard = match std::mem::replace(&mut wait.slot, Slot::Absent) {
            Slot::Claimed { discard } => discard,
            other => {
                // Never: a claimed slot stays claimed until settled.
                wait.slot = other;
                None
            }
        };
        let open = wait.open;
        if open && !(held || gone) {
            if let Some(Turn::Waiting { ahead, after }) = turn {
                self.watch_ahead(&mut place, &wait.wake, ahead.clone(), *after);
            }
            wait.slot = Slot::Ready(place);
            return None;
        }
        wait.wants = open && gone;
        if !open {
            waits.remove(&serial);
        }
        drop(waits);
        self.unwatch_place(&mut place);
        self.places_changed();
        if held {
            // The place is the hold now: whoever has the lease releases it.
            return Some((place, discard));
        }
        if !gone {
            *orphan = Some(Orphan {
                place,
                leaving: discard,
            });
        }
        None
    }

    /// An attempt of the wait `serial` won as a newcomer: a place it was making or had made is
    /// not needed any more, and is returned (or left to its maker) to delete.
    pub(super) fn won_without_place(self: &Arc<Self>, line: &Line, serial: u64) -> Option<Orphan> {
        let mut waits = line.waits();
        let wait = waits.get_mut(&serial)?;
        wait.wants = false;
        let wait_key = wait.id.key.clone();
        match std::mem::replace(&mut wait.slot, Slot::Absent) {
            Slot::Ready(mut place) => {
                let leaving = Some(line.leaving(&wait_key));
                drop(waits);
                self.unwatch_place(&mut place);
                self.places_changed();
                Some(Orphan { place, leaving })
            }
            Slot::Making { discard } => {
                let leaving = discard.unwrap_or_else(|| line.leaving(&wait.id.key));
                wait.slot = Slot::Making {
                    discard: Some(leaving),
                };
                None
            }
            other => {
                wait.slot = other;
                None
            }
        }
    }

    /// Removes the watch of the key ahead of `place`, if it has one.
    fn unwatch_place(&self, place: &mut Place) {
        if let Some((watch, _)) = place.ahead.take() {
            self.watches.remove(watch);
        }
    }

    /// Deletes a place that is not needed any more (now, or in the background).
    pub(super) async fn delete_place(self: &Arc<Self>, place: Place) {
        self.delete_or_later(place.into_stray()).await;
    }

    /// Deletes a place nobody waits on; attempts for its key go on once it is done.
    pub(super) async fn delete_orphan(self: Arc<Self>, orphan: Orphan) {
        let Orphan { place, leaving } = orphan;
        self.delete_place(place).await;
        drop(leaving);
    }

    /// Deletes a place nobody waits on in a task of its own, so that the attempt that found
    /// it is answered without waiting for the delete.
    pub(super) fn delete_orphan_soon(self: &Arc<Self>, orphan: Orphan) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(self.clone().delete_orphan(orphan));
            }
            // No runtime left to send it: the shared lease ends with the process.
            Err(_) => self.delete_later(orphan.place.into_stray()),
        }
    }

    /// The line's places changed: the lease keeper runs while there are any.
    fn places_changed(self: &Arc<Self>) {
        if self.places() > 0 {
            self.keep_places_alive();
        }
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
