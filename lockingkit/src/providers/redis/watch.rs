//! Waking this process's waiters the moment another process releases their key.
//!
//! Every release of a lock or a reader publishes on the key's channel (`…:released`, see
//! [`RedisLockKeys`](crate::keys::RedisLockKeys)). The backend keeps **one** pub/sub
//! connection, subscribed to the channels of the keys its waits are for (see `wait`), and a
//! message wakes every wait of that key in this process, whose caller attempts at once. A lock
//! that *expires* publishes nothing: waiters still learn of it by polling, which stays the
//! fallback.
//!
//! - **A wait subscribes when it opens**, which the engine does at its caller's first busy
//!   answer: its interest is registered and the subscription asked for at once. A release
//!   published between that busy answer and the subscription being in place goes unheard, and
//!   one published between the busy answer and the opening cannot be told from one published
//!   before the attempt. So a wait is woken once when its subscription is in place: when the
//!   server confirms it, or at once if the channel was subscribed already. That costs each
//!   wait one attempt, never a backoff.
//! - **A wait that ends gives its interest up at once.** The channel stays subscribed
//!   [`LINGER`] as a cache: a contended key is waited for again and again (each hand-off ends
//!   one wait, and the next busy answer opens another, here or in a clone of this backend), and
//!   a channel still subscribed spares that wait the `SUBSCRIBE` round trip and the connection
//!   a pair of commands. A subscription holds nothing on the key, so a lingering one never
//!   makes an attempt busy.
//! - **Every wait is woken when its subscription stops telling**: when the connection is lost
//!   (a release may have been missed as it broke) and again when it is back and subscribed.
//! - **One connection in all**, opened on the first subscription and closed after [`IDLE`]
//!   with no channel subscribed. It opens through the backend's outage gate (see
//!   `connection`): while Redis is failing it waits for the gate's probe like every request,
//!   and only the server's first answer on it counts as Redis answering again; a connection
//!   closed before that answer counts for nothing (see [`Report`]). A lost
//!   connection is opened again only after a backoff ([`FIRST_DELAY`] doubling to
//!   [`MOST_DELAY`]) that starts over once a connection stayed subscribed for [`STEADY`]. A
//!   connection that stops answering pings is treated as lost.
//! - **A refused subscription disables the watch** (a Redis 7 ACL user has no channels unless
//!   granted `&<key_prefix>:*`): it is logged once, waiters poll, and subscribing is tried
//!   again every [`MOST_DELAY`].
//! - On Redis Cluster, a `PUBLISH` reaches every node, so one connection to any node hears the
//!   releases of every slot (and each release costs every node a cluster-bus message).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{PubSub, PubSubSink, PubSubStream};
use redis::ConnectionInfo;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::connection::{Server, Target, FIRST_DELAY, MOST_DELAY};
use super::errors::{self, Stage};
use crate::backend::{BackendError, BackendErrorKind};
use crate::backoff::Backoff;
use crate::health::{Admission, Health, Probe};

/// A channel nobody waits on stays subscribed this long, for the next wait of the same key.
const LINGER: Duration = Duration::from_secs(1);

/// The connection closes after this long without a subscribed channel.
const IDLE: Duration = Duration::from_secs(10);

/// How often an otherwise quiet connection is pinged, so a frozen server or a silent network is
/// noticed.
const PING_EVERY: Duration = Duration::from_secs(5);

/// A connection that stayed subscribed this long was a good one: the backoff after losing it
/// starts over.
const STEADY: Duration = Duration::from_secs(10);

/// The release watch of one backend: the channels its waits listen on, and the one task that
/// keeps the pub/sub connection.
pub(super) struct ReleaseWatch {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    target: Target,
    timeout: Duration,
    /// Whether Redis can be reached, shared with the lock connection.
    health: Arc<Health>,
    /// Cancelled at shutdown: the task ends and closes its connection, and no other starts.
    stop: CancellationToken,
    /// Whether Redis has refused a subscription (said once in the log).
    refused: AtomicBool,
}

