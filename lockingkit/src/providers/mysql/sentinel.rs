//! Noticing at once that the server ended a session.
//!
//! A MySQL client reads from its connection only while a statement runs, so a session the
//! server ends while it sits idle (`KILL`, a restart, a crash) goes unnoticed until its next
//! statement or check, and by then another client may hold its locks. So every session is
//! watched from a connection of its own: the session holds a *marker*, the named lock
//! `lkw:<connection id>` (connection ids are unique among a server's live connections), and
//! its *sentinel* waits for the marker in `GET_LOCK(marker, 2)`, sent again each time it times
//! out. The server grants the marker to the sentinel the moment the session ends, and a
//! restart or crash closes the sentinel's connection at the same moment; either way the
//! sentinel's statement returns at once, and the session is ended here, which every lease on
//! it sees as loss. A sentinel whose statement fails or goes unanswered ends the session too:
//! it can no longer vouch for it.
//!
//! When this process closes a session, the server frees the marker and the sentinel, finding
//! the session ended already, gives the marker back and closes its own connection. The
//! sentinel is also what closes a session that has held nothing and run nothing for half the
//! server's idle limit, before the server would (and log the abort).

use std::sync::Arc;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::Row;

use super::connection::Connector;
use super::errors::Stage;
use super::session::Session;
use super::take::first_number;
use super::waiting::SLICE;
use super::UNLOCK;
use crate::backend::BackendError;

/// The marker of the session with connection id `id`.
fn marker(id: u32) -> Arc<str> {
    Arc::from(format!("lkw:{id}"))
}

/// Opens a session and its sentinel: the two connections one after the other (the reconnect
/// backoff lets one connect at a time through while connecting fails), then the marker on the
/// session, then the sentinel's first wait.
pub(super) async fn open_watched(connector: &Arc<Connector>) -> Result<Arc<Session>, BackendError> {
    let session = Arc::new(Session::with(connector.connect().await?, connector.timeout));
    let watcher = match connector.connect().await {
        Ok(conn) => Arc::new(Session::with(conn, connector.timeout)),
        Err(error) => {
            session.end();
            return Err(error);
        }
    };
    let marker = marker(session.server_id());
    let mark = marker.clone();
    let taken = session
        .run(Stage::Attempt, move |conn| {
            Box::pin(async move {
                let row = conn
                    .exec_first::<Row, _, _>("SELECT GET_LOCK(?, 0)", (&*mark,))
                    .await?;
                Ok(first_number(row) == Some(1))
            })
        })
        .await;
    match taken {
        Ok(true) => {}
        Ok(false) => {
            session.end();
            watcher.end();
            return Err(BackendError::permanent(
                "the MySQL session could not take its own marker lock",
            ));
        }
        Err(error) => {
            session.end();
            watcher.end();
            return Err(error);
        }
    }
    let idle_close = connector.idle_limit / 2;
    tokio::spawn(watch(session.clone(), watcher, marker, idle_close));
    Ok(session)
}

/// The sentinel's loop: waits for the marker until the session ends, then ends it here too.
/// Between two waits it also closes the session once it has held nothing and run nothing for
/// `idle_close`: the server would close it soon (its idle limit) and log the abort.
async fn watch(
    session: Arc<Session>,
    sentinel: Arc<Session>,
    marker: Arc<str>,
    idle_close: Duration,
) {
    let seconds = u32::try_from(SLICE.as_secs()).unwrap_or(1);
    let granted = loop {
        let mark = marker.clone();
        let answer = sentinel
            .run_waiting(Stage::Held, SLICE, move |conn| {
                Box::pin(async move {
                    let row = conn
                        .exec_first::<Row, _, _>("SELECT GET_LOCK(?, ?)", (&*mark, seconds))
                        .await?;
                    Ok(first_number(row))
                })
            })
            .await;
        match answer {
            // Timed out: the session still holds its marker.
            Ok(Some(0)) => {
                let idle = session.holds() == 0 && session.busy() == 0;
                if idle && session.quiet_for() >= idle_close {
                    // Closing it frees the marker, which the next wait is granted.
                    session.end();
                }
            }
            Ok(Some(1)) => break true,
            // NULL (interrupted), an error, no answer: nothing vouches for the session now.
            _ => break false,
        }
    };
    session.end();
    if granted {
        let mark = marker.clone();
        let _ = sentinel
            .run(Stage::Release, move |conn| {
                Box::pin(async move { conn.exec_drop(UNLOCK, (&*mark,)).await })
            })
            .await;
    }
    sentinel.end();
}
