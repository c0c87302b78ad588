//! The verdict on a history: a pure function of its events.
//!
//! Seven properties, each from the evidence that can prove it broken:
//!
//! - **Mutual exclusion.** A hold is one `(process, token)` pair. In the register's order of
//!   answers, the accepted requests of two holds of one key must not interleave: once another
//!   hold's request is accepted, an earlier hold must never be accepted again.
//! - **Fencing.** In the register's order, no accepted request carries a token lower than one
//!   accepted before it on the same key.
//! - **No lost or doubled update.** Each acknowledged write is an increment that must be in the
//!   register's final value exactly once: two acknowledged writes of one value to one key (one
//!   overwrote the other), or a final value below the number of acknowledged writes, lose an
//!   update; a final value above acknowledged plus unknown writes doubles one. A write whose
//!   outcome is unknown (`info`, or invoked and never finished: its client was killed) may or
//!   may not count.
//! - **Readers and writers.** In the register's order, no reader's accepted read falls between
//!   an exclusive hold's first and last accepted requests.
//! - **A holder's belief.** A client that asked `is_held()` and was told yes, at an instant after
//!   another hold of the key that excludes it was granted with a greater token, believed it held
//!   a lock someone else held: for a lease this breaks the engine's deadline (90% of the lease
//!   after the last renewal's *send*), whatever the faults, while the clock runs within the
//!   margin. Where the provider's documented guarantees allow the overlap (a session-held lock
//!   that the server freed under a fault is seen lost at the holder's next check; a restart of
//!   a server without persistence loses every lock; a client clock slower than the margin), the
//!   violation is reported as *expected*, with the reason and how many of the holder's later
//!   requests the register accepted and refused, and fails nothing: fencing is what must refuse
//!   such a holder, and an accepted stale request is a fencing or mutual-exclusion violation.
//! - **Semaphore slots.** A semaphore slot's token grows per slot, so no one token fences every
//!   holder, and the register does not fence slots against each other. What is checked is what
//!   clients were told: a hold counts from its grant's answer to the last request at which its
//!   lock said it was held, and at no instant may more holds count than the semaphore admits.
//!   Where a stale holder's belief is one the guarantees allow (as for the check above), the
//!   violation is expected.
//! - **Tokens grow.** (Semaphore slots aside.) A hold granted after another hold's grant was answered (in real time) has
//!   a greater token, whatever the modes and whatever happened to the backend in between.
//!
//! Each violation names its operations and the faults active while they ran (or that ended less
//! than [`FAULT_MARGIN_NS`] before), so a reader can see what led to it.

use std::collections::{BTreeMap, HashMap};

use crate::history::{
    Event, FaultEvent, FaultKind, FaultPhase, OpEvent, OpKind, Phase, RegisterEntry,
};

/// How long before a violation's first operation a fault still counts as active at it: a
/// pause or partition that just ended is the usual cause of what follows.
pub const FAULT_MARGIN_NS: u64 = 5_000_000_000;

/// At most this many operations are listed with one violation.
const OPS_SHOWN: usize = 12;

/// The kinds of violation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ViolationKind {
    /// Two holds of one key whose accepted register requests interleave.
    MutualExclusion,
    /// An accepted request with a token lower than an earlier accepted one.
    Fencing,
    /// An acknowledged increment missing from the final value.
    LostUpdate,
    /// An increment counted more than once in the final value.
    DoubledUpdate,
    /// A reader's accepted read inside an exclusive hold's accepted requests.
    ReaderWriter,
    /// A client told its lock was held after an excluding hold with a greater token was granted.
    HeldAfterTaken,
    /// More clients told they held a semaphore slot at once than the semaphore admits.
    OverAdmitted,
    /// A hold whose token is not greater than that of a hold granted before it was asked for.
    TokenOrder,
}

