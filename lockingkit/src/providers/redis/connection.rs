//! The connections a backend's locks share, opened on first use and again after a failure:
//! one multiplexed connection to a server, or the cluster client's (one per node).
//!
//! Every request is bounded by the request timeout on our side too, whatever the client
//! library does: a frozen server must not hang a lock call. Whether Redis can be reached is one
//! [`Health`] per backend, shared with the release watch (see `watch`): after a request or a
//! connection attempt finds Redis unreachable or refusing our credentials, requests fail at once
//! with that cause, without touching the server, and one at a time is let through as a probe,
//! first 100 ms after the failure, then less and less often (jittered), up to 0.9 s apart; the
//! first answer ends it. So a thousand renewals of a server that is down cost a few connection
//! attempts in the first second and about one a second after, not a thousand, one connect is in
//! flight at a time, and a server that is back is asked again within 0.9 s. These failures are
//! this gate's to pace (`BackendError::paced_by_provider`): the engine's gate adds no backoff of
//! its own on top.
//!
//! A request that times out on an open connection is not counted: the server is slow or frozen,
//! nothing reconnects, and what was sent still runs once it answers — including a release,
//! which must not be held back behind renewals that timed out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::cluster_async::{ClusterConnection, Connect};
use redis::io::tcp::{socket2, TcpSettings};
use redis::{AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Value};
use rustls::ClientConfig;
use tokio::time::Instant;

use super::errors::{self, Stage};
use super::locked;
use super::node::{self, NodeConnection};
use super::options::RedisOptions;
use super::tls::Tls;
use crate::backend::{BackendError, BackendErrorKind};
use crate::health::{Admission, Health, Refusal};

/// Where the backend connects: parsed once from the options.
#[derive(Clone)]
pub(super) enum Target {
    Server(Server),
    Cluster(Vec<ConnectionInfo>),
}

/// One server, and TLS to it when its URL says `rediss://`.
#[derive(Clone)]
pub(super) struct Server {
    pub(super) info: ConnectionInfo,
    pub(super) tls: Option<Tls>,
}

impl Target {
    /// Whether `options` name a server over TLS (`rediss://`), which needs a client
    /// configuration to connect.
    pub(super) fn uses_tls(options: &RedisOptions) -> bool {
        let scheme = options
            .url
            .expose()
            .trim()
            .split_once("://")
            .map(|(s, _)| s);
        matches!(scheme, Some("rediss" | "valkeys"))
    }

    /// The problems with the URL of `options`, worded to follow the field's name (checking only:
    /// no TLS is set up).
    pub(super) fn problems(options: &RedisOptions) -> Vec<String> {
        Self::parse(options, None).err().unwrap_or_default()
    }

    /// The target of `options`, with `tls` for a `rediss://` server (without it, which only
    /// checking the URL does, such a server is parsed but cannot be reached over TLS), or every
    /// problem with its URL, worded to follow the field's name. No problem quotes the URL: it
    /// may carry the password.
    pub(super) fn parse(
        options: &RedisOptions,
        tls: Option<&Arc<ClientConfig>>,
    ) -> Result<Target, Vec<String>> {
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
        if options.cluster {
            return Ok(Target::Cluster(infos));
        }
        let info = infos.remove(0);
        let tls = match (Self::uses_tls(options), tls) {
            (true, Some(config)) => Some(Tls::new(config.clone(), &info).map_err(|p| vec![p])?),
            _ => None,
        };
        Ok(Target::Server(Server { info, tls }))
    }
}

