//! Contract cases for leader election (`DistributedLock::leader`), on any backend.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::cases::{processes, required, until_idle};
use super::{quick_polling, unique_prefix, ContractBackend, HeldInterval, IntervalChecker};
use crate::{DistributedLock, LeaderState, Leadership, Term};

/// How much later than its documented bound a hand-over may come on a loaded machine.
const HANDOVER_SLACK: Duration = Duration::from_secs(1);

/// Records one term of leader work as a hold, from its start to the moment it is dropped
/// (finished, or cancelled on loss or resignation).
struct TermRecord {
    checker: Arc<IntervalChecker>,
    key: String,
    process: usize,
    term: u64,
    start: Instant,
}

impl Drop for TermRecord {
    fn drop(&mut self) {
        self.checker.record(HeldInterval {
            key: self.key.clone(),
            process: self.process,
            fencing_token: self.term,
            start: self.start,
            end: Instant::now(),
        });
    }
}

fn campaign(
    lock: &DistributedLock,
    key: &str,
    process: usize,
    checker: &Arc<IntervalChecker>,
    term_length: Duration,
    pause: Duration,
) -> Leadership {
    let checker = checker.clone();
    let recorded_key = key.to_owned();
    let work = move |term: Term| {
        let record = TermRecord {
            checker: checker.clone(),
            key: recorded_key.clone(),
            process,
            term: term.number(),
            start: Instant::now(),
        };
        async move {
            let _record = record;
            tokio::time::sleep(term_length).await;
        }
    };
    required(
        required(lock.leader(key), "leader(key)")
            .retry_delays(pause, pause)
            .start(work),
        "start a campaign",
    )
}

async fn until_state(
    state: &mut watch::Receiver<LeaderState>,
    within: Duration,
    what: &str,
    wanted: impl Fn(&LeaderState) -> bool,
) {
    let reached = tokio::time::timeout(within, state.wait_for(|s| wanted(s)))
        .await
        .is_ok_and(|r| r.is_ok());
    assert!(
        reached,
        "contract broken: {what} within {within:?}; state {:?}",
        *state.borrow()
    );
}

/// Three processes campaign for one key; terms end as the work finishes and leadership moves
/// on. At no moment do two of them run leader work, terms grow in the order they began, and
/// leadership passes between processes.
pub async fn one_leader_at_a_time_among_campaigners_in_three_processes<B: ContractBackend>(
    backend: &B,
) {
    let procs = processes(backend, 3, quick_polling()).await;
    let key = unique_prefix("election");
    let checker = Arc::new(IntervalChecker::new());
    // A leader pauses 200 ms after its term while the others poll at most 100 ms apart
    // (`quick_polling`), so leadership usually changes hands.
    let campaigns: Vec<Leadership> = procs
        .iter()
        .enumerate()
        .map(|(i, lock)| {
            campaign(
                lock,
                &key,
                i,
                &checker,
                Duration::from_millis(30),
                Duration::from_millis(200),
            )
        })
        .collect();
    let give_up = Instant::now() + Duration::from_secs(60);
    while checker.holds().len() < 12 {
        assert!(
            Instant::now() < give_up,
            "contract broken: only {} terms in 60 s",
            checker.holds().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for leadership in campaigns {
        required(leadership.resign().await, "resign");
    }
    checker.assert_consistent();
    let mut leaders: Vec<usize> = checker.holds().iter().map(|h| h.process).collect();
    leaders.sort_unstable();
    leaders.dedup();
    assert!(
        leaders.len() >= 2,
        "contract broken: leadership never changed hands: {leaders:?}"
    );
    all_idle_after_resigning(&procs).await;
}

/// A leader that resigns releases at once: a follower in another process leads within its
/// provider's `max_retry_delay` (plus slack for a loaded machine), in a later term; a
/// follower that resigns stops campaigning and leaves nothing behind.
pub async fn leadership_passes_on_resign_within_the_bound<B: ContractBackend>(backend: &B) {
    let options = quick_polling();
    let bound = options.max_retry_delay + HANDOVER_SLACK;
    let procs = processes(backend, 3, options).await;
    let key = unique_prefix("handover");
    let checker = Arc::new(IntervalChecker::new());
    let long = Duration::from_secs(3600);
    let pause = Duration::from_millis(50);
    let first = campaign(&procs[0], &key, 0, &checker, long, pause);
    let mut first_state = first.state();
    until_state(
        &mut first_state,
        Duration::from_secs(10),
        "the only campaign leads",
        LeaderState::is_leading,
    )
    .await;
    let first_term = first_state.borrow().term();
    let second = campaign(&procs[1], &key, 1, &checker, long, pause);
    let third = campaign(&procs[2], &key, 2, &checker, long, pause);
    tokio::time::sleep(bound).await;
    assert!(
        !second.is_leading() && !third.is_leading(),
        "contract broken: two leaders at once"
    );

    let resigned = Instant::now();
    required(first.resign().await, "the leader resigns");
    let mut states = (second.state(), third.state());
    tokio::select! {
        _ = until_state(&mut states.0, bound, "a follower leads after the resignation", LeaderState::is_leading) => {}
        _ = until_state(&mut states.1, bound, "a follower leads after the resignation", LeaderState::is_leading) => {}
    }
    let handed_over = resigned.elapsed();
    assert!(
        handed_over <= bound,
        "contract broken: hand-over took {handed_over:?}"
    );
    let next_term = second
        .state()
        .borrow()
        .term()
        .or(third.state().borrow().term());
    assert!(
        next_term > first_term,
        "contract broken: term {next_term:?} after {first_term:?}"
    );
    assert!(
        !(second.is_leading() && third.is_leading()),
        "contract broken: two leaders at once"
    );

    let (leader, follower) = if second.is_leading() {
        (second, third)
    } else {
        (third, second)
    };
    let follower_state = follower.state();
    required(follower.resign().await, "a follower resigns");
    assert!(matches!(
        *follower_state.borrow(),
        LeaderState::Stopped { error: None }
    ));
    required(leader.resign().await, "the new leader resigns");
    checker.assert_consistent();
    all_idle_after_resigning(&procs).await;
}

/// Waits until every process of `procs` has given back all it held once its campaigns resigned.
async fn all_idle_after_resigning(procs: &[DistributedLock]) {
    for lock in procs {
        until_idle(
            lock,
            Duration::from_secs(5),
            "a resigned campaign leaves nothing behind",
        )
        .await;
    }
}
