//! The contract cases every provider must pass (`contract_tests!` runs them all), each a
//! function over a [`ContractBackend`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::{
    abandon_after_polls, quick_polling, unique_prefix, ContractBackend, HeldInterval,
    IntervalChecker,
};
use crate::{
    DistributedLock, DistributedSemaphore, ErrorKind, LockError, LockHandle, LockMode, LockOptions,
    ReaderWriterLock,
};

/// Unwraps a result the contract requires to be `Ok`, failing the case with context otherwise.
#[track_caller]
pub(super) fn required<T>(result: Result<T, LockError>, what: &str) -> T {
    match result {
        Ok(value) => value,
        Err(error) => panic!("contract broken: {what}: {error}"),
    }
}

#[track_caller]
pub(super) fn expect_kind<T: std::fmt::Debug>(
    result: Result<T, LockError>,
    kind: ErrorKind,
    what: &str,
) {
    match result {
        Err(error) => assert_eq!(error.kind(), kind, "contract broken: {what}: {error}"),
        Ok(value) => panic!("contract broken: {what}: expected {kind}, got {value:?}"),
    }
}

pub(super) async fn processes<B: ContractBackend>(
    backend: &B,
    count: usize,
    options: LockOptions,
) -> Vec<DistributedLock> {
    let mut all = Vec::with_capacity(count);
    for _ in 0..count {
        all.push(backend.new_process(options.clone()).await);
    }
    all
}