/// One node's connection settings, with the TCP settings a lock client needs.
fn parse_one(url: &str, cluster: bool) -> Result<ConnectionInfo, String> {
    const FORM: &str =
        "must be redis://[user[:password]@]host[:port][/db], rediss://… (TLS) or unix:///path";
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let plain = match scheme {
        "rediss" | "valkeys" if cluster => {
            return Err(
                "uses TLS, which the redis provider supports on one server only, not on \
                        a Redis Cluster"
                    .to_owned(),
            )
        }
        "rediss" | "valkeys" if rest.contains('#') => {
            return Err(
                "asks for TLS without checking the certificate (#insecure), which the \
                        redis provider does not do: trust a private CA with tls_root_cert"
                    .to_owned(),
            )
        }
        // The library parses the rest; the TLS session is ours (see `tls`).
        "rediss" | "valkeys" => format!("redis://{rest}"),
        "redis" | "valkey" | "unix" | "redis+unix" | "valkey+unix" => url.to_owned(),
        _ => return Err(FORM.to_owned()),
    };
    // The library's own messages are fixed texts that never repeat the URL.
    let info = plain
        .as_str()
        .into_connection_info()
        .map_err(|error| format!("{FORM} ({})", errors::library_text(&error)))?;
    // `CLIENT SETINFO` (Redis 7.2 and later) would be answered with an error by older servers
    // on every connection, the pub/sub one included.
    let info = node::without_client_setinfo(info);
    if cluster && info.redis_settings().db() != 0 {
        return Err("names a database other than 0, which Redis Cluster does not have".to_owned());
    }
    if cluster && matches!(info.addr(), ConnectionAddr::Unix(_)) {
        return Err("is a Unix socket: Redis Cluster nodes are reached over TCP".to_owned());
    }
    Ok(info.set_tcp_settings(tcp_settings()))
}

/// No Nagle delay (requests are small and answered at once), and keepalive probes (see
/// [`keepalive`]).
fn tcp_settings() -> TcpSettings {
    TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive())
}

/// Keepalive probes, so a vanished server is noticed within about a minute rather than the
/// kernel's two hours.
pub(super) fn keepalive() -> socket2::TcpKeepalive {
    socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3)
}

/// How long after a failure the first probe may go out.
pub(super) const FIRST_DELAY: Duration = Duration::from_millis(100);
/// The longest time between two probes while Redis keeps failing.
pub(super) const MOST_DELAY: Duration = Duration::from_secs(5);

/// The open connections of one backend.
#[derive(Clone)]
enum Link {
    Server(NodeConnection),
    Cluster(ClusterConnection<NodeConnection>),
}

/// The shared connections of a backend, opened on first use.
pub(super) struct Connection {
    target: Target,
    timeout: Duration,
    /// The open link and its number, so a failure drops only the link it happened on.
    link: Mutex<Option<(u64, Link)>>,
    opened: AtomicU64,
    /// Held while a link is being opened: one at a time.
    opening: tokio::sync::Mutex<()>,
    health: Arc<Health>,
}

/// What a request showed about the connection.
enum Seen {
    /// Redis answered (whatever it said).
    Answered,
    /// Redis could not be reached, or refused our credentials.
    Failed(BackendError),
    /// Nothing either way: an open connection timed out.
    Nothing,
}

impl Connection {
    pub(super) fn new(target: Target, timeout: Duration, health: Arc<Health>) -> Self {
        Connection {
            target,
            timeout,
            link: Mutex::new(None),
            opened: AtomicU64::new(0),
            opening: tokio::sync::Mutex::new(()),
            health,
        }
    }

    /// Sends `request` (one command, or a pipeline of `count` commands) within the request
    /// timeout. The outer error is a timeout, a connection that could not be opened or a
    /// refusal while Redis is failing, already classified for `stage`; the inner one is the
    /// library's, for the caller to read (a missing script) before classifying it.
    pub(super) async fn send(
        &self,
        stage: Stage,
        request: Request<'_>,
    ) -> Result<redis::RedisResult<Vec<Value>>, Failed> {
        let probe = match self.health.admit() {
            Admission::Go => None,
            Admission::Probe(probe) => Some(probe),
            Admission::Refused(refusal) => return Err(Failed::unsent(refused(stage, refusal))),
        };
        let (seen, answered) = self.exchange(stage, request, probe.is_some()).await;
        match (seen, probe) {
            (Seen::Answered, Some(probe)) => {
                probe.answered();
            }
            (Seen::Answered, None) => {
                self.health.answered();
            }
            (Seen::Failed(cause), Some(probe)) => probe.failed(&cause),
            (Seen::Failed(cause), None) => {
                self.health.failed(&cause, false);
            }
            // A probe dropped without an outcome lets the next caller probe.
            (Seen::Nothing, _) => {}
        }
        answered
    }