impl ViolationKind {
    /// The name the report prints.
    pub fn name(self) -> &'static str {
        match self {
            ViolationKind::MutualExclusion => "mutual-exclusion",
            ViolationKind::Fencing => "fencing",
            ViolationKind::LostUpdate => "lost-update",
            ViolationKind::DoubledUpdate => "doubled-update",
            ViolationKind::ReaderWriter => "reader-in-writer",
            ViolationKind::HeldAfterTaken => "held-after-taken",
            ViolationKind::OverAdmitted => "over-admitted",
            ViolationKind::TokenOrder => "token-order",
        }
    }

    /// Every kind, in report order.
    pub const ALL: [ViolationKind; 8] = [
        ViolationKind::MutualExclusion,
        ViolationKind::Fencing,
        ViolationKind::LostUpdate,
        ViolationKind::DoubledUpdate,
        ViolationKind::ReaderWriter,
        ViolationKind::HeldAfterTaken,
        ViolationKind::OverAdmitted,
        ViolationKind::TokenOrder,
    ];
}

/// One violation, with what shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// What was violated.
    pub kind: ViolationKind,
    /// On which key.
    pub key: String,
    /// One sentence on what happened.
    pub detail: String,
    /// The operations that show it (register entries and client operations).
    pub ops: Vec<Event>,
    /// The faults active at the time (their start events).
    pub faults: Vec<FaultEvent>,
    /// Why the provider's documented guarantees allow it, when they do: it then fails nothing.
    pub expected: Option<String>,
}

/// Counts of what a history holds, for the report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Finished client operations by kind and outcome (ok, fail, info), incomplete ones as info.
    pub ops: BTreeMap<(String, String), u64>,
    /// Register requests accepted.
    pub accepted: u64,
    /// Register requests refused for a stale token.
    pub refused: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u64>,
}

/// The checker's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// What the history holds.
    pub tally: Tally,
    /// Every violation found.
    pub violations: Vec<Violation>,
}

impl Report {
    /// How many violations of `kind` the guarantees do not allow.
    pub fn count(&self, kind: ViolationKind) -> usize {
        self.violations
            .iter()
            .filter(|v| v.kind == kind && v.expected.is_none())
            .count()
    }

    /// How many violations of `kind` the provider's documented guarantees allow.
    pub fn expected(&self, kind: ViolationKind) -> usize {
        self.violations
            .iter()
            .filter(|v| v.kind == kind && v.expected.is_some())
            .count()
    }

    /// Whether no violation breaks a guarantee.
    pub fn passed(&self) -> bool {
        self.violations.iter().all(|v| v.expected.is_some())
    }
}

/// What the provider under check promises, for the violations its guarantees allow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Guarantees {
    /// Locks are held by a server session (PostgreSQL): a session the server ends under a fault
    /// frees the lock at once, and its holder learns it at its next check.
    pub session_held: bool,
    /// A server restart loses every lock (Redis without persistence; Azurite, which keeps no
    /// lease across its restart): each holder learns it at its next renewal.
    pub restart_loses_locks: bool,
}

/// Checks a whole history, allowing nothing.
pub fn check(events: &[Event]) -> Report {
    check_with(events, Guarantees::default())
}

/// Checks a whole history of a provider with these guarantees.
pub fn check_with(events: &[Event], guarantees: Guarantees) -> Report {
    let faults = fault_spans(events);
    let mut register: Vec<&RegisterEntry> = events
        .iter()
        .filter_map(|e| match e {
            Event::Register(entry) => Some(entry),
            _ => None,
        })
        .collect();
    register.sort_by_key(|e| e.seq);

    let mut violations = Vec::new();
    violations.extend(check_mutual_exclusion(&register, &faults));
    violations.extend(check_fencing(&register, &faults));
    violations.extend(check_readers(&register, &faults));
    let ops = complete_ops(events);
    violations.extend(check_updates(events, &ops, &faults));
    violations.extend(beliefs::check_held_after_taken(events, &faults, guarantees));
    violations.extend(beliefs::check_over_admission(events, &faults, guarantees));
    violations.extend(beliefs::check_token_order(&ops, &faults));
    // What breaks a guarantee first.
    violations.sort_by_key(|v| v.expected.is_some());

    let mut tally = Tally::default();
    for op in &ops {
        let outcome = match op.outcome {
            Phase::Ok => "ok",
            Phase::Fail => "fail",
            Phase::Info | Phase::Invoke => "info",
        };
        let name = format!("{:?}", op.invoke.op).to_lowercase();
        *tally.ops.entry((name, outcome.to_string())).or_default() += 1;
    }
    for entry in &register {
        if entry.accepted {
            tally.accepted += 1;
        } else {
            tally.refused += 1;
        }
    }
    for span in &faults {
        *tally.faults.entry(span.start.fault).or_default() += 1;
    }
    Report { tally, violations }
}

