//! One slice of waiting in the server's lock queue: a statement that waits at most [`SLICE`]
//! for a key and, when the server grants it, keeps it and answers its fencing token in the
//! same round trip, so the lock the server granted is the waiter's lock (see `waiting`).

use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};

use super::super::schema::Schema;

/// The longest one watch statement (and so its snapshot) lives.
pub(super) const SLICE: Duration = Duration::from_millis(500);

/// Without the wait function (see `schema`): queues for the key exclusively and, once granted,
/// takes a fencing token in the same statement (the subquery runs first); it fails with
/// SQLSTATE 55P03 when the session's `lock_timeout` ends the slice, which the server logs as
/// an ERROR. For writers.
fn watch_sql(sequence: &str) -> String {
    format!(
        "SELECT nextval('{sequence}') FROM (SELECT pg_advisory_lock($1::bigint) OFFSET 0) granted"
    )
}

/// The same, shared: granted when no writer holds the key or waits in the server's queue ahead
/// of it. For readers.
fn watch_shared_sql(sequence: &str) -> String {
    format!(
        "SELECT nextval('{sequence}') FROM \
         (SELECT pg_advisory_lock_shared($1::bigint) OFFSET 0) granted"
    )
}

/// Sets the session's `lock_timeout` to [`SLICE`], or to half the server's `deadlock_timeout`
/// when that is shorter (at least 10 ms), so that a wait ends before the deadlock detector
/// looks at it.
const SET_SLICE: &str = "SELECT set_config('lock_timeout', \
     greatest(10, least(500, (extract(epoch FROM current_setting('deadlock_timeout')::interval) * 500)::int))::text || 'ms', \
     false)";

/// How a waiting session waits one slice, prepared once per session: one statement is sent
/// every half second while a key stays busy.
pub(super) enum SliceStatements {
    /// The wait function: answers the fencing token if the key was granted, logging nothing.
    /// `withdraw` is the session's server process, whose wait `pg_cancel_backend` ends at once
    /// (the function answers NULL), if the function is this version's.
    Function {
        watch: Statement,
        withdraw: Option<i32>,
    },
    /// [`watch_sql`] and [`watch_shared_sql`] under the session's `lock_timeout`, for a
    /// database without the function.
    Plain { watch: Statement, shared: Statement },
}

impl SliceStatements {
    /// Prepares the statements on a new waiting session: the watch function if the database
    /// has it, else the plain statements under a `lock_timeout` of one slice.
    pub(super) async fn prepare(
        client: &Client,
        schema: &Schema,
    ) -> Result<SliceStatements, tokio_postgres::Error> {
        let facts = client
            .query_one(&schema.waiting_session_facts(), &[])
            .await?;
        if facts.try_get::<_, bool>(0)? {
            let current = facts.try_get::<_, bool>(1)?;
            let process = facts.try_get::<_, i32>(2)?;
            let watch = schema.watch_statement();
            let types = [Type::INT8, Type::BOOL, Type::INT4];
            let watch = client.prepare_typed(&watch, &types).await?;
            return Ok(SliceStatements::Function {
                watch,
                withdraw: current.then_some(process),
            });
        }
        client.batch_execute(SET_SLICE).await?;
        let watch = client
            .prepare_typed(&watch_sql(&schema.sequence), &[Type::INT8])
            .await?;
        let shared = client
            .prepare_typed(&watch_shared_sql(&schema.sequence), &[Type::INT8])
            .await?;
        Ok(SliceStatements::Plain { watch, shared })
    }

    /// The server process whose waiting statement `pg_cancel_backend` may end early: `None`
    /// when a cancel would fail the statement with an error in the server's log instead.
    pub(super) fn withdrawable(&self) -> Option<i32> {
        match self {
            SliceStatements::Function { withdraw, .. } => *withdraw,
            SliceStatements::Plain { .. } => None,
        }
    }

    /// Waits one slice for `advisory_key` (exclusively if `exclusive`): `Some(token)` when the
    /// server granted it, which the session now holds, and `None` when the slice ended first.
    /// An error may come after the grant: the session may hold the key, and must close.
    pub(super) async fn wait_one(
        &self,
        client: &Client,
        advisory_key: i64,
        exclusive: bool,
    ) -> Result<Option<i64>, tokio_postgres::Error> {
        match self {
            SliceStatements::Function { watch, .. } => {
                let slice_ms = i32::try_from(SLICE.as_millis()).unwrap_or(i32::MAX);
                let params: [&(dyn ToSql + Sync); 3] = [&advisory_key, &exclusive, &slice_ms];
                let row = client.query_one(watch, &params).await?;
                row.try_get::<_, Option<i64>>(0)
            }
            SliceStatements::Plain { watch, shared } => {
                let statement = if exclusive { watch } else { shared };
                match client.query_one(statement, &[&advisory_key]).await {
                    Ok(row) => row.try_get::<_, i64>(0).map(Some),
                    // The slice ended with the key still taken.
                    Err(error) if error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => Ok(None),
                    Err(error) => Err(error),
                }
            }
        }
    }
}
