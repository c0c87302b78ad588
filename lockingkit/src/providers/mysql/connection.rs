//! Opening one session: the connection string, the settings a lock session needs, and the
//! shared reconnect backoff.
//!
//! Error messages never repeat the connection string: it usually carries a password.

use std::sync::Arc;
use std::time::Duration;

use mysql_async::{Conn, Opts, OptsBuilder};

use super::errors::{self, Stage};
use crate::backend::BackendError;
use crate::providers::reconnect::Reconnect;

/// Parses a `mysql://` URL into the driver's options, with the settings a lock session needs
/// where the URL leaves them open.
pub(super) fn parse(url: &str) -> Result<Opts, String> {
    let opts = Opts::from_url(url).map_err(|error| {
        // The driver's URL errors quote at most a parameter's name or value, never the user
        // or password part.
        format!("is not a MySQL connection URL (mysql://user:password@host:port/database): {error}")
    })?;
    let mut builder = OptsBuilder::from_opts(opts.clone());
    // The driver would move a loopback connection to the server's unix socket, around what
    // the URL names (a proxy, a port forward): only when the URL asks for it.
    if !url.contains("prefer_socket=") {
        builder = builder.prefer_socket(false);
    }
    // A vanished peer is noticed by keepalive probes instead of the kernel's two hours.
    if opts.tcp_keepalive().is_none() {
        builder = builder.tcp_keepalive(Some(Duration::from_secs(30)));
    }
    Ok(builder.into())
}

/// How every session of a backend connects: options, statement timeout and the one reconnect
/// backoff lock sessions and waiting sessions share.
pub(super) struct Connector {
    opts: Opts,
    pub(super) timeout: Duration,
    /// How long a session may sit idle before the server closes it (`wait_timeout`); ours
    /// close their idle sessions in half that.
    pub(super) idle_limit: Duration,
    reconnect: Reconnect,
}

impl Connector {
    pub(super) fn new(opts: Opts, timeout: Duration, check_interval: Duration) -> Arc<Self> {
        // Each session's own settings, sent once when it opens:
        // - autocommit, so the fencing row's lock ends with each statement whatever the
        //   server's default;
        // - a wait for that row bounded by the statement timeout (whole seconds, at least 1);
        // - an idle limit three check intervals long (at least 10 s): a session that holds
        //   locks answers a check every interval, so only a client that vanished without a
        //   word (frozen, cut off by the network) leaves one idle that long, and the server
        //   then closes it and frees its locks instead of keeping them for its 8-hour default.
        let seconds = timeout.as_secs().clamp(1, 3600);
        let idle_seconds = check_interval
            .as_secs()
            .saturating_mul(3)
            .clamp(MIN_IDLE_LIMIT_SECONDS, MAX_IDLE_LIMIT_SECONDS);
        let opts = OptsBuilder::from_opts(opts)
            .init(vec![format!(
                "SET SESSION autocommit = 1, innodb_lock_wait_timeout = {seconds}, \
                 wait_timeout = {idle_seconds}"
            )])
            .into();
        Arc::new(Connector {
            opts,
            timeout,
            idle_limit: Duration::from_secs(idle_seconds),
            reconnect: Reconnect::new(),
        })
    }

    /// Whether connects are failing now (no connect would be tried).
    pub(super) fn is_failing(&self) -> bool {
        self.reconnect.is_failing()
    }

    /// One connection through the shared backoff: refused at once, without touching the
    /// server, while connects fail and no attempt is due.
    pub(super) async fn connect(&self) -> Result<Conn, BackendError> {
        self.reconnect.connect(self.connect_unthrottled()).await
    }

    /// One connection, whatever the backoff says (for `verify`, which an operator runs).
    pub(super) async fn connect_unthrottled(&self) -> Result<Conn, BackendError> {
        match tokio::time::timeout(self.timeout, Conn::new(self.opts.clone())).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(error)) => Err(errors::query_error(error, Stage::Connect)),
            Err(_) => Err(errors::timed_out(Stage::Connect, self.timeout)),
        }
    }
}

/// The shortest idle limit sessions ask for, in seconds.
const MIN_IDLE_LIMIT_SECONDS: u64 = 10;
/// The longest (the servers' own maximum of `wait_timeout` on Linux).
const MAX_IDLE_LIMIT_SECONDS: u64 = 31_536_000;

/// Closes `conn` in the background: a `COM_QUIT` if the server takes it within `timeout`, and
/// the socket closed either way, so a frozen server keeps no task of ours waiting.
pub(super) fn close(conn: Conn, timeout: Duration) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                // Dropped at the timeout, the connection is marked closed first and then
                // drops its socket without another try.
                let _ = tokio::time::timeout(timeout, conn.disconnect()).await;
            });
        }
        // Without a runtime the driver cannot say goodbye; dropping closes the socket.
        Err(_) => drop(conn),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_without_repeating_them() {
        assert!(parse("mysql://app:pw@db:3306/app").is_ok());
        let error = parse("postgres://app:hunter2@db/app")
            .err()
            .unwrap_or_default();
        assert!(error.contains("mysql://"), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
        let error = parse("mysql://app:hunter2@db/app?unknown_setting=1")
            .err()
            .unwrap_or_default();
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn sessions_reach_what_the_url_names() {
        let opts = parse("mysql://app@127.0.0.1:3307/app").unwrap_or_else(|e| panic!("{e}"));
        assert!(!opts.prefer_socket());
        assert_eq!(opts.tcp_keepalive(), Some(Duration::from_secs(30)));
        let opts =
            parse("mysql://app@127.0.0.1/app?prefer_socket=true").unwrap_or_else(|e| panic!("{e}"));
        assert!(opts.prefer_socket());
    }
}
