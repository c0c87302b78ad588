//! Leader election on paused tokio time through the public API: work dropped on loss, terms
//! that grow, resignation that releases at once, failures that stop the campaign and outages
//! that do not. The cross-provider cases are in the contract kit (`lockingkit::testing`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::backend::BackendError;
use lockingkit::testing::Intercept;
use lockingkit::{DistributedLock, ErrorKind, LeaderState, Leadership, MemoryBackend, MemoryStore};
use tokio::sync::watch;

const KEY: &str = "jobs/outbox-relay";
const LEASE: Duration = Duration::from_secs(30);

fn locks(store: &MemoryStore) -> DistributedLock {
    DistributedLock::builder(MemoryBackend::with_lease(store.clone(), LEASE))
        .build()
        .expect("valid options")
}

/// Counts how many leader works are running and how many were dropped.
#[derive(Clone, Default)]
struct Works {
    running: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
}

struct Running(Works);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
        self.0.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

type Work = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl Works {
    /// Leader work that runs until it is dropped.
    fn forever(&self) -> impl FnMut(lockingkit::Term) -> Work + Send + 'static {
        let works = self.clone();
        move |_term| {
            works.running.fetch_add(1, Ordering::SeqCst);
            let guard = Running(works.clone());
            Box::pin(async move {
                let _guard = guard;
                std::future::pending::<()>().await
            })
        }
    }
}

async fn until(
    state: &mut watch::Receiver<LeaderState>,
    what: &str,
    f: impl Fn(&LeaderState) -> bool,
) -> LeaderState {
    match tokio::time::timeout(Duration::from_secs(600), state.wait_for(|s| f(s))).await {
        Ok(Ok(state)) => return state.clone(),
        Ok(Err(_)) => panic!("the campaign went away before: {what}"),
        Err(_) => {}
    }
    panic!("never: {what}; state {:?}", *state.borrow())
}

/// A campaign for `KEY` on `locks` whose leader work runs until it is dropped.
fn campaign(locks: &DistributedLock, works: &Works) -> Leadership {
    locks
        .leader(KEY)
        .expect("key")
        .start(works.forever())
        .expect("started")
}

/// A campaign on `store` whose work runs until it is dropped, once it leads: its works, the
/// leadership, its state and the state it first led in.
async fn leading(
    store: &MemoryStore,
) -> (Works, Leadership, watch::Receiver<LeaderState>, LeaderState) {
    let works = Works::default();
    let leadership = campaign(&locks(store), &works);
    let mut state = leadership.state();
    let led = until(&mut state, "leads", LeaderState::is_leading).await;
    (works, leadership, state, led)
}

