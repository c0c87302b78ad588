//! The connections a backend's locks share, opened on first use: one auto-reconnecting,
//! multiplexed connection to a server, or the cluster client's (one per primary).
//!
//! Every request is bounded by the request timeout on our side too, whatever the client
//! library does: a frozen server must not hang a lock call. One connection attempt is in flight
//! at a time (the library's reconnect, or our opening of the cluster client), and after a
//! failed one the next waits for a backoff (see [`Gate`]).

use std::sync::Mutex;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::{socket2, TcpSettings};
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Value};
use tokio::time::Instant;

use super::errors::{self, Stage};
use super::options::RedisOptions;
use crate::backend::{BackendError, BackendErrorKind};

/// Where the backend connects: parsed once from the options.
#[derive(Clone)]
pub(super) enum Target {
    Server(ConnectionInfo),
    Cluster(Vec<ConnectionInfo>),
}

impl Target {
    /// The target of `options`, or every problem with its URL, worded to follow the field's
    /// name. No problem quotes the URL: it may carry the password.
    pub(super) fn parse(options: &RedisOptions) -> Result<Target, Vec<String>> {
        let text = options.url.expose().trim();
        if text.is_empty() {
            return Err(vec!["is required".to_owned()]);
        }
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        if !options.cluster && parts.len() > 1 {
            return Err(vec![
                "names several nodes: it takes one server, or set cluster = true for a Redis \
                 Cluster"
                    .to_owned(),
            ]);
        }
        let mut problems = Vec::new();
        let mut infos = Vec::with_capacity(parts.len());
        for (index, part) in parts.iter().enumerate() {
            let which = if parts.len() > 1 {
                format!("(node {}) ", index + 1)
            } else {
                String::new()
            };
            match parse_one(part, options.cluster) {
                Ok(info) => infos.push(info),
                Err(problem) => problems.push(format!("{which}{problem}")),
            }
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        Ok(if options.cluster {
            Target::Cluster(infos)
        } else {
            Target::Server(infos.remove(0))
        })
    }
}

/// One node's connection settings, with the TCP settings a lock client needs.
fn parse_one(url: &str, cluster: bool) -> Result<ConnectionInfo, String> {
    const FORM: &str = "must be redis://[user[:password]@]host[:port][/db] or unix:///path";
    let scheme = url.split_once("://").map(|(scheme, _)| scheme);
    match scheme {
        Some("rediss" | "valkeys") => {
            return Err("uses TLS, which the redis provider does not support yet".to_owned())
        }
        Some("redis" | "valkey" | "unix" | "redis+unix" | "valkey+unix") => {}
        _ => return Err(FORM.to_owned()),
    }
    // The library's own messages are fixed texts that never repeat the URL.
    let info = url
        .into_connection_info()
        .map_err(|error| format!("{FORM} ({})", errors::library_text(&error)))?;
    // `CLIENT SETINFO` (Redis 7.2 and later) would be answered with an error by older servers
    // on every connection.
    let settings = info.redis_settings().clone().set_skip_set_lib_name();
    let info = info.set_redis_settings(settings);
    if cluster && info.redis_settings().db() != 0 {
        return Err("names a database other than 0, which Redis Cluster does not have".to_owned());
    }
    if cluster && matches!(info.addr(), ConnectionAddr::Unix(_)) {
        return Err("is a Unix socket: Redis Cluster nodes are reached over TCP".to_owned());
    }
    Ok(info.set_tcp_settings(tcp_settings()))
}

/// No Nagle delay (requests are small and answered at once), and keepalive probes so a
/// vanished server is noticed within about a minute rather than the kernel's two hours.
fn tcp_settings() -> TcpSettings {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive)
}

