//! Hold accounting: which advisory locks a session holds, attempts, or may hold.
//!
//! Session advisory locks are reentrant, and one session's locks never conflict with each
//! other, so the server would grant a session anything it asks for again. This book is what
//! keeps a session from taking a key twice:
//!
//! - An exclusive key (a plain lock, a writer) or a semaphore slot is taken at most once per
//!   session, and never while the session holds the key in the other mode.
//! - A key may be held shared many times over (the server counts the holds, and each lease
//!   unlocks one); never exclusively at the same time.
//! - A semaphore attempt skips the slots the session holds, and at most one attempt per
//!   semaphore runs on a session at once, since which slot it takes is known only from its
//!   answer.
//! - What an attempt or unlock that did not answer may have left held is not taken on this
//!   session again until the server has said it is free (see `unconfirmed`).

use std::collections::HashMap;
use std::sync::{MutexGuard, PoisonError};

use super::Session;

/// One advisory lock held for a lease, as the server names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(in crate::providers::postgres) enum Advisory {
    /// `pg_advisory_lock(bigint)`: a plain lock or a writer.
    Exclusive(i64),
    /// `pg_advisory_lock_shared(bigint)`: a reader. The server counts a session's shared holds
    /// of a key, and each lease unlocks once.
    Shared(i64),
    /// `pg_advisory_lock(int4, int4)`: one slot of a semaphore (semaphore key, slot).
    Slot(i32, i32),
}

impl Advisory {
    pub(in crate::providers::postgres) fn object(self) -> Object {
        match self {
            Advisory::Exclusive(key) | Advisory::Shared(key) => Object::Key(key),
            Advisory::Slot(semaphore, slot) => Object::Slot(semaphore, slot),
        }
    }
}

/// What one attempt asks the server for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::providers::postgres) enum Attempt {
    /// The key alone.
    Exclusive(i64),
    /// The key alongside other readers.
    Shared(i64),
    /// Any one slot of the semaphore `key` that nobody holds, among `0..max_count`.
    Semaphore { key: i32, max_count: u16 },
}

impl Attempt {
    pub(in crate::providers::postgres) fn object(self) -> Object {
        match self {
            Attempt::Exclusive(key) | Attempt::Shared(key) => Object::Key(key),
            Attempt::Semaphore { key, .. } => Object::Semaphore(key),
        }
    }

    fn shared(self) -> bool {
        matches!(self, Attempt::Shared(_))
    }
}

/// What the key map tracks: the server's lock objects, and semaphores being attempted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(in crate::providers::postgres) enum Object {
    /// The `bigint` lock of a key, exclusive or shared.
    Key(i64),
    /// One semaphore slot.
    Slot(i32, i32),
    /// A semaphore attempt in flight: which slot it takes is known only from its answer, so at
    /// most one attempt per semaphore runs on a session, and one that goes unanswered makes the
    /// whole semaphore unconfirmed on it.
    Semaphore(i32),
}

/// What a session knows about one lock object. An exclusive object has at most one attempt,
/// hold or unconfirmed outcome at a time; a shared key may have many of each, because the
/// server counts shared holds per session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(in crate::providers::postgres) struct Entry {
    pub(super) shared: bool,
    /// Attempts on their way; their answers decide.
    pub(super) attempting: u32,
    /// Holds for leases.
    pub(super) held: u32,
    /// Holds the session may have: an attempt or unlock went unanswered. An unlock is retried
    /// until it answers; meanwhile the object is not taken on this session.
    pub(super) unconfirmed: u32,
    /// For a semaphore attempt: the slots it may try.
    pub(super) max_count: u16,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.attempting == 0 && self.held == 0 && self.unconfirmed == 0
    }
}

/// Whether a session may take an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::providers::postgres) enum Availability {
    /// It has unlocks the server has not confirmed: it takes no new locks.
    Draining,
    /// It holds the key in another mode, may hold it, or is attempting it exclusively.
    HasKey,
    /// Another attempt on the same semaphore is on its way here.
    InFlight,
    /// It may take the shared attempt, and holds (or attempts) the key shared already.
    Again,
    /// It may take the attempt.
    Free,
}

/// The hold book of one session.
#[derive(Default)]
pub(in crate::providers::postgres) struct Keys {
    pub(super) by_object: HashMap<Object, Entry>,
    /// Holds for leases, over every object.
    pub(super) held: usize,
    /// Unconfirmed outcomes, over every object.
    pub(super) unconfirmed: usize,
}

impl Session {
    pub(in crate::providers::postgres) fn keys(&self) -> MutexGuard<'_, Keys> {
        // Every critical section leaves the map consistent.
        self.holds.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `attempt` may go here, in one look at the key map.
    pub(in crate::providers::postgres) fn availability(&self, attempt: Attempt) -> Availability {
        let keys = self.keys();
        if keys.unconfirmed > 0 {
            return Availability::Draining;
        }
        match (keys.by_object.get(&attempt.object()), attempt) {
            (None, _) => Availability::Free,
            (Some(_), Attempt::Semaphore { .. }) => Availability::InFlight,
            (Some(entry), Attempt::Shared(_)) if entry.shared => Availability::Again,
            (Some(_), _) => Availability::HasKey,
        }
    }

