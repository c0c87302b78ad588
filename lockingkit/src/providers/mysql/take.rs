//! The statements that take a lock with its fencing token, and set up the counters they use.
//!
//! Every request is a single statement: the driver does not report an error raised by a later
//! statement of a multi-statement request until the connection's next request, so a lock
//! taken by the first statement could go unnoticed.
//!
//! # Fencing tokens without a write per lock
//! A token is `epoch × 2⁴⁷ + n`. The *epoch* is a row of an InnoDB table (the fencing table),
//! moved on once per server start: the row also names the server start it belongs to (the
//! server's id and start time) and a *base*, a value of the server's `UUID_SHORT()` counter
//! drawn when the epoch began. `n` is `UUID_SHORT() − base`, drawn by the very statement that
//! takes the lock. `UUID_SHORT()` grows by one on each call for as long as the server runs, so
//! tokens grow within an epoch with no write at all: the statement that takes a lock reads no
//! table and writes nothing, not even to the binary log.
//!
//! A session reads the row once. A row of another server start (the server restarted or
//! crashed, or this is a promoted replica), or one whose epoch is spent (`n` would reach
//! 2⁴⁷), is moved on to a new epoch by one conditional UPDATE, which only one of several
//! clients racing for it wins; the others read what it wrote. Every token of the new epoch is
//! above every token before it, whatever the server's clock did across the restart.
//!
//! A token is only handed out while `n` is below 2⁴⁷. Once one session's `UUID_SHORT()` has
//! passed that mark, every later call does too, so no session can hand out a token of the old
//! epoch after one of the new (see [`Counter::token`]).

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
    /// showed the lock held was sent (for a waiting session, the token's draw after its
    /// `GET_LOCK`, not the `GET_LOCK` that may have waited long before the grant).
    Granted {
        index: usize,
        fencing_token: u64,
        confirmed: Instant,
    },
    /// The fencing epoch cannot be read (see [`Missing`]): nothing was kept.
    Unusable(Missing),
}

/// Why the fencing epoch cannot be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Missing {
    /// The epoch row is gone (the table is there).
    Row,
    /// The server does not tell its start time (its `Uptime` status).
    ServerStart,
}

/// How many low bits of a token count within an epoch.
const EPOCH_SHIFT: u32 = 47;
/// The count within an epoch that no token reaches.
const EPOCH_SPAN: u64 = 1 << EPOCH_SHIFT;
/// The most epochs: tokens stay within 63 bits.
const MAX_EPOCH: u64 = (1 << (63 - EPOCH_SHIFT)) - 1;

/// The epoch a session draws its tokens in: read once per session (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Counter {
    epoch: u64,
    base: u64,
}

impl Counter {
    /// The token for a `UUID_SHORT()` value drawn under a lock; `None` when the value lies
    /// outside this epoch (its span is spent): the session must read the row again.
    pub(super) fn token(self, drawn: u64) -> Option<u64> {
        let n = drawn
            .checked_sub(self.base)
            .filter(|n| (1..EPOCH_SPAN).contains(n))?;
        Some((self.epoch << EPOCH_SHIFT) | n)
    }
}

/// The fencing statements for one fencing table.
pub(super) struct FencingSql {
    /// Checks the epoch row.
    select: String,
    /// Creates the table with its epoch row, in one statement.
    create: String,
    /// The epoch row next to what it must match: this server's id and start time, and a
    /// fresh `UUID_SHORT()`.
    load: String,
    /// The same on a server without `information_schema.GLOBAL_STATUS` (MySQL 8, whose
    /// `performance_schema.global_status` spells the name `Uptime` and may compare it
    /// case-sensitively).
    load_performance_schema: String,
    /// Moves the row on to a new epoch for this server start, unless someone just did.
    next_epoch: String,
}

/// An exclusive attempt: the lock, and a token drawn only if it was granted (0 when it was
/// not; NULL when the server failed to answer the request).
const LOCK: &str = "SELECT CASE GET_LOCK(?, 0) WHEN 1 THEN UUID_SHORT() WHEN 0 THEN 0 END";
/// Draws a token after a lock taken by a statement of its own.
const DRAW: &str = "SELECT UUID_SHORT()";

