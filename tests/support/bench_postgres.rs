//! What LockingKit adds to a PostgreSQL advisory-lock round trip: `try_acquire` + `release`
//! through the lock next to raw prepared statements, interleaved in one run against one server.
//!
//! Per pair, LockingKit checks a connection out of its pool, runs the prepared
//! `SELECT nextval(…) FROM (SELECT pg_try_advisory_lock($1) …) WHERE ok` (lock and fencing
//! token in one round trip), lets the engine start keeping the lock, runs the prepared
//! `pg_advisory_unlock($1)` and returns the connection to the pool: two round trips, like the
//! baselines.
//!
//! - **raw pooled** (the reference): a deadpool-postgres pool of one connection, one checkout
//!   per pair, cached prepared `pg_try_advisory_lock($1)` and `pg_advisory_unlock($1)`;
//! - **raw dedicated**: one client held for the whole run, statements prepared once;
//! - **raw with fencing**: raw pooled, but locking with LockingKit's statement: what the
//!   fencing token costs the server;
//! - **backend alone**: `PostgresBackend` through the `LockBackend` trait without the engine:
//!   what the provider adds over raw with fencing, and, against `lockingkit`, what the engine
//!   adds (waiting room, the task that checks the held connection, telemetry).
//!
//! The variants run in a fresh random order every round, inside a runtime task, as
//! application code would.
//!
//! For profiling, `LOCKINGKIT_BENCH_VARIANT=<n>` runs variant `n` alone (0 LockingKit, 1 raw
//! pooled, 2 raw dedicated, 3 raw with fencing, 4 backend alone); the others report zero.

use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use lockingkit::backend::LockBackend;
use lockingkit::keys::PostgresLockKeys;
use lockingkit::providers::postgres::{DEFAULT_FENCING_SCHEMA, DEFAULT_FENCING_SEQUENCE};
use lockingkit::{DistributedLock, LockMode, PostgresBackend};

use crate::postgres::PostgresServer;

/// Names the one variant to run, for profiling it alone.
const VARIANT_ENV: &str = "LOCKINGKIT_BENCH_VARIANT";

const TRY_LOCK: &str = "SELECT pg_try_advisory_lock($1)";
const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

/// Median and 99th percentile of one variant.
#[derive(Clone, Copy, Debug)]
pub struct Latency {
    pub median: Duration,
    pub p99: Duration,
}

/// The latencies of one run.
#[derive(Clone, Debug)]
pub struct PostgresBenchReport {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// LockingKit `try_acquire` + `release`.
    pub lockingkit: Latency,
    /// Raw prepared try-lock + unlock on a connection checked out of a pool.
    pub raw_pooled: Latency,
    /// Raw prepared try-lock + unlock on one client held throughout.
    pub raw_dedicated: Latency,
    /// Raw prepared lock-with-fencing statement + unlock on a pooled connection: the server's
    /// share of LockingKit's cost.
    pub raw_fenced: Latency,
    /// The PostgreSQL backend alone (`LockBackend::try_acquire` + `release`), without the
    /// engine: the engine's share is the difference to `lockingkit`.
    pub backend_only: Latency,
}

impl PostgresBenchReport {
    /// LockingKit's median over the raw pooled median (the goal is at most 1.10).
    pub fn ratio(&self) -> f64 {
        self.lockingkit.median.as_secs_f64() / self.raw_pooled.median.as_secs_f64()
    }

    /// LockingKit's median over the dedicated client's.
    pub fn ratio_to_dedicated(&self) -> f64 {
        self.lockingkit.median.as_secs_f64() / self.raw_dedicated.median.as_secs_f64()
    }

