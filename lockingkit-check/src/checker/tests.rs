//! The checker on small synthetic histories: a clean one passes, and each kind of violation is
//! found. These are what show the checker can fail.

use super::*;
use crate::history::{Access, Event, FaultEvent, FaultKind, FaultPhase, OpEvent, OpKind, Phase};

/// Builds a history as a run would write it: the register's answers in order, the clients'
/// operations, the faults, the final values.
#[derive(Default)]
struct Script {
    events: Vec<Event>,
    seq: u64,
    time: u64,
}

impl Script {
    fn tick(&mut self) -> u64 {
        self.time += 1_000;
        self.time
    }

    fn op(&mut self, process: u32, phase: Phase, op: OpKind, token: u64, value: Option<u64>) {
        let time = self.tick();
        self.events.push(Event::Op(OpEvent {
            time,
            process,
            phase,
            op,
            key: "k".into(),
            token: Some(token),
            value,
            error: None,
            shared: false,
            permits: None,
            held: None,
        }));
    }

    fn register(&mut self, process: u32, access: Access, token: u64, value: u64, accepted: bool) {
        let time = self.tick();
        self.events.push(Event::Register(RegisterEntry {
            seq: self.seq,
            time,
            process,
            key: "k".into(),
            access,
            token,
            value,
            accepted,
            shared: false,
        }));
        self.seq += 1;
    }

    /// A whole increment by `process` holding `token`: read `value`, write `value + 1`, both
    /// accepted and acknowledged.
    fn increment(&mut self, process: u32, token: u64, value: u64) {
        self.op(process, Phase::Invoke, OpKind::Read, token, None);
        self.register(process, Access::Read, token, value, true);
        self.op(process, Phase::Ok, OpKind::Read, token, Some(value));
        self.write(process, token, value + 1, Phase::Ok);
    }

    fn write(&mut self, process: u32, token: u64, value: u64, outcome: Phase) {
        self.op(process, Phase::Invoke, OpKind::Write, token, Some(value));
        self.register(process, Access::Write, token, value, outcome != Phase::Fail);
        self.op(process, outcome, OpKind::Write, token, Some(value));
    }

    fn fault(&mut self, id: u64, fault: FaultKind, phase: FaultPhase) {
        let time = self.tick();
        self.events.push(Event::Nemesis(FaultEvent {
            time,
            id,
            fault,
            slot: 0,
            process: Some(1),
            phase,
            rate_percent: None,
        }));
    }

    fn finish(mut self, value: u64) -> Vec<Event> {
        self.events.push(Event::Final {
            key: "k".into(),
            value,
        });
        self.events
    }
}

/// A provider whose locks are held by server sessions (PostgreSQL).
const SESSION_HELD: Guarantees = Guarantees {
    session_held: true,
    restart_loses_locks: false,
};

fn kinds(report: &Report) -> Vec<ViolationKind> {
    let mut kinds: Vec<_> = report.violations.iter().map(|v| v.kind).collect();
    kinds.dedup();
    kinds
}

#[test]
fn a_clean_history_with_a_refused_stale_holder_passes() {
    let mut s = Script::default();
    s.increment(1, 1, 0);
    s.fault(0, FaultKind::PauseLong, FaultPhase::Start);
    s.increment(2, 2, 1);
    s.fault(0, FaultKind::PauseLong, FaultPhase::End);
    // The paused holder of token 1 wakes and writes: refused, and it knows it.
    s.write(1, 1, 2, Phase::Fail);
    s.increment(3, 3, 2);
    let report = check(&s.finish(3));
    assert_eq!(report.violations, vec![]);
    assert_eq!(report.tally.refused, 1);
    assert_eq!(report.tally.faults.get(&FaultKind::PauseLong), Some(&1));
}

#[test]
fn an_unknown_write_may_or_may_not_count() {
    for last in [1, 2] {
        let mut s = Script::default();
        s.increment(1, 1, 0);
        s.op(2, Phase::Invoke, OpKind::Read, 2, None);
        s.register(2, Access::Read, 2, 1, true);
        s.op(2, Phase::Ok, OpKind::Read, 2, Some(1));
        // Process 2 is killed with its write in flight: the invoke never finishes.
        s.op(2, Phase::Invoke, OpKind::Write, 2, Some(2));
        if last == 2 {
            s.register(2, Access::Write, 2, 2, true);
        }
        assert_eq!(check(&s.finish(last)).violations, vec![], "final {last}");
    }
}