/// Waits, yielding, until `lock` has `count` callers queued for `key`.
async fn until_queued(lock: &DistributedLock, key: &str, count: usize) {
    let give_up = Instant::now() + Duration::from_secs(10);
    while lock.waiting(key) < count {
        assert!(Instant::now() < give_up, "waiters never queued");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// How long a process may take to give a key up at the backend once its holder is gone
/// (released, dropped, or an attempt whose caller went away): a quarter of a lease period on an
/// expiring backend, where a leaked lease frees the key when it expires, so it cannot pass for a
/// release in this time. A connection-held backend never frees a leaked lease, and its lease
/// period is only the check interval: there the bound only catches a hang (5 s), and the tries
/// that follow catch a leak.
pub(super) fn release_settles_within<B: ContractBackend>(backend: &B) -> Duration {
    settles_within(backend.leases_held_by_connection(), backend.lease_period())
}

/// [`release_settles_within`] for a backend whose leases are held by a connection or not, with
/// the given lease period.
pub(super) fn settles_within(held_by_connection: bool, lease_period: Duration) -> Duration {
    if held_by_connection {
        Duration::from_secs(5)
    } else {
        lease_period / 4
    }
}

/// Waits, yielding, until `lock` holds, attempts and queues for nothing, failing the case after
/// `within`. The engine passes a key on only once its release at the backend has answered, so an
/// idle process has given every lock it had back to the backend.
pub(super) async fn until_idle(lock: &DistributedLock, within: Duration, what: &str) {
    let give_up = Instant::now() + within;
    while lock.local_callers() != 0 {
        assert!(
            Instant::now() < give_up,
            "contract broken: {what}: the process still had {} key(s) after {within:?}",
            lock.local_callers()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Once the holder in `from` is gone, `to` (another process) gets `key` on its first try, well
/// before a leaked lease could have expired.
pub(super) async fn next_process_gets_it_at_once<B: ContractBackend>(
    backend: &B,
    from: &DistributedLock,
    to: &DistributedLock,
    key: &str,
    what: &str,
) -> LockHandle {
    until_idle(from, release_settles_within(backend), what).await;
    match to.try_acquire(key).await {
        Ok(handle) => handle,
        Err(error) => panic!(
            "contract broken: {what}: another process could not take the key at once, so the \
             lock was not released at the backend: {error}"
        ),
    }
}

/// A held key is busy for every other caller, in this process and in others, and never
/// reentrant.
pub async fn busy_and_not_reentrant<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("busy");
    let held = required(procs[0].try_acquire(&key).await, "first try_acquire");
    assert_eq!(held.key(), key);
    assert!(held.is_held());
    expect_kind(
        procs[0].try_acquire(&key).await,
        ErrorKind::Busy,
        "the same process acquiring again",
    );
    expect_kind(
        procs[1].try_acquire(&key).await,
        ErrorKind::Busy,
        "another process",
    );
    expect_kind(
        procs[0].acquire(&key, Duration::from_millis(300)).await,
        ErrorKind::Timeout,
        "the same process waiting",
    );
    expect_kind(
        procs[1].acquire(&key, Duration::from_millis(300)).await,
        ErrorKind::Timeout,
        "another process waiting",
    );
    required(held.release().await, "release");
}

/// After a confirmed release, another process gets the lock on its first try.
pub async fn release_lets_the_next_holder_in_at_once<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("handoff");
    for round in 0..3 {
        let (from, to) = if round % 2 == 0 { (0, 1) } else { (1, 0) };
        let held = required(procs[from].try_acquire(&key).await, "acquire");
        required(held.release().await, "release");
        let next = required(
            procs[to].try_acquire(&key).await,
            "try_acquire right after another process released",
        );
        required(next.release().await, "release");
    }
    // Within one process the next local caller gets it at once too.
    let held = required(procs[0].try_acquire(&key).await, "acquire");
    let waiter = {
        let lock = procs[0].clone();
        let key = key.clone();
        tokio::spawn(async move { lock.acquire(&key, Duration::from_secs(30)).await })
    };
    until_queued(&procs[0], &key, 1).await;
    required(held.release().await, "release");
    let next = match waiter.await {
        Ok(result) => required(result, "the local waiter"),
        Err(join) => panic!("waiter task failed: {join}"),
    };
    required(next.release().await, "release");
}

/// Release fires the lost token and happens once; dropping a handle releases it.
pub async fn release_is_idempotent_and_drop_releases<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("release");
    let held = required(procs[0].try_acquire(&key).await, "acquire");
    let lost = held.lost_token();
    required(held.release().await, "release");
    assert!(lost.is_cancelled(), "the lost token fires on release");

    let held = required(procs[0].try_acquire(&key).await, "acquire again");
    let lost = held.lost_token();
    drop(held);
    assert!(lost.is_cancelled(), "the lost token fires on drop");
    let next = next_process_gets_it_at_once(
        backend,
        &procs[0],
        &procs[1],
        &key,
        "a dropped handle is released in the background",
    )
    .await;
    required(next.release().await, "release");
    assert_eq!(procs[0].local_callers(), 0, "nothing left behind locally");
}

/// `acquire` waits for a release and reports `Timeout` when the lock stays busy, neither early
/// nor much late, and a waiter gets the lock soon after the holder releases it: at once in the
/// holder's process (the turn is handed over), within one retry delay in another process.
pub async fn waiting_and_timeouts<B: ContractBackend>(backend: &B) {
    let options = quick_polling();
    let procs = processes(backend, 2, options.clone()).await;
    let key = unique_prefix("wait");
    // Slack for one attempt in flight and a loaded machine; a wait that overruns by a whole
    // lease quarter or a release that needs a lease to expire still fails.
    let slack = options.max_retry_delay + release_settles_within(backend);
    let held = required(procs[0].try_acquire(&key).await, "acquire");
    let timeout = Duration::from_millis(400);
    let started = Instant::now();
    expect_kind(
        procs[1].acquire(&key, timeout).await,
        ErrorKind::Timeout,
        "waiting on a held lock",
    );
    let waited = started.elapsed();
    assert!(
        waited >= timeout,
        "contract broken: gave up after {waited:?}"
    );
    assert!(
        waited <= timeout + slack,
        "contract broken: a {timeout:?} wait took {waited:?}"
    );

    // Another process: its waiter polls the backend and must see the release promptly.
    let waiter = spawn_acquire(&procs[1], &key);
    until_queued(&procs[1], &key, 1).await;
    let released_at = Instant::now();
    required(held.release().await, "release");
    let (acquired_at, handle) = joined(waiter).await;
    let handle = required(handle, "the waiter in another process after release");
    let took = acquired_at.duration_since(released_at);
    assert!(
        took <= slack,
        "contract broken: another process got the lock {took:?} after its release"
    );

    // The same process: the release hands the turn straight to the queued waiter.
    let waiter = spawn_acquire(&procs[1], &key);
    until_queued(&procs[1], &key, 1).await;
    let released_at = Instant::now();
    required(handle.release().await, "release");
    let (acquired_at, handle) = joined(waiter).await;
    let handle = required(handle, "the local waiter after release");
    let took = acquired_at.duration_since(released_at);
    assert!(
        took <= release_settles_within(backend),
        "contract broken: a local waiter got the lock {took:?} after its release"
    );
    required(handle.release().await, "release");
}

type Acquisition = (Instant, Result<LockHandle, LockError>);

fn spawn_acquire(lock: &DistributedLock, key: &str) -> tokio::task::JoinHandle<Acquisition> {
    let lock = lock.clone();
    let key = key.to_owned();
    tokio::spawn(async move {
        let handle = lock.acquire(&key, Duration::from_secs(30)).await;
        (Instant::now(), handle)
    })
}

async fn joined(task: tokio::task::JoinHandle<Acquisition>) -> Acquisition {
    match task.await {
        Ok(pair) => pair,
        Err(join) => panic!("waiter task failed: {join}"),
    }
}

/// Eighty acquisitions by twenty contenders spread over four processes never overlap, and
/// fencing tokens grow in acquisition order.
pub async fn eighty_acquisitions_by_twenty_contenders_in_four_processes_never_overlap<
    B: ContractBackend,
>(
    backend: &B,
) {
    let procs = processes(backend, 4, quick_polling()).await;
    let key = unique_prefix("contenders");
    let checker = Arc::new(IntervalChecker::new());
    let mut tasks = Vec::new();
    for contender in 0..20 {
        let process = contender % 4;
        let lock = procs[process].clone();
        let key = key.clone();
        let checker = checker.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let handle = required(
                    lock.acquire(&key, Duration::from_secs(120)).await,
                    "acquire",
                );
                let start = Instant::now();
                // HeldInterval briefly so overlapping holds, if any, would be caught.
                tokio::time::sleep(Duration::from_millis(2)).await;
                assert!(handle.is_held(), "lost while held");
                let end = Instant::now();
                checker.record(HeldInterval {
                    key: key.clone(),
                    process,
                    fencing_token: handle.fencing_token(),
                    start,
                    end,
                });
                required(handle.release().await, "release");
            }
        }));
    }
    for task in tasks {
        if let Err(join) = task.await {
            panic!("contender failed: {join}");
        }
    }
    assert_eq!(checker.holds().len(), 80);
    checker.assert_consistent();
}

