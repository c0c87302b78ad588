//! The nemesis: a fault schedule drawn from a seed, and the loop that applies it to a fleet of
//! clients, logging each fault's start and end.
//!
//! Faults come one at a time, each lifted before the next begins, so every fault in the history
//! has a clear span; all are over a second before the run ends, so the last operations run on a
//! quiet system.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::clock::monotonic_ns;
use crate::error::CheckError;
use crate::history::{Event, FaultEvent, FaultKind, FaultPhase};
use crate::rng::SeededRng;

/// One planned fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedFault {
    /// The quiet time before it.
    pub after: Duration,
    /// What it is.
    pub kind: FaultKind,
    /// Which client slot it hits.
    pub slot: usize,
    /// How long it lasts (for a kill: how long until the replacement starts).
    pub lasts: Duration,
}

/// Draws the schedule of a run of `run` long against `clients` clients: faults of `kinds`,
/// timed against the lease (a short pause is a third of it, a long one two and a half).
pub fn schedule(
    seed: u64,
    kinds: &[FaultKind],
    clients: usize,
    lease: Duration,
    run: Duration,
) -> Vec<PlannedFault> {
    // The nemesis draws from its own stream of the seed, apart from the clients' key choices.
    let mut rng = SeededRng::new(seed ^ 0x006e_656d_6573_6973);
    let lease_ms = lease.as_millis() as u64;
    let quiet_end = run.saturating_sub(Duration::from_secs(1));
    let mut plan = Vec::new();
    let mut at = Duration::ZERO;
    // Every kind once first, in an order of the seed's, so that a short run meets each; then
    // drawn from the list, where a kind listed twice comes twice as often.
    let mut first: Vec<FaultKind> = Vec::new();
    for &kind in kinds {
        if !first.contains(&kind) {
            first.push(kind);
        }
    }
    for i in (1..first.len()).rev() {
        first.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut first = first.into_iter();
    while !kinds.is_empty() && clients > 0 {
        let after = Duration::from_millis(rng.between(200, 1000));
        let kind = match first.next() {
            Some(kind) => kind,
            None => kinds[rng.below(kinds.len() as u64) as usize],
        };
        let slot = rng.below(clients as u64) as usize;
        let lasts = Duration::from_millis(match kind {
            FaultKind::Kill => rng.between(100, 500),
            FaultKind::PauseShort => lease_ms / 3,
            FaultKind::PauseLong => lease_ms * 5 / 2,
            FaultKind::Blackhole | FaultKind::Reset | FaultKind::Delay => {
                rng.between(lease_ms, lease_ms * 2)
            }
            // Long enough for the slow renewal's answer and the lease to run out after it.
            FaultKind::SlowThenCut => lease_ms * 2,
            FaultKind::ServerCrash => rng.between(200, 1000),
            FaultKind::ServerPause => rng.between(lease_ms / 3, lease_ms * 2),
            // Set for a client's whole life, not scheduled.
            FaultKind::ClockRate => 0,
        });
        at += after + lasts;
        if at > quiet_end {
            break;
        }
        plan.push(PlannedFault {
            after,
            kind,
            slot,
            lasts,
        });
    }
    plan
}

/// What the nemesis can do to the clients of one provider.
pub trait Fleet {
    /// The fault kinds this fleet can suffer.
    fn kinds(&self) -> &'static [FaultKind];
    /// The process in `slot` now.
    fn process(&self, slot: usize) -> Option<u32>;
    /// The slot a fault of `kind` planned for `planned` should strike instead, when the fleet
    /// knows a better target than a client in the middle of an update (none by default).
    fn aim(&self, _kind: FaultKind, _planned: usize) -> Option<usize> {
        None
    }
    /// Begins `kind` on `slot` (or on the server, for a server fault).
    fn begin(&mut self, kind: FaultKind, slot: usize) -> EndFuture<'_>;
    /// Lifts `kind` from `slot` (for a kill: starts the replacement; for a server crash: starts
    /// the server again).
    fn end(&mut self, kind: FaultKind, slot: usize) -> EndFuture<'_>;
    /// Stops every client (any fault still on is lifted by the stop) and returns their events.
    fn stop(&mut self) -> StopFuture<'_>;
}

/// What beginning or lifting a fault returns.
pub type EndFuture<'a> = Pin<Box<dyn Future<Output = Result<(), CheckError>> + Send + 'a>>;

/// What stopping a fleet returns: the clients' events.
pub type StopFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<Event>, CheckError>> + Send + 'a>>;

/// The faults so far, shared with the progress lines and the final history.
#[derive(Clone, Default)]
pub struct FaultLog {
    events: Arc<Mutex<Vec<Event>>>,
}

impl FaultLog {
    fn push(&self, event: FaultEvent) {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Event::Nemesis(event));
    }

    /// How many faults have begun.
    pub fn begun(&self) -> usize {
        self.events()
            .iter()
            .filter(|e| matches!(e, Event::Nemesis(f) if f.phase == FaultPhase::Start))
            .count()
    }

    /// The events so far.
    pub fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Applies `plan` to `fleet`, in order, logging into `log`.
///
/// A fault strikes a client that `mid_update` (the register's view) names as in the middle of a
/// read-modify-write, when there is one, else the planned slot: clients spend much of their
/// time waiting for a lock, and a pause there tests nothing. So the seed fixes the kinds and
/// times of the faults, and the timing of the run picks among the holders.
pub async fn inject(
    plan: &[PlannedFault],
    fleet: &mut dyn Fleet,
    log: &FaultLog,
    mid_update: &(dyn Fn() -> Vec<u32> + Send + Sync),
) -> Result<(), CheckError> {
    for (id, fault) in plan.iter().enumerate() {
        tokio::time::sleep(fault.after).await;
        let slot = fleet
            .aim(fault.kind, fault.slot)
            .unwrap_or_else(|| target(fault.slot, fleet, &mid_update()));
        let event = |phase, process| FaultEvent {
            time: monotonic_ns(),
            id: id as u64,
            fault: fault.kind,
            slot,
            process,
            phase,
            rate_percent: None,
        };
        // A fault of the server strikes no one client.
        let process = (!fault.kind.hits_server())
            .then(|| fleet.process(slot))
            .flatten();
        log.push(event(FaultPhase::Start, process));
        fleet.begin(fault.kind, slot).await?;
        tokio::time::sleep(fault.lasts).await;
        fleet.end(fault.kind, slot).await?;
        log.push(event(FaultPhase::End, process));
    }
    Ok(())
}

/// The slot of one of the `holders`, chosen by the planned slot, or the planned slot itself.
fn target(planned: usize, fleet: &dyn Fleet, holders: &[u32]) -> usize {
    let slots: Vec<usize> = (0..)
        .take_while(|&slot| fleet.process(slot).is_some())
        .filter(|&slot| fleet.process(slot).is_some_and(|p| holders.contains(&p)))
        .collect();
    if slots.is_empty() {
        planned
    } else {
        slots[planned % slots.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Processes 10, 11, 12 in slots 0, 1, 2.
    struct Three;

    impl Fleet for Three {
        fn kinds(&self) -> &'static [FaultKind] {
            &[FaultKind::Kill]
        }
        fn process(&self, slot: usize) -> Option<u32> {
            (slot < 3).then_some(10 + slot as u32)
        }
        fn begin(&mut self, _: FaultKind, _: usize) -> EndFuture<'_> {
            Box::pin(async { Ok(()) })
        }
        fn end(&mut self, _: FaultKind, _: usize) -> EndFuture<'_> {
            Box::pin(async { Ok(()) })
        }
        fn stop(&mut self) -> StopFuture<'_> {
            Box::pin(async { Ok(Vec::new()) })
        }
    }

    #[test]
    fn a_fault_strikes_a_client_mid_update_when_there_is_one() {
        assert_eq!(target(1, &Three, &[]), 1);
        assert_eq!(target(1, &Three, &[12]), 2);
        assert_eq!(target(0, &Three, &[10, 12]), 0);
        assert_eq!(target(1, &Three, &[10, 12]), 2);
        // A process the register names that is no longer in a slot (killed) is no target.
        assert_eq!(target(2, &Three, &[99]), 2);
    }

    #[test]
    fn a_seed_gives_one_schedule_that_ends_a_second_before_the_run() {
        let kinds = [FaultKind::Kill, FaultKind::PauseLong, FaultKind::Blackhole];
        let lease = Duration::from_secs(1);
        let run = Duration::from_secs(20);
        let plan = schedule(7, &kinds, 5, lease, run);
        assert_eq!(plan, schedule(7, &kinds, 5, lease, run));
        assert_ne!(plan, schedule(8, &kinds, 5, lease, run));
        let total: Duration = plan.iter().map(|f| f.after + f.lasts).sum();
        assert!(total <= run - Duration::from_secs(1));
        assert!(plan.iter().all(|f| f.slot < 5 && kinds.contains(&f.kind)));
        assert!(plan.len() >= 3, "{plan:?}");
        // Every kind comes before any comes twice.
        let mut opening: Vec<FaultKind> = plan.iter().take(3).map(|f| f.kind).collect();
        opening.sort();
        let mut all = kinds.to_vec();
        all.sort();
        assert_eq!(opening, all);
    }
}