#[test]
fn interleaved_holds_with_one_token_are_a_mutual_exclusion_violation() {
    // Two processes were handed the same token (a lock that let both in): the register cannot
    // tell them apart by token, so only the hold interleaving shows it.
    let mut s = Script::default();
    s.op(1, Phase::Invoke, OpKind::Read, 5, None);
    s.register(1, Access::Read, 5, 0, true);
    s.op(1, Phase::Ok, OpKind::Read, 5, Some(0));
    s.fault(7, FaultKind::Blackhole, FaultPhase::Start);
    s.increment(2, 5, 0);
    s.write(1, 5, 1, Phase::Ok);
    let report = check(&s.finish(1));
    assert!(kinds(&report).contains(&ViolationKind::MutualExclusion));
    let violation = &report.violations[0];
    assert_eq!(violation.kind, ViolationKind::MutualExclusion);
    assert_eq!(violation.faults.len(), 1, "the blackhole was active");
    assert_eq!(violation.faults[0].fault, FaultKind::Blackhole);
    // Both holders' interleaved requests are listed.
    assert!(violation.ops.len() >= 3);
}

#[test]
fn an_accepted_stale_token_is_a_fencing_violation() {
    let mut s = Script::default();
    s.op(1, Phase::Invoke, OpKind::Read, 1, None);
    s.register(1, Access::Read, 1, 0, true);
    s.op(1, Phase::Ok, OpKind::Read, 1, Some(0));
    s.increment(2, 2, 0);
    // A register that forgot its rule accepts token 1 after token 2.
    s.write(1, 1, 1, Phase::Ok);
    let report = check(&s.finish(1));
    assert_eq!(report.count(ViolationKind::Fencing), 1);
    assert!(report.count(ViolationKind::MutualExclusion) >= 1);
    assert!(report.count(ViolationKind::LostUpdate) >= 1);
}

#[test]
fn a_final_value_below_the_acknowledged_writes_is_a_lost_update() {
    let mut s = Script::default();
    s.increment(1, 1, 0);
    s.increment(2, 2, 1);
    // The register's value went missing: nothing in the register log shows it, only the count.
    let report = check(&s.finish(1));
    assert_eq!(kinds(&report), vec![ViolationKind::LostUpdate]);
}

#[test]
fn two_acknowledged_writes_of_one_value_are_a_lost_update() {
    let mut s = Script::default();
    s.increment(1, 1, 0);
    s.increment(2, 2, 0);
    s.increment(3, 3, 1);
    // Final 2, three acknowledged increments, value 1 written twice.
    let report = check(&s.finish(2));
    assert_eq!(report.count(ViolationKind::LostUpdate), 2);
    assert_eq!(report.count(ViolationKind::Fencing), 0);
}

#[test]
fn a_final_value_above_acknowledged_and_unknown_writes_is_a_doubled_update() {
    let mut s = Script::default();
    s.increment(1, 1, 0);
    s.write(2, 2, 2, Phase::Info);
    let report = check(&s.finish(3));
    assert_eq!(kinds(&report), vec![ViolationKind::DoubledUpdate]);
}

#[test]
fn a_refused_write_does_not_count_as_an_increment() {
    let mut s = Script::default();
    s.increment(1, 2, 0);
    s.write(2, 1, 1, Phase::Fail);
    let report = check(&s.finish(2));
    assert_eq!(kinds(&report), vec![ViolationKind::DoubledUpdate]);
}

#[test]
fn faults_long_over_are_not_blamed() {
    let mut s = Script::default();
    s.fault(1, FaultKind::Kill, FaultPhase::Start);
    s.fault(1, FaultKind::Kill, FaultPhase::End);
    s.time += FAULT_MARGIN_NS * 2;
    s.increment(1, 1, 0);
    let report = check(&s.finish(0));
    assert_eq!(report.violations.len(), 1);
    assert_eq!(report.violations[0].faults, vec![]);
}

#[test]
fn the_register_check_alone_counts_fencing_and_exclusion_violations() {
    let mut s = Script::default();
    s.increment(2, 2, 0);
    s.register(1, Access::Write, 1, 1, true);
    let entries: Vec<RegisterEntry> = s
        .events
        .into_iter()
        .filter_map(|e| match e {
            Event::Register(entry) => Some(entry),
            _ => None,
        })
        .collect();
    assert_eq!(check_register(&entries), 1);
}

#[test]
fn a_stale_hold_let_in_late_is_one_violation_however_many_holds_it_straddles() {
    let mut s = Script::default();
    s.op(1, Phase::Invoke, OpKind::Read, 1, None);
    s.register(1, Access::Read, 1, 0, true);
    s.op(1, Phase::Ok, OpKind::Read, 1, Some(0));
    for (n, token) in (2..6).enumerate() {
        s.increment(2, token, n as u64);
    }
    s.write(1, 1, 1, Phase::Ok);
    let report = check(&s.finish(1));
    assert_eq!(report.count(ViolationKind::MutualExclusion), 1);
    assert!(report.violations[0].detail.contains("4 later hold(s)"));
}