/// The register-only checks (mutual exclusion and fencing), for progress lines while a run
/// goes on: they need neither the clients' histories nor the final values.
pub fn check_register(entries: &[RegisterEntry]) -> usize {
    let mut sorted: Vec<&RegisterEntry> = entries.iter().collect();
    sorted.sort_by_key(|e| e.seq);
    check_mutual_exclusion(&sorted, &[]).len() + check_fencing(&sorted, &[]).len()
}

/// A fault from its start to its end (or the end of the run).
pub(crate) struct FaultSpan {
    start: FaultEvent,
    end: u64,
}

fn fault_spans(events: &[Event]) -> Vec<FaultSpan> {
    let mut spans: Vec<FaultSpan> = Vec::new();
    let mut open: HashMap<u64, usize> = HashMap::new();
    for event in events {
        let Event::Nemesis(fault) = event else {
            continue;
        };
        match fault.phase {
            FaultPhase::Start => {
                open.insert(fault.id, spans.len());
                spans.push(FaultSpan {
                    start: fault.clone(),
                    end: u64::MAX,
                });
            }
            FaultPhase::End => {
                if let Some(&index) = open.get(&fault.id) {
                    spans[index].end = fault.time;
                }
            }
        }
    }
    spans
}

/// The faults active between `from` and `to`, or ended less than the margin before `from`.
pub(crate) fn active_faults(faults: &[FaultSpan], from: u64, to: u64) -> Vec<FaultEvent> {
    faults
        .iter()
        .filter(|f| f.start.time <= to && f.end.saturating_add(FAULT_MARGIN_NS) >= from)
        .map(|f| f.start.clone())
        .collect()
}

pub(crate) fn with_faults(
    kind: ViolationKind,
    key: &str,
    detail: String,
    mut ops: Vec<Event>,
    faults: &[FaultSpan],
) -> Violation {
    let times = ops.iter().filter_map(event_time);
    let from = times.clone().min().unwrap_or(0);
    let to = times.max().unwrap_or(u64::MAX);
    ops.truncate(OPS_SHOWN);
    Violation {
        kind,
        key: key.to_string(),
        detail,
        ops,
        faults: active_faults(faults, from, to),
        expected: None,
    }
}

fn event_time(event: &Event) -> Option<u64> {
    match event {
        Event::Op(op) => Some(op.time),
        Event::Register(entry) => Some(entry.time),
        Event::Nemesis(fault) => Some(fault.time),
        Event::Final { .. } => None,
    }
}

/// The accepted entries of each key, in the register's order.
fn by_key<'a>(register: &[&'a RegisterEntry]) -> BTreeMap<&'a str, Vec<&'a RegisterEntry>> {
    let mut keys: BTreeMap<&str, Vec<&RegisterEntry>> = BTreeMap::new();
    for entry in register.iter().filter(|e| e.accepted) {
        keys.entry(entry.key.as_str()).or_default().push(entry);
    }
    keys
}

/// Each exclusive hold's first and last accepted request, in the register's order (positions
/// in `accepted`), in order of their first request.
fn exclusive_holds(accepted: &[&RegisterEntry]) -> Vec<((u32, u64), usize, usize)> {
    let mut holds: Vec<((u32, u64), usize, usize)> = Vec::new();
    let mut index_of: HashMap<(u32, u64), usize> = HashMap::new();
    for (at, entry) in accepted.iter().enumerate().filter(|(_, e)| !e.shared) {
        let hold = (entry.process, entry.token);
        match index_of.get(&hold) {
            Some(&i) => holds[i].2 = at,
            None => {
                index_of.insert(hold, holds.len());
                holds.push((hold, at, at));
            }
        }
    }
    holds
}

