//! The statements of the lock protocol, prepared once per session on first use.

use tokio_postgres::types::Type;
use tokio_postgres::Statement;

use super::Session;

/// The statements of the lock protocol, prepared once per session on first use.
#[derive(Clone, Copy, Debug)]
pub(in crate::providers::postgres) enum Prepared {
    /// Try-lock with the fencing token in the same round trip.
    Lock,
    /// `pg_advisory_unlock($1)`.
    Unlock,
    /// Shared try-lock with the fencing token.
    LockShared,
    /// Shared try-lock on a session that already holds the key shared, which the server
    /// grants without looking at its queue: it first looks for a queued writer itself.
    LockSharedAgain,
    /// `pg_advisory_unlock_shared($1)`.
    UnlockShared,
    /// Takes one free slot of a semaphore, with its fencing token.
    LockSlot,
    /// `pg_advisory_unlock($1, $2)` of one slot.
    UnlockSlot,
    /// Unlocks every slot of a semaphore the session holds but no lease knows of.
    UnlockStraySlots,
    /// `pg_advisory_unlock($1)` if `pg_locks` shows the session holding `$1`.
    UnlockIfHeld,
    /// One `pg_advisory_unlock_shared($1)` if the session holds `$1` shared.
    UnlockSharedIfHeld,
    /// `pg_advisory_unlock($1, $2)` if the session holds that slot.
    UnlockSlotIfHeld,
}

impl Prepared {
    pub(super) const COUNT: usize = 12;

    fn index_and_types(self) -> (usize, &'static [Type]) {
        const KEY: &[Type] = &[Type::INT8];
        match self {
            Prepared::Lock => (0, KEY),
            Prepared::Unlock => (1, KEY),
            // 2 was the session check's, which is sent unnamed now (see `run_check`).
            Prepared::LockShared => (3, KEY),
            Prepared::LockSharedAgain => (4, KEY),
            Prepared::UnlockShared => (5, KEY),
            Prepared::LockSlot => (6, &[Type::INT4, Type::INT4, Type::INT4, Type::INT4_ARRAY]),
            Prepared::UnlockSlot => (7, &[Type::INT4, Type::INT4]),
            Prepared::UnlockStraySlots => (8, &[Type::INT4, Type::INT4_ARRAY]),
            Prepared::UnlockIfHeld => (9, KEY),
            Prepared::UnlockSharedIfHeld => (10, KEY),
            Prepared::UnlockSlotIfHeld => (11, &[Type::INT4, Type::INT4]),
        }
    }
}

impl Session {
    /// The prepared statement `which` (with text `sql`), preparing it on first use.
    pub(in crate::providers::postgres) async fn statement(
        &self,
        which: Prepared,
        sql: &str,
    ) -> Result<Statement, tokio_postgres::Error> {
        let (index, types) = which.index_and_types();
        let slot = &self.statements[index];
        if let Some(statement) = slot.get() {
            return Ok(statement.clone());
        }
        // Boxed: preparing runs once per session, and inline its future would enlarge every
        // lock attempt and release (each is moved into a box per call).
        let statement = Box::pin(self.client.prepare_typed(sql, types)).await?;
        // Two callers may prepare at once; either statement serves.
        Ok(slot.get_or_init(|| statement).clone())
    }
}
