//! The statements that take a lock with its fencing token, and set up the counter they bump.
//!
//! Every request is a single statement: the driver does not report an error raised by a later
//! statement of a multi-statement request until the connection's next request, so a lock
//! taken by the first statement could go unnoticed.

use std::sync::Arc;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row};
use tokio::time::Instant;

use super::errors;
use super::session::Session;
use super::UNLOCK;

/// One name an attempt may take.
pub(super) struct Candidate {
    pub(super) name: Arc<str>,
    /// Its slot, for a semaphore's.
    pub(super) slot: Option<u16>,
}

/// What a request took.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Taken {
    /// None of the names: someone holds each.
    Busy,
    /// `names[index]`, with its fencing token. `confirmed`: when the statement that last
    /// showed the lock held was sent (for a waiting session, the counter's bump after its
    /// `GET_LOCK`, not the `GET_LOCK` that may have waited long before the grant).
    Granted {
        index: usize,
        fencing_token: u64,
        confirmed: Instant,
    },
    /// The counter row is gone (the table is there): nothing was kept.
    NoCounterRow,
}

/// The fencing statements for one table.
pub(super) struct FencingSql {
    /// Checks the counter row.
    select: String,
    /// Creates the table with its counter row, in one statement.
    create: String,
    /// An exclusive attempt: the lock, and the counter bumped only if it was granted. Sessions
    /// count matched rows (`CLIENT_FOUND_ROWS`), so it answers one row whether or not the lock
    /// was granted, and none when the counter row is gone; `LAST_INSERT_ID(expr)` sets the
    /// answer's insert id only when it runs, so a token there means the lock was granted.
    lock: String,
    /// Bumps the counter after a lock taken by a statement of its own.
    bump: String,
}

impl FencingSql {
    pub(super) fn new(table: &str) -> Self {
        FencingSql {
            select: format!("SELECT v FROM `{table}` WHERE id = 1"),
            create: format!(
                "CREATE TABLE `{table}` (id TINYINT UNSIGNED NOT NULL PRIMARY KEY, \
                 v BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB SELECT 1 AS id, 0 AS v"
            ),
            lock: format!(
                "UPDATE `{table}` SET v = IF(GET_LOCK(?, 0) = 1, LAST_INSERT_ID(v + 1), v) \
                 WHERE id = 1"
            ),
            bump: format!("UPDATE `{table}` SET v = LAST_INSERT_ID(v + 1) WHERE id = 1"),
        }
    }
}

impl FencingSql {
    /// The statement that creates the table with its counter row.
    pub(super) fn create(&self) -> &str {
        &self.create
    }
}

/// Creates the fencing table with its counter row unless the table exists: `Ok(false)` when
/// the table exists without the row (someone deleted it; making it again would start tokens
/// over).
pub(super) async fn ensure_fencing(
    conn: &mut Conn,
    sql: Arc<FencingSql>,
) -> Result<bool, mysql_async::Error> {
    // Checking first lets a user without CREATE use a table made beforehand.
    match conn.query_first::<Row, _>(&*sql.select).await {
        Ok(row) => return Ok(row.is_some()),
        Err(mysql_async::Error::Server(error)) if error.code == errors::NO_SUCH_TABLE => {}
        Err(error) => return Err(error),
    }
    // The table and its row in one atomic statement; another process that made it first
    // makes this one fail with "table exists", which is as good.
    match conn.query_drop(&*sql.create).await {
        Err(mysql_async::Error::Server(error)) if error.code == errors::TABLE_EXISTS => {}
        other => other?,
    }
    Ok(true)
}

