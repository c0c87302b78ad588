//! The MySQL rows of the benchmark, on a throwaway MariaDB server (`lockingkit-tests`'
//! fixture; `scripts/setup-mariadb.sh` installs the binaries), each next to the very same
//! statements sent raw through mysql_async (`benches/benches/lockingkit.rs` prints the rows):
//!
//! - **pair**: `try_acquire` + `release` through `DistributedLock` on `MysqlBackend` with the
//!   default options, next to the provider's two statements sent by hand on one connection —
//!   `UPDATE lockingkit_fencing_now SET v = IF(GET_LOCK(?, 0) = 1, LAST_INSERT_ID(v + 1), v)
//!   WHERE id = 1` (lock and fencing token in one round trip, on the MEMORY count) then
//!   `SELECT RELEASE_LOCK(?)`, both
//!   prepared once through the connection's statement cache, as the provider's are — and next
//!   to the backend alone (`LockBackend` without the engine). One key per variant, reused every
//!   round, as the PostgreSQL pair does; a fresh random order every round.
//! - **throughput**: 256 tasks on keys of their own, pairs per second through one
//!   `DistributedLock` (its default session budget) next to the same raw statements over a
//!   mysql_async `Pool` of 16 connections, one checked out per pair; rounds of each alternate.
//!   LockingKit's connections are counted at the socket: every TCP connection this process has
//!   open to the server once the rounds are over and the raw pool is closed, whatever the
//!   backend uses each for.
//! - **hand-off**: from the start of a holder's `release` to the moment a waiter in another
//!   `DistributedLock` (a backend of its own: its sessions, its waiting sessions), blocked in
//!   `acquire`, holds the key: the server grants the waiter's queued `GET_LOCK`.
//!
//! Both sides connect the same way: over TCP to the URL's address (`prefer_socket=false`, the
//! provider's default). When measuring for real, the rows run with this process on one CPU and
//! the server on another ([`SplitCpus`]): on the 2-CPU VM, a client and a server that share
//! both CPUs give pair latencies in two bands some 50 µs apart, and a median lands in either.

use std::time::Duration;

use lockingkit::keys::MysqlLockKeys;
use lockingkit::{DistributedLock, MysqlBackend, MysqlOptions};
use lockingkit_tests::mariadb::MariaDbServer;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts};
use tokio::sync::Mutex;

use crate::cpus::SplitCpus;
use crate::handoff::handoff;
use crate::load::{alternating, connections_to, pairs_for, Throughput, WARM_UP};
use crate::pair::{backend_pair, lock_on, lock_pair};
use crate::postgres_throughput::max_sessions_override;
use crate::samples::{interleaved, timed, Order, Percentiles, Rounds};

/// The provider's exclusive attempt, byte for byte: the lock and, only if it was granted, the
/// draw of the fencing token's count.
pub const RAW_LOCK: &str = "SELECT CASE GET_LOCK(?, 0) WHEN 1 THEN UUID_SHORT() WHEN 0 THEN 0 END";
/// The provider's unlock.
pub const RAW_UNLOCK: &str = "SELECT RELEASE_LOCK(?)";

/// The connections of the raw pool, as the baseline.
const RAW_POOL: usize = 16;

/// Sample counts for the MySQL rows.
#[derive(Clone, Copy, Debug)]
pub struct MysqlSizes {
    /// Pairs of each variant.
    pub pairs: usize,
    /// Cross-process hand-offs.
    pub handoffs: usize,
    /// Rounds of each side of the throughput row.
    pub load_rounds: usize,
    /// How long each of those rounds runs.
    pub load_round: Duration,
    /// Whether to run the client and the server on CPUs of their own (see [`SplitCpus`]).
    pub split_cpus: bool,
}

/// The provider on `server` with default options.
pub fn backend(server: &MariaDbServer) -> MysqlBackend {
    MysqlBackend::new(MysqlOptions::new(server.url())).expect("options")
}

/// A `DistributedLock` on `server` with default options.
pub fn lock(server: &MariaDbServer) -> DistributedLock {
    lock_on(backend(server))
}

