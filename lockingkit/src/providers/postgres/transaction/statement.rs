//! The one statement of an attempt, and what its answer means.
//!
//! An attempt is a single row: the fencing token when the lock was taken, `0` when it is busy,
//! or a negative code when the lock cannot be taken in this transaction at all. The refusals
//! are decided by the server before the try-lock runs, in the same round trip, so a refused
//! attempt takes nothing and leaves the sequence alone.
//!
//! **The sequence** is looked up by name as the statement runs (`to_regclass`, which answers
//! NULL for a missing sequence or schema), never when it is parsed: `nextval('name')` would
//! resolve the name at parse time and fail the statement, aborting the caller's transaction.
//! So whether it exists is a fact of the database each attempt runs in, with nothing to
//! remember per value of ours: one value serves databases with and without it.
//!
//! **Isolation.** Under REPEATABLE READ or SERIALIZABLE, a transaction reads from one snapshot,
//! taken at its first statement: at the latest the lock statement itself, so before the lock
//! is granted. Writes the previous holder committed just before it let go are then invisible
//! to the new holder, and the lock protects none of its reads. Only READ COMMITTED (which
//! PostgreSQL also runs for READ UNCOMMITTED) takes a snapshot per statement, so every
//! statement after the grant sees them.

use crate::error::{ErrorKind, LockError};

/// The answer for REPEATABLE READ.
const REPEATABLE_READ: i64 = -1;
/// The answer for SERIALIZABLE.
const SERIALIZABLE: i64 = -2;
/// The answer when the fencing sequence does not exist in this database.
const NO_SEQUENCE: i64 = -3;

/// What one attempt's answer says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Answer {
    /// Taken, with this fencing token.
    Taken(u64),
    /// Someone else holds the key.
    Busy,
    /// The transaction runs at an isolation level the lock cannot protect.
    Refused(&'static str),
    /// The fencing sequence does not exist in the transaction's database.
    NoSequence,
}

/// The attempt with the try-lock `function` (`pg_try_advisory_xact_lock` or its `_shared`
/// form) and the fencing `sequence` (`schema.name`).
pub(super) fn lock_sql(function: &str, sequence: &str) -> String {
    // CASE runs only the branch it picks: the try-lock only for READ COMMITTED with the
    // sequence there, nextval only once the lock is taken.
    format!(
        "SELECT CASE current_setting('transaction_isolation') \
         WHEN 'repeatable read' THEN {REPEATABLE_READ} \
         WHEN 'serializable' THEN {SERIALIZABLE} \
         ELSE CASE WHEN to_regclass('{sequence}') IS NULL THEN {NO_SEQUENCE} \
         WHEN {function}($1) THEN nextval(to_regclass('{sequence}')) ELSE 0 END END"
    )
}

/// Reads an attempt's answer; `None` for a value no statement of ours returns.
pub(super) fn read(value: i64) -> Option<Answer> {
    match value {
        1.. => u64::try_from(value).ok().map(Answer::Taken),
        0 => Some(Answer::Busy),
        REPEATABLE_READ => Some(Answer::Refused("REPEATABLE READ")),
        SERIALIZABLE => Some(Answer::Refused("SERIALIZABLE")),
        NO_SEQUENCE => Some(Answer::NoSequence),
        _ => None,
    }
}

/// The error for a transaction at `level`.
pub(super) fn refused(level: &str) -> LockError {
    LockError::new(
        ErrorKind::Misconfigured,
        format!(
            "the transaction runs at {level} isolation: its snapshot predates the lock, so the lock would not protect its reads; take transaction-scoped locks in READ COMMITTED transactions (PostgreSQL's default)"
        ),
    )
}

/// The error for a database without the fencing `sequence`.
pub(super) fn no_sequence(sequence: &str) -> LockError {
    LockError::new(
        ErrorKind::Misconfigured,
        format!(
            "the fencing sequence {sequence} does not exist in this database: create it once with PostgresTransactionLocks::create_fencing_sequence or lockingkit::providers::postgres::setup_sql (a PostgresBackend on the same database creates it on first use)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_reads_as_one_outcome() {
        assert_eq!(read(1), Some(Answer::Taken(1)));
        assert_eq!(read(i64::MAX), Some(Answer::Taken(i64::MAX as u64)));
        assert_eq!(read(0), Some(Answer::Busy));
        assert_eq!(read(-1), Some(Answer::Refused("REPEATABLE READ")));
        assert_eq!(read(-2), Some(Answer::Refused("SERIALIZABLE")));
        assert_eq!(read(-3), Some(Answer::NoSequence));
        assert_eq!(read(-4), None);
        assert_eq!(read(i64::MIN), None);
    }
}
