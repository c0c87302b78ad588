//! Readers and semaphores on PostgreSQL (row 10), each next to raw SQL, interleaved in one
//! run against one server: `try_read` + `release` against raw shared advisory locks, a
//! semaphore's one free slot against the raw two-key lock of that slot, and the round trips of
//! a semaphore attempt, counted by a proxy.

use std::time::Duration;

use deadpool_postgres::Pool;
use lockingkit::keys::PostgresLockKeys;
use lockingkit::PostgresOptions;
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::proxy::FaultProxy;

use crate::pair::lock_on;
use crate::postgres_pairs::{backend, raw_pair};
use crate::samples::{interleaved, timed, Order, Percentiles, Rounds};

/// Readers and semaphores on PostgreSQL, each next to raw SQL, interleaved in one run.
#[derive(Clone, Debug)]
pub struct ModesReport {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// `ReaderWriterLock::try_read` + `release` through `DistributedLock` (engine included).
    pub shared: Percentiles,
    /// Raw prepared `pg_try_advisory_lock_shared` + `pg_advisory_unlock_shared`, pooled.
    pub raw_shared: Percentiles,
    /// The semaphore's slots, `slots - 1` of them held by another session throughout.
    pub slots: u32,
    /// `DistributedSemaphore::try_acquire` + `release` taking the one free slot.
    pub semaphore: Percentiles,
    /// Raw prepared `pg_try_advisory_lock(int4, int4)` of one known-free slot + unlock.
    pub raw_slot: Percentiles,
    /// Round trips per semaphore `try_acquire`, counted by a TCP proxy in front of the server
    /// (the goal is one: the attempt finds and takes the free slot in one statement).
    pub semaphore_round_trips: f64,
}

impl ModesReport {
    /// The reader pair's median over the raw shared pair's.
    pub fn shared_ratio(&self) -> f64 {
        self.shared.ratio_to(self.raw_shared)
    }

    /// The semaphore pair's median over the raw one-slot pair's.
    pub fn semaphore_ratio(&self) -> f64 {
        self.semaphore.ratio_to(self.raw_slot)
    }
}

const TRY_LOCK_SHARED: &str = "SELECT pg_try_advisory_lock_shared($1)";
const UNLOCK_SHARED: &str = "SELECT pg_advisory_unlock_shared($1)";
const TRY_LOCK_SLOT: &str = "SELECT pg_try_advisory_lock($1::int4, $2::int4)";
const UNLOCK_SLOT: &str = "SELECT pg_advisory_unlock($1::int4, $2::int4)";

/// The semaphore's slots in `measure_modes`.
const SLOTS: u32 = 16;

/// Measures readers and semaphores against raw SQL: `pairs` interleaved pairs of each, after a
/// warm-up, then the round trips of semaphore attempts through a counting proxy.
pub async fn measure_modes(server: &PostgresServer, pairs: usize) -> ModesReport {
    let variants = ModeVariants::connect(server).await;
    let rounds = Rounds::new(pairs, 50, Order::Shuffled);
    let samples = interleaved(rounds, |variant| timed(variants.pair(variant))).await;
    let semaphore_round_trips = semaphore_round_trips(server, &variants.semaphore_key, pairs).await;
    drop(variants);

    let [shared, raw_shared, semaphore, raw_slot] = samples.map(Percentiles::of);
    ModesReport {
        pairs,
        shared,
        raw_shared,
        slots: SLOTS,
        semaphore,
        raw_slot,
        semaphore_round_trips,
    }
}

/// The four variants `measure_modes` compares, with every semaphore slot but one held by
/// another session for the whole run.
struct ModeVariants {
    /// The session holding the other slots; only kept open.
    _occupier: tokio_postgres::Client,
    free_slot: i32,
    readers: lockingkit::ReaderWriterLock,
    semaphore_key: String,
    semaphore: lockingkit::DistributedSemaphore,
    pool: Pool,
    slot_pool: Pool,
    raw_read_key: i64,
    raw_semaphore: i32,
}

impl ModeVariants {
    async fn connect(server: &PostgresServer) -> ModeVariants {
        let pid = std::process::id();
        let read_key = format!("bench/modes/read/{pid}");
        let readers = lock_on(backend(server.options(Duration::from_secs(30))))
            .reader_writer(&read_key)
            .expect("readers on PostgreSQL");
        let semaphore_key = format!("bench/modes/semaphore/{pid}");
        let semaphore = lock_on(backend(server.options(Duration::from_secs(30))))
            .semaphore(&semaphore_key, SLOTS)
            .expect("a semaphore on PostgreSQL");

        let occupier = server.connect().await;
        let semaphore_id = PostgresLockKeys::semaphore_key(&semaphore_key);
        for slot in 0..SLOTS as i32 - 1 {
            occupier
                .query_one(TRY_LOCK_SLOT, &[&semaphore_id, &slot])
                .await
                .expect("occupy a slot");
        }
        ModeVariants {
            _occupier: occupier,
            free_slot: SLOTS as i32 - 1,
            readers,
            semaphore_key,
            semaphore,
            pool: server.plain_pool(1),
            slot_pool: server.plain_pool(1),
            raw_read_key: PostgresLockKeys::advisory_key(&format!("bench/modes/raw-read/{pid}")),
            raw_semaphore: PostgresLockKeys::semaphore_key(&format!("bench/modes/raw-slot/{pid}")),
        }
    }

    /// One pair of `variant`: 0 reader, 1 raw shared, 2 semaphore, 3 raw slot.
    async fn pair(&self, variant: usize) {
        match variant {
            0 => self
                .readers
                .try_read()
                .await
                .expect("reader")
                .release()
                .await
                .expect("reader release"),
            1 => {
                raw_pair(
                    &self.pool,
                    TRY_LOCK_SHARED,
                    UNLOCK_SHARED,
                    &[&self.raw_read_key],
                )
                .await
            }
            2 => self
                .semaphore
                .try_acquire()
                .await
                .expect("the one free slot")
                .release()
                .await
                .expect("slot release"),
            _ => {
                let slot = &self.slot_pool;
                raw_pair(
                    slot,
                    TRY_LOCK_SLOT,
                    UNLOCK_SLOT,
                    &[&self.raw_semaphore, &self.free_slot],
                )
                .await;
            }
        }
    }
}

/// Round trips per attempt of the semaphore at `semaphore_key`, through a proxy that counts
/// request/answer exchanges.
async fn semaphore_round_trips(server: &PostgresServer, semaphore_key: &str, pairs: usize) -> f64 {
    let proxy = FaultProxy::to_port(server.port()).await;
    let counted = lock_on(backend(
        PostgresOptions::new(format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            proxy.port()
        ))
        .with_check_interval(Duration::from_secs(30)),
    ))
    .semaphore(semaphore_key, SLOTS)
    .expect("a semaphore");
    // The first attempt opens the session and prepares the statement.
    counted
        .try_acquire()
        .await
        .expect("slot")
        .release()
        .await
        .expect("release");
    let attempts = 20.min(pairs.max(1));
    let mut round_trips = 0;
    for _ in 0..attempts {
        let before = proxy.exchanges().len();
        let held = counted.try_acquire().await.expect("the one free slot");
        round_trips += proxy.exchanges().len() - before;
        held.release().await.expect("release");
    }
    round_trips as f64 / attempts as f64
}