/// The raw client's options for `server`: the URL, over TCP to its address.
pub fn raw_options(server: &MariaDbServer) -> OptsBuilder {
    let url = Opts::from_url(&server.url()).expect("a mysql:// URL");
    OptsBuilder::from_opts(url).prefer_socket(false)
}

/// One raw pair of the lock name `name` on `conn`: the lock statement (which must grant it
/// with a fencing token), then the unlock.
pub async fn raw_pair(conn: &mut Conn, name: &str) {
    let drawn: Option<Option<u64>> = conn.exec_first(RAW_LOCK, (name,)).await.expect("raw lock");
    assert!(
        matches!(drawn, Some(Some(drawn)) if drawn > 0),
        "the raw lock was busy"
    );
    let released: Option<i64> = conn.exec_first(RAW_UNLOCK, (name,)).await.expect("unlock");
    assert_eq!(released, Some(1), "the raw unlock was refused");
}

/// What the MySQL rows measured.
#[derive(Clone, Debug)]
pub struct MysqlReport {
    /// The pair row.
    pub pairs: MysqlPairs,
    /// The throughput row.
    pub throughput: Throughput,
    /// Cross-process hand-offs, release to the waiter holding the key.
    pub handoff: Percentiles,
    /// How many hand-offs were measured.
    pub handoffs: usize,
    /// Where the client and the server ran.
    pub cpus: String,
}

/// Every MySQL row, on one server started for them.
pub async fn measure(sizes: MysqlSizes) -> MysqlReport {
    let server = MariaDbServer::start().await;
    let split = sizes
        .split_cpus
        .then(|| server.pid().and_then(SplitCpus::pin))
        .flatten();
    let cpus = split.as_ref().map_or_else(
        || "client and server on any CPU".to_owned(),
        SplitCpus::describe,
    );
    let pairs = measure_pairs(&server, sizes.pairs).await;
    let (rounds, length) = (sizes.load_rounds, sizes.load_round);
    let throughput = throughput(&server, 256, rounds, length).await;
    let handoff = cross_process(&server, sizes.handoffs).await;
    drop(split);
    MysqlReport {
        pairs,
        throughput,
        handoff,
        handoffs: sizes.handoffs,
        cpus,
    }
}

/// The latencies of the pair row.
#[derive(Clone, Copy, Debug)]
pub struct MysqlPairs {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// LockingKit `try_acquire` + `release`.
    pub lockingkit: Percentiles,
    /// The same statements sent raw on one connection.
    pub raw: Percentiles,
    /// The MySQL backend alone, without the engine.
    pub backend_only: Percentiles,
}

impl MysqlPairs {
    /// LockingKit's median over the raw statements' (the goal is at most 1.10).
    pub fn ratio(&self) -> f64 {
        self.lockingkit.ratio_to(self.raw)
    }
}

/// Measures `pairs` pairs of each variant, interleaved in a fresh order every round, after a
/// warm-up.
pub async fn measure_pairs(server: &MariaDbServer, pairs: usize) -> MysqlPairs {
    let pid = std::process::id();
    let locks = lock(server);
    let bare = backend(server);
    let keys = [
        format!("bench/mysql/lockingkit/{pid}"),
        format!("bench/mysql/raw/{pid}"),
        format!("bench/mysql/backend/{pid}"),
    ];
    // A first LockingKit pair, so that its session is open and its fencing epoch read.
    lock_pair(&locks, &keys[0]).await;
    let conn = Conn::new(raw_options(server))
        .await
        .expect("raw connection");
    // Locked outside the timed pair: it only hands the one connection to the variant.
    let conn = Mutex::new(conn);
    let raw_name = MysqlLockKeys::lock_name(&keys[1]);
    let rounds = Rounds::new(pairs, 100, Order::Shuffled);
    let samples = interleaved(rounds, |variant| {
        let (locks, bare, conn, raw_name, key) = (&locks, &bare, &conn, &raw_name, &keys[variant]);
        async move {
            match variant {
                0 => timed(lock_pair(locks, key)).await,
                1 => {
                    let mut conn = conn.lock().await;
                    timed(raw_pair(&mut conn, raw_name)).await
                }
                _ => timed(backend_pair(bare, key)).await,
            }
        }
    })
    .await;
    let [lockingkit, raw, backend_only] = samples.map(Percentiles::of);
    let conn = conn.into_inner();
    conn.disconnect().await.expect("the raw connection closes");
    MysqlPairs {
        pairs,
        lockingkit,
        raw,
        backend_only,
    }
}