impl FencingSql {
    pub(super) fn new(table: &str) -> Self {
        let load = |status: &str| {
            format!(
                "SELECT f.epoch, f.server_id, f.started, f.base, @@server_id, \
                 UNIX_TIMESTAMP() - CAST(s.VARIABLE_VALUE AS SIGNED), UUID_SHORT() \
                 FROM `{table}` AS f LEFT JOIN {status} AS s \
                 ON s.VARIABLE_NAME IN ('UPTIME', 'Uptime') \
                 WHERE f.id = 1"
            )
        };
        FencingSql {
            select: format!("SELECT epoch FROM `{table}` WHERE id = 1"),
            create: format!(
                "CREATE TABLE `{table}` (id TINYINT UNSIGNED NOT NULL PRIMARY KEY, \
                 epoch BIGINT UNSIGNED NOT NULL, server_id BIGINT UNSIGNED NOT NULL, \
                 started BIGINT NOT NULL, base BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB \
                 SELECT 1 AS id, 0 AS epoch, 0 AS server_id, 0 AS started, 0 AS base"
            ),
            load: load("information_schema.GLOBAL_STATUS"),
            load_performance_schema: load("performance_schema.global_status"),
            next_epoch: format!(
                "UPDATE `{table}` SET epoch = LAST_INSERT_ID(epoch + 1), server_id = ?, \
                 started = ?, base = ? WHERE id = 1 AND epoch = ?"
            ),
        }
    }

    /// The statement that creates the table with its epoch row.
    pub(super) fn create(&self) -> String {
        format!("{};", self.create)
    }
}

/// Creates the fencing table with its epoch row unless the table exists, and reads the row
/// into `session` as its first request would: `Ok(Some(_))` when that cannot be done, as when
/// the table exists without the row (someone deleted it; making it again would start tokens
/// over).
pub(super) async fn ensure_fencing(
    conn: &mut Conn,
    session: Arc<Session>,
    sql: Arc<FencingSql>,
) -> Result<Option<Missing>, mysql_async::Error> {
    // Checking first lets a user without CREATE use a table made beforehand.
    let exists = match conn.query_first::<Row, _>(&*sql.select).await {
        Ok(row) => Some(row.is_some()),
        Err(mysql_async::Error::Server(error)) if error.code == errors::NO_SUCH_TABLE => None,
        Err(error) => return Err(error),
    };
    match exists {
        Some(false) => return Ok(Some(Missing::Row)),
        Some(true) => {}
        // The table and its row in one atomic statement; another process that made it first
        // makes this one fail with "table exists", which is as good.
        None => match conn.query_drop(&*sql.create).await {
            Err(mysql_async::Error::Server(error)) if error.code == errors::TABLE_EXISTS => {}
            other => other?,
        },
    }
    // The server's start time included: a user who may not read it learns so here, and the
    // session's first attempt need not read the row again.
    Ok(counter(conn, &session, &sql).await?.err())
}

/// The epoch row as read, next to the server it was read from.
struct Loaded {
    epoch: u64,
    server_id: u64,
    started: i64,
    base: u64,
    this_server: u64,
    this_start: i64,
    drawn: u64,
}

impl Loaded {
    /// The row's epoch, if it is this server start's and its span is not spent.
    fn counter(&self) -> Option<Counter> {
        let counter = Counter {
            epoch: self.epoch,
            base: self.base,
        };
        let current = self.server_id == self.this_server && self.started == self.this_start;
        (current && (1..=MAX_EPOCH).contains(&self.epoch))
            .then_some(counter)
            .filter(|counter| counter.token(self.drawn).is_some())
    }
}