/// Keys that look alike, or that a naive mapping would confuse (escapes, dot segments, Unicode
/// normalisation, control characters, names at the backends' length and segment limits).
fn look_alike_keys() -> Vec<String> {
    let unique = unique_prefix("alike").replace('/', "-");
    let fixed = [
        "a/b",
        "a~2Fb",
        "a%2Fb",
        "a_b",
        "..",
        ".",
        "a.",
        "/a",
        "a/",
        "a//b",
        "a///b",
        "a/./b",
        "a/.b",
        "ключ",
        "🔒",
        "A b",
        "a b",
        "Orders/42",
        "orders/42",
        // The same text in NFC and NFD: byte-for-byte different keys.
        "caf\u{e9}",
        "cafe\u{301}",
        // Control characters, and the characters they could be confused with.
        "a\u{0}b",
        "a\tb",
        "a\nb",
        "a\rb",
        "a\u{7f}b",
        "a\u{1}b",
        "a\u{2028}b",
    ];
    let mut keys: Vec<String> = fixed.iter().map(|k| (*k).to_owned()).collect();
    // The edge cases above only mean something at the start of a key, so they are used as they
    // are; a unique pair keeps repeated runs apart.
    keys.push(format!("{unique}/x"));
    keys.push(format!("{unique}~2Fx"));
    // 512 characters, the longest key, in one, two, three and four bytes each.
    keys.push("x".repeat(512));
    keys.push(format!("{}y", "x".repeat(511)));
    keys.push("é".repeat(512));
    keys.push("ह".repeat(512));
    keys.push("🔒".repeat(512));
    keys.push(format!("{}🔓", "🔒".repeat(511)));
    // Azure blob names at 1024 characters (kept readable) and 1025 (hashed): `~` escapes to
    // three characters.
    keys.push(format!("{}a", "~".repeat(341)));
    keys.push(format!("{}b", "~".repeat(341)));
    keys.push(format!("{}ab", "~".repeat(341)));
    keys.push(format!("{}ac", "~".repeat(341)));
    // 254 segments (kept readable) and 255 (hashed).
    keys.push(format!("{}a", "a/".repeat(253)));
    keys.push(format!("{}b", "a/".repeat(253)));
    keys.push(format!("{}a", "a/".repeat(254)));
    keys.push(format!("{}b", "a/".repeat(254)));
    keys.push(format!("{}a", "a/".repeat(255)));
    keys
}

