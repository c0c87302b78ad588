//! A fault-injecting TCP proxy between one "process" and its backend.
//!
//! Each engine under test connects to its backend through its own [`FaultProxy`], so a fault
//! hits exactly one process while the others keep a clean line to the same server. The fault
//! is switched at run time and applies to open connections as well as new ones:
//!
//! - [`Fault::Pass`]: bytes flow both ways (after the configured latency, if any).
//! - [`Fault::Blackhole`]: a network partition. New connections are accepted and then hear
//!   nothing; open ones stop forwarding in both directions. Nothing is dropped: bytes wait in
//!   the kernel's buffers and flow again when the fault is lifted, as TCP retransmission would
//!   deliver them after a partition heals (a close, too, is delivered then).
//! - [`Fault::Reset`]: every open connection and every new one is closed with a TCP RST on both
//!   sides, as a middlebox or a crashed peer would.
//!
//! The proxy also watches the request/answer rhythm of each connection. Both protocols used here
//! (HTTP/1.1 and the PostgreSQL extended query protocol) send one request and wait for its
//! answer, so "the client sent bytes, then the server sent bytes" is one exchange. The send time
//! of the last *answered* exchange bounds, from outside the engine, when its last successful
//! renewal or check was sent.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::WriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What the proxy does to traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything.
    Pass,
    /// Accept, forward nothing, keep connections open.
    Blackhole,
    /// Reset every connection, open and new.
    Reset,
}

/// One request and the first bytes of its answer, as seen by the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exchange {
    /// The proxy's own number of the connection (in accept order, from 0).
    pub connection: usize,
    /// When the proxy read the first bytes of the request from the client.
    pub sent: Instant,
    /// When the proxy read the first bytes of the answer from the server.
    pub answered: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Settings {
    fault: Fault,
    latency: Duration,
    closed: bool,
    /// Bumped by [`FaultProxy::reset_open_connections`]: connections opened before are reset.
    resets: u64,
}

struct Shared {
    /// Where new connections go; see [`FaultProxy::set_backend`].
    backend: Mutex<SocketAddr>,
    settings: watch::Sender<Settings>,
    accepted: AtomicUsize,
    open: AtomicUsize,
    exchanges: Mutex<Vec<Exchange>>,
    answered: tokio::sync::Notify,
    /// When each connection's current request started, if it has not been answered yet.
    unanswered: Mutex<Vec<Option<Instant>>>,
}