/// Reads the epoch row, with the server's start time.
async fn load(
    conn: &mut Conn,
    sql: &FencingSql,
) -> Result<Result<Loaded, Missing>, mysql_async::Error> {
    let row = match conn.query_first::<Row, _>(&*sql.load).await {
        Err(mysql_async::Error::Server(error)) if errors::is_unknown_table(error.code) => {
            conn.query_first::<Row, _>(&*sql.load_performance_schema)
                .await?
        }
        other => other?,
    };
    let Some(row) = row else {
        return Ok(Err(Missing::Row));
    };
    let read = |row: &Row| -> Option<Result<Loaded, Missing>> {
        // NULL where the server has no `Uptime` status to join.
        let this_start: Option<i64> = row.get_opt(5)?.ok()?;
        let Some(this_start) = this_start else {
            return Some(Err(Missing::ServerStart));
        };
        Some(Ok(Loaded {
            epoch: row.get_opt(0)?.ok()?,
            server_id: row.get_opt(1)?.ok()?,
            started: row.get_opt(2)?.ok()?,
            base: row.get_opt(3)?.ok()?,
            this_server: row.get_opt(4)?.ok()?,
            this_start,
            drawn: row.get_opt(6)?.ok()?,
        }))
    };
    read(&row).ok_or_else(|| {
        mysql_async::Error::Other("unexpected answer about the fencing epoch".into())
    })
}

/// The session's epoch: the one it read before, or the row's, moved on to a new epoch first
/// if it belongs to another server start or its span is spent.
async fn counter(
    conn: &mut Conn,
    session: &Session,
    sql: &FencingSql,
) -> Result<Result<Counter, Missing>, mysql_async::Error> {
    if let Some(counter) = session.counter() {
        return Ok(Ok(counter));
    }
    for _ in 0..3 {
        let loaded = match load(conn, sql).await? {
            Ok(loaded) => loaded,
            Err(missing) => return Ok(Err(missing)),
        };
        if let Some(counter) = loaded.counter() {
            session.set_counter(Some(counter));
            return Ok(Ok(counter));
        }
        // A new epoch, based on a value drawn before it starts: every value drawn after is
        // above it. Only the UPDATE that still finds the epoch it read moves it on; a client
        // that lost the race reads the winner's row.
        let base: Option<u64> = conn.query_first(DRAW).await?;
        let base = base.ok_or_else(|| mysql_async::Error::Other("no UUID_SHORT()".into()))?;
        if loaded.epoch >= MAX_EPOCH {
            return Err(mysql_async::Error::Other(
                "the fencing epochs are used up".into(),
            ));
        }
        let started = (loaded.this_server, loaded.this_start, base, loaded.epoch);
        conn.exec_drop(&*sql.next_epoch, started).await?;
    }
    Err(mysql_async::Error::Other(
        "the fencing epoch kept moving on".into(),
    ))
}

/// Takes the first free name of `names` this session does not hold, with its fencing token.
/// Each `GET_LOCK` waits up to `wait_seconds` (0 for an attempt; a waiting session's slice,
/// which names one name, otherwise).
///
/// An exclusive attempt is one statement, `SELECT CASE GET_LOCK(?, 0) WHEN 1 THEN
/// UUID_SHORT() WHEN 0 THEN 0 END`: the token is drawn only once the lock is granted. A
/// waiting `GET_LOCK` draws its token in a statement of its own after the grant, so that the
/// lease counts from then; so does a semaphore's request, which must say which slot it took.
///
/// A grant whose draw lies past its epoch's span is given back, and the request is made once
/// more under the epoch the session then moves on to (see the module docs).
pub(super) async fn take(
    conn: &mut Conn,
    session: Arc<Session>,
    names: Arc<[Candidate]>,
    sql: Arc<FencingSql>,
    wait_seconds: u32,
) -> Result<Taken, mysql_async::Error> {
    for _ in 0..2 {
        let counter = match counter(conn, &session, &sql).await? {
            Ok(counter) => counter,
            Err(missing) => return Ok(Taken::Unusable(missing)),
        };
        match take_once(conn, &session, &names, counter, wait_seconds).await? {
            Some(taken) => return Ok(taken),
            None => session.set_counter(None),
        }
    }
    Err(mysql_async::Error::Other(
        "the fencing epoch kept moving on".into(),
    ))
}