#[tokio::test(start_paused = true)]
async fn leader_work_is_dropped_at_loss_and_the_campaign_leads_again_in_a_later_term() {
    let store = MemoryStore::new();
    let (works, leadership, mut state, first) = leading(&store).await;
    assert_eq!(works.running.load(Ordering::SeqCst), 1);

    assert!(store.break_lease(KEY), "the lease was held");
    until(&mut state, "deposed", |s| !s.is_leading()).await;
    assert_eq!(
        works.running.load(Ordering::SeqCst),
        0,
        "the work was dropped"
    );
    assert_eq!(works.dropped.load(Ordering::SeqCst), 1);

    let second = until(&mut state, "leads again", LeaderState::is_leading).await;
    assert!(second.term() > first.term(), "{second:?} after {first:?}");
    assert_eq!(works.running.load(Ordering::SeqCst), 1);
    leadership.resign().await.expect("resigned");
    assert_eq!(works.running.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn the_work_stops_within_the_renewal_that_finds_the_lease_gone() {
    let store = MemoryStore::new();
    let (works, leadership, mut state, _) = leading(&store).await;
    let broken = tokio::time::Instant::now();
    store.break_lease(KEY);
    until(&mut state, "deposed", |s| !s.is_leading()).await;
    // Renewals run every third of the lease: the loss is seen at the next one, no later.
    assert!(
        broken.elapsed() <= LEASE / 3,
        "deposed after {:?}",
        broken.elapsed()
    );
    assert_eq!(works.dropped.load(Ordering::SeqCst), 1);
    drop(leadership);
}

/// How long the releases of the test below take to be answered.
const RELEASE_TRIP: Duration = Duration::from_millis(50);

#[tokio::test(start_paused = true)]
async fn resigning_drops_the_work_and_waits_for_the_release_to_be_confirmed() {
    let store = MemoryStore::new();
    let works = Works::default();
    let slow_release =
        Intercept::new(MemoryBackend::with_lease(store.clone(), LEASE)).on_release(|release| {
            Box::pin(async move {
                tokio::time::sleep(RELEASE_TRIP).await;
                release.await
            })
        });
    let locks = DistributedLock::builder(slow_release)
        .build()
        .expect("valid options");
    let leadership = campaign(&locks, &works);
    let mut state = leadership.state();
    until(&mut state, "leads", LeaderState::is_leading).await;
    let started = tokio::time::Instant::now();
    leadership.resign().await.expect("resigned");
    assert!(
        !store.is_locked(KEY),
        "released at the backend before resign returned"
    );
    let took = started.elapsed();
    assert!(
        took >= RELEASE_TRIP && took <= RELEASE_TRIP * 2,
        "resigning took {took:?}"
    );
    assert_eq!(works.running.load(Ordering::SeqCst), 0);
    assert!(matches!(
        *state.borrow(),
        LeaderState::Stopped { error: None }
    ));
    assert_eq!(locks.local_callers(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_follower_leads_once_the_leader_resigns_and_its_term_is_greater() {
    let store = MemoryStore::new();
    let (works, first, _leader, led) = leading(&store).await;
    let second = campaign(&locks(&store), &works);
    let mut follower = second.state();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!follower.borrow().is_leading(), "two leaders at once");
    first.resign().await.expect("resigned");
    let resigned = tokio::time::Instant::now();
    let next = until(&mut follower, "second leads", LeaderState::is_leading).await;
    // Another process polls at most max_retry_delay (1 s by default) apart.
    assert!(
        resigned.elapsed() <= Duration::from_secs(1),
        "after {:?}",
        resigned.elapsed()
    );
    assert!(next.term() > led.term());
    second.resign().await.expect("resigned");
}

#[tokio::test(start_paused = true)]
async fn work_that_returns_ends_the_term_and_a_new_one_begins_after_the_backoff() {
    let store = MemoryStore::new();
    let terms = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = terms.clone();
    let leadership = locks(&store)
        .leader(KEY)
        .expect("key")
        .retry_delays(Duration::from_millis(100), Duration::from_millis(400))
        .start(move |term| {
            seen.lock()
                .expect("not poisoned")
                .push((term.number(), tokio::time::Instant::now()));
            async {}
        })
        .expect("started");
    tokio::time::sleep(Duration::from_secs(3)).await;
    leadership.resign().await.expect("resigned");
    let terms = terms.lock().expect("not poisoned").clone();
    assert!(terms.len() >= 5, "only {} terms in 3 s", terms.len());
    for pair in terms.windows(2) {
        assert!(pair[1].0 > pair[0].0, "terms must grow: {terms:?}");
        let gap = pair[1].1 - pair[0].1;
        // The pause is jittered within [d/2, d] of a delay between 100 and 400 ms.
        assert!(
            gap >= Duration::from_millis(50) && gap <= Duration::from_millis(401),
            "gap {gap:?}"
        );
    }
    assert!(!store.is_locked(KEY));
}

#[tokio::test(start_paused = true)]
async fn an_outage_is_retried_at_the_backoff_and_the_campaign_leads_once_it_ends() {
    let store = MemoryStore::new();
    store.set_unavailable(true);
    let works = Works::default();
    let leadership = campaign(&locks(&store), &works);
    let mut state = leadership.state();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!state.borrow().is_leading() && !state.borrow().is_stopped());
    // 60 s of an outage at a backoff capped at 5 s (and the provider's own outage pacing): no
    // spinning.
    let attempts = store.attempts();
    assert!((1..=60).contains(&attempts), "{attempts} attempts in 60 s");
    store.set_unavailable(false);
    until(
        &mut state,
        "leads after the outage",
        LeaderState::is_leading,
    )
    .await;
    leadership.resign().await.expect("resigned");
}

#[tokio::test(start_paused = true)]
async fn a_misconfiguration_stops_the_campaign_with_that_error_instead_of_spinning() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let counted = attempts.clone();
    // Every attempt fails as misconfigured.
    let failing = Intercept::new(MemoryBackend::with_lease(MemoryStore::new(), LEASE))
        .on_try_acquire(move |_attempt| {
            counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Err(BackendError::misconfigured("no such container")) })
        });
    let locks = DistributedLock::builder(failing)
        .build()
        .expect("valid options");
    let works = Works::default();
    let leadership = campaign(&locks, &works);
    let mut state = leadership.state();
    let stopped = until(&mut state, "stops", LeaderState::is_stopped).await;
    let LeaderState::Stopped { error: Some(error) } = stopped else {
        panic!("stopped without the error: {stopped:?}");
    };
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        1,
        "one attempt, then stopped"
    );
    let resigned = leadership.resign().await.expect_err("the campaign's error");
    assert_eq!(resigned.kind(), ErrorKind::Misconfigured);
    assert_eq!(works.running.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_leadership_resigns_in_the_background() {
    let store = MemoryStore::new();
    let (works, leadership, mut state, _) = leading(&store).await;
    drop(leadership);
    until(&mut state, "stopped", LeaderState::is_stopped).await;
    assert!(!store.is_locked(KEY));
    assert_eq!(works.running.load(Ordering::SeqCst), 0);
}

#[test]
fn starting_needs_a_runtime_and_valid_delays() {
    let locks = DistributedLock::in_memory();
    let outside = locks.leader(KEY).expect("key").start(|_| async {});
    assert_eq!(
        outside.expect_err("no runtime").kind(),
        ErrorKind::Misconfigured
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let zero = locks
            .leader(KEY)
            .expect("key")
            .retry_delays(Duration::ZERO, Duration::from_secs(1));
        assert_eq!(
            zero.start(|_| async {}).expect_err("zero").kind(),
            ErrorKind::Misconfigured
        );
        let inverted = locks
            .leader(KEY)
            .expect("key")
            .retry_delays(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(
            inverted.start(|_| async {}).expect_err("inverted").kind(),
            ErrorKind::Misconfigured
        );
    });
    assert_eq!(
        locks.leader("").expect_err("empty").kind(),
        ErrorKind::InvalidKey
    );
}

/// How a campaign read at the moment a release was sent: `is_leading()`, and whether the
/// watch had moved on to `Campaigning`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct AtRelease {
    leading: bool,
    campaigning: bool,
}

