//! The verdict on a history: a pure function of its events.
//!
//! Three properties, each from the evidence that can prove it broken:
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
}

impl ViolationKind {
    /// The name the report prints.
    pub fn name(self) -> &'static str {
        match self {
            ViolationKind::MutualExclusion => "mutual-exclusion",
            ViolationKind::Fencing => "fencing",
            ViolationKind::LostUpdate => "lost-update",
            ViolationKind::DoubledUpdate => "doubled-update",
        }
    }

    /// Every kind, in report order.
    pub const ALL: [ViolationKind; 4] = [
        ViolationKind::MutualExclusion,
        ViolationKind::Fencing,
        ViolationKind::LostUpdate,
        ViolationKind::DoubledUpdate,
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
    /// How many violations of `kind`.
    pub fn count(&self, kind: ViolationKind) -> usize {
        self.violations.iter().filter(|v| v.kind == kind).count()
    }
}

/// Checks a whole history.
pub fn check(events: &[Event]) -> Report {
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
    let ops = complete_ops(events);
    violations.extend(check_updates(events, &ops, &faults));

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
struct FaultSpan {
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
fn active_faults(faults: &[FaultSpan], from: u64, to: u64) -> Vec<FaultEvent> {
    faults
        .iter()
        .filter(|f| f.start.time <= to && f.end.saturating_add(FAULT_MARGIN_NS) >= from)
        .map(|f| f.start.clone())
        .collect()
}

fn with_faults(
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

fn by_key<'a>(register: &[&'a RegisterEntry]) -> BTreeMap<&'a str, Vec<&'a RegisterEntry>> {
    let mut keys: BTreeMap<&str, Vec<&RegisterEntry>> = BTreeMap::new();
    for entry in register.iter().filter(|e| e.accepted) {
        keys.entry(entry.key.as_str()).or_default().push(entry);
    }
    keys
}

fn check_mutual_exclusion(register: &[&RegisterEntry], faults: &[FaultSpan]) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (key, accepted) in by_key(register) {
        // Each hold's first and last accepted request, in the register's order.
        let mut holds: Vec<((u32, u64), usize, usize)> = Vec::new();
        let mut index_of: HashMap<(u32, u64), usize> = HashMap::new();
        for (at, entry) in accepted.iter().enumerate() {
            let hold = (entry.process, entry.token);
            match index_of.get(&hold) {
                Some(&i) => holds[i].2 = at,
                None => {
                    index_of.insert(hold, holds.len());
                    holds.push((hold, at, at));
                }
            }
        }
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
        let mut highest: Option<&RegisterEntry> = None;
        for entry in accepted {
            match highest {
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
                Some(top) if entry.token == top.token => {}
                _ => highest = Some(entry),
            }
        }
    }
    violations
}

/// A client operation and how it finished (`Invoke` when it never did).
struct CompleteOp<'a> {
    invoke: &'a OpEvent,
    completion: Option<&'a OpEvent>,
    outcome: Phase,
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

#[cfg(test)]
mod tests;
