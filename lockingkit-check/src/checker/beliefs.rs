//! The checks on what clients were told rather than what the register accepted: a holder told
//! its lock was held after another hold took the key, more semaphore holders told they held a
//! slot than the semaphore admits, and tokens that did not grow.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::ViolationKind;
use super::{active_faults, with_faults, CompleteOp, FaultSpan, Guarantees, Violation};
use crate::history::{Event, FaultEvent, FaultKind, OpEvent, OpKind, Phase};

/// Every granted hold's acquire completion, by key, in order of time.
fn grants(events: &[Event]) -> BTreeMap<&str, Vec<&OpEvent>> {
    let mut grants: BTreeMap<&str, Vec<&OpEvent>> = BTreeMap::new();
    for event in events {
        if let Event::Op(op) = event {
            let slot = op.permits.is_some();
            if op.op == OpKind::Acquire && op.phase == Phase::Ok && op.token.is_some() && !slot {
                grants.entry(op.key.as_str()).or_default().push(op);
            }
        }
    }
    for list in grants.values_mut() {
        list.sort_by_key(|op| op.time);
    }
    grants
}

/// A register request's invoke at which the client's lock said it was held (a semaphore slot's
/// included).
fn says_held(op: &OpEvent) -> bool {
    op.phase == Phase::Invoke
        && matches!(op.op, OpKind::Read | OpKind::Write)
        && op.held == Some(true)
        && op.token.is_some()
}

/// A belief that another hold's grant can contradict: a semaphore slot's token grows per slot,
/// so it says nothing of another slot's; slots are counted instead.
fn is_belief(op: &OpEvent) -> bool {
    says_held(op) && op.permits.is_none()
}

/// Beliefs of holding after an excluding hold with a greater token was granted: one violation
/// per hold, at its first such belief.
pub(crate) fn check_held_after_taken(
    events: &[Event],
    faults: &[FaultSpan],
    guarantees: Guarantees,
) -> Vec<Violation> {
    let grants = grants(events);
    let mut reported: HashSet<(u32, u64)> = HashSet::new();
    let mut violations = Vec::new();
    for event in events {
        let Event::Op(belief) = event else {
            continue;
        };
        let token = belief.token.unwrap_or(0);
        if !is_belief(belief) || reported.contains(&(belief.process, token)) {
            continue;
        }
        let Some(list) = grants.get(belief.key.as_str()) else {
            continue;
        };
        // Granted (its answer recorded) before the client asked whether it held.
        let before = list.partition_point(|g| g.time < belief.time);
        let taker = list[..before]
            .iter()
            .filter(|g| !(g.shared && belief.shared) && g.token.unwrap_or(0) > token)
            .min_by_key(|g| g.time);
        let Some(taker) = taker else {
            continue;
        };
        reported.insert((belief.process, token));
        let (accepted, refused) = requests_after(events, belief, taker.time);
        let mut violation = with_faults(
            ViolationKind::HeldAfterTaken,
            &belief.key,
            format!(
                "process {} was told its hold (token {token}) was held {} ms after process {} \
                 was granted token {}; the register then accepted {accepted} and refused \
                 {refused} of its requests",
                belief.process,
                belief.time.saturating_sub(taker.time) / 1_000_000,
                taker.process,
                taker.token.unwrap_or(0)
            ),
            vec![Event::Op((*taker).clone()), Event::Op(belief.clone())],
            faults,
        );
        // Only a fault begun by the grant can have freed the key for it.
        let on_holder: Vec<FaultEvent> = active_faults(faults, taker.time, belief.time)
            .into_iter()
            .filter(|f| f.time <= taker.time)
            .filter(|f| f.fault.hits_server() || f.process == Some(belief.process))
            .collect();
        violation.expected = allowed_by(guarantees, &on_holder);
        violations.push(violation);
    }
    violations
}

/// How many register requests of `belief`'s hold after `since` were accepted, and refused.
fn requests_after(events: &[Event], belief: &OpEvent, since: u64) -> (usize, usize) {
    let mut counts = (0, 0);
    for event in events {
        if let Event::Register(entry) = event {
            let same = entry.process == belief.process
                && Some(entry.token) == belief.token
                && entry.key == belief.key;
            if same && entry.time > since {
                if entry.accepted {
                    counts.0 += 1;
                } else {
                    counts.1 += 1;
                }
            }
        }
    }
    counts
}

