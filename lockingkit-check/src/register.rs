//! The fenced register: a small TCP server, kept apart from the lock backend, that holds one
//! number per key and refuses any request whose fencing token is lower than the highest it has
//! seen for that key.
//!
//! The rule covers reads as well as writes: once a newer holder has read, a stale holder can
//! neither write nor read, so its read-modify-write cannot straddle the newer one. Readers hold
//! a key together, so a reader's read is refused only below the highest token of an exclusive
//! hold; it still raises the key's highest token, so a writer older than the reader is refused
//! from then on. Every request, accepted or refused, goes into the register's log in the order
//! it was answered; that order is the one the checker trusts.
//!
//! The protocol is one JSON line each way: a [`Request`], then a [`Reply`].

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::clock::monotonic_ns;
use crate::history::{Access, Event, RegisterEntry};

/// A request to the register.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The asking client process.
    pub process: u32,
    /// The key.
    pub key: String,
    /// The fencing token of the lock the client holds on `key`.
    pub token: u64,
    /// Read, or write `value`.
    pub access: Access,
    /// The value to write (ignored for a read).
    #[serde(default)]
    pub value: u64,
    /// Whether the token is a reader's (a read only).
    #[serde(default)]
    pub shared: bool,
}

/// The register's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request was accepted.
    pub accepted: bool,
    /// The value after the request (for a refusal, the current one).
    pub value: u64,
    /// The highest token the register has seen for the key.
    pub highest: u64,
}

#[derive(Default)]
struct Cell {
    value: u64,
    /// The highest token accepted, from any hold.
    highest: u64,
    /// The highest token accepted from an exclusive hold: the floor of a reader's token.
    highest_exclusive: u64,
    /// The process whose accepted read was the key's last accepted request: a holder in the
    /// middle of its read-modify-write.
    reader: Option<u32>,
}

#[derive(Default)]
struct State {
    cells: HashMap<String, Cell>,
    log: Vec<RegisterEntry>,
}

impl State {
    /// Answers one request and logs it: the one place the fencing rule lives.
    fn answer(&mut self, request: &Request) -> Reply {
        let cell = self.cells.entry(request.key.clone()).or_default();
        // A reader may only read; a write with a reader's token is refused.
        let shared = request.shared;
        let accepted = if shared {
            request.access == Access::Read && request.token >= cell.highest_exclusive
        } else {
            request.token >= cell.highest
        };
        if accepted {
            cell.highest = cell.highest.max(request.token);
            if !shared {
                cell.highest_exclusive = request.token;
            }
            match request.access {
                Access::Write => {
                    cell.value = request.value;
                    cell.reader = None;
                }
                // A shared hold's read begins no update (a semaphore's key is never written, so
                // its readers would be named mid-update long after they left).
                Access::Read if !shared => cell.reader = Some(request.process),
                Access::Read => {}
            }
        }
        let reply = Reply {
            accepted,
            value: cell.value,
            highest: cell.highest,
        };
        let seq = self.log.len() as u64;
        self.log.push(RegisterEntry {
            seq,
            time: monotonic_ns(),
            process: request.process,
            key: request.key.clone(),
            access: request.access,
            token: request.token,
            value: match request.access {
                Access::Read => cell.value,
                Access::Write => request.value,
            },
            accepted,
            shared,
        });
        reply
    }
}

/// The running register server, on a free loopback port; stops on drop.
pub struct Register {
    address: SocketAddr,
    state: Arc<Mutex<State>>,
    accept: JoinHandle<()>,
}

impl Register {
    /// Starts the server on 127.0.0.1.
    pub async fn start() -> std::io::Result<Register> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let address = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let accept = tokio::spawn(accept_loop(listener, state.clone()));
        Ok(Register {
            address,
            state,
            accept,
        })
    }

    /// Where clients connect.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The log so far (every answered request, in order).
    pub fn log(&self) -> Vec<RegisterEntry> {
        lock(&self.state).log.clone()
    }

    /// The processes in the middle of a read-modify-write now (their read was the last accepted
    /// request on a key), which the nemesis prefers to strike.
    pub fn mid_update(&self) -> Vec<u32> {
        let state = lock(&self.state);
        let mut processes: Vec<u32> = state.cells.values().filter_map(|c| c.reader).collect();
        processes.sort_unstable();
        processes
    }

    /// How many requests it has answered.
    pub fn answered(&self) -> usize {
        lock(&self.state).log.len()
    }

    /// The log and the final value of every key, as history events.
    pub fn history(&self) -> Vec<Event> {
        let state = lock(&self.state);
        let finals: BTreeMap<&String, u64> =
            state.cells.iter().map(|(k, c)| (k, c.value)).collect();
        state
            .log
            .iter()
            .cloned()
            .map(Event::Register)
            .chain(finals.into_iter().map(|(key, value)| Event::Final {
                key: key.clone(),
                value,
            }))
            .collect()
    }
}