/// Look-alike keys never share a lock, in one process or across processes.
///
/// Any two of the keys differ in some bit of their index. In the round for that bit, one process
/// holds every key with the bit clear while another process takes every key with the bit set, so
/// two keys that share a backend lock show up as `Busy` across processes — also on backends whose
/// locks are reentrant within one connection, where holding both in one process would not tell.
pub async fn look_alike_keys_never_share_a_lock<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let keys = look_alike_keys();
    let rounds = usize::BITS - (keys.len() - 1).leading_zeros();
    for bit in 0..rounds {
        let (mut held, mut taken) = (Vec::new(), Vec::new());
        for (index, key) in keys.iter().enumerate() {
            if index >> bit & 1 == 0 {
                let what = format!("look-alike key #{index} (round {bit}) in the first process");
                held.push(required(procs[0].try_acquire(key).await, &what));
            } else {
                let what = format!(
                    "look-alike key #{index} (round {bit}) shares a lock with a key the other \
                     process holds"
                );
                taken.push(required(procs[1].try_acquire(key).await, &what));
            }
        }
        for (index, key) in keys.iter().enumerate() {
            let what = format!("look-alike key #{index} from the process not holding it");
            let other = if index >> bit & 1 == 0 {
                &procs[1]
            } else {
                &procs[0]
            };
            expect_kind(other.try_acquire(key).await, ErrorKind::Busy, &what);
        }
        for handle in held.into_iter().chain(taken) {
            required(handle.release().await, "release");
        }
    }
}

/// Dropping an acquire future before, during or after its backend attempt never leaks the lock.
pub async fn cancellation_before_during_and_after_an_attempt_leaks_nothing<B: ContractBackend>(
    backend: &B,
) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("cancel");

    // Before: a waiter queued behind a local holder is dropped.
    let held = required(procs[0].try_acquire(&key).await, "acquire");
    let queued = tokio::time::timeout(
        Duration::from_millis(50),
        procs[0].acquire(&key, Duration::from_secs(30)),
    )
    .await;
    assert!(queued.is_err(), "the queued waiter should still be waiting");
    required(held.release().await, "release");
    let next = required(procs[1].try_acquire(&key).await, "after a dropped waiter");
    required(next.release().await, "release");

    // During: the caller goes away at varying points of the attempt.
    for round in 0..20u64 {
        let cut = Duration::from_micros(50 + round * 150);
        let attempt = tokio::time::timeout(cut, procs[0].try_acquire(&key)).await;
        drop(attempt);
        let next = next_process_gets_it_at_once(
            backend,
            &procs[0],
            &procs[1],
            &key,
            "a lease won by a cancelled attempt is released",
        )
        .await;
        required(next.release().await, "release");
    }
    // During, at chosen points: right after the attempt was first polled (its request sent or
    // queued), and after more and more of it ran.
    for polls in 1..=10 {
        drop(abandon_after_polls(procs[0].try_acquire(&key), polls).await);
        let next = next_process_gets_it_at_once(
            backend,
            &procs[0],
            &procs[1],
            &key,
            "a lease won by an attempt abandoned in flight is released",
        )
        .await;
        required(next.release().await, "release");
    }

    // After: the attempt won and the handle is dropped at once.
    let won = required(procs[0].try_acquire(&key).await, "acquire");
    drop(won);
    let next = next_process_gets_it_at_once(
        backend,
        &procs[0],
        &procs[1],
        &key,
        "a handle dropped as soon as it was won is released",
    )
    .await;
    required(next.release().await, "release");

    let give_up = Instant::now() + Duration::from_secs(20);
    while procs[0].local_callers() != 0 {
        assert!(
            Instant::now() < give_up,
            "a cancelled attempt never finished"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A held lock stays held over more than three lease periods, renewed in the background.
pub async fn renewal_keeps_the_lock_over_three_lease_periods<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("renewal");
    let held = required(procs[0].try_acquire(&key).await, "acquire");
    let period = backend.lease_period();
    let until = Instant::now() + period * 3 + period / 2;
    while Instant::now() < until {
        tokio::time::sleep(period / 4).await;
        required(held.ensure_held(), "held during renewal");
        expect_kind(
            procs[1].try_acquire(&key).await,
            ErrorKind::Busy,
            "another process while renewed",
        );
    }
    assert!(!held.lost_token().is_cancelled());
    required(held.release().await, "release after renewals");
}

/// Fencing tokens strictly grow across holders and processes.
pub async fn fencing_tokens_grow<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("fencing");
    let mut last = 0u64;
    for round in 0..10 {
        let handle = required(procs[round % 2].try_acquire(&key).await, "acquire");
        assert!(
            handle.fencing_token() > last,
            "token {} after {last}",
            handle.fencing_token()
        );
        last = handle.fencing_token();
        required(handle.release().await, "release");
    }
}

