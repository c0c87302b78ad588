//! The statements that take a lock with its fencing token, and set up the counters they use.
//!
//! Every request is a single statement: the driver does not report an error raised by a later
//! statement of a multi-statement request until the connection's next request, so a lock
//! taken by the first statement could go unnoticed.
//!
//! # Fencing tokens without a disk write per lock
//! A token is `epoch × 2⁴⁰ + n`. The *epoch* is a counter row in an InnoDB table (the fencing
//! table, durable), bumped only when the server starts afresh; `n` counts grants in a row of a
//! MEMORY table beside it (`<fencing table>_now`), which lives in the server's memory: bumping
//! it costs no redo log write and no flush. A restart or crash empties the MEMORY table, and the
//! first attempt after it finds no row: it bumps the epoch (one durable commit), and seeds the
//! row with `new epoch × 2⁴⁰`, above every token handed out before, however many that was. A
//! row that has counted 2³⁹ grants in one epoch is moved on to a new epoch the same way, long
//! before its count could reach the next epoch's tokens. (A durable row bumped on every grant
//! cost a commit each, two thirds of a pair's time; a MariaDB SEQUENCE, which caches values,
//! went back after a crash: see the MySQL guide.)

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
    /// The epoch row is gone (the table is there): nothing was kept.
    NoCounterRow,
}

/// How many low bits of a token count grants within an epoch.
const EPOCH_SHIFT: u32 = 40;
/// A count within an epoch from which the next grant moves the row to a new epoch.
const EPOCH_FULL: u64 = 1 << 39;
/// The most epochs: tokens stay within 63 bits.
const MAX_EPOCH: u64 = (1 << (63 - EPOCH_SHIFT)) - 1;

/// The fencing statements for one fencing table and its MEMORY companion.
pub(super) struct FencingSql {
    /// Checks the epoch row.
    select: String,
    /// Creates the table with its epoch row, in one statement.
    create: String,
    /// Creates the MEMORY table unless it exists.
    create_now: String,
    /// Reads nothing from the MEMORY table: fails if it is missing.
    probe_now: String,
    /// Bumps the epoch.
    next_epoch: String,
    /// Seeds the MEMORY row with a new epoch's first token, or moves it on to it.
    seed: String,
    /// An exclusive attempt: the lock, and the count bumped only if it was granted. Sessions
    /// count matched rows (`CLIENT_FOUND_ROWS`), so it answers one row whether or not the lock
    /// was granted, and none when the row is gone; `LAST_INSERT_ID(expr)` sets the answer's
    /// insert id only when it runs, so a token there means the lock was granted.
    lock: String,
    /// Bumps the count after a lock taken by a statement of its own.
    bump: String,
}

impl FencingSql {
    pub(super) fn new(table: &str) -> Self {
        let now = format!("{table}_now");
        FencingSql {
            select: format!("SELECT v FROM `{table}` WHERE id = 1"),
            create: format!(
                "CREATE TABLE `{table}` (id TINYINT UNSIGNED NOT NULL PRIMARY KEY, \
                 v BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB SELECT 1 AS id, 0 AS v"
            ),
            create_now: format!(
                "CREATE TABLE IF NOT EXISTS `{now}` (id TINYINT UNSIGNED NOT NULL PRIMARY KEY, \
                 v BIGINT UNSIGNED NOT NULL) ENGINE=MEMORY"
            ),
            probe_now: format!("SELECT 1 FROM `{now}` WHERE 0"),
            next_epoch: format!("UPDATE `{table}` SET v = LAST_INSERT_ID(v + 1) WHERE id = 1"),
            seed: format!(
                "INSERT INTO `{now}` (id, v) VALUES (1, ?) ON DUPLICATE KEY UPDATE v = GREATEST(v, ?)"
            ),
            lock: format!(
                "UPDATE `{now}` SET v = IF(GET_LOCK(?, 0) = 1, LAST_INSERT_ID(v + 1), v) \
                 WHERE id = 1"
            ),
            bump: format!("UPDATE `{now}` SET v = LAST_INSERT_ID(v + 1) WHERE id = 1"),
        }
    }

    /// The statements that create both tables, the epoch row included.
    pub(super) fn create(&self) -> String {
        format!("{};\n{}", self.create, self.create_now)
    }
}