    /// How many locks this session holds for leases.
    pub(in crate::providers::postgres) fn held(&self) -> usize {
        self.keys().held
    }

    /// Reserves `attempt` on this session, unless [`availability`](Self::availability) says no
    /// meanwhile. `Some(true)`: a shared attempt on a key this session already holds or attempts
    /// shared.
    pub(in crate::providers::postgres) fn reserve(&self, attempt: Attempt) -> Option<bool> {
        let mut keys = self.keys();
        let object = attempt.object();
        let entry = keys.by_object.entry(object).or_default();
        let again = !entry.is_empty();
        if again && !(attempt.shared() && entry.shared && entry.unconfirmed == 0) {
            return None;
        }
        entry.shared = attempt.shared();
        entry.attempting = entry.attempting.saturating_add(1);
        if let Attempt::Semaphore { max_count, .. } = attempt {
            entry.max_count = max_count;
        }
        Some(again)
    }

    /// Applies `change` to the entry of `object`, keeping the totals, and tells the session set
    /// when the session stops draining or a semaphore attempt ends (attempts of the same
    /// semaphore may be waiting for it).
    pub(in crate::providers::postgres) fn update(
        &self,
        object: Object,
        change: impl FnOnce(&mut Entry),
    ) {
        let mut keys = self.keys();
        let keys = &mut *keys;
        let entry = keys.by_object.entry(object).or_default();
        let before = *entry;
        change(entry);
        let after = *entry;
        let (held, unconfirmed) = (
            keys.held.saturating_sub(before.held as usize),
            keys.unconfirmed.saturating_sub(before.unconfirmed as usize),
        );
        if after.is_empty() {
            keys.by_object.remove(&object);
        }
        keys.held = held.saturating_add(after.held as usize);
        keys.unconfirmed = unconfirmed.saturating_add(after.unconfirmed as usize);
        let drained = before.unconfirmed > after.unconfirmed && keys.unconfirmed == 0;
        let semaphore_done = matches!(object, Object::Semaphore(_)) && after.is_empty();
        if drained || semaphore_done {
            self.changed.notify_waiters();
        }
    }

    /// The server answered `attempt` busy.
    pub(in crate::providers::postgres) fn attempt_busy(&self, attempt: Attempt) {
        self.update(attempt.object(), |entry| {
            entry.attempting = entry.attempting.saturating_sub(1)
        });
    }

    /// `attempt` took `hold` for a lease.
    pub(in crate::providers::postgres) fn attempt_held(&self, attempt: Attempt, hold: Advisory) {
        if attempt.object() != hold.object() {
            // The slot first: until the semaphore's attempt is gone no other attempt of it runs
            // here, and after that every one sees the slot as this session's.
            self.update(hold.object(), |entry| {
                entry.held = entry.held.saturating_add(1)
            });
            self.update(attempt.object(), |entry| {
                entry.attempting = entry.attempting.saturating_sub(1)
            });
        } else {
            self.update(hold.object(), |entry| {
                entry.attempting = entry.attempting.saturating_sub(1);
                entry.held = entry.held.saturating_add(1);
            });
        }
    }

    /// Whether the session holds, attempts and may hold nothing at all.
    pub(in crate::providers::postgres) fn holds_nothing(&self) -> bool {
        self.keys().by_object.is_empty()
    }

    /// The session holds `hold` for a lease, granted by the server to a statement that waited
    /// for it (see `waiting`) rather than by an attempt reserved here.
    pub(in crate::providers::postgres) fn adopt(&self, hold: Advisory) {
        self.update(hold.object(), |entry| {
            entry.shared = matches!(hold, Advisory::Shared(_));
            entry.held = entry.held.saturating_add(1);
        });
    }

    /// The server confirmed the unlock of `hold`.
    pub(in crate::providers::postgres) fn released(&self, hold: Advisory) {
        self.update(hold.object(), |entry| {
            entry.held = entry.held.saturating_sub(1)
        });
    }

    /// The slots of semaphore `key` this session holds or may hold, which an attempt must not
    /// take again (the server would grant them by re-entrancy).
    pub(in crate::providers::postgres) fn slots_of(&self, key: i32) -> Vec<i32> {
        self.keys()
            .by_object
            .keys()
            .filter_map(|object| match *object {
                Object::Slot(semaphore, slot) if semaphore == key => Some(slot),
                _ => None,
            })
            .collect()
    }

    /// A held lock was given up: if it was the last one a draining session kept open for, the
    /// session closes, which frees whatever it may still hold.
    pub(in crate::providers::postgres) fn after_release(&self) {
        let keys = self.keys();
        if keys.unconfirmed > 0 && keys.held == 0 {
            drop(keys);
            self.close();
        }
    }
}