/// Local waiters for a key are served first come, first served.
pub async fn local_waiters_are_served_in_arrival_order<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("fifo");
    let held = required(procs[0].try_acquire(&key).await, "acquire");
    let order = Arc::new(Mutex::new(Vec::new()));
    let served = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for index in 0..6 {
        let lock = procs[1].clone();
        let key2 = key.clone();
        let order = order.clone();
        let served = served.clone();
        tasks.push(tokio::spawn(async move {
            let handle = required(lock.acquire(&key2, Duration::from_secs(60)).await, "waiter");
            order
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(index);
            served.fetch_add(1, Ordering::SeqCst);
            required(handle.release().await, "release");
        }));
        until_queued(&procs[1], &key, index + 1).await;
    }
    required(held.release().await, "release");
    for task in tasks {
        if let Err(join) = task.await {
            panic!("waiter failed: {join}");
        }
    }
    assert_eq!(served.load(Ordering::SeqCst), 6);
    let order = order.lock().unwrap_or_else(PoisonError::into_inner).clone();
    assert_eq!(
        order,
        (0..6).collect::<Vec<_>>(),
        "waiters served out of order"
    );
}

/// The reader-writer lock `key` of a provider declared to have reader-writer locks.
fn reader_writer(lock: &DistributedLock, key: &str) -> ReaderWriterLock {
    required(
        lock.reader_writer(key),
        "the suite was told the provider has reader-writer locks",
    )
}

/// The semaphore `key` of `max_count` of a provider declared to have semaphores.
fn semaphore(lock: &DistributedLock, key: &str, max_count: u32) -> DistributedSemaphore {
    required(
        lock.semaphore(key, max_count),
        "the suite was told the provider has semaphores",
    )
}

/// Checks that a provider declared to have no lock of `mode` says so: `supports` answers
/// `false` and asking for such a lock is refused as `Misconfigured`. A provider whose locks are
/// exclusive only must never hand out an exclusive lock as a shared one.
async fn refuses<B: ContractBackend>(backend: &B, mode: LockMode) {
    let process = backend.new_process(quick_polling()).await;
    let key = unique_prefix("refused-mode");
    assert!(
        !process.supports(mode),
        "contract broken: the suite was told the provider has no {} locks, but it supports them",
        mode.as_str()
    );
    let refusal = match mode {
        LockMode::Shared => process.reader_writer(&key).map(drop),
        LockMode::Semaphore { max_count } => process.semaphore(&key, max_count).map(drop),
        LockMode::Exclusive => process.ensure_supports(mode),
    };
    expect_kind(
        refusal,
        ErrorKind::Misconfigured,
        "a lock of a mode the provider does not support",
    );
}

/// The check `contract_tests!` runs in place of the reader-writer cases for a provider
/// declared `without: [readers]`: it refuses reader-writer locks as `Misconfigured`.
pub async fn a_provider_without_readers_refuses_them<B: ContractBackend>(backend: &B) {
    refuses(backend, LockMode::Shared).await;
}

