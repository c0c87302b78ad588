//! Waiting for state that only a server can report (a queue place, a session, a watcher): the
//! server sends no signal for it, so the test asks until it holds.

use std::time::Duration;

use tokio::time::Instant;

/// Waits for `condition`, asking every 10 ms; fails the test if it does not hold `within`.
pub async fn eventually(what: &str, within: Duration, mut condition: impl AsyncFnMut() -> bool) {
    let give_up = Instant::now() + within;
    while !condition().await {
        assert!(
            Instant::now() < give_up,
            "{what} did not happen within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