impl Script {
    fn acquire_event(&mut self, process: u32, phase: Phase, token: Option<u64>, shared: bool) {
        let time = self.tick();
        self.events.push(Event::Op(OpEvent {
            time,
            process,
            phase,
            op: OpKind::Acquire,
            key: "k".into(),
            token,
            value: None,
            error: None,
            shared,
            permits: None,
            held: None,
        }));
    }

    /// A granted acquire, invoked and answered with nothing in between.
    fn acquire(&mut self, process: u32, token: u64, shared: bool) {
        self.acquire_event(process, Phase::Invoke, None, shared);
        self.acquire_event(process, Phase::Ok, Some(token), shared);
    }

    /// A read's invoke at which the lock answered `held`.
    fn asks(&mut self, process: u32, token: u64, shared: bool, held: bool) {
        let time = self.tick();
        self.events.push(Event::Op(OpEvent {
            time,
            process,
            phase: Phase::Invoke,
            op: OpKind::Read,
            key: "k".into(),
            token: Some(token),
            value: None,
            error: None,
            shared,
            permits: None,
            held: Some(held),
        }));
    }

    fn shared_read(&mut self, process: u32, token: u64) {
        self.register(process, Access::Read, token, 0, true);
        if let Some(Event::Register(entry)) = self.events.last_mut() {
            entry.shared = true;
        }
    }
}

#[test]
fn a_holder_told_it_holds_after_the_key_was_taken_is_a_violation() {
    for held in [true, false] {
        let mut s = Script::default();
        s.acquire(1, 1, false);
        s.acquire(2, 2, false);
        s.asks(1, 1, false, held);
        let report = check(&s.finish(0));
        let found = usize::from(held);
        assert_eq!(report.count(ViolationKind::HeldAfterTaken), found, "{held}");
        assert_eq!(report.passed(), !held);
    }
}

#[test]
fn readers_told_they_hold_together_are_no_violation_but_a_reader_under_a_writer_is() {
    let mut s = Script::default();
    s.acquire(1, 1, true);
    s.acquire(2, 2, true);
    s.asks(1, 1, true, true);
    assert_eq!(check(&s.events.clone()).violations, vec![]);
    s.acquire(3, 3, false);
    s.asks(2, 2, true, true);
    let report = check(&s.finish(0));
    assert_eq!(kinds(&report), vec![ViolationKind::HeldAfterTaken]);
    assert!(report.violations[0].detail.contains("process 3"));
}

#[test]
fn a_session_freed_under_a_fault_on_its_holder_is_expected_only_with_session_held_locks() {
    let mut s = Script::default();
    s.acquire(1, 1, false);
    s.fault(0, FaultKind::Reset, FaultPhase::Start);
    s.acquire(2, 2, false);
    s.asks(1, 1, false, true);
    s.fault(0, FaultKind::Reset, FaultPhase::End);
    let events = s.finish(0);
    let report = check_with(&events, SESSION_HELD);
    assert_eq!(report.expected(ViolationKind::HeldAfterTaken), 1);
    assert!(report.passed());
    // A lease gives no such excuse: its deadline must pass before the store lets it go.
    assert!(!check(&events).passed());
}

#[test]
fn a_restart_that_loses_locks_excuses_only_the_providers_that_say_so() {
    let mut s = Script::default();
    s.acquire(1, 1, false);
    let time = s.tick();
    s.events.push(Event::Nemesis(FaultEvent {
        time,
        id: 0,
        fault: FaultKind::ServerCrash,
        slot: 0,
        process: None,
        phase: FaultPhase::Start,
        rate_percent: None,
    }));
    s.acquire(2, 2, false);
    s.asks(1, 1, false, true);
    let events = s.finish(0);
    let restart = Guarantees {
        restart_loses_locks: true,
        ..Guarantees::default()
    };
    assert!(check_with(&events, restart).passed());
    assert!(!check(&events).passed());
}

#[test]
fn a_token_not_above_one_granted_before_the_acquire_began_is_out_of_order() {
    let mut s = Script::default();
    // Invoked before the other grants were answered: they raced, any order is fine.
    s.acquire_event(3, Phase::Invoke, None, true);
    s.acquire(1, 5, false);
    s.acquire(2, 6, true);
    s.acquire_event(3, Phase::Ok, Some(4), true);
    assert_eq!(check(&s.events.clone()).violations, vec![]);
    // Invoked after grants of 5 and 6 were answered, yet given 6 again.
    s.acquire(4, 6, true);
    let report = check(&s.finish(0));
    assert_eq!(kinds(&report), vec![ViolationKind::TokenOrder]);
}