/// The open connections of one backend.
#[derive(Clone)]
enum Link {
    Server(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The shared connections of a backend, opened on first use.
pub(super) struct Connection {
    target: Target,
    timeout: Duration,
    link: Mutex<Option<Link>>,
    /// Held while a link is being opened: one at a time.
    opening: tokio::sync::Mutex<()>,
    gate: Mutex<Gate>,
}

/// After a failure that says the connection is unusable (refused, closed, or the credentials
/// were refused; not a timeout, after which the connection stays), requests fail at once with that failure for a backoff that doubles from
/// [`FIRST_BACKOFF`] to [`MAX_BACKOFF`], instead of each starting a connection attempt: a
/// thousand renewals of a server that is down make a few connection attempts a second, not a
/// thousand.
#[derive(Default)]
struct Gate {
    closed_until: Option<Instant>,
    backoff: Duration,
    last: Option<(BackendErrorKind, String)>,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update leaves the value consistent, so a poisoned lock is still usable.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Connection {
    pub(super) fn new(target: Target, timeout: Duration) -> Self {
        Connection {
            target,
            timeout,
            link: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            gate: Mutex::new(Gate::default()),
        }
    }

    /// Sends `request` (one command, or a pipeline of `count` commands) within the request
    /// timeout. The outer error is a timeout, a connection that could not be opened or a
    /// closed gate, already classified for `stage`; the inner one is the library's, for the
    /// caller to read (a missing script) before classifying it.
    pub(super) async fn send(
        &self,
        stage: Stage,
        request: Request<'_>,
    ) -> Result<redis::RedisResult<Vec<Value>>, BackendError> {
        if let Some(closed) = self.closed_gate() {
            return Err(closed);
        }
        let deadline = crate::clock::in_(self.timeout);
        let link = tokio::time::timeout_at(deadline, self.link())
            .await
            .map_err(|_| errors::timed_out(stage, self.timeout))??;
        let answered = match link {
            Link::Server(mut manager) => {
                tokio::time::timeout_at(deadline, request.send(&mut manager)).await
            }
            Link::Cluster(mut cluster) => {
                tokio::time::timeout_at(deadline, request.send(&mut cluster)).await
            }
        };
        let answered = answered.map_err(|_| errors::timed_out(stage, self.timeout))?;
        match &answered {
            Ok(_) => locked(&self.gate).closed_until = None,
            // A frozen or slow server: the connection stays, nothing reconnects, and what was
            // sent still runs once it answers — including a release, which must not be held
            // back behind renewals that timed out.
            Err(error) if error.is_timeout() => {}
            Err(error) => {
                let failure = errors::request_error(error, stage);
                match failure.kind() {
                    BackendErrorKind::Misconfigured => {
                        // The library keeps a connection that failed to authenticate for good;
                        // the next attempt after the backoff opens a new one.
                        *locked(&self.link) = None;
                        self.close_gate(&failure);
                    }
                    BackendErrorKind::Transient { reached: false } => self.close_gate(&failure),
                    _ => {}
                }
            }
        }
        Ok(answered)
    }

    /// The failure to report while the gate is closed.
    fn closed_gate(&self) -> Option<BackendError> {
        let gate = locked(&self.gate);
        let until = gate.closed_until?;
        if Instant::now() >= until {
            return None;
        }
        let (kind, message) = gate.last.clone()?;
        Some(BackendError::new(kind, message))
    }

    fn close_gate(&self, failure: &BackendError) {
        let mut gate = locked(&self.gate);
        gate.backoff = match gate.closed_until {
            Some(_) => (gate.backoff * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF),
            None => FIRST_BACKOFF,
        };
        gate.closed_until = Some(crate::clock::in_(gate.backoff));
        gate.last = Some((failure.kind(), failure.message().to_owned()));
    }

    async fn link(&self) -> Result<Link, BackendError> {
        if let Some(link) = locked(&self.link).clone() {
            return Ok(link);
        }
        let _opening = self.opening.lock().await;
        if let Some(link) = locked(&self.link).clone() {
            return Ok(link);
        }
        match self.open().await {
            Ok(link) => {
                *locked(&self.link) = Some(link.clone());
                Ok(link)
            }
            Err(failure) => {
                self.close_gate(&failure);
                Err(failure)
            }
        }
    }

    async fn open(&self) -> Result<Link, BackendError> {
        match &self.target {
            Target::Server(info) => {
                let client = redis::Client::open(info.clone())
                    .map_err(|e| errors::request_error(&e, Stage::Connect))?;
                // No retries of its own: a failed reconnect fails the requests waiting for it,
                // and the gate spaces the next ones.
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout))
                    .set_number_of_retries(0);
                // Lazy: nothing connects until the first request, which waits for it.
                ConnectionManager::new_lazy_with_config(client, config)
                    .map(Link::Server)
                    .map_err(|e| errors::request_error(&e, Stage::Connect))
            }
            Target::Cluster(nodes) => {
                let client = redis::cluster::ClusterClientBuilder::new(nodes.to_vec())
                    .connection_timeout(self.timeout)
                    .response_timeout(self.timeout)
                    .tcp_settings(tcp_settings())
                    .build()
                    .map_err(|e| errors::request_error(&e, Stage::Connect))?;
                client
                    .get_async_connection()
                    .await
                    .map(Link::Cluster)
                    .map_err(|e| errors::request_error(&e, Stage::Connect))
            }
        }
    }
}

/// A request to send: one command, or a pipeline of commands.
#[derive(Clone, Copy)]
pub(super) enum Request<'a> {
    Command(&'a redis::Cmd),
    Pipeline(&'a redis::Pipeline, usize),
}

impl Request<'_> {
    /// The answers, with every error the server sent in place of one as an `Err`.
    async fn send<C: ConnectionLike>(self, connection: &mut C) -> redis::RedisResult<Vec<Value>> {
        let answers = match self {
            Request::Command(cmd) => vec![connection.req_packed_command(cmd).await?],
            Request::Pipeline(pipeline, count) => {
                connection.req_packed_commands(pipeline, 0, count).await?
            }
        };
        answers.into_iter().map(Value::extract_error).collect()
    }
}