/// The slowest clock rate, in percent of real time, at which a lease's deadline (90% of the
/// lease on the client's clock) still comes before the lease ends on the server's.
pub(crate) const SLOWEST_SAFE_RATE_PERCENT: u32 = 90;

/// Why `guarantees` allow a holder to believe it holds after the key was taken, given the
/// faults that struck it or the server: `None` when they do not.
fn allowed_by(guarantees: Guarantees, faults: &[FaultEvent]) -> Option<String> {
    let slow = faults.iter().find_map(|f| {
        (f.fault == FaultKind::ClockRate)
            .then_some(f.rate_percent)
            .flatten()
            .filter(|&rate| rate < SLOWEST_SAFE_RATE_PERCENT)
    });
    if let Some(rate) = slow {
        return Some(format!(
            "the holder's clock ran at {rate}% of real time, beyond the documented 10% margin: \
             its deadline, 90% of the lease on its clock, came after the lease ended"
        ));
    }
    if guarantees.session_held {
        if let Some(fault) = faults.first() {
            return Some(format!(
                "a session-held lock that the server freed under a fault ({}) is seen lost at \
                 the holder's next check",
                fault.fault.name()
            ));
        }
    }
    let crashed = faults.iter().any(|f| f.fault == FaultKind::ServerCrash);
    if guarantees.restart_loses_locks && crashed {
        return Some(
            "the server's restart lost every lock (a Redis without persistence; Azurite, which \
             keeps no lease across a restart); the holder learns it at its next renewal"
                .to_string(),
        );
    }
    None
}

/// Holds whose token is not greater than one granted (answered) before the hold was asked for.
pub(crate) fn check_token_order(ops: &[CompleteOp<'_>], faults: &[FaultSpan]) -> Vec<Violation> {
    // Each key's grants as (invoke, completion), in order of completion.
    let mut by_key: BTreeMap<&str, Vec<(&OpEvent, &OpEvent)>> = BTreeMap::new();
    for op in ops {
        if let (OpKind::Acquire, Phase::Ok, Some(done)) = (op.invoke.op, op.outcome, op.completion)
        {
            // Slots number their tokens apart: two slots' tokens are not ordered.
            if done.token.is_some() && done.permits.is_none() {
                by_key
                    .entry(done.key.as_str())
                    .or_default()
                    .push((op.invoke, done));
            }
        }
    }
    let mut violations = Vec::new();
    for (key, mut list) in by_key {
        list.sort_by_key(|(_, done)| done.time);
        // The grant with the greatest token among the first n, for every n.
        let mut greatest: Vec<&OpEvent> = Vec::with_capacity(list.len());
        for (_, done) in &list {
            let top = match greatest.last() {
                Some(top) if top.token >= done.token => *top,
                _ => *done,
            };
            greatest.push(top);
        }
        for (invoke, done) in &list {
            let before = list.partition_point(|(_, earlier)| earlier.time < invoke.time);
            let Some(top) = before.checked_sub(1).map(|i| greatest[i]) else {
                continue;
            };
            if top.token >= done.token {
                violations.push(with_faults(
                    ViolationKind::TokenOrder,
                    key,
                    format!(
                        "token {} granted to process {} is not above token {} granted to \
                         process {} before it asked",
                        done.token.unwrap_or(0),
                        done.process,
                        top.token.unwrap_or(0),
                        top.process
                    ),
                    vec![Event::Op(top.clone()), Event::Op((*done).clone())],
                    faults,
                ));
            }
        }
    }
    violations
}

/// A semaphore slot's hold, over the span in which its client certainly believed it held it:
/// from its grant's answer to the last request at which its lock said it was held.
struct SlotHold<'a> {
    grant: &'a OpEvent,
    last: &'a OpEvent,
}