/// A reader's accepted read between an exclusive hold's first and last accepted requests.
fn check_readers(register: &[&RegisterEntry], faults: &[FaultSpan]) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (key, accepted) in by_key(register) {
        for (hold, first, last) in exclusive_holds(&accepted) {
            let inside = accepted[first..=last].iter().find(|e| e.shared);
            if let Some(reader) = inside {
                violations.push(with_faults(
                    ViolationKind::ReaderWriter,
                    key,
                    format!(
                        "reader (process {}, token {}) read inside hold (process {}, token {})",
                        reader.process, reader.token, hold.0, hold.1
                    ),
                    vec![
                        Event::Register(accepted[first].clone()),
                        Event::Register((*reader).clone()),
                        Event::Register(accepted[last].clone()),
                    ],
                    faults,
                ));
            }
        }
    }
    violations
}

fn check_mutual_exclusion(register: &[&RegisterEntry], faults: &[FaultSpan]) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (key, accepted) in by_key(register) {
        let holds = exclusive_holds(&accepted);
        // Holds are in order of their first request; one that starts before the latest-ending
        // earlier hold has ended interleaves with it. One violation per earlier hold, however
        // many later holds it straddles (a stale holder let in late straddles them all).
        let mut widest: Option<((u32, u64), usize)> = None;
        let mut reported: HashMap<(u32, u64), (usize, usize)> = HashMap::new();
        for &(hold, first, last) in &holds {
            if let Some((earlier, earlier_last)) = widest {
                if first < earlier_last {
                    if let Some((index, straddled)) = reported.get_mut(&earlier) {
                        *straddled += 1;
                        let violation: &mut Violation = &mut violations[*index];
                        violation.detail = straddle_detail(earlier, *straddled);
                    } else {
                        // The overlap: from the later hold's first request to the earlier's last.
                        let ops = accepted[first..=earlier_last]
                            .iter()
                            .filter(|e| [earlier, hold].contains(&(e.process, e.token)))
                            .map(|e| Event::Register((*e).clone()))
                            .collect();
                        reported.insert(earlier, (violations.len(), 1));
                        violations.push(with_faults(
                            ViolationKind::MutualExclusion,
                            key,
                            straddle_detail(earlier, 1),
                            ops,
                            faults,
                        ));
                    }
                }
            }
            if widest.is_none_or(|(_, end)| last > end) {
                widest = Some((hold, last));
            }
        }
    }
    violations
}

fn straddle_detail(hold: (u32, u64), straddled: usize) -> String {
    format!(
        "hold (process {}, token {}) was accepted after {straddled} later hold(s) began",
        hold.0, hold.1
    )
}

fn check_fencing(register: &[&RegisterEntry], faults: &[FaultSpan]) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (key, accepted) in by_key(register) {
        // A reader is fenced by exclusive holds only; an exclusive hold by every hold.
        let mut highest: Option<&RegisterEntry> = None;
        let mut highest_exclusive: Option<&RegisterEntry> = None;
        for entry in accepted {
            let floor = if entry.shared {
                highest_exclusive
            } else {
                highest
            };
            match floor {
                Some(top) if entry.token < top.token => violations.push(with_faults(
                    ViolationKind::Fencing,
                    key,
                    format!(
                        "{:?} with token {} accepted after token {} was",
                        entry.access, entry.token, top.token
                    ),
                    vec![Event::Register(top.clone()), Event::Register(entry.clone())],
                    faults,
                )),
                _ => {
                    if highest.is_none_or(|top| entry.token > top.token) {
                        highest = Some(entry);
                    }
                    let exclusive_top = highest_exclusive.is_none_or(|top| entry.token > top.token);
                    if !entry.shared && exclusive_top {
                        highest_exclusive = Some(entry);
                    }
                }
            }
        }
    }
    violations
}

/// A client operation and how it finished (`Invoke` when it never did).
pub(crate) struct CompleteOp<'a> {
    pub(crate) invoke: &'a OpEvent,
    pub(crate) completion: Option<&'a OpEvent>,
    pub(crate) outcome: Phase,
}