/// The check `contract_tests!` runs in place of the semaphore cases for a provider declared
/// `without: [semaphores]`: it refuses semaphores (of two holders) as `Misconfigured`.
pub async fn a_provider_without_semaphores_refuses_them<B: ContractBackend>(backend: &B) {
    refuses(backend, LockMode::Semaphore { max_count: 2 }).await;
}

/// Readers in several processes hold a key together; a writer excludes readers and writers, in
/// its own process and in others; every hold is given back at once.
pub async fn readers_hold_together_and_a_writer_holds_alone<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 3, quick_polling()).await;
    let key = unique_prefix("rw");
    let rws: Vec<ReaderWriterLock> = procs.iter().map(|lock| reader_writer(lock, &key)).collect();
    let mut readers = Vec::new();
    for (index, rw) in rws.iter().enumerate() {
        readers.push(required(rw.try_read().await, "a reader beside readers"));
        let what = format!("a second reader in process {index}");
        readers.push(required(rw.try_read().await, &what));
    }
    assert!(readers.iter().all(|handle| handle.is_held()));
    for rw in &rws {
        expect_kind(
            rw.try_write().await,
            ErrorKind::Busy,
            "a writer among readers",
        );
    }
    expect_kind(
        procs[0].try_acquire(&key).await,
        ErrorKind::Busy,
        "a plain lock is the writer: busy among readers",
    );
    for reader in readers {
        required(reader.release().await, "release a reader");
    }
    until_idle(
        &procs[1],
        release_settles_within(backend),
        "readers released",
    )
    .await;
    until_idle(
        &procs[2],
        release_settles_within(backend),
        "readers released",
    )
    .await;

    // The writer must not wait for its own intent: the readers are gone.
    let writer = match tokio::time::timeout(
        release_settles_within(backend) + quick_polling().max_retry_delay * 4,
        rws[1].write(Duration::from_secs(30)),
    )
    .await
    {
        Ok(writer) => required(writer, "the writer once every reader left"),
        Err(_) => panic!("contract broken: the writer did not get in once every reader left"),
    };
    for rw in &rws {
        expect_kind(
            rw.try_read().await,
            ErrorKind::Busy,
            "a reader beside a writer",
        );
        expect_kind(
            rw.try_write().await,
            ErrorKind::Busy,
            "a writer beside a writer",
        );
    }
    required(writer.release().await, "release the writer");
    until_idle(
        &procs[1],
        release_settles_within(backend),
        "the writer released",
    )
    .await;
    let reader = required(rws[0].try_read().await, "a reader after the writer");
    required(reader.release().await, "release");
}

/// A writer that waits behind a stream of overlapping readers is not starved: new readers are
/// held back while it waits, and it gets in soon after the readers it found have left.
pub async fn a_writer_waiting_behind_overlapping_readers_gets_in<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 3, quick_polling()).await;
    let key = unique_prefix("writer-starvation");
    let writer_rw = reader_writer(&procs[0], &key);
    let reader_hold = Duration::from_millis(100);
    let writer_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two reader processes take turns so that some reader always holds the key: each reader
    // starts before the other's ends.
    let mut streams = Vec::new();
    for (process, lock) in procs.iter().enumerate().skip(1) {
        let rw = reader_writer(lock, &key);
        let done = writer_done.clone();
        streams.push(tokio::spawn(async move {
            tokio::time::sleep(reader_hold / 2 * (process as u32 - 1)).await;
            let mut reads = 0usize;
            while !done.load(Ordering::SeqCst) {
                if let Ok(reader) = rw.try_read().await {
                    reads += 1;
                    tokio::time::sleep(reader_hold).await;
                    let _ = reader.release().await;
                } else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            reads
        }));
    }
    // Let the readers overlap for a while before the writer arrives.
    tokio::time::sleep(reader_hold * 3).await;
    let asked = Instant::now();
    // The readers holding when the writer arrives finish within one hold; a reader that got in
    // before the writer's intent reached the backend (PostgreSQL: its watcher queued in the
    // server's lock queue) costs one more. After that, new readers are held back and the
    // backend hands the key to the writer (PostgreSQL grants it to the watcher, and that grant
    // is the writer's lock), so no reader slips in between. Polling steps and a release that
    // settles cover the rest.
    let bound =
        reader_hold * 2 + quick_polling().max_retry_delay * 4 + release_settles_within(backend);
    let writer = tokio::time::timeout(bound * 4, writer_rw.write(Duration::from_secs(60))).await;
    writer_done.store(true, Ordering::SeqCst);
    let waited = asked.elapsed();
    let writer = match writer {
        Ok(writer) => required(writer, "the waiting writer"),
        Err(_) => panic!(
            "contract broken: a writer behind overlapping readers waited over {:?}",
            bound * 4
        ),
    };
    assert!(
        waited <= bound,
        "contract broken: the writer waited {waited:?} behind overlapping readers (bound {bound:?})"
    );
    let mut reads = 0;
    for stream in streams {
        reads += match stream.await {
            Ok(reads) => reads,
            Err(join) => panic!("reader stream failed: {join}"),
        };
    }
    assert!(reads >= 2, "the readers never overlapped ({reads} reads)");
    required(writer.release().await, "release the writer");
}