impl Drop for Register {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

// A poisoned lock only means a connection task panicked mid-answer; the state is still whole
// (each answer is one insert and one push).
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop(listener: TcpListener, state: Arc<Mutex<State>>) {
    while let Ok((stream, _)) = listener.accept().await {
        tokio::spawn(serve(stream, state.clone()));
    }
}

async fn serve(stream: TcpStream, state: Arc<Mutex<State>>) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(request) = serde_json::from_str::<Request>(&line) else {
            return;
        };
        let reply = lock(&state).answer(&request);
        let mut text = serde_json::to_string(&reply).unwrap_or_default();
        text.push('\n');
        if write.write_all(text.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// Why a register request has no answer.
#[derive(Debug)]
pub enum RegisterFailure {
    /// No answer in time: the request may or may not have been applied.
    TimedOut,
    /// The connection failed: the request may or may not have been applied.
    Io(std::io::Error),
}

impl std::fmt::Display for RegisterFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegisterFailure::TimedOut => f.write_str("register timed out"),
            RegisterFailure::Io(e) => write!(f, "register i/o: {e}"),
        }
    }
}

/// A client's connection to the register, opened on first use and again after a failure.
pub struct RegisterClient {
    address: SocketAddr,
    timeout: Duration,
    connection: Option<BufReader<TcpStream>>,
}

impl RegisterClient {
    /// A client of the register at `address`, waiting up to `timeout` for each answer.
    pub fn new(address: SocketAddr, timeout: Duration) -> Self {
        RegisterClient {
            address,
            timeout,
            connection: None,
        }
    }

    /// Sends one request and waits for its answer.
    pub async fn request(&mut self, request: &Request) -> Result<Reply, RegisterFailure> {
        let result = tokio::time::timeout(self.timeout, self.exchange(request)).await;
        let outcome = match result {
            Ok(Ok(reply)) => return Ok(reply),
            Ok(Err(e)) => RegisterFailure::Io(e),
            Err(_) => RegisterFailure::TimedOut,
        };
        // A late answer must not be read as the next request's.
        self.connection = None;
        Err(outcome)
    }

    async fn exchange(&mut self, request: &Request) -> std::io::Result<Reply> {
        let connection = match &mut self.connection {
            Some(c) => c,
            None => self
                .connection
                .insert(BufReader::new(TcpStream::connect(self.address).await?)),
        };
        let mut text = serde_json::to_string(request)?;
        text.push('\n');
        connection.get_mut().write_all(text.as_bytes()).await?;
        let mut line = String::new();
        if connection.read_line(&mut line).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(serde_json::from_str(&line)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(token: u64, access: Access, value: u64) -> Request {
        Request {
            process: 1,
            key: "k".into(),
            token,
            access,
            value,
            shared: false,
        }
    }

    fn reader(token: u64) -> Request {
        Request {
            shared: true,
            ..request(token, Access::Read, 0)
        }
    }

    #[test]
    fn only_an_exclusive_read_marks_its_holder_mid_update() {
        let mut state = State::default();
        let mid = |state: &State| state.cells.get("k").and_then(|c| c.reader);
        assert!(state.answer(&reader(1)).accepted);
        assert_eq!(mid(&state), None, "a reader begins no update");
        assert!(state.answer(&request(2, Access::Read, 0)).accepted);
        assert_eq!(mid(&state), Some(1));
        assert!(state.answer(&request(2, Access::Write, 1)).accepted);
        assert_eq!(mid(&state), None);
    }

    #[test]
    fn readers_do_not_fence_one_another_but_fence_older_writers() {
        let mut state = State::default();
        assert!(state.answer(&request(2, Access::Read, 0)).accepted);
        // A reader older than an exclusive hold that has been accepted is stale.
        assert!(!state.answer(&reader(1)).accepted);
        assert!(state.answer(&reader(4)).accepted);
        assert!(state.answer(&reader(3)).accepted, "readers hold together");
        assert!(!state.answer(&request(2, Access::Write, 1)).accepted);
        assert!(
            !state
                .answer(&Request {
                    shared: true,
                    ..request(5, Access::Write, 1)
                })
                .accepted,
            "a reader never writes"
        );
        assert!(state.answer(&request(6, Access::Write, 1)).accepted);
        assert!(!state.answer(&reader(5)).accepted);
        assert!(state.log.iter().filter(|e| e.shared).count() == 5);
    }

    #[test]
    fn a_stale_token_is_refused_for_reads_and_writes_after_a_newer_read() {
        let mut state = State::default();
        assert!(state.answer(&request(1, Access::Read, 0)).accepted);
        assert!(state.answer(&request(2, Access::Read, 0)).accepted);
        assert!(!state.answer(&request(1, Access::Write, 1)).accepted);
        assert!(!state.answer(&request(1, Access::Read, 0)).accepted);
        let reply = state.answer(&request(2, Access::Write, 1));
        assert_eq!((reply.accepted, reply.value), (true, 1));
        assert_eq!(state.log.len(), 5);
        assert_eq!(state.log.iter().filter(|e| e.accepted).count(), 3);
    }

    #[tokio::test]
    async fn a_client_reads_and_writes_over_tcp() -> Result<(), Box<dyn std::error::Error>> {
        let register = Register::start().await?;
        let mut client = RegisterClient::new(register.address(), Duration::from_secs(5));
        let wrote = client
            .request(&request(3, Access::Write, 7))
            .await
            .map_err(|e| e.to_string())?;
        assert!(wrote.accepted);
        let read = client
            .request(&request(3, Access::Read, 0))
            .await
            .map_err(|e| e.to_string())?;
        assert_eq!(read.value, 7);
        assert_eq!(register.answered(), 2);
        Ok(())
    }
}