/// Every channel in `channels` is one the task was asked to subscribe to: a wait asks when it
/// opens, and a channel leaves the map (to be unsubscribed) only once nobody listens on it.
#[derive(Default)]
struct State {
    channels: HashMap<String, Channel>,
    /// The subscriber task, while one runs.
    task: Option<mpsc::UnboundedSender<String>>,
    /// Whether the task has a connection now on which the server confirmed the subscriptions.
    connected: bool,
}

struct Channel {
    /// Bumped whenever the channel's waits should retry.
    woken: watch::Sender<u64>,
    /// Waits open on this channel.
    interest: usize,
    /// Whether the server confirmed the subscription on the task's current connection.
    confirmed: bool,
    /// When the last wait went away, while none is open.
    unused_since: Option<Instant>,
}

impl Channel {
    fn new() -> Self {
        Channel {
            woken: watch::Sender::new(0),
            interest: 0,
            confirmed: false,
            unused_since: None,
        }
    }

    fn wake(&self) {
        self.woken
            .send_modify(|generation| *generation = generation.wrapping_add(1));
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    super::locked(state)
}

impl ReleaseWatch {
    pub(super) fn new(target: Target, timeout: Duration, health: Arc<Health>) -> Self {
        ReleaseWatch {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                target,
                timeout,
                health,
                stop: CancellationToken::new(),
                refused: AtomicBool::new(false),
            }),
        }
    }

    /// Closes the pub/sub connection for good and wakes every wait, which polls from now on.
    pub(super) fn stop(&self) {
        let mut state = lock(&self.shared.state);
        // Under the lock, so no wait opens in between: one that opens later sees the flag.
        self.shared.stop.cancel();
        // Dropping a channel's sender wakes its waits (see `Interest::changed`).
        state.channels.clear();
        state.task = None;
    }

    /// Whether the pub/sub connection is open, its subscriptions confirmed by the server (0 or
    /// 1).
    pub(super) fn connections(&self) -> usize {
        usize::from(lock(&self.shared.state).connected)
    }

    /// One wait's interest in `channel`, registered now, the subscription asked for at once
    /// (see the module docs). After shutdown the interest hears nothing: the wait polls.
    pub(super) fn listen(&self, channel: String) -> Interest {
        let mut state = lock(&self.shared.state);
        if self.shared.stop.is_cancelled() {
            drop(state);
            let (_, woken) = watch::channel(0);
            return Interest {
                shared: None,
                channel,
                woken,
                closed: true,
            };
        }
        let mut fresh = false;
        let entry = state.channels.entry(channel.clone()).or_insert_with(|| {
            fresh = true;
            Channel::new()
        });
        entry.interest += 1;
        entry.unused_since = None;
        let mut woken = entry.woken.subscribe();
        if entry.confirmed {
            // Subscribed already: the subscription is in place from the start.
            woken.mark_changed();
        }
        if fresh {
            self.shared.subscribe(&mut state, &channel);
        }
        drop(state);
        Interest {
            shared: Some(self.shared.clone()),
            channel,
            woken,
            closed: false,
        }
    }
}

impl Shared {
    /// Asks the task to subscribe to `channel`, just entered in the map, starting the task if
    /// none runs (a new task subscribes to every channel in the map once connected).
    fn subscribe(self: &Arc<Self>, state: &mut State, channel: &str) {
        let sent = state
            .task
            .as_ref()
            .is_some_and(|task| task.send(channel.to_owned()).is_ok());
        if sent {
            return;
        }
        let (commands, receiver) = mpsc::unbounded_channel();
        state.task = Some(commands);
        let stop = self.stop.clone();
        let task = subscriber(Arc::downgrade(self), receiver);
        tokio::spawn(async move {
            // Dropping the task at shutdown closes its connection.
            tokio::select! {
                _ = stop.cancelled() => {}
                () = task => {}
            }
        });
    }
}

