//! What every server fixture asks of the operating system: a loopback port for a server that
//! binds it itself, signals to a server's processes, and whether a process still runs.

use std::fmt::Display;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The first port handed to servers. The range lies below Linux's ephemeral range (32768 and
/// up by default), so the kernel never gives one of these ports to a `bind(0)` or an outgoing
/// connection of any process between our check and the server's own bind: the race that a
/// port found by binding port 0 and dropping the listener has. Only another test process's
/// fixture can take one, and each process starts at its own place in the range.
const FIRST_PORT: u16 = 12_000;
/// How many ports the range holds. A Redis Cluster node's bus port (+10 000) stays below the
/// ephemeral range too.
const PORTS: u32 = 10_000;
/// Each test process starts this many ports after the process id before it (modulo the
/// range): nextest runs one test a process, and a test starts a few servers at most.
const PORTS_PER_PROCESS: u32 = 50;

/// A loopback port that no listener holds now, for a server that must bind it itself; never
/// the same one twice in a process (until the range wraps). The server may still lose it to
/// another test process between this check and its bind: every fixture's start tries again on
/// a new port when its server fails to bind.
pub fn free_port() -> io::Result<u16> {
    free_port_with_partner(0)
}

/// A free loopback port whose partner `partner_offset` above it is free too (a Redis Cluster
/// node's bus port is its port + 10 000); 0 asks for the port alone.
pub fn free_port_with_partner(partner_offset: u16) -> io::Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let start = std::process::id() % (PORTS / PORTS_PER_PROCESS) * PORTS_PER_PROCESS;
    // The first call places this process; a lost race only means two calls check one port.
    let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..PORTS {
        let port = FIRST_PORT + (NEXT.fetch_add(1, Ordering::Relaxed) % PORTS) as u16;
        let partner_free =
            partner_offset == 0 || port.checked_add(partner_offset).is_some_and(is_free);
        if is_free(port) && partner_free {
            return Ok(port);
        }
    }
    Err(io::Error::other(
        "no free loopback port in the fixtures' range",
    ))
}

fn is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// Sends `signal` to process `pid` (a stale or out-of-range pid does nothing).
pub fn signal(pid: impl TryInto<libc::pid_t>, signal: libc::c_int) {
    let Ok(pid) = pid.try_into() else {
        return;
    };
    // SAFETY: kill has no memory-safety preconditions; a stale pid only yields ESRCH.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Whether process `pid` runs: it exists and is no zombie (a zombie holds nothing any more).
pub fn alive(pid: impl Into<i64>) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.into())).unwrap_or_default();
    // The state is the first field after the parenthesised command name.
    match stat.rsplit_once(')') {
        Some((_, rest)) => {
            let state = rest.trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        None => false,
    }
}

/// Runs `launch` until it succeeds, for a server started again on the port it had before a
/// kill or stop: the port can stay taken for a moment after its process died. Panics with the
/// last failure after five seconds of them.
pub fn relaunch<T, E: Display>(server: &str, mut launch: impl FnMut() -> Result<T, E>) -> T {
    let mut last = String::new();
    for _ in 0..50 {
        match launch() {
            Ok(started) => return started,
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{server} did not start again on its port: {last}");
}
