//! What every server fixture asks of the operating system: a loopback port for a server that
//! binds it itself, signals to a server's processes, and what `/proc` says of a process (whether
//! it still runs, its children, when it started).

use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};

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

/// A loopback port that no listener holds now and no other test process has reserved, for a
/// server that must bind it itself; never the same one twice in a process (until the range
/// wraps). A program that is no fixture may still bind it first: `ServerProcess::start`
/// (server.rs) tries again on new ports when its server fails to bind or another process
/// answers on its port.
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
        if reserve(port) && is_free(port) && partner_free {
            return Ok(port);
        }
    }
    Err(io::Error::other(
        "no free loopback port in the fixtures' range",
    ))
}

/// Reserves `port` for this test process until it exits, against every other test process:
/// an exclusive `flock` on a file named after the port, which the kernel drops with the
/// process. Two processes whose walks through the range meet can otherwise both find a port
/// free and start servers on it, and the loser's readiness check is answered by the winner.
/// `true` also when the reservation files cannot be made (the bind check still applies).
fn reserve(port: u16) -> bool {
    use std::os::fd::AsRawFd;
    static HELD: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());
    let dir = std::env::temp_dir().join("lockingkit-ports");
    if std::fs::create_dir_all(&dir).is_err() {
        return true;
    }
    let Ok(file) = std::fs::File::create(dir.join(port.to_string())) else {
        return true;
    };
    // SAFETY: flock only reads the descriptor, which `file` owns and keeps open.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
    if locked {
        HELD.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(file);
    }
    locked
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
    stat_fields(pid.into())
        .and_then(|fields| fields.into_iter().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

/// Every process whose parent is `parent` (a PostgreSQL postmaster's backends, say).
pub fn children_of(parent: impl Into<i64>) -> Vec<u32> {
    let parent = parent.into().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| stat_fields(pid.into()).is_some_and(|fields| fields.get(1) == Some(&parent)))
        .collect()
}

/// Whether process `pid` or one of its descendants holds the listening socket on loopback
/// `port`. A readiness check that connects to a port cannot tell our server from another test
/// process's server that won the port between the allocator's check and our server's bind:
/// ours then exits (or never binds) while theirs answers for it. `None` when `/proc` cannot
/// say (a process of another user whose descriptors we may not read).
pub fn listens_on(pid: u32, port: u16) -> Option<bool> {
    let sockets = listening_sockets(port)?;
    let mut pending = vec![pid];
    while let Some(pid) = pending.pop() {
        let descriptors = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
        let holds = descriptors.flatten().any(|entry| {
            std::fs::read_link(entry.path()).is_ok_and(|target| {
                let target = target.to_string_lossy();
                target
                    .strip_prefix("socket:[")
                    .and_then(|rest| rest.strip_suffix(']'))
                    .is_some_and(|inode| sockets.iter().any(|s| s == inode))
            })
        });
        if holds {
            return Some(true);
        }
        pending.extend(children_of(pid));
    }
    Some(false)
}

/// The inodes of the sockets listening on `port` (IPv4 `/proc/net/tcp`; state `0A` is LISTEN).
fn listening_sockets(port: u16) -> Option<Vec<String>> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let wanted = format!(":{port:04X}");
    Some(
        table
            .lines()
            .skip(1)
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let listening = fields.get(3) == Some(&"0A");
                let on_port = fields.get(1).is_some_and(|local| local.ends_with(&wanted));
                (listening && on_port).then(|| fields.get(9).map(|inode| (*inode).to_owned()))?
            })
            .collect(),
    )
}

/// When process `pid` started, in clock ticks since boot: with the pid, it names one process
/// even after the pid is reused.
pub fn start_time(pid: impl Into<i64>) -> Option<u64> {
    stat_fields(pid.into())?.get(19)?.parse().ok()
}

/// The fields of `/proc/{pid}/stat` after the parenthesised command name (which may hold
/// spaces): the state first, then the parent's pid, and so on (`proc(5)`, from field 3).
pub fn stat_fields(pid: i64) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// A command that runs one test of this test binary again, in a process of its own: the
/// `#[ignore]`d test `name` of the module at `module_path` (the caller's `module_path!()`),
/// matched exactly, with its output shown. The suite's own run skips an ignored test, so such
/// a test only does its work when started this way.
pub fn this_test_again(module_path: &str, name: &str) -> std::process::Command {
    // A test's full name is its path without the crate's name.
    let path = match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_owned(),
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = std::process::Command::new(exe);
    command.args([path.as_str(), "--exact", "--ignored", "--nocapture"]);
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_port_is_refused_to_every_other_reservation() {
        let port = free_port().expect("a port");
        // Another open file description conflicts like another process's would.
        assert!(!reserve(port), "a port reserved twice");
    }

    #[test]
    fn the_listener_of_a_port_is_told_from_a_process_that_is_not() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a listener");
        let port = listener.local_addr().expect("its address").port();
        assert_eq!(listens_on(std::process::id(), port), Some(true));
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("a process");
        let answer = listens_on(other.id(), port);
        let _ = other.kill();
        let _ = other.wait();
        assert_eq!(
            answer,
            Some(false),
            "a process that holds no socket on the port"
        );
    }
}
