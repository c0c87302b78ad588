//! Waking this process's waiters the moment another process releases their key.
//!
//! Every release script publishes on the key's channel (`…:released`, see
//! [`RedisLockKeys`](crate::keys::RedisLockKeys)). For the keys this process waits for, the
//! backend keeps **one** pub/sub connection, subscribed to their channels, and a message wakes
//! every waiter of that key in this process, which then attempts at once (see
//! [`LockBackend::release_hint`](crate::LockBackend::release_hint)). A lock that *expires*
//! publishes nothing: waiters still learn of it by polling, which stays the fallback.
//!
//! - **Subscribing costs a round trip, so only waits that met a busy key pay it.** A hint
//!   registers its interest at once (a release published on a channel already subscribed is
//!   never missed), but asks for a subscription only when first polled, which the engine does
//!   after a busy answer; when the server confirms a new subscription, the channel's waiters
//!   are woken once, so a release that landed between the busy answer and the subscription
//!   costs one attempt, not a backoff.
//! - **Channels linger**: the engine asks for a new hint before each attempt, so a channel
//!   nobody waits on stays subscribed for [`LINGER`] before it is unsubscribed.
//! - **One connection in all**, opened on the first subscription and closed after [`IDLE`]
//!   with no channel subscribed. It opens through the backend's outage gate (see
//!   `connection`): while Redis is failing it waits for the gate's probe like every request,
//!   and only the server's first answer on it counts as Redis answering again. A lost
//!   connection is opened again only after a backoff ([`FIRST_DELAY`] doubling to
//!   [`MOST_DELAY`]) that starts over once a connection stayed subscribed for [`STEADY`]; once
//!   it is back, every waiter is woken once, as a release may have been missed meanwhile. A
//!   connection that stops answering pings is treated as lost.
//! - **A refused subscription disables the watch** (a Redis 7 ACL user has no channels unless
//!   granted `&<key_prefix>:*`): it is logged once, waiters poll, and subscribing is tried
//!   again every [`MOST_DELAY`].
//! - On Redis Cluster, a `PUBLISH` reaches every node, so one connection to any node hears the
//!   releases of every slot (and each release costs every node a cluster-bus message).

use std::collections::HashMap;
use std::future::Future;
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

/// A channel nobody waits on stays subscribed this long, for the next round of the same wait.
const LINGER: Duration = Duration::from_secs(1);

/// The connection closes after this long without a subscribed channel.
const IDLE: Duration = Duration::from_secs(10);

/// How often an otherwise quiet connection is pinged, so a frozen server or a silent network is
/// noticed.
const PING_EVERY: Duration = Duration::from_secs(5);

/// A connection that stayed subscribed this long was a good one: the backoff after losing it
/// starts over.
const STEADY: Duration = Duration::from_secs(10);

/// The release watch of one backend: the channels its waiters wait on, and the one task that
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

#[derive(Default)]
struct State {
    channels: HashMap<String, Channel>,
    /// The subscriber task, while one runs.
    task: Option<mpsc::UnboundedSender<String>>,
    /// Whether the task has a connection now on which the server confirmed the subscriptions.
    connected: bool,
}

struct Channel {
    /// Bumped whenever the channel's waiters should retry.
    woken: watch::Sender<u64>,
    /// Hints alive for this channel.
    interest: usize,
    /// Whether the task was asked to subscribe (and has, unless the connection is down).
    requested: bool,
    /// When the last hint went away, while none is alive.
    unused_since: Option<Instant>,
}

