//! The session check: one round trip per session per check interval vouches for every lock
//! on it.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::watch as channel;
use tokio::time::Instant;

use super::Session;

#[derive(Default)]
pub(in crate::providers::postgres) struct CheckState {
    /// When the newest successful check was sent.
    confirmed: Option<Instant>,
    /// The check in flight: `None` until it answers, then whether the session answered.
    running: Option<channel::Receiver<Option<bool>>>,
}

impl Session {
    /// Checks that the session answers, at most once per `interval`: a check sent within the
    /// last `interval` vouches for every lock on the session, and callers that arrive while a
    /// check is in flight share its answer. A check that fails or does not answer within
    /// `timeout` ends the session, which is loss for every lock on it.
    pub(in crate::providers::postgres) async fn check(
        self: &Arc<Self>,
        interval: Duration,
        timeout: Duration,
    ) -> bool {
        let mut running = {
            let mut state = self.check.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            if state
                .confirmed
                .is_some_and(|sent| now.saturating_duration_since(sent) < interval)
            {
                return true;
            }
            match &state.running {
                Some(running) => running.clone(),
                None => {
                    let (answer, running) = channel::channel(None);
                    state.running = Some(running.clone());
                    // In a task of its own, so that its answer is recorded even if every caller
                    // went away.
                    tokio::spawn(run_check(self.clone(), answer, now, timeout));
                    running
                }
            }
        };
        let alive = match running.wait_for(Option::is_some).await {
            Ok(answer) => *answer == Some(true),
            Err(_) => false,
        };
        alive
    }
}

async fn run_check(
    session: Arc<Session>,
    answer: channel::Sender<Option<bool>>,
    sent: Instant,
    timeout: Duration,
) {
    // Unnamed: its answer must come from whichever server process runs it, even behind a
    // pooler that would fail a prepared statement there (see `pooler`).
    let checked = session.client.query_typed_one(super::super::CHECK, &[]);
    let alive = match session.bounded(timeout, checked).await {
        Ok(Ok(row)) => session.pooling.same_process(session.server_process, &row),
        _ => false,
    };
    {
        let mut state = session.check.lock().unwrap_or_else(PoisonError::into_inner);
        state.running = None;
        if alive {
            state.confirmed = Some(sent);
        }
    }
    if !alive {
        session.close();
    }
    answer.send_replace(Some(alive));
}