/// One wait's interest in a channel; dropping it gives the interest up at once (the channel
/// lingers, then goes).
pub(super) struct Interest {
    /// `None` for an interest opened after shutdown, which nothing registered.
    shared: Option<Arc<Shared>>,
    channel: String,
    woken: watch::Receiver<u64>,
    /// Whether the channel's sender is gone (the watch stopped): said once, then never again.
    closed: bool,
}

impl Interest {
    /// Resolves when the channel heard a release, the subscription came into place or stopped
    /// telling since the last call, or the watch stopped (once). Cancel-safe: a wake that
    /// lands while nobody listens is kept for the next call.
    pub(super) async fn changed(&mut self) {
        if self.closed {
            return std::future::pending().await;
        }
        if self.woken.changed().await.is_err() {
            // Shut down: the wait polls from now on, without a wake-up loop.
            self.closed = true;
        }
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let Some(shared) = &self.shared else {
            return;
        };
        let mut state = lock(&shared.state);
        if let Some(entry) = state.channels.get_mut(&self.channel) {
            entry.interest = entry.interest.saturating_sub(1);
            if entry.interest == 0 {
                entry.unused_since = Some(Instant::now());
            }
        }
    }
}

/// Why the subscriber stopped using its connection.
enum Ended {
    /// The backend is gone, or nothing was subscribed for [`IDLE`]: the task ends.
    Done,
    /// The connection failed or stopped answering: open another, after a backoff.
    Lost,
    /// Redis refused a subscription (`NOPERM`): the user may not use the release channels.
    Refused,
}

/// The subscriber task: keeps one pub/sub connection subscribed to every channel in the map.
///
/// After every lost connection it waits before opening the next, [`FIRST_DELAY`] doubling to
/// [`MOST_DELAY`] (jittered), and the delay starts over only after a connection stayed
/// subscribed for [`STEADY`]: a connection that opens and fails at once (a middlebox, a
/// server that drops subscribers) costs one connect per backoff, not a loop of them. A refused
/// subscription disables the watch until [`MOST_DELAY`] has passed; waiters poll meanwhile.
async fn subscriber(shared: Weak<Shared>, mut commands: mpsc::UnboundedReceiver<String>) {
    let mut losses = Backoff::new(FIRST_DELAY, MOST_DELAY);
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        let (connected, timeout) = (strong.connect().await, strong.timeout);
        drop(strong);
        let resume = match connected {
            // Redis is failing: no connection before the next probe is due.
            Err(retry_at) => retry_at,
            Ok(opened) => {
                let (ended, subscribed_for) = serve(&shared, &mut commands, opened, timeout).await;
                stopped_telling(&shared);
                match ended {
                    Ended::Done => return,
                    Ended::Lost => {
                        if subscribed_for >= STEADY {
                            losses.reset();
                        }
                        crate::clock::in_(losses.next_delay())
                    }
                    Ended::Refused => {
                        refused(&shared);
                        crate::clock::in_(MOST_DELAY)
                    }
                }
            }
        };
        tokio::time::sleep_until(resume).await;
        if stop_if_unwanted(&shared) {
            return;
        }
    }
}

/// Says once per backend that the watch is disabled because Redis refuses the subscriptions.
fn refused(shared: &Weak<Shared>) {
    let Some(shared) = shared.upgrade() else {
        return;
    };
    if !shared.refused.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            target: "lockingkit",
            provider = super::PROVIDER,
            "Redis refused to subscribe to the lock's release channels (NOPERM): waiters in this \
             process poll instead of being woken by releases, and subscribing is tried again \
             every {MOST_DELAY:?}; grant the Redis user the channels `&<key_prefix>:*`"
        );
    }
}