/// Takes the first free name of `names` this session does not hold, with its fencing token.
/// Each `GET_LOCK` waits up to `wait_seconds` (0 for an attempt; a waiting session's slice,
/// which names one name, otherwise).
///
/// An exclusive attempt is one statement, `UPDATE … SET v = IF(GET_LOCK(?, 0) = 1, …) WHERE id
/// = 1`: the row is locked before the new value is computed, and sessions read under
/// REPEATABLE READ (see `connection`), where InnoDB hands each row over once (READ COMMITTED's
/// "semi-consistent" reads would evaluate an UPDATE's row twice), so the lock is taken at most
/// once. A waiting
/// `GET_LOCK` must not hold the counter row while it waits, and a semaphore's request must say
/// which slot it took: those take the lock first and bump the counter in a second statement.
pub(super) async fn take(
    conn: &mut Conn,
    session: Arc<Session>,
    names: Arc<[Candidate]>,
    sql: Arc<FencingSql>,
    wait_seconds: u32,
) -> Result<Taken, mysql_async::Error> {
    let free: Vec<usize> = {
        let held = session.names();
        (0..names.len())
            .filter(|&i| !held.contains(&names[i].name))
            .collect()
    };
    let index = match (free.as_slice(), wait_seconds) {
        // This session holds every one: the server would grant them again, by re-entrancy.
        ([], _) => return Ok(Taken::Busy),
        (&[index], 0) => return take_in_one(conn, &session, &names[index], &sql, index).await,
        (&[index], seconds) => {
            let row = conn
                .exec_first::<Row, _, _>("SELECT GET_LOCK(?, ?)", (&*names[index].name, seconds))
                .await?;
            (first_number(row) == Some(1)).then_some(index)
        }
        (free, _) => {
            let mut query = String::from("SELECT CASE");
            for &i in free {
                // Names are lowercase hexadecimal, digits and colons (see `MysqlLockKeys`):
                // quoting them needs no escapes.
                query.push_str(&format!(
                    " WHEN GET_LOCK('{}', 0) = 1 THEN {i}",
                    names[i].name
                ));
            }
            query.push_str(" END");
            let row = conn.query_first::<Row, _>(query).await?;
            first_number(row)
                .and_then(|i| usize::try_from(i).ok())
                .filter(|i| free.contains(i))
        }
    };
    let Some(index) = index else {
        return Ok(Taken::Busy);
    };
    let name = &names[index];
    session.names().insert(name.name.clone());
    let confirmed = Instant::now();
    let bumped = conn.exec_drop(&*sql.bump, ()).await;
    match bumped.map(|()| (conn.affected_rows(), conn.last_insert_id())) {
        Ok((1, Some(fencing_token))) if fencing_token > 0 => Ok(Taken::Granted {
            index,
            fencing_token,
            confirmed,
        }),
        Ok(_) => {
            undo(conn, &session, name).await?;
            Ok(Taken::NoCounterRow)
        }
        Err(error) => {
            if !errors::breaks_session(&error) {
                undo(conn, &session, name).await?;
            }
            Err(error)
        }
    }
}

/// An exclusive attempt in one statement (see [`take`]).
async fn take_in_one(
    conn: &mut Conn,
    session: &Session,
    name: &Candidate,
    sql: &FencingSql,
    index: usize,
) -> Result<Taken, mysql_async::Error> {
    let confirmed = Instant::now();
    if let Err(error) = conn.exec_drop(&*sql.lock, (&*name.name,)).await {
        // The statement may have failed after the lock was taken (a full disk, say).
        if !errors::breaks_session(&error) {
            session.names().insert(name.name.clone());
            undo(conn, session, name).await?;
        }
        return Err(error);
    }
    match (conn.affected_rows(), conn.last_insert_id()) {
        (1, Some(fencing_token)) if fencing_token > 0 => {
            session.names().insert(name.name.clone());
            Ok(Taken::Granted {
                index,
                fencing_token,
                confirmed,
            })
        }
        (1, _) => Ok(Taken::Busy),
        _ => Ok(Taken::NoCounterRow),
    }
}

/// Gives back a name this session may hold.
async fn undo(
    conn: &mut Conn,
    session: &Session,
    name: &Candidate,
) -> Result<(), mysql_async::Error> {
    conn.exec_drop(UNLOCK, (&*name.name,)).await?;
    session.names().remove(&name.name);
    Ok(())
}

/// The first column of `row` as a number, if it is one.
pub(super) fn first_number(row: Option<Row>) -> Option<i64> {
    row.and_then(|row| row.get_opt::<Option<i64>, usize>(0)?.ok()?)
}