    /// Opens the link if needed and sends `request` on it, saying what that showed. A link
    /// opened before this request that turns out broken (the server restarted, or closed it
    /// while idle) is replaced once within the same request timeout: the broken link is news
    /// about the past, and the server may well be back. What a request may have done on the
    /// broken link cannot outlive it unless the server kept it (a restart without persistence
    /// forgets it), and a lease it took then expires like any unanswered one.
    async fn exchange(
        &self,
        stage: Stage,
        request: Request<'_>,
        probe: bool,
    ) -> (Seen, Result<redis::RedisResult<Vec<Value>>, Failed>) {
        let deadline = crate::clock::in_(self.timeout);
        let opened = self.opened.load(Ordering::Relaxed);
        let first = self.exchange_once(stage, request, probe, deadline).await;
        match first {
            (Seen::Failed(_), Ok(Err(_)), Some(number)) if number < opened => {
                let (seen, answered, _) = self.exchange_once(stage, request, probe, deadline).await;
                (seen, answered)
            }
            (seen, answered, _) => (seen, answered),
        }
    }

    /// One exchange on the open link (or a new one), and the number of the link it broke on
    /// (a broken link is dropped).
    async fn exchange_once(
        &self,
        stage: Stage,
        request: Request<'_>,
        probe: bool,
        deadline: Instant,
    ) -> (
        Seen,
        Result<redis::RedisResult<Vec<Value>>, Failed>,
        Option<u64>,
    ) {
        let (number, link) = match tokio::time::timeout_at(deadline, self.link(probe)).await {
            Ok(Ok(link)) => link,
            Ok(Err(failure)) => {
                let failure = failure.paced_by_provider();
                return (
                    Seen::Failed(failure.clone()),
                    Err(Failed::unsent(failure)),
                    None,
                );
            }
            Err(_) => {
                // Opening the connection took too long: the server is unreachable.
                let failure = errors::timed_out(Stage::Connect, self.timeout);
                return (
                    Seen::Failed(failure.clone()),
                    Err(Failed::unsent(failure)),
                    None,
                );
            }
        };
        let answered = match link {
            Link::Server(mut connection) => {
                tokio::time::timeout_at(deadline, request.send(&mut connection)).await
            }
            Link::Cluster(mut cluster) => {
                tokio::time::timeout_at(deadline, request.send(&mut cluster)).await
            }
        };
        let Ok(answered) = answered else {
            let failure = errors::timed_out(stage, self.timeout);
            return (Seen::Nothing, Err(Failed::sent(failure)), None);
        };
        let mut broke = None;
        let seen = match &answered {
            Ok(_) => Seen::Answered,
            Err(error) if error.is_timeout() => Seen::Nothing,
            Err(error) if errors::is_authentication(error) => {
                // The server forgot who we are (ACL changed, or it restarted with another
                // password): only a new connection authenticates again.
                self.drop_link(number);
                Seen::Failed(errors::request_error(error, stage))
            }
            Err(error) => {
                let failure = errors::request_error(error, stage);
                if failure.kind() == (BackendErrorKind::Transient { reached: false }) {
                    // The connection is broken (reset, closed): the next request opens another.
                    if matches!(self.target, Target::Server(_)) {
                        self.drop_link(number);
                        broke = Some(number);
                    }
                    Seen::Failed(failure)
                } else {
                    Seen::Answered
                }
            }
        };
        (seen, Ok(answered), broke)
    }

    /// Forgets link `number`, if it is still the open one.
    fn drop_link(&self, number: u64) {
        let mut link = locked(&self.link);
        if link.as_ref().is_some_and(|(open, _)| *open == number) {
            *link = None;
        }
    }