    /// A few lines for humans.
    pub fn render(&self) -> String {
        let line = |name: &str, l: Latency| {
            format!(
                "  {name:<38} median {:>8.1} µs   p99 {:>8.1} µs\n",
                micros(l.median),
                micros(l.p99)
            )
        };
        format!(
            "PostgreSQL acquire+release over loopback TCP, {} interleaved pairs each:\n{}{}{}{}{}  \
             ratio lockingkit / raw pooled (median)   {:.3} (goal <= 1.10)\n  \
             ratio lockingkit / raw dedicated (median) {:.3}",
            self.pairs,
            line("lockingkit try_acquire+release", self.lockingkit),
            line("raw prepared, pooled connection", self.raw_pooled),
            line("raw prepared, dedicated connection", self.raw_dedicated),
            line("raw prepared with fencing, pooled", self.raw_fenced),
            line("PostgresBackend alone (no engine)", self.backend_only),
            self.ratio(),
            self.ratio_to_dedicated(),
        )
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The median and 99th percentile of `samples`.
pub fn latency(mut samples: Vec<Duration>) -> Latency {
    samples.sort_unstable();
    let at = |q: f64| {
        let index = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(index).copied().unwrap_or_default()
    };
    Latency {
        median: at(0.5),
        p99: at(0.99),
    }
}

/// Measures `pairs` pairs of each variant, interleaved, after a warm-up.
pub async fn measure(server: &PostgresServer, pairs: usize) -> PostgresBenchReport {
    let variants = PairVariants::connect(server).await;
    let only: Option<usize> = std::env::var(VARIANT_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok());
    let samples: [Vec<Duration>; 5] =
        interleaved(pairs, only, |variant| variants.pair(variant)).await;
    let [kit, pooled, dedicated, fenced, backend_only] = samples;
    PostgresBenchReport {
        pairs,
        lockingkit: latency(kit),
        raw_pooled: latency(pooled),
        raw_dedicated: latency(dedicated),
        raw_fenced: latency(fenced),
        backend_only: latency(backend_only),
    }
}

/// Runs `pair` of every variant `warm_up + pairs` times, in a fresh random order every
/// round, and answers the times of the rounds after the warm-up, per variant. `only` runs one
/// variant alone; the others answer no samples.
async fn interleaved<const VARIANTS: usize, Pair: std::future::Future<Output = ()>>(
    pairs: usize,
    only: Option<usize>,
    pair: impl Fn(usize) -> Pair,
) -> [Vec<Duration>; VARIANTS] {
    let mut samples: [Vec<Duration>; VARIANTS] = std::array::from_fn(|_| Vec::new());
    let warm_up = 50.min(pairs);
    let mut order: [usize; VARIANTS] = std::array::from_fn(|v| v);
    let mut random = Shuffle::seeded();
    for round in 0..warm_up + pairs {
        // A fresh order every round, so no variant systematically follows another (the
        // background work a LockingKit release leaves would otherwise land on one neighbour).
        random.shuffle(&mut order);
        for variant in order {
            if only.is_some_and(|only| only != variant) {
                continue;
            }
            let started = Instant::now();
            pair(variant).await;
            if round >= warm_up {
                samples[variant].push(started.elapsed());
            }
        }
    }
    samples
}

/// The five variants `measure` compares, each with a key and a connection of its own, so
/// none is warmer for being used more often.
struct PairVariants {
    dedicated: tokio_postgres::Client,
    try_lock: tokio_postgres::Statement,
    unlock: tokio_postgres::Statement,
    dedicated_key: i64,
    pool: Pool,
    pooled_key: i64,
    fenced_pool: Pool,
    fenced_key: i64,
    fenced_lock: String,
    bare: PostgresBackend,
    bare_key: String,
    locks: DistributedLock,
    kit_key: String,
}

impl PairVariants {
    async fn connect(server: &PostgresServer) -> PairVariants {
        let pid = std::process::id();
        let backend =
            PostgresBackend::new(server.options(Duration::from_secs(5))).expect("options");
        let locks = DistributedLock::builder(backend).build().expect("lock");
        let kit_key = format!("bench/lockingkit/{pid}");
        let bare = PostgresBackend::new(server.options(Duration::from_secs(5))).expect("options");
        let bare_key = format!("bench/backend/{pid}");
        let pool = raw_pool(server, 1);
        let fenced_pool = raw_pool(server, 1);
        let pooled_key = PostgresLockKeys::advisory_key(&format!("bench/pooled/{pid}"));
        let fenced_key = PostgresLockKeys::advisory_key(&format!("bench/fenced/{pid}"));
        let fenced_lock = format!(
            "SELECT nextval('{}.{}') FROM (SELECT pg_try_advisory_lock($1) AS ok OFFSET 0) s WHERE ok",
            DEFAULT_FENCING_SCHEMA, DEFAULT_FENCING_SEQUENCE
        );
        let dedicated = server.connect().await;
        let try_lock = dedicated.prepare(TRY_LOCK).await.expect("prepare");
        let unlock = dedicated.prepare(UNLOCK).await.expect("prepare");
        let dedicated_key = PostgresLockKeys::advisory_key(&format!("bench/dedicated/{pid}"));

        // The first LockingKit attempt creates the fencing sequence the raw fenced variant uses.
        locks
            .try_acquire(&kit_key)
            .await
            .expect("first lock")
            .release()
            .await
            .expect("first release");
        PairVariants {
            dedicated,
            try_lock,
            unlock,
            dedicated_key,
            pool,
            pooled_key,
            fenced_pool,
            fenced_key,
            fenced_lock,
            bare,
            bare_key,
            locks,
            kit_key,
        }
    }

    /// One pair of `variant`: 0 LockingKit, 1 raw pooled, 2 raw dedicated, 3 raw with
    /// fencing, 4 the backend alone.
    async fn pair(&self, variant: usize) {
        match variant {
            0 => self
                .locks
                .try_acquire(&self.kit_key)
                .await
                .expect("lockingkit acquire")
                .release()
                .await
                .expect("lockingkit release"),
            1 => {
                let client = self.pool.get().await.expect("pooled connection");
                raw_pair(&client, TRY_LOCK, self.pooled_key).await;
            }
            2 => self.dedicated_pair().await,
            3 => {
                let client = self.fenced_pool.get().await.expect("pooled connection");
                raw_pair(&client, &self.fenced_lock, self.fenced_key).await;
            }
            _ => {
                let acquired = self
                    .bare
                    .try_acquire(&self.bare_key, LockMode::Exclusive)
                    .await
                    .expect("backend acquire")
                    .expect("backend lock was busy");
                self.bare
                    .release(&acquired.lease)
                    .await
                    .expect("backend release");
            }
        }
    }

    async fn dedicated_pair(&self) {
        let taken: bool = self
            .dedicated
            .query_one(&self.try_lock, &[&self.dedicated_key])
            .await
            .expect("raw lock")
            .get(0);
        assert!(taken, "the raw dedicated lock was busy");
        let released: bool = self
            .dedicated
            .query_one(&self.unlock, &[&self.dedicated_key])
            .await
            .expect("raw unlock")
            .get(0);
        assert!(released, "the raw dedicated unlock was refused");
    }
}

/// A deadpool-postgres pool of up to `size` plain connections to `server`, as an application
/// that takes advisory locks by hand would use.
pub fn raw_pool(server: &PostgresServer, size: usize) -> Pool {
    let config: tokio_postgres::Config = server.connection_string().parse().expect("config");
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager).max_size(size).build().expect("pool")
}

/// A small xorshift generator: enough to shuffle the order of variants.
pub struct Shuffle(u64);

impl Shuffle {
    /// Seeded from the clock: a fresh order every run.
    pub fn seeded() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Shuffle(nanos | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Shuffles `items` in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// One raw pair on a pooled connection: `lock_sql` (answers a row when taken) then unlock.
async fn raw_pair(client: &deadpool_postgres::Client, lock_sql: &str, key: i64) {
    let lock = client.prepare_cached(lock_sql).await.expect("prepare");
    let unlock = client.prepare_cached(UNLOCK).await.expect("prepare");
    let row = client
        .query_opt(&lock, &[&key])
        .await
        .expect("raw lock")
        .expect("the raw lock answered no row");
    if let Ok(taken) = row.try_get::<_, bool>(0) {
        assert!(taken, "the raw pooled lock was busy");
    }
    let released: bool = client
        .query_one(&unlock, &[&key])
        .await
        .expect("raw unlock")
        .get(0);
    assert!(released, "the raw pooled unlock was refused");
}

/// Readers and semaphores on PostgreSQL, each next to raw SQL, interleaved in one run.
#[derive(Clone, Debug)]
pub struct ModesReport {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// `ReaderWriterLock::try_read` + `release` through `DistributedLock` (engine included).
    pub shared: Latency,
    /// Raw prepared `pg_try_advisory_lock_shared` + `pg_advisory_unlock_shared`, pooled.
    pub raw_shared: Latency,
    /// The semaphore's slots, `slots - 1` of them held by another session throughout.
    pub slots: u32,
    /// `DistributedSemaphore::try_acquire` + `release` taking the one free slot.
    pub semaphore: Latency,
    /// Raw prepared `pg_try_advisory_lock(int4, int4)` of one known-free slot + unlock.
    pub raw_slot: Latency,
    /// Round trips per semaphore `try_acquire`, counted by a TCP proxy in front of the server
    /// (the goal is one: the attempt finds and takes the free slot in one statement).
    pub semaphore_round_trips: f64,
}

impl ModesReport {
    /// The reader pair's median over the raw shared pair's.
    pub fn shared_ratio(&self) -> f64 {
        self.shared.median.as_secs_f64() / self.raw_shared.median.as_secs_f64()
    }

    /// The semaphore pair's median over the raw one-slot pair's.
    pub fn semaphore_ratio(&self) -> f64 {
        self.semaphore.median.as_secs_f64() / self.raw_slot.median.as_secs_f64()
    }
}

const TRY_LOCK_SHARED: &str = "SELECT pg_try_advisory_lock_shared($1)";
const UNLOCK_SHARED: &str = "SELECT pg_advisory_unlock_shared($1)";
const TRY_LOCK_SLOT: &str = "SELECT pg_try_advisory_lock($1::int4, $2::int4)";
const UNLOCK_SLOT: &str = "SELECT pg_advisory_unlock($1::int4, $2::int4)";

/// The semaphore's slots in `measure_modes`.
const SLOTS: u32 = 16;

fn postgres_lock(options: lockingkit::PostgresOptions) -> DistributedLock {
    let backend = PostgresBackend::new(options).expect("options");
    DistributedLock::builder(backend).build().expect("lock")
}

/// Measures readers and semaphores against raw SQL: `pairs` interleaved pairs of each, after a
/// warm-up, then the round trips of semaphore attempts through a counting proxy.
pub async fn measure_modes(server: &PostgresServer, pairs: usize) -> ModesReport {
    let variants = ModeVariants::connect(server).await;
    let samples: [Vec<Duration>; 4] =
        interleaved(pairs, None, |variant| variants.pair(variant)).await;
    let semaphore_round_trips = semaphore_round_trips(server, &variants.semaphore_key, pairs).await;
    drop(variants);

    let [shared, raw_shared, semaphore, raw_slot] = samples;
    ModesReport {
        pairs,
        shared: latency(shared),
        raw_shared: latency(raw_shared),
        slots: SLOTS,
        semaphore: latency(semaphore),
        raw_slot: latency(raw_slot),
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
        let readers = postgres_lock(server.options(Duration::from_secs(30)))
            .reader_writer(&read_key)
            .expect("readers on PostgreSQL");
        let semaphore_key = format!("bench/modes/semaphore/{pid}");
        let semaphore = postgres_lock(server.options(Duration::from_secs(30)))
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
            pool: raw_pool(server, 1),
            slot_pool: raw_pool(server, 1),
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
            1 => self.raw_shared_pair().await,
            2 => self
                .semaphore
                .try_acquire()
                .await
                .expect("the one free slot")
                .release()
                .await
                .expect("slot release"),
            _ => self.raw_slot_pair().await,
        }
    }

    async fn raw_shared_pair(&self) {
        let client = self.pool.get().await.expect("pooled connection");
        let lock = client
            .prepare_cached(TRY_LOCK_SHARED)
            .await
            .expect("prepare");
        let unlock = client.prepare_cached(UNLOCK_SHARED).await.expect("prepare");
        let taken: bool = client
            .query_one(&lock, &[&self.raw_read_key])
            .await
            .expect("raw shared lock")
            .get(0);
        assert!(taken, "the raw shared lock was refused");
        let released: bool = client
            .query_one(&unlock, &[&self.raw_read_key])
            .await
            .expect("raw shared unlock")
            .get(0);
        assert!(released);
    }

    async fn raw_slot_pair(&self) {
        let client = self.slot_pool.get().await.expect("pooled connection");
        let lock = client.prepare_cached(TRY_LOCK_SLOT).await.expect("prepare");
        let unlock = client.prepare_cached(UNLOCK_SLOT).await.expect("prepare");
        let taken: bool = client
            .query_one(&lock, &[&self.raw_semaphore, &self.free_slot])
            .await
            .expect("raw slot lock")
            .get(0);
        assert!(taken, "the raw slot was taken");
        let released: bool = client
            .query_one(&unlock, &[&self.raw_semaphore, &self.free_slot])
            .await
            .expect("raw slot unlock")
            .get(0);
        assert!(released);
    }
}

/// Round trips per attempt of the semaphore at `semaphore_key`, through a proxy that counts
/// request/answer exchanges.
async fn semaphore_round_trips(server: &PostgresServer, semaphore_key: &str, pairs: usize) -> f64 {
    let proxy = crate::proxy::FaultProxy::to_port(server.port()).await;
    let counted = postgres_lock(lockingkit::PostgresOptions {
        connection_string: format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            proxy.port()
        )
        .into(),
        check_interval: Duration::from_secs(30),
        ..lockingkit::PostgresOptions::default()
    })
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