/// A pub/sub connection just opened, and the report it owes the backend's [`Health`] once the
/// server has answered on it (or failed to).
struct Opened {
    sink: PubSubSink,
    stream: PubSubStream,
    report: Report,
}

/// What the first request on a new connection tells the backend's [`Health`]. Opening a
/// connection proves little (a server that needs no password is sent nothing), so only the
/// server's first answer counts as one.
///
/// A connection that opened and then closed before its first answer is not counted as Redis
/// failing either: the server (or a proxy) accepted it, and servers close pub/sub connections
/// for reasons of their own (`CLIENT KILL TYPE pubsub`, the pub/sub output buffer limit) while
/// lock requests on the command connection are served. Counting it made such a kill refuse
/// lock attempts, and end waits, as an outage. The watch paces its own reopening (its backoff),
/// and a server that is really gone is found by the next connect, which is counted.
struct Report {
    health: Arc<Health>,
    probe: Option<Probe>,
}

impl Report {
    /// The server answered (whatever it said); any other outcome is no evidence either way (a
    /// probe dropped without an outcome lets the next caller probe).
    fn outcome<T>(self, result: &Result<redis::RedisResult<T>, tokio::time::error::Elapsed>) {
        // A request error that is an answer (an ACL refusal, say) still shows a server that
        // answers; one that is not (closed, reset, silent) shows nothing.
        let answered = match result {
            Ok(Ok(_)) => true,
            Ok(Err(error)) => !matches!(
                errors::request_error(error, Stage::Connect).kind(),
                BackendErrorKind::Transient { reached: false }
            ),
            Err(_) => false,
        };
        if !answered {
            return;
        }
        match self.probe {
            Some(probe) => {
                probe.answered();
            }
            None => {
                self.health.answered();
            }
        }
    }

    /// The connection attempt itself failed with `cause`.
    fn failed(self, cause: &BackendError) {
        match self.probe {
            Some(probe) => probe.failed(cause),
            None => {
                self.health.failed(cause, false);
            }
        }
    }
}

impl Shared {
    /// A pub/sub connection, opened through the backend's [`Health`]; while Redis is failing
    /// and no probe is due, none is tried, and `Err` says when to ask again.
    async fn connect(&self) -> Result<Opened, Instant> {
        let probe = match self.health.admit() {
            Admission::Go => None,
            Admission::Probe(probe) => Some(probe),
            Admission::Refused(refusal) => return Err(refusal.retry_at),
        };
        let report = Report {
            health: self.health.clone(),
            probe,
        };
        match open(&self.target, self.timeout).await {
            Ok((sink, stream)) => Ok(Opened {
                sink,
                stream,
                report,
            }),
            Err(cause) => {
                report.failed(&cause);
                let next = self
                    .health
                    .current_failure()
                    .map(|failure| failure.retry_at);
                Err(next.unwrap_or_else(|| crate::clock::in_(FIRST_DELAY)))
            }
        }
    }
}

/// Opens a pub/sub connection to the server, or to the first cluster node that answers.
pub(super) async fn open(
    target: &Target,
    timeout: Duration,
) -> Result<(PubSubSink, PubSubStream), BackendError> {
    let nodes: Vec<&ConnectionInfo> = match target {
        Target::Server(Server {
            info,
            tls: Some(tls),
        }) => return tls.pubsub(info, timeout).await.map(PubSub::split),
        Target::Server(Server { info, tls: None }) => vec![info],
        Target::Cluster(nodes) => nodes.iter().collect(),
    };
    let mut last = errors::timed_out(Stage::Connect, timeout);
    for node in nodes {
        let client = match redis::Client::open(node.clone()) {
            Ok(client) => client,
            Err(error) => {
                last = errors::request_error(&error, Stage::Connect);
                continue;
            }
        };
        match tokio::time::timeout(timeout, client.get_async_pubsub()).await {
            Ok(Ok(pubsub)) => return Ok(pubsub.split()),
            Ok(Err(error)) => last = errors::request_error(&error, Stage::Connect),
            Err(_) => last = errors::timed_out(Stage::Connect, timeout),
        }
    }
    Err(last)
}