/// Every semaphore hold with a belief after its grant, by key. A process runs one hold at a
/// time: a grant opens it, and the process's next acquire or release closes it.
fn slot_holds(events: &[Event]) -> BTreeMap<&str, Vec<SlotHold<'_>>> {
    let mut open: HashMap<u32, (&OpEvent, Option<&OpEvent>)> = HashMap::new();
    let mut holds: BTreeMap<&str, Vec<SlotHold<'_>>> = BTreeMap::new();
    for event in events {
        let Event::Op(op) = event else {
            continue;
        };
        let starts = op.op == OpKind::Acquire && op.phase == Phase::Invoke;
        if starts || op.op == OpKind::Release {
            close(open.remove(&op.process), &mut holds);
        } else if op.op == OpKind::Acquire && op.phase == Phase::Ok && op.permits.is_some() {
            close(open.insert(op.process, (op, None)), &mut holds);
        } else if says_held(op) && op.permits.is_some() {
            if let Some((grant, last)) = open.get_mut(&op.process) {
                if grant.key == op.key && grant.token == op.token {
                    *last = Some(op);
                }
            }
        }
    }
    let mut rest: Vec<_> = open.into_values().collect();
    rest.sort_by_key(|(grant, _)| (grant.time, grant.process));
    for hold in rest {
        close(Some(hold), &mut holds);
    }
    holds
}

/// Files a closed slot hold under its key, if its client was ever told it held it.
fn close<'a>(
    hold: Option<(&'a OpEvent, Option<&'a OpEvent>)>,
    holds: &mut BTreeMap<&'a str, Vec<SlotHold<'a>>>,
) {
    if let Some((grant, Some(last))) = hold {
        holds
            .entry(grant.key.as_str())
            .or_default()
            .push(SlotHold { grant, last });
    }
}

/// More clients told they held a slot of a semaphore, at one instant, than it admits. Each
/// hold counts from its grant's answer to its last request at which the lock said it was held:
/// its client believed it held the slot all that time. One violation per grant that took the
/// count over; expected when enough of the holds it met were stale for a reason the provider's
/// guarantees allow.
pub(crate) fn check_over_admission(
    events: &[Event],
    faults: &[FaultSpan],
    guarantees: Guarantees,
) -> Vec<Violation> {
    let mut violations = Vec::new();
    for (key, mut holds) in slot_holds(events) {
        holds.sort_by_key(|h| (h.grant.time, h.grant.process));
        let mut active: Vec<&SlotHold<'_>> = Vec::new();
        for hold in &holds {
            let start = hold.grant.time;
            active.retain(|earlier| earlier.last.time > start);
            let permits = hold.grant.permits.unwrap_or(u32::MAX) as usize;
            if active.len() >= permits {
                violations.push(over_admitted(key, hold, &active, faults, guarantees));
            }
            active.push(hold);
        }
    }
    violations
}

fn over_admitted(
    key: &str,
    hold: &SlotHold<'_>,
    active: &[&SlotHold<'_>],
    faults: &[FaultSpan],
    guarantees: Guarantees,
) -> Violation {
    let start = hold.grant.time;
    let permits = hold.grant.permits.unwrap_or(0) as usize;
    let others: Vec<String> = active
        .iter()
        .map(|h| format!("{} (token {})", h.grant.process, h.grant.token.unwrap_or(0)))
        .collect();
    let mut ops = vec![Event::Op(hold.grant.clone())];
    for earlier in active {
        ops.push(Event::Op(earlier.grant.clone()));
        ops.push(Event::Op(earlier.last.clone()));
    }
    let mut violation = with_faults(
        ViolationKind::OverAdmitted,
        key,
        format!(
            "{} holders of a semaphore of {permits} at once: process {} was granted a slot \
             (token {}) while processes {} were still told they held theirs",
            active.len() + 1,
            hold.grant.process,
            hold.grant.token.unwrap_or(0),
            others.join(", ")
        ),
        ops,
        faults,
    );
    // Excused when, leaving out the holds whose staleness the guarantees allow, the rest fit.
    let reasons: Vec<String> = active
        .iter()
        .filter_map(|earlier| {
            // Only a fault begun by the grant can have freed a slot for it.
            let on_holder: Vec<FaultEvent> = active_faults(faults, start, earlier.last.time)
                .into_iter()
                .filter(|f| f.time <= start)
                .filter(|f| f.fault.hits_server() || f.process == Some(earlier.grant.process))
                .collect();
            allowed_by(guarantees, &on_holder)
        })
        .collect();
    if active.len() + 1 - reasons.len() <= permits {
        violation.expected = reasons.into_iter().next();
    }
    violation
}