/// Eighty acquisitions of a semaphore of three by twenty contenders in four processes never
/// have more than three holders at once, and slots are given back at once.
pub async fn a_semaphore_never_has_more_than_its_count_of_holders<B: ContractBackend>(backend: &B) {
    const COUNT: u32 = 3;
    let procs = processes(backend, 4, quick_polling()).await;
    let key = unique_prefix("semaphore");
    let mut semaphores = Vec::new();
    for process in &procs {
        semaphores.push(semaphore(process, &key, COUNT));
    }
    let checker = Arc::new(IntervalChecker::new());
    let most = Arc::new(AtomicUsize::new(0));
    let current = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for contender in 0..20 {
        let process = contender % 4;
        let semaphore = semaphores[process].clone();
        let (checker, most, current, key) =
            (checker.clone(), most.clone(), current.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let slot = required(semaphore.acquire(Duration::from_secs(120)).await, "a slot");
                let start = Instant::now();
                let now = current.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                assert!(slot.is_held(), "lost while held");
                current.fetch_sub(1, Ordering::SeqCst);
                let end = Instant::now();
                checker.record(HeldInterval {
                    key: key.clone(),
                    process,
                    fencing_token: slot.fencing_token(),
                    start,
                    end,
                });
                required(slot.release().await, "release a slot");
            }
        }));
    }
    for task in tasks {
        if let Err(join) = task.await {
            panic!("contender failed: {join}");
        }
    }
    assert_eq!(checker.holds().len(), 80);
    checker.assert_at_most(COUNT as usize);
    assert!(
        most.load(Ordering::SeqCst) >= 2,
        "twenty contenders never held two slots at once: the semaphore acted as a lock"
    );
    // Every slot is free again, for another process, at once.
    for process in &procs {
        until_idle(process, release_settles_within(backend), "slots released").await;
    }
    let mut again = Vec::new();
    for _ in 0..COUNT {
        again.push(required(
            semaphores[0].try_acquire().await,
            "a free slot after the run",
        ));
    }
    expect_kind(
        semaphores[1].try_acquire().await,
        ErrorKind::Busy,
        "a fourth holder",
    );
    // The semaphore's key names no lock: the lock of the same key is free.
    let lock = required(
        procs[2].try_acquire(&key).await,
        "the lock named like the semaphore",
    );
    required(lock.release().await, "release");
    for slot in again {
        required(slot.release().await, "release");
    }
}

/// A semaphore of one is a lock: its holders never overlap, and their fencing tokens grow in
/// the order they held it, across processes.
pub async fn a_semaphore_of_one_hands_out_growing_tokens<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("semaphore-of-one");
    let mut semaphores = Vec::new();
    for process in &procs {
        semaphores.push(semaphore(process, &key, 1));
    }
    let mut last = 0u64;
    for round in 0..6 {
        let semaphore = &semaphores[round % 2];
        let slot = required(semaphore.try_acquire().await, "the only slot");
        expect_kind(
            semaphores[(round + 1) % 2].try_acquire().await,
            ErrorKind::Busy,
            "a second holder of a semaphore of one",
        );
        assert!(
            slot.fencing_token() > last,
            "contract broken: token {} after {last}",
            slot.fencing_token()
        );
        last = slot.fencing_token();
        required(slot.release().await, "release");
        until_idle(
            &procs[round % 2],
            release_settles_within(backend),
            "released",
        )
        .await;
    }
}