    /// The open link, or a new one. Callers that queued behind a connect that failed get that
    /// failure instead of connecting again, unless they are the probe.
    async fn link(&self, probe: bool) -> Result<(u64, Link), BackendError> {
        if let Some(link) = locked(&self.link).clone() {
            return Ok(link);
        }
        let _opening = self.opening.lock().await;
        if let Some(link) = locked(&self.link).clone() {
            return Ok(link);
        }
        if !probe {
            if let Some(failure) = self.health.current_failure() {
                return Err(failure.cause);
            }
        }
        let link = self.open().await?;
        let number = self.opened.fetch_add(1, Ordering::Relaxed);
        *locked(&self.link) = Some((number, link.clone()));
        Ok((number, link))
    }

    /// Where the backend connects.
    pub(super) fn target(&self) -> &Target {
        &self.target
    }

    /// A connection of its own for a one-off check, closed when dropped: not the shared link,
    /// and not behind the outage gate (a startup check asks the server itself).
    pub(super) async fn check_link(&self) -> Result<Checking, BackendError> {
        let link = tokio::time::timeout(self.timeout, self.open())
            .await
            .map_err(|_| errors::timed_out(Stage::Check, self.timeout))??;
        Ok(Checking {
            link,
            timeout: self.timeout,
        })
    }

    /// Closes the link (once requests still using it are done); a request after this opens
    /// another.
    pub(super) fn close(&self) {
        *locked(&self.link) = None;
    }

    async fn open(&self) -> Result<Link, BackendError> {
        match &self.target {
            Target::Server(Server {
                info,
                tls: Some(tls),
            }) => tls
                .multiplexed(info, self.timeout)
                .await
                .map(|connection| Link::Server(NodeConnection::new(connection))),
            Target::Server(Server { info, tls: None }) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout));
                NodeConnection::connect_with_config(info.clone(), config)
                    .await
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
                // The node connections are ours (see `node`): the crate's own would send
                // `CLIENT SETINFO` and could not keep each node's script cache. The crate hides
                // this entry point from its docs, so an update may change it: the build, and the
                // cluster test that reads each node's `INFO errorstats`, would say so.
                client
                    .get_async_generic_connection::<NodeConnection>()
                    .await
                    .map(Link::Cluster)
                    .map_err(|e| errors::request_error(&e, Stage::Connect))
            }
        }
    }
}

/// A request that failed without an answer: before it could reach Redis (refused while Redis
/// is failing, or no connection could be opened), or after it was sent, when it may still run.
pub(super) struct Failed {
    pub(super) error: BackendError,
    /// Whether the request went out (and so may have run).
    pub(super) sent: bool,
}

impl Failed {
    fn unsent(error: BackendError) -> Self {
        Failed { error, sent: false }
    }

    /// A failure of a request that went out.
    pub(super) fn sent(error: BackendError) -> Self {
        Failed { error, sent: true }
    }
}

impl From<Failed> for BackendError {
    fn from(failed: Failed) -> Self {
        failed.error
    }
}

/// A connection opened for a startup check; closed when dropped.
pub(super) struct Checking {
    link: Link,
    timeout: Duration,
}

impl Checking {
    /// Sends `request` within the request timeout; the inner error is the library's.
    pub(super) async fn send(
        &mut self,
        request: Request<'_>,
    ) -> Result<redis::RedisResult<Vec<Value>>, BackendError> {
        let answered = match &mut self.link {
            Link::Server(connection) => {
                tokio::time::timeout(self.timeout, request.send(connection)).await
            }
            Link::Cluster(cluster) => {
                tokio::time::timeout(self.timeout, request.send(cluster)).await
            }
        };
        answered.map_err(|_| errors::timed_out(Stage::Check, self.timeout))
    }
}

/// The error a caller gets while Redis is failing and no request is sent.
fn refused(stage: Stage, refusal: Refusal) -> BackendError {
    let now = Instant::now();
    let message = format!(
        "{}: {} (no request sent: Redis has failed for {:?}; the next attempt is in {:?})",
        stage.as_str(),
        refusal.cause.message(),
        now.saturating_duration_since(refusal.since),
        refusal.retry_at.saturating_duration_since(now),
    );
    refusal.cause.with_message(message).paced_by_provider()
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