/// One request under `counter`'s epoch: `None` when the grant's draw lay past the epoch's
/// span (the name given back).
async fn take_once(
    conn: &mut Conn,
    session: &Session,
    names: &[Candidate],
    counter: Counter,
    wait_seconds: u32,
) -> Result<Option<Taken>, mysql_async::Error> {
    let free: Vec<usize> = {
        let held = session.names();
        (0..names.len())
            .filter(|&i| !held.contains(&names[i].name))
            .collect()
    };
    let index = match (free.as_slice(), wait_seconds) {
        // This session holds every one: the server would grant them again, by re-entrancy.
        ([], _) => return Ok(Some(Taken::Busy)),
        (&[index], 0) => return take_in_one(conn, session, &names[index], counter, index).await,
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
        return Ok(Some(Taken::Busy));
    };
    let name = &names[index];
    session.names().insert(name.name.clone());
    let confirmed = Instant::now();
    let drawn = match conn.query_first::<Option<u64>, _>(DRAW).await {
        Ok(drawn) => drawn.flatten(),
        Err(error) => {
            if !errors::breaks_session(&error) {
                undo(conn, session, name).await?;
            }
            return Err(error);
        }
    };
    let Some(drawn) = drawn else {
        undo(conn, session, name).await?;
        return Err(mysql_async::Error::Other("no UUID_SHORT()".into()));
    };
    granted(
        conn,
        session,
        name,
        counter.token(drawn),
        (index, confirmed),
    )
    .await
}

/// The grant of `name` with its token, or the name given back when the draw lay past the
/// epoch's span (`None`).
async fn granted(
    conn: &mut Conn,
    session: &Session,
    name: &Candidate,
    token: Option<u64>,
    (index, confirmed): (usize, Instant),
) -> Result<Option<Taken>, mysql_async::Error> {
    match token {
        Some(fencing_token) => Ok(Some(Taken::Granted {
            index,
            fencing_token,
            confirmed,
        })),
        None => {
            undo(conn, session, name).await?;
            Ok(None)
        }
    }
}

/// An exclusive attempt in one statement (see [`take`]).
async fn take_in_one(
    conn: &mut Conn,
    session: &Session,
    name: &Candidate,
    counter: Counter,
    index: usize,
) -> Result<Option<Taken>, mysql_async::Error> {
    let confirmed = Instant::now();
    let drawn = match conn
        .exec_first::<Option<u64>, _, _>(LOCK, (&*name.name,))
        .await
    {
        Ok(drawn) => drawn,
        Err(error) => {
            // The statement may have failed after the lock was taken.
            if !errors::breaks_session(&error) {
                session.names().insert(name.name.clone());
                undo(conn, session, name).await?;
            }
            return Err(error);
        }
    };
    match drawn {
        Some(Some(0)) => Ok(Some(Taken::Busy)),
        Some(Some(drawn)) => {
            session.names().insert(name.name.clone());
            granted(
                conn,
                session,
                name,
                counter.token(drawn),
                (index, confirmed),
            )
            .await
        }
        // NULL: the server failed to take or refuse the lock (it was killed, say).
        _ => Err(mysql_async::Error::Other(
            "unexpected answer to the lock statement".into(),
        )),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_lie_within_their_epoch_and_never_overflow() {
        let counter = Counter {
            epoch: 3,
            base: 1 << 56,
        };
        assert_eq!(counter.token((1 << 56) + 1), Some((3 << 47) | 1));
        assert_eq!(
            counter.token((1 << 56) + EPOCH_SPAN - 1),
            Some((4 << 47) - 1),
            "the last token of an epoch lies below the next epoch's first"
        );
        // The base itself, values before it, and values past the span are no tokens.
        assert_eq!(counter.token(1 << 56), None);
        assert_eq!(counter.token(0), None);
        assert_eq!(counter.token((1 << 56) + EPOCH_SPAN), None);
        assert_eq!(counter.token(u64::MAX), None);
        let last = Counter {
            epoch: MAX_EPOCH,
            base: 0,
        };
        assert_eq!(last.token(EPOCH_SPAN - 1), Some(i64::MAX as u64));
    }
}