/// Notes, at each release the backend is sent, how the campaign it is told of reads.
#[derive(Default)]
struct Notes {
    campaign: std::sync::Mutex<Option<watch::Receiver<LeaderState>>>,
    at_release: std::sync::Mutex<Vec<AtRelease>>,
}

impl Notes {
    fn watch(&self, state: watch::Receiver<LeaderState>) {
        *self.campaign.lock().expect("not poisoned") = Some(state);
    }

    /// Notes how the campaign watched reads now, as a release is sent.
    fn note_release(&self) {
        if let Some(state) = &*self.campaign.lock().expect("not poisoned") {
            let state = state.borrow();
            self.at_release
                .lock()
                .expect("not poisoned")
                .push(AtRelease {
                    leading: state.is_leading(),
                    campaigning: matches!(*state, LeaderState::Campaigning),
                });
        }
    }

    fn taken(&self) -> Vec<AtRelease> {
        self.at_release.lock().expect("not poisoned").clone()
    }
}

/// The in-memory backend, noting how the campaign reads when a release is sent: the hook
/// runs on the release's first poll, in the same poll as the engine's call.
fn noted(store: &MemoryStore) -> (DistributedLock, Arc<Notes>) {
    let notes = Arc::new(Notes::default());
    let noting = notes.clone();
    let backend = Intercept::new(MemoryBackend::with_lease(store.clone(), LEASE)).on_release(
        move |release| {
            noting.note_release();
            release
        },
    );
    let locks = DistributedLock::builder(backend)
        .build()
        .expect("valid options");
    (locks, notes)
}

#[tokio::test(start_paused = true)]
async fn a_term_that_ends_or_is_resigned_reads_campaigning_before_its_release_is_sent() {
    let store = MemoryStore::new();
    let (locks, notes) = noted(&store);
    let leadership = locks
        .leader(KEY)
        .expect("key")
        .start(|_term| tokio::time::sleep(Duration::from_secs(1)))
        .expect("started");
    notes.watch(leadership.state());
    // Terms of 1 s with pauses of 100 ms to 5 s between: some end by returning, and the
    // campaign leads again before it is resigned.
    let mut state = leadership.state();
    until(&mut state, "leads", LeaderState::is_leading).await;
    until(&mut state, "the first term ended", |s| !s.is_leading()).await;
    until(&mut state, "leads again", LeaderState::is_leading).await;
    leadership.resign().await.expect("resigned");
    let seen = notes.taken();
    assert_eq!(seen.len(), 2, "one release per term: {seen:?}");
    let after_the_fact = AtRelease {
        leading: false,
        campaigning: true,
    };
    assert!(seen.iter().all(|at| *at == after_the_fact), "{seen:?}");
}

#[tokio::test(start_paused = true)]
async fn a_term_lost_at_its_deadline_is_not_leading_when_the_best_effort_release_is_sent() {
    let store = MemoryStore::new();
    let (locks, notes) = noted(&store);
    let works = Works::default();
    let leadership = campaign(&locks, &works);
    notes.watch(leadership.state());
    let mut state = leadership.state();
    until(&mut state, "leads", LeaderState::is_leading).await;
    // Renewals that never answer: the engine declares the lock lost at its deadline and then
    // sends a release, which frees the key for the next campaigner at once.
    store.set_renewal_fault(lockingkit::providers::memory::RenewalFault::Hang);
    until(&mut state, "deposed", |s| !s.is_leading()).await;
    let seen = notes.taken();
    assert!(!seen.is_empty(), "the loss sent a release");
    assert!(
        !seen[0].leading,
        "leading while its release was sent: {seen:?}"
    );
    drop(leadership);
}