/// Ends the task if no wait is open any more (under the state lock, so a wait that opens later
/// starts a new task). Returns whether it did.
fn stop_if_unwanted(shared: &Weak<Shared>) -> bool {
    let Some(shared) = shared.upgrade() else {
        return true;
    };
    let mut state = lock(&shared.state);
    if state.channels.values().any(|c| c.interest > 0) {
        return false;
    }
    state.channels.clear();
    state.task = None;
    true
}

/// Serves one connection until it fails, the backend goes, or it idles out; returns why it
/// ended and how long it stayed subscribed.
async fn serve(
    shared: &Weak<Shared>,
    commands: &mut mpsc::UnboundedReceiver<String>,
    opened: Opened,
    timeout: Duration,
) -> (Ended, Duration) {
    let Opened {
        mut sink,
        mut stream,
        report,
    } = opened;
    // Every channel wanted now, subscribed in one command (a ping when none is: the server's
    // first answer is owed to the health report); their waits retry once, as a release may
    // have gone unheard while the connection was down.
    let Some(wanted) = wanted_channels(shared) else {
        return (Ended::Done, Duration::ZERO);
    };
    let first = if wanted.is_empty() {
        tokio::time::timeout(timeout, sink.ping::<redis::Value>())
            .await
            .map(|answer| answer.map(drop))
    } else {
        tokio::time::timeout(timeout, sink.subscribe(&wanted)).await
    };
    report.outcome(&first);
    if let Err(ended) = checked(first) {
        return (ended, Duration::ZERO);
    }
    confirmed(shared, &wanted);
    let subscribed = Instant::now();
    let ended = listen(shared, commands, &mut sink, &mut stream, timeout).await;
    (ended, subscribed.elapsed())
}

/// Subscribes and unsubscribes as waits come and go, and wakes waiters as releases arrive,
/// until the connection fails, the backend goes, or it idles out.
async fn listen(
    shared: &Weak<Shared>,
    commands: &mut mpsc::UnboundedReceiver<String>,
    sink: &mut PubSubSink,
    stream: &mut PubSubStream,
    timeout: Duration,
) -> Ended {
    let mut quiet_since = Instant::now();
    let mut idle_since = Instant::now();
    // One tick a second whatever else arrives: a sleep made anew each turn of the loop would
    // never end while messages keep coming, and nothing would ever be unsubscribed.
    let mut tick = tokio::time::interval(LINGER);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let turn = tokio::select! {
            command = commands.recv() => match command {
                None => Err(Ended::Done),
                Some(channel) => {
                    let subscribed = tokio::time::timeout(timeout, sink.subscribe(&channel)).await;
                    checked(subscribed).map(|()| confirmed(shared, std::slice::from_ref(&channel)))
                }
            },
            message = stream.next() => match message {
                None => Err(Ended::Lost),
                Some(message) => {
                    quiet_since = Instant::now();
                    wake(shared, &[message.get_channel_name().to_owned()]);
                    Ok(())
                }
            },
            _ = tick.tick() => {
                tend(shared, sink, timeout, &mut quiet_since, &mut idle_since).await
            }
        };
        if let Err(ended) = turn {
            return ended;
        }
    }
}

/// Once a second: unsubscribes what nobody waits on, pings a quiet connection, and ends an idle
/// one.
async fn tend(
    shared: &Weak<Shared>,
    sink: &mut PubSubSink,
    timeout: Duration,
    quiet_since: &mut Instant,
    idle_since: &mut Instant,
) -> Result<(), Ended> {
    let gone = sweep(shared).ok_or(Ended::Done)?;
    if !gone.is_empty() {
        checked(tokio::time::timeout(timeout, sink.unsubscribe(&gone)).await)?;
    }
    if quiet_since.elapsed() >= PING_EVERY {
        checked(tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await)?;
        *quiet_since = Instant::now();
    }
    let subscribed = wanted_channels(shared).ok_or(Ended::Done)?;
    if !subscribed.is_empty() {
        *idle_since = Instant::now();
    } else if idle_since.elapsed() >= IDLE && stop_if_unwanted(shared) {
        return Err(Ended::Done);
    }
    Ok(())
}