/// Dropping a semaphore holder's acquire before (while it waits), during or after its attempt
/// leaks nothing, and a slot is renewed over three lease periods; the same for a reader, on a
/// provider that also has reader-writer locks (it says so through `supports`, which the
/// readers' own cases or their refusal check hold to the declaration).
pub async fn shared_holds_leak_nothing_and_stay_renewed<B: ContractBackend>(backend: &B) {
    let procs = processes(backend, 2, quick_polling()).await;
    let key = unique_prefix("shared-holds");
    let (semaphore, other) = (semaphore(&procs[0], &key, 2), semaphore(&procs[1], &key, 2));
    let rw = procs[0]
        .supports(LockMode::Shared)
        .then(|| reader_writer(&procs[0], &key));
    for polls in 1..=6 {
        drop(abandon_after_polls(semaphore.try_acquire(), polls).await);
        if let Some(rw) = &rw {
            drop(abandon_after_polls(rw.try_read(), polls).await);
        }
        until_idle(
            &procs[0],
            release_settles_within(backend),
            "an abandoned attempt",
        )
        .await;
        let a = required(
            other.try_acquire().await,
            "the first slot from another process",
        );
        let b = required(
            other.try_acquire().await,
            "the second slot from another process",
        );
        required(a.release().await, "release");
        required(b.release().await, "release");
        let writer = required(
            procs[1].try_acquire(&key).await,
            "the writer after readers went",
        );
        required(writer.release().await, "release");
    }

    // Before: a semaphore wait and a reader's wait dropped while they wait.
    let (a, b) = (
        required(other.try_acquire().await, "a slot"),
        required(other.try_acquire().await, "a slot"),
    );
    let writer = match &rw {
        Some(_) => Some(required(procs[1].try_acquire(&key).await, "a writer")),
        None => None,
    };
    let waits = tokio::time::timeout(Duration::from_millis(50), async {
        let slot = semaphore.acquire(Duration::from_secs(30)).await;
        let read = match &rw {
            Some(rw) => Some(rw.read(Duration::from_secs(30)).await),
            None => None,
        };
        (slot.is_ok(), read.map(|r| r.is_ok()))
    })
    .await;
    assert!(waits.is_err(), "the waits should still be waiting");
    for held in [Some(a), Some(b), writer].into_iter().flatten() {
        required(held.release().await, "release");
    }
    until_idle(&procs[0], release_settles_within(backend), "dropped waits").await;
    // After: holds dropped as soon as they were won are given back at once.
    drop(required(semaphore.try_acquire().await, "a slot"));
    if let Some(rw) = &rw {
        drop(required(rw.try_read().await, "a reader"));
    }
    until_idle(&procs[0], release_settles_within(backend), "dropped holds").await;
    let (a, b) = (
        required(other.try_acquire().await, "the first slot after drops"),
        required(other.try_acquire().await, "the second slot after drops"),
    );
    required(a.release().await, "release");
    required(b.release().await, "release");
    let writer = required(
        procs[1].try_acquire(&key).await,
        "the writer after a dropped reader",
    );
    required(writer.release().await, "release");

    stay_renewed(&semaphore, rw.as_ref(), backend.lease_period()).await;
}

/// A slot of `semaphore`, and a reader of `rw` if given, held over three and a half lease
/// periods: renewed, never lost.
async fn stay_renewed(
    semaphore: &DistributedSemaphore,
    rw: Option<&ReaderWriterLock>,
    period: Duration,
) {
    let slot = required(semaphore.try_acquire().await, "a slot");
    let reader = match rw {
        Some(rw) => Some(required(rw.try_read().await, "a reader")),
        None => None,
    };
    let until = Instant::now() + period * 3 + period / 2;
    while Instant::now() < until {
        assert!(
            slot.is_held(),
            "contract broken: a slot was lost while renewed"
        );
        if let Some(reader) = &reader {
            assert!(
                reader.is_held(),
                "contract broken: a reader was lost while renewed"
            );
        }
        tokio::time::sleep(period / 4).await;
    }
    required(slot.release().await, "release the slot");
    if let Some(reader) = reader {
        required(reader.release().await, "release the reader");
    }
}