/// Creates the fencing table with its epoch row unless the table exists, and the MEMORY table
/// beside it: `Ok(false)` when the table exists without the row (someone deleted it; making
/// it again would start tokens over).
pub(super) async fn ensure_fencing(
    conn: &mut Conn,
    sql: Arc<FencingSql>,
) -> Result<bool, mysql_async::Error> {
    // Checking first lets a user without CREATE use a table made beforehand.
    let exists = match conn.query_first::<Row, _>(&*sql.select).await {
        Ok(row) => Some(row.is_some()),
        Err(mysql_async::Error::Server(error)) if error.code == errors::NO_SUCH_TABLE => None,
        Err(error) => return Err(error),
    };
    match exists {
        Some(false) => return Ok(false),
        Some(true) => {}
        // The table and its row in one atomic statement; another process that made it first
        // makes this one fail with "table exists", which is as good.
        None => match conn.query_drop(&*sql.create).await {
            Err(mysql_async::Error::Server(error)) if error.code == errors::TABLE_EXISTS => {}
            other => other?,
        },
    }
    // Made only if missing (a table made beforehand is left alone, and a user without CREATE
    // gets no error when it exists).
    let now_exists = conn.query_first::<Row, _>(&*sql.probe_now).await;
    match now_exists {
        Ok(_) => {}
        Err(mysql_async::Error::Server(error)) if error.code == errors::NO_SUCH_TABLE => {
            conn.query_drop(&*sql.create_now).await?;
        }
        Err(error) => return Err(error),
    }
    Ok(true)
}

/// Moves the MEMORY row on to a new epoch (and makes it if the server lost it): bumps the
/// epoch durably first, so every token after is above every token before. `Ok(false)` when
/// the epoch row is gone.
async fn new_epoch(conn: &mut Conn, sql: &FencingSql) -> Result<bool, mysql_async::Error> {
    conn.exec_drop(&*sql.next_epoch, ()).await?;
    let epoch = match (conn.affected_rows(), conn.last_insert_id()) {
        (1, Some(epoch)) if (1..=MAX_EPOCH).contains(&epoch) => epoch,
        (1, Some(_)) => {
            return Err(mysql_async::Error::Other(
                "the fencing epochs are used up".into(),
            ))
        }
        _ => return Ok(false),
    };
    let first = epoch << EPOCH_SHIFT;
    conn.exec_drop(&*sql.seed, (first, first)).await?;
    Ok(true)
}

/// Takes the first free name of `names` this session does not hold, with its fencing token.
/// Each `GET_LOCK` waits up to `wait_seconds` (0 for an attempt; a waiting session's slice,
/// which names one name, otherwise).
///
/// An exclusive attempt is one statement, `UPDATE <table>_now SET v = IF(GET_LOCK(?, 0) = 1,
/// LAST_INSERT_ID(v + 1), v) WHERE id = 1`: the row is locked (a MEMORY table locks the table)
/// before the new value is computed once, so the lock is taken at most once. A waiting
/// `GET_LOCK` must not hold the counter while it waits, and a semaphore's request must say
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
    match next_token(conn, &sql).await {
        Ok(Some(fencing_token)) => Ok(Taken::Granted {
            index,
            fencing_token,
            confirmed,
        }),
        Ok(None) => {
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

/// The next fencing token, after a lock taken by a statement of its own; `None` when the
/// epoch row is gone.
async fn next_token(conn: &mut Conn, sql: &FencingSql) -> Result<Option<u64>, mysql_async::Error> {
    for first_try in [true, false] {
        conn.exec_drop(&*sql.bump, ()).await?;
        match (conn.affected_rows(), conn.last_insert_id()) {
            (1, Some(token)) if token > 0 => return moved_on(conn, sql, token).await.map(Some),
            // The server lost the MEMORY row (it restarted): a new epoch, then again.
            (0, _) if first_try => {
                if !new_epoch(conn, sql).await? {
                    return Ok(None);
                }
            }
            _ => break,
        }
    }
    Err(mysql_async::Error::Other(
        "unexpected answer to the fencing counter".into(),
    ))
}

/// `token`, after moving the MEMORY row on to a new epoch if its count within this one is
/// full.
async fn moved_on(
    conn: &mut Conn,
    sql: &FencingSql,
    token: u64,
) -> Result<u64, mysql_async::Error> {
    if token & ((1 << EPOCH_SHIFT) - 1) >= EPOCH_FULL {
        new_epoch(conn, sql).await?;
    }
    Ok(token)
}

/// An exclusive attempt in one statement (see [`take`]).
async fn take_in_one(
    conn: &mut Conn,
    session: &Session,
    name: &Candidate,
    sql: &FencingSql,
    index: usize,
) -> Result<Taken, mysql_async::Error> {
    for first_try in [true, false] {
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
            (1, Some(token)) if token > 0 => {
                session.names().insert(name.name.clone());
                let fencing_token = match moved_on(conn, sql, token).await {
                    Ok(token) => token,
                    Err(error) => {
                        if !errors::breaks_session(&error) {
                            undo(conn, session, name).await?;
                        }
                        return Err(error);
                    }
                };
                return Ok(Taken::Granted {
                    index,
                    fencing_token,
                    confirmed,
                });
            }
            (1, _) => return Ok(Taken::Busy),
            // No row: the server lost the MEMORY row (it restarted), so the lock was not
            // asked for. A new epoch, then the attempt again.
            (0, _) if first_try => {
                if !new_epoch(conn, sql).await? {
                    return Ok(Taken::NoCounterRow);
                }
            }
            _ => break,
        }
    }
    Err(mysql_async::Error::Other(
        "unexpected answer to the lock statement".into(),
    ))
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