impl Channel {
    fn new() -> Self {
        Channel {
            woken: watch::Sender::new(0),
            interest: 0,
            requested: false,
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

    /// Closes the pub/sub connection for good and wakes every waiter, which polls from now on.
    pub(super) fn stop(&self) {
        self.shared.stop.cancel();
        let mut state = lock(&self.shared.state);
        // Dropping a channel's sender wakes its hints.
        state.channels.clear();
        state.task = None;
    }

    /// Whether the pub/sub connection is open, its subscriptions confirmed by the server (0 or
    /// 1).
    pub(super) fn connections(&self) -> usize {
        usize::from(lock(&self.shared.state).connected)
    }

    /// A future that resolves when `channel` may have seen a release: interest is registered
    /// now; the subscription is asked for on first poll.
    pub(super) fn hint(&self, channel: String) -> impl Future<Output = ()> + Send + 'static {
        let mut receiver = {
            let mut state = lock(&self.shared.state);
            let entry = state
                .channels
                .entry(channel.clone())
                .or_insert_with(Channel::new);
            entry.interest += 1;
            entry.unused_since = None;
            entry.woken.subscribe()
        };
        let interest = Interest {
            shared: self.shared.clone(),
            channel,
        };
        async move {
            interest.subscribe();
            // A closed sender means the channel was dropped from the map: wake, harmlessly.
            let _ = receiver.changed().await;
            drop(interest);
        }
    }
}

/// One hint's interest in a channel; dropping it lets the channel linger and then go.
struct Interest {
    shared: Arc<Shared>,
    channel: String,
}

impl Interest {
    /// Asks the task to subscribe to the channel unless it was asked already, starting the task
    /// if none runs.
    fn subscribe(&self) {
        if self.shared.stop.is_cancelled() {
            // Shut down: waits poll.
            return;
        }
        let mut state = lock(&self.shared.state);
        let requested = match state.channels.get_mut(&self.channel) {
            Some(entry) => std::mem::replace(&mut entry.requested, true),
            None => return,
        };
        if requested {
            return;
        }
        let sent = state
            .task
            .as_ref()
            .is_some_and(|task| task.send(self.channel.clone()).is_ok());
        if !sent {
            let (commands, receiver) = mpsc::unbounded_channel();
            let _ = commands.send(self.channel.clone());
            state.task = Some(commands);
            drop(state);
            let stop = self.shared.stop.clone();
            let task = subscriber(Arc::downgrade(&self.shared), receiver);
            tokio::spawn(async move {
                // Dropping the task at shutdown closes its connection.
                tokio::select! {
                    _ = stop.cancelled() => {}
                    () = task => {}
                }
            });
        }
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut state = lock(&self.shared.state);
        if let Some(entry) = state.channels.get_mut(&self.channel) {
            entry.interest = entry.interest.saturating_sub(1);
            if entry.interest == 0 {
                entry.unused_since = Some(Instant::now());
                if !entry.requested {
                    // Never subscribed: nothing to linger for.
                    state.channels.remove(&self.channel);
                }
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

/// The subscriber task: keeps one pub/sub connection subscribed to every requested channel.
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
                if let Some(strong) = shared.upgrade() {
                    lock(&strong.state).connected = false;
                }
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
struct Report {
    health: Arc<Health>,
    probe: Option<Probe>,
}

impl Report {
    /// The server answered (whatever it said), or the request failed with `result`'s error.
    fn outcome<T>(self, result: &Result<redis::RedisResult<T>, tokio::time::error::Elapsed>) {
        let failure = match result {
            Ok(Ok(_)) => None,
            Ok(Err(error)) => Some(errors::request_error(error, Stage::Connect))
                .filter(|e| e.kind() == (BackendErrorKind::Transient { reached: false })),
            // A connection that opened and then stayed silent: slow or frozen, not counted
            // (a probe dropped without an outcome lets the next caller probe).
            Err(_) => return,
        };
        match (failure, self.probe) {
            (None, Some(probe)) => {
                probe.answered();
            }
            (None, None) => {
                self.health.answered();
            }
            (Some(cause), Some(probe)) => probe.failed(&cause),
            (Some(cause), None) => {
                self.health.failed(&cause, false);
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

/// Ends the task if no channel is wanted any more (under the state lock, so a hint that comes
/// later starts a new task). Returns whether it did.
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
    // first answer is owed to the health report); their waiters retry once, as a release may
    // have gone unheard while the connection was down.
    let Some(wanted) = requested_channels(shared) else {
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
    // Counted as open only now that the server has answered on it.
    if let Some(shared) = shared.upgrade() {
        lock(&shared.state).connected = true;
    }
    wake(shared, &wanted);
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
                    checked(subscribed).map(|()| wake(shared, std::slice::from_ref(&channel)))
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
    let subscribed = requested_channels(shared).ok_or(Ended::Done)?;
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
fn requested_channels(shared: &Weak<Shared>) -> Option<Vec<String>> {
    let shared = shared.upgrade()?;
    let state = lock(&shared.state);
    Some(
        state
            .channels
            .iter()
            .filter(|(_, c)| c.requested)
            .map(|(name, _)| name.clone())
            .collect(),
    )
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
