//! The events of a run, one JSON object per line.
//!
//! Each client process writes its own operations; the register writes every request it
//! answered, in the order it answered them, and the value of each key at the end; the nemesis
//! writes when each fault began and ended. Times are [`monotonic_ns`](crate::clock::monotonic_ns)
//! in every process, so all of them lie on one time line.

use serde::{Deserialize, Serialize};

use crate::error::CheckError;

/// One line of a history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// A step of a client operation.
    Op(OpEvent),
    /// A request the register answered.
    Register(RegisterEntry),
    /// A fault beginning or ending.
    Nemesis(FaultEvent),
    /// The register's value of a key when the run ended.
    Final {
        /// The key.
        key: String,
        /// Its value.
        value: u64,
    },
}

/// Where an operation is: invoked, or finished one of three ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The client began the operation.
    Invoke,
    /// It happened.
    Ok,
    /// It did not happen (a refusal, a busy lock).
    Fail,
    /// Unknown: it may or may not have happened (a timeout, a broken connection).
    Info,
}

/// What a client did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// Acquire the key's lock.
    Acquire,
    /// Read the register, with the lock's token.
    Read,
    /// Write the register (the value read plus one), with the lock's token.
    Write,
    /// Release the lock.
    Release,
}

/// A step of one client operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpEvent {
    /// When, in monotonic nanoseconds.
    pub time: u64,
    /// The client process (an OS pid, or a simulated one for the in-memory provider).
    pub process: u32,
    /// Invoked or finished how.
    pub phase: Phase,
    /// The operation.
    pub op: OpKind,
    /// The lock's key, which is also the register's.
    pub key: String,
    /// The fencing token, once the lock is held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<u64>,
    /// The value read (read ok) or to write (write invoke and its completion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
    /// Why it failed or is unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Whether the hold is a reader's (shared with other readers); false for an exclusive hold.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
    /// For a semaphore slot's hold: how many holders the semaphore admits. Such a hold is
    /// also `shared`, and its token grows per slot, so it is never compared with another's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
    /// On a register request's invoke: what the lock's `is_held()` answered just after `time`,
    /// so the client believed it held the lock at `time` or later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<bool>,
}

/// A register access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// Read the value.
    Read,
    /// Set the value.
    Write,
}

/// One request the register answered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterEntry {
    /// The register's order of answers (from 0), which is the order that counts.
    pub seq: u64,
    /// When it answered, in monotonic nanoseconds.
    pub time: u64,
    /// The client process that asked.
    pub process: u32,
    /// The key.
    pub key: String,
    /// Read or write.
    pub access: Access,
    /// The fencing token sent.
    pub token: u64,
    /// The value read or written (for a refused request, the value it would have read or set).
    pub value: u64,
    /// Whether the register accepted it (see [`register`](crate::register) for the rule).
    pub accepted: bool,
    /// Whether it came from a reader's hold.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
}

/// The kinds of fault the nemesis injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a client (or cancel its task), then start a new one in its place.
    Kill,
    /// SIGSTOP a client for less than a lease, then SIGCONT.
    PauseShort,
    /// SIGSTOP a client for more than a lease, then SIGCONT.
    PauseLong,
    /// The client's connections to the backend hear nothing.
    Blackhole,
    /// The client's connections to the backend are reset.
    Reset,
    /// The client's connections to the backend are delayed.
    Delay,
    /// The client's next renewal reaches the backend but its answer comes late (0.4 of the
    /// lease); every renewal after it is cut off. A lease renewed just before a partition, on a
    /// slow line: the deadline must count from the renewal's send, not its answer.
    SlowThenCut,
    /// The backend server is killed (SIGKILL) and started again on its port.
    ServerCrash,
    /// The backend server is frozen (SIGSTOP), then thawed.
    ServerPause,
    /// The client process runs with its clocks (monotonic included) at `rate_percent` of real
    /// time, from its start to its end (libfaketime).
    ClockRate,
}

impl FaultKind {
    /// Every kind, in report order.
    pub const ALL: [FaultKind; 10] = [
        FaultKind::Kill,
        FaultKind::PauseShort,
        FaultKind::PauseLong,
        FaultKind::Blackhole,
        FaultKind::Reset,
        FaultKind::Delay,
        FaultKind::SlowThenCut,
        FaultKind::ServerCrash,
        FaultKind::ServerPause,
        FaultKind::ClockRate,
    ];

    /// Whether it strikes the backend server, all clients at once, rather than one client.
    pub fn hits_server(self) -> bool {
        matches!(self, FaultKind::ServerCrash | FaultKind::ServerPause)
    }

    /// The name the report prints.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::PauseShort => "pause<lease",
            FaultKind::PauseLong => "pause>lease",
            FaultKind::Blackhole => "blackhole",
            FaultKind::Reset => "reset",
            FaultKind::Delay => "delay",
            FaultKind::SlowThenCut => "slow-then-cut",
            FaultKind::ServerCrash => "server-crash",
            FaultKind::ServerPause => "server-pause",
            FaultKind::ClockRate => "clock-rate",
        }
    }
}

/// Whether a fault begins or ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultPhase {
    /// The fault begins.
    Start,
    /// The fault is lifted.
    End,
}

/// A fault beginning or ending.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultEvent {
    /// When, in monotonic nanoseconds.
    pub time: u64,
    /// The fault's number in the run; its start and end share it.
    pub id: u64,
    /// What kind of fault.
    pub fault: FaultKind,
    /// The client slot it hits (a slot keeps its number across restarts).
    pub slot: usize,
    /// The process it hit, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<u32>,
    /// Begins or ends.
    pub phase: FaultPhase,
    /// For a clock-rate fault: the client's clock rate, in percent of real time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_percent: Option<u32>,
}

/// Parses a history written as JSON lines. A last line cut short (a client killed in the
/// middle of a write) is skipped; a bad line anywhere else is an error.
pub fn parse_lines(text: &str) -> Result<Vec<Event>, CheckError> {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut events = Vec::with_capacity(lines.len());
    for (n, line) in lines.iter().enumerate() {
        match serde_json::from_str(line) {
            Ok(event) => events.push(event),
            Err(_) if n + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(error) => {
                return Err(CheckError::History(format!("line {}: {error}", n + 1)));
            }
        }
    }
    Ok(events)
}

/// One event as a JSON line (with its newline).
pub fn to_line(event: &Event) -> String {
    // An event is plain data (strings, numbers, enums): serializing it cannot fail.
    let mut line = serde_json::to_string(event).unwrap_or_default();
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_cut_short_at_the_end_is_skipped_and_one_in_the_middle_is_an_error() {
        let whole = to_line(&Event::Final {
            key: "k".into(),
            value: 3,
        });
        let cut = format!("{whole}{{\"type\":\"fin");
        assert_eq!(parse_lines(&cut).map(|e| e.len()).ok(), Some(1));
        let middle = format!("{{\"type\":\"fin\n{whole}");
        assert!(parse_lines(&middle).is_err());
    }
}