#[test]
fn a_readers_read_inside_an_exclusive_hold_is_a_violation() {
    let mut s = Script::default();
    s.register(1, Access::Read, 1, 0, true);
    s.shared_read(2, 2);
    s.register(1, Access::Write, 1, 1, true);
    let report = check(&s.finish(1));
    assert_eq!(report.count(ViolationKind::ReaderWriter), 1);
}

impl Script {
    /// Marks the last event as a semaphore slot's of two permits (and shared, as slots are).
    fn slot(&mut self) {
        if let Some(Event::Op(op)) = self.events.last_mut() {
            op.shared = true;
            op.permits = Some(2);
        }
    }

    /// A granted slot of a semaphore of two.
    fn slot_acquire(&mut self, process: u32, token: u64) {
        self.acquire_event(process, Phase::Invoke, None, true);
        self.slot();
        self.acquire_event(process, Phase::Ok, Some(token), true);
        self.slot();
    }

    /// A slot holder's read, at which its lock answered `held`.
    fn slot_asks(&mut self, process: u32, token: u64, held: bool) {
        self.asks(process, token, true, held);
        self.slot();
    }

    fn slot_release(&mut self, process: u32, token: u64) {
        self.op(process, Phase::Invoke, OpKind::Release, token, None);
        self.slot();
    }
}

#[test]
fn three_holders_told_they_hold_a_semaphore_of_two_at_once_are_over_admitted() {
    let mut s = Script::default();
    s.slot_acquire(1, 1);
    s.slot_acquire(2, 1); // another slot numbers its tokens from 1 too
    s.slot_asks(1, 1, true);
    // A third holder after the first released: two at once, no violation.
    s.slot_release(1, 1);
    s.slot_acquire(3, 2);
    s.slot_asks(2, 1, true);
    s.slot_asks(3, 2, true);
    assert_eq!(check(&s.events.clone()).violations, vec![]);
    // A fourth while the second and third are still told they hold: three at once.
    s.slot_acquire(4, 2);
    s.slot_asks(2, 1, true);
    s.slot_asks(3, 2, true);
    s.slot_asks(4, 2, true);
    let report = check(&s.finish(0));
    assert_eq!(kinds(&report), vec![ViolationKind::OverAdmitted]);
    assert!(report.violations[0].detail.contains("process 4"));
    assert!(!report.passed());
}

#[test]
fn a_slot_holder_no_longer_told_it_holds_does_not_count() {
    let mut s = Script::default();
    s.slot_acquire(1, 1);
    s.slot_acquire(2, 1);
    s.slot_asks(1, 1, true);
    s.slot_asks(2, 1, true);
    s.slot_acquire(3, 2);
    // The first was told its slot was gone: its last belief came before the third's grant.
    s.slot_asks(1, 1, false);
    s.slot_asks(2, 1, true);
    s.slot_asks(3, 2, true);
    assert_eq!(check(&s.finish(0)).violations, vec![]);
}

#[test]
fn a_stale_slot_holder_under_a_session_fault_is_expected_only_with_session_held_locks() {
    let mut s = Script::default();
    s.slot_acquire(1, 1);
    s.slot_acquire(2, 1);
    s.fault(0, FaultKind::Reset, FaultPhase::Start);
    s.slot_acquire(3, 2);
    s.slot_asks(1, 1, true);
    s.slot_asks(2, 1, true);
    s.slot_asks(3, 2, true);
    s.fault(0, FaultKind::Reset, FaultPhase::End);
    let events = s.finish(0);
    let report = check_with(&events, SESSION_HELD);
    assert_eq!(report.expected(ViolationKind::OverAdmitted), 1);
    assert!(report.passed());
    assert_eq!(check(&events).count(ViolationKind::OverAdmitted), 1);
}

#[test]
fn a_fault_begun_after_the_grant_excuses_nothing() {
    let mut s = Script::default();
    s.acquire(1, 1, false);
    s.acquire(2, 2, false);
    // The holder's connection was reset only after the key was granted to another: that
    // cannot be what freed it.
    s.fault(0, FaultKind::Reset, FaultPhase::Start);
    s.asks(1, 1, false, true);
    s.fault(0, FaultKind::Reset, FaultPhase::End);
    let report = check_with(&s.finish(0), SESSION_HELD);
    assert_eq!(report.count(ViolationKind::HeldAfterTaken), 1);
    assert!(!report.passed());
}