/// A TCP proxy on a free loopback port; stops (and resets its connections) on drop.
pub struct FaultProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy to `backend`, forwarding everything until told otherwise.
    pub async fn start(backend: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind the proxy");
        let address = listener.local_addr().expect("the proxy's address");
        let (settings, _) = watch::channel(Settings {
            fault: Fault::Pass,
            latency: Duration::ZERO,
            closed: false,
            resets: 0,
        });
        let shared = Arc::new(Shared {
            backend: Mutex::new(backend),
            settings,
            accepted: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            exchanges: Mutex::new(Vec::new()),
            answered: tokio::sync::Notify::new(),
            unanswered: Mutex::new(Vec::new()),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        FaultProxy {
            address,
            shared,
            accept,
        }
    }

    /// A proxy to a backend listening on `port` of the loopback interface.
    pub async fn to_port(port: u16) -> FaultProxy {
        Self::start(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await
    }

    /// Where clients connect.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.address.port()
    }

    /// Switches the fault; open connections follow at once.
    pub fn set_fault(&self, fault: Fault) {
        self.shared.settings.send_modify(|s| s.fault = fault);
    }

    /// Resets every open connection with a TCP RST, once; new connections pass (unless a
    /// fault says otherwise). Switching to [`Fault::Reset`] and straight back would not: an open
    /// connection may never see the brief fault.
    pub fn reset_open_connections(&self) {
        self.shared.settings.send_modify(|s| s.resets += 1);
    }

    /// Sends new connections to `backend` from now on, as a service address does after a
    /// failover; open connections stay where they are (cut them with
    /// [`reset_open_connections`](Self::reset_open_connections)).
    pub fn set_backend(&self, backend: SocketAddr) {
        *lock(&self.shared.backend) = backend;
    }

    /// The current fault.
    pub fn fault(&self) -> Fault {
        self.shared.settings.borrow().fault
    }

    /// Delays every chunk the client sends by `latency` before forwarding it: each request
    /// takes that much longer to reach the server.
    pub fn set_latency(&self, latency: Duration) {
        self.shared.settings.send_modify(|s| s.latency = latency);
    }

    /// How many connections the proxy has accepted.
    pub fn connections_accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// How many accepted connections are still open.
    pub fn connections_open(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// Every answered exchange so far, in the order the answers arrived.
    pub fn exchanges(&self) -> Vec<Exchange> {
        lock(&self.shared.exchanges).clone()
    }

    /// The send time of the latest request that was answered: an upper bound on the send
    /// time of the engine's last successful renewal or check through this proxy (the engine
    /// sends before the proxy reads, and only an answered request can succeed).
    pub fn last_answered_request(&self) -> Option<Instant> {
        lock(&self.shared.exchanges).iter().map(|e| e.sent).max()
    }

    /// Waits for the first answered exchange whose request was read after `after`.
    pub async fn exchange_after(&self, after: Instant) -> Exchange {
        loop {
            let answered = self.shared.answered.notified();
            tokio::pin!(answered);
            // Registered before looking, so an answer recorded in between still wakes us.
            answered.as_mut().enable();
            if let Some(exchange) = lock(&self.shared.exchanges).iter().find(|e| e.sent > after) {
                return *exchange;
            }
            answered.await;
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.settings.send_modify(|s| s.closed = true);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
        lock(&shared.unanswered).push(None);
        shared.open.fetch_add(1, Ordering::SeqCst);
        let shared = shared.clone();
        tokio::spawn(async move {
            serve(id, client, &shared).await;
            shared.open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Closes a stream with RST instead of FIN.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Waits while the proxy blackholes; `None` once it resets or closes, or this connection (opened
/// at reset count `born`) was reset.
async fn passable(settings: &mut watch::Receiver<Settings>, born: u64) -> Option<()> {
    loop {
        let current = *settings.borrow_and_update();
        if current.closed || current.fault == Fault::Reset || current.resets != born {
            return None;
        }
        if current.fault == Fault::Pass {
            return Some(());
        }
        settings.changed().await.ok()?;
    }
}

/// Whether one direction ended (`n`, the bytes read, is 0); if so, marks it closed and passes
/// the end on to the other side.
async fn ended(n: usize, open: &mut bool, other_side: &mut WriteHalf<'_>) -> bool {
    if n == 0 {
        *open = false;
        let _ = other_side.shutdown().await;
    }
    n == 0
}

async fn serve(id: usize, mut client: TcpStream, shared: &Shared) {
    let mut settings = shared.settings.subscribe();
    let born = settings.borrow().resets;
    // A new connection in a blackhole is accepted and then left silent.
    if passable(&mut settings, born).await.is_none() {
        reset(client);
        return;
    }
    let backend = *lock(&shared.backend);
    let Ok(mut server) = TcpStream::connect(backend).await else {
        // The backend refuses: pass that on as closely as TCP allows.
        reset(client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut from_client = vec![0u8; 64 * 1024];
    let mut from_server = vec![0u8; 64 * 1024];
    let (mut client_open, mut server_open) = (true, true);
    let outcome = loop {
        if !client_open && !server_open {
            break Some(());
        }
        if passable(&mut settings, born).await.is_none() {
            break None;
        }
        let (mut client_read, mut client_write) = client.split();
        let (mut server_read, mut server_write) = server.split();
        tokio::select! {
            changed = settings.changed() => {
                if changed.is_err() {
                    break None;
                }
            }
            read = client_read.read(&mut from_client), if client_open => {
                let n = read.unwrap_or(0);
                if ended(n, &mut client_open, &mut server_write).await {
                    continue;
                }
                {
                    let mut unanswered = lock(&shared.unanswered);
                    unanswered[id].get_or_insert_with(Instant::now);
                }
                let latency = settings.borrow().latency;
                if !latency.is_zero() {
                    tokio::time::sleep(latency).await;
                }
                if server_write.write_all(&from_client[..n]).await.is_err() {
                    break None;
                }
            }
            read = server_read.read(&mut from_server), if server_open => {
                let n = read.unwrap_or(0);
                if ended(n, &mut server_open, &mut client_write).await {
                    continue;
                }
                let answered = Instant::now();
                if let Some(sent) = lock(&shared.unanswered)[id].take() {
                    lock(&shared.exchanges).push(Exchange {
                        connection: id,
                        sent,
                        answered,
                    });
                    shared.answered.notify_waiters();
                }
                if client_write.write_all(&from_server[..n]).await.is_err() {
                    break None;
                }
            }
        }
    };
    if outcome.is_none() {
        reset(client);
        reset(server);
    }
}