/// Alternates `rounds` rounds of LockingKit and raw pairs, `length` each, `tasks` at once, each
/// task on a key of its own. LockingKit runs on the default session budget unless
/// `LOCKINGKIT_BENCH_MAX_SESSIONS` sets another, as rows 7 and 8 do.
pub async fn throughput(
    server: &MariaDbServer,
    tasks: usize,
    rounds: usize,
    length: Duration,
) -> Throughput {
    let pid = std::process::id();
    let mut options = MysqlOptions::new(server.url());
    if let Some(sessions) = max_sessions_override() {
        options = options.with_max_sessions(sessions);
    }
    let locks = lock_on(MysqlBackend::new(options).expect("options"));
    let kit_pair = {
        let locks = locks.clone();
        move |task: usize, _round: u64| {
            let locks = locks.clone();
            async move { lock_pair(&locks, &format!("bench/mysql/throughput/{pid}/{task}")).await }
        }
    };
    // Warm-up: sessions open, statements prepared.
    pairs_for(tasks, WARM_UP, kit_pair.clone()).await;
    let pool = raw_pool(server);
    let raw_pair = {
        let pool = pool.clone();
        move |task: usize, _round: u64| {
            let pool = pool.clone();
            async move {
                let key = format!("bench/mysql/raw-throughput/{pid}/{task}");
                let mut conn = pool.get_conn().await.expect("pooled connection");
                raw_pair(&mut conn, &MysqlLockKeys::lock_name(&key)).await;
            }
        }
    };
    pairs_for(tasks, WARM_UP, raw_pair.clone()).await;
    let (kit_per_s, raw_per_s) = alternating(tasks, rounds, length, kit_pair, raw_pair).await;
    pool.disconnect().await.expect("the raw pool closes");
    // Only LockingKit's backend is connected now, its sessions opened by the rounds' load.
    let lockingkit_connections = connections_to(&[server.port()]);
    drop(locks);
    Throughput {
        lockingkit_pairs_per_s: kit_per_s,
        lockingkit_connections,
        raw_pairs_per_s: raw_per_s,
        raw_connections: RAW_POOL,
    }
}

/// The raw side's pool of [`RAW_POOL`] connections. It keeps a connection as it is between
/// checkouts (no `COM_RESET_CONNECTION`, mysql_async's default, which would also drop its
/// prepared statements): the cheapest way the same statements can go through a pool.
fn raw_pool(server: &MariaDbServer) -> Pool {
    let constraints = PoolConstraints::new(RAW_POOL, RAW_POOL).expect("pool constraints");
    let pool_options = PoolOpts::default()
        .with_constraints(constraints)
        .with_reset_connection(false);
    Pool::new(raw_options(server).pool_opts(pool_options))
}

/// Cross-process hand-offs: `holder` and the waiter are `DistributedLock`s on backends of
/// their own, as two processes have. Each hold lasts 2 to 20 ms, so a few hundred samples take
/// a few seconds; the waiter's `GET_LOCK` is queued at the server within the first of them
/// (its waiting session kept from one sample to the next), and a queued `GET_LOCK` is granted
/// the moment the key is freed whenever that is, except in the one round trip every 2 s
/// slice spends sending it again. A few hand-offs first, not counted, open the waiting session.
pub async fn cross_process(server: &MariaDbServer, samples: usize) -> Percentiles {
    let key = format!("bench/mysql/handoff/{}", std::process::id());
    let (holder, waiter) = (lock(server), lock(server));
    let hold = |i: usize| Duration::from_millis(2 + (i as u64 * 7) % 19);
    handoff(&holder, &waiter, &key, 5.min(samples), hold).await;
    handoff(&holder, &waiter, &key, samples, hold).await
}