/// What a request's answer means for the connection: fine, lost (an error or no answer in
/// time), or refused for want of permission.
fn checked<T>(
    answer: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
) -> Result<T, Ended> {
    match answer {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) if errors::is_no_permission(&error) => Err(Ended::Refused),
        _ => Err(Ended::Lost),
    }
}

/// The channels a subscription was asked for; `None` once the backend is gone.
fn wanted_channels(shared: &Weak<Shared>) -> Option<Vec<String>> {
    let shared = shared.upgrade()?;
    let state = lock(&shared.state);
    Some(state.channels.keys().cloned().collect())
}

/// The server confirmed the subscriptions to `channels` on the task's connection: the
/// connection counts as open (only now that the server has answered on it), and their waits
/// retry once, as a release before the subscription went unheard.
fn confirmed(shared: &Weak<Shared>, channels: &[String]) {
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let mut state = lock(&shared.state);
    state.connected = true;
    for channel in channels {
        if let Some(entry) = state.channels.get_mut(channel) {
            entry.confirmed = true;
            entry.wake();
        }
    }
}

/// The task's connection ended: no subscription is in place any more, and the waits that
/// relied on one retry once, as a release may have been missed as it broke. They are woken
/// again once a new connection has subscribed.
fn stopped_telling(shared: &Weak<Shared>) {
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let mut state = lock(&shared.state);
    state.connected = false;
    for entry in state.channels.values_mut() {
        if std::mem::replace(&mut entry.confirmed, false) {
            entry.wake();
        }
    }
}

fn wake(shared: &Weak<Shared>, channels: &[String]) {
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let state = lock(&shared.state);
    for channel in channels {
        if let Some(entry) = state.channels.get(channel) {
            entry.wake();
        }
    }
}

/// Drops the channels nobody has waited on for [`LINGER`] and returns them, to unsubscribe.
fn sweep(shared: &Weak<Shared>) -> Option<Vec<String>> {
    let shared = shared.upgrade()?;
    let mut state = lock(&shared.state);
    let gone: Vec<String> = state
        .channels
        .iter()
        .filter(|(_, c)| c.interest == 0 && c.unused_since.is_some_and(|at| at.elapsed() >= LINGER))
        .map(|(name, _)| name.clone())
        .collect();
    for name in &gone {
        state.channels.remove(name);
    }
    Some(gone)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed() -> redis::RedisError {
        std::io::Error::new(std::io::ErrorKind::ConnectionReset, "closed by the server").into()
    }

    fn report(health: &Arc<Health>) -> Report {
        Report {
            health: health.clone(),
            probe: None,
        }
    }

    #[test]
    fn a_connection_closed_before_its_first_answer_is_no_outage() {
        let health = Arc::new(Health::new(FIRST_DELAY, MOST_DELAY));
        report(&health).outcome::<()>(&Ok(Err(closed())));
        assert!(
            !health.is_failing(),
            "a killed pub/sub connection refused lock attempts"
        );
    }

    #[test]
    fn a_failed_connect_is_an_outage_and_an_answer_ends_it() {
        let health = Arc::new(Health::new(FIRST_DELAY, MOST_DELAY));
        report(&health).failed(&errors::request_error(&closed(), Stage::Connect));
        assert!(health.is_failing(), "a refused connect went uncounted");
        report(&health).outcome(&Ok(Ok(())));
        assert!(!health.is_failing(), "the server's answer did not end it");
    }
}