/// Pairs each invoke with its completion: a client process runs one operation at a time, so
/// the next event of the same process finishes it. An invoke followed by another invoke, or by
/// nothing, never finished (its process was killed): its outcome is unknown.
fn complete_ops(events: &[Event]) -> Vec<CompleteOp<'_>> {
    let mut ops = Vec::new();
    let mut pending: HashMap<u32, &OpEvent> = HashMap::new();
    for event in events {
        let Event::Op(op) = event else {
            continue;
        };
        match op.phase {
            Phase::Invoke => {
                if let Some(unfinished) = pending.insert(op.process, op) {
                    ops.push(CompleteOp {
                        invoke: unfinished,
                        completion: None,
                        outcome: Phase::Invoke,
                    });
                }
            }
            outcome => {
                if let Some(invoke) = pending.remove(&op.process) {
                    ops.push(CompleteOp {
                        invoke,
                        completion: Some(op),
                        outcome,
                    });
                }
            }
        }
    }
    let mut unfinished: Vec<&OpEvent> = pending.into_values().collect();
    unfinished.sort_by_key(|op| (op.time, op.process));
    ops.extend(unfinished.into_iter().map(|invoke| CompleteOp {
        invoke,
        completion: None,
        outcome: Phase::Invoke,
    }));
    ops
}

fn check_updates(events: &[Event], ops: &[CompleteOp<'_>], faults: &[FaultSpan]) -> Vec<Violation> {
    let mut violations = Vec::new();
    let finals: BTreeMap<&str, u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Final { key, value } => Some((key.as_str(), *value)),
            _ => None,
        })
        .collect();
    let mut acknowledged: BTreeMap<&str, Vec<&OpEvent>> = BTreeMap::new();
    let mut unknown: BTreeMap<&str, u64> = BTreeMap::new();
    for op in ops.iter().filter(|op| op.invoke.op == OpKind::Write) {
        let key = op.invoke.key.as_str();
        match (op.outcome, op.completion) {
            (Phase::Ok, Some(done)) => acknowledged.entry(key).or_default().push(done),
            (Phase::Info | Phase::Invoke, _) => *unknown.entry(key).or_default() += 1,
            _ => {}
        }
    }
    let mut keys: Vec<&str> = finals.keys().copied().collect();
    keys.extend(acknowledged.keys().copied());
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let acked = acknowledged.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let maybe = unknown.get(key).copied().unwrap_or(0);
        let acked_count = acked.len() as u64;
        let Some(&last) = finals.get(key) else {
            continue;
        };
        // Two acknowledged writes of one value: the later overwrote the earlier's increment.
        let mut by_value: BTreeMap<Option<u64>, Vec<&OpEvent>> = BTreeMap::new();
        for op in acked {
            by_value.entry(op.value).or_default().push(op);
        }
        for (value, same) in by_value.iter().filter(|(_, same)| same.len() > 1) {
            violations.push(with_faults(
                ViolationKind::LostUpdate,
                key,
                format!(
                    "{} acknowledged writes of value {} (an increment overwritten)",
                    same.len(),
                    value.map_or_else(|| "?".to_string(), |v| v.to_string())
                ),
                same.iter().map(|op| Event::Op((*op).clone())).collect(),
                faults,
            ));
        }
        let recent = || {
            acked
                .iter()
                .rev()
                .take(OPS_SHOWN)
                .rev()
                .map(|op| Event::Op((*op).clone()))
                .collect::<Vec<_>>()
        };
        if last < acked_count {
            violations.push(with_faults(
                ViolationKind::LostUpdate,
                key,
                format!("final value {last} < {acked_count} acknowledged increments"),
                recent(),
                faults,
            ));
        } else if last > acked_count + maybe {
            violations.push(with_faults(
                ViolationKind::DoubledUpdate,
                key,
                format!(
                    "final value {last} > {acked_count} acknowledged + {maybe} unknown increments"
                ),
                recent(),
                faults,
            ));
        }
    }
    violations
}

mod beliefs;

#[cfg(test)]
mod tests;
