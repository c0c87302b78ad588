//! LockingKit's MySQL try_acquire + release next to distributed-lock-mysql's `try_acquire` +
//! `release` (`GET_LOCK` on a sqlx 0.8 pool) and the statements of each sent raw through
//! mysql_async, interleaved in one run against one throwaway MariaDB server.
//!
//! ```text
//! scripts/setup-mariadb.sh
//! cd bench-peers && cargo bench --bench mysql_peer
//! ```
//!
//! Like the benchmark's MySQL rows, it runs this process on one CPU and the server on another
//! (`lockingkit_benches::cpus`); `LOCKINGKIT_BENCH_ANY_CPU=1` lets both run anywhere.
//!
//! Variants, in a fresh random order every round, each on a key of its own reused every round:
//! - LockingKit `try_acquire` + `release` on `MysqlBackend` with the default options (the lock
//!   and its fencing token in one statement, on one of its shared sessions);
//! - distributed-lock-mysql `try_acquire` + `release` as its docs build it,
//!   `MySqlLockProvider::new(url)`: a sqlx pool with sqlx's defaults, which pings a connection
//!   at every checkout (`test_before_acquire`), the checkout timed; no fencing token;
//! - the same on a sqlx pool without that ping, the peer's cheapest configuration;
//! - LockingKit's two statements raw on one mysql_async connection (row 15's baseline);
//! - the peer's two statements raw on one mysql_async connection: `SELECT GET_LOCK(?, 0)` and
//!   `SELECT RELEASE_LOCK(?)`, prepared once, no fencing.

use std::time::Duration;

use distributed_lock_core::traits::{DistributedLock as _, LockHandle as _, LockProvider as _};
use distributed_lock_mysql::lock::MySqlDistributedLock;
use distributed_lock_mysql::MySqlLockProvider;
use lockingkit::keys::MysqlLockKeys;
use lockingkit::DistributedLock;
use lockingkit_benches::cpus::SplitCpus;
use lockingkit_benches::mode::{in_task, two_worker_runtime, BenchMode};
use lockingkit_benches::mysql_rows::{lock, raw_options, raw_pair};
use lockingkit_benches::pair::lock_pair;
use lockingkit_benches::samples::{interleaved, timed, Order, Percentiles, Rounds};
use lockingkit_tests::mariadb::MariaDbServer;
use mysql_async::prelude::Queryable;
use mysql_async::Conn;
use tokio::sync::Mutex;

const PAIRS: usize = 5000;
const WARM_UP: usize = 200;

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let pairs = mode.pick(PAIRS, 20);
    in_task(
        &two_worker_runtime(),
        "the MySQL peer benchmark",
        measure(pairs),
    );
}

/// Every variant, each with its lock (or connection) and key.
struct Variants {
    locks: DistributedLock,
    kit_key: String,
    peer: MySqlDistributedLock,
    peer_unpinged: MySqlDistributedLock,
    raw: Mutex<Conn>,
    raw_name: String,
    bare: Mutex<Conn>,
    bare_name: String,
}

impl Variants {
    async fn connect(server: &MariaDbServer) -> Variants {
        let pid = std::process::id();
        // TLS off for the peer's sqlx as for mysql_async (the fixture's server has no TLS
        // either way; this only keeps sqlx from asking for it).
        let url = format!("{}?ssl-mode=DISABLED", server.url());
        let provider = MySqlLockProvider::new(url.clone())
            .await
            .expect("distributed-lock-mysql provider");
        let pool = sqlx_mysql_peer::mysql::MySqlPoolOptions::new()
            .test_before_acquire(false)
            .connect(&url)
            .await
            .expect("sqlx pool");
        let unpinged = MySqlLockProvider::builder()
            .pool(pool)
            .build()
            .await
            .expect("distributed-lock-mysql provider");
        let locks = lock(server);
        let kit_key = format!("peers/lockingkit/{pid}");
        // A first LockingKit pair, so that its session is open and its fencing epoch read.
        lock_pair(&locks, &kit_key).await;
        let connect = || async { Conn::new(raw_options(server)).await.expect("connection") };
        Variants {
            locks,
            kit_key,
            peer: provider.create_lock(&format!("peers/dlm/{pid}")),
            peer_unpinged: unpinged.create_lock(&format!("peers/dlm-unpinged/{pid}")),
            raw: Mutex::new(connect().await),
            raw_name: MysqlLockKeys::lock_name(&format!("peers/raw/{pid}")),
            bare: Mutex::new(connect().await),
            bare_name: format!("peers/bare/{pid}"),
        }
    }

    /// One timed pair of `variant`, in the order of the module docs.
    async fn pair(&self, variant: usize) -> Duration {
        match variant {
            0 => timed(lock_pair(&self.locks, &self.kit_key)).await,
            1 => timed(peer_pair(&self.peer)).await,
            2 => timed(peer_pair(&self.peer_unpinged)).await,
            3 => {
                let mut conn = self.raw.lock().await;
                timed(raw_pair(&mut conn, &self.raw_name)).await
            }
            _ => {
                let mut conn = self.bare.lock().await;
                timed(bare_pair(&mut conn, &self.bare_name)).await
            }
        }
    }
}

/// One distributed-lock-mysql pair: `try_acquire` (a pool checkout and `GET_LOCK(?, 0)`), then
/// `release` (`RELEASE_LOCK`, the connection back to the pool).
async fn peer_pair(peer: &MySqlDistributedLock) {
    let handle = peer
        .try_acquire()
        .await
        .expect("distributed-lock-mysql acquire")
        .expect("the distributed-lock-mysql lock was busy");
    handle
        .release()
        .await
        .expect("distributed-lock-mysql release");
}

/// The peer's statements sent raw on `conn`: a bare named lock, no fencing token.
async fn bare_pair(conn: &mut Conn, name: &str) {
    let taken: Option<i64> = conn
        .exec_first("SELECT GET_LOCK(?, 0)", (name,))
        .await
        .expect("raw lock");
    assert_eq!(taken, Some(1), "the raw lock was busy");
    let released: Option<i64> = conn
        .exec_first("SELECT RELEASE_LOCK(?)", (name,))
        .await
        .expect("raw unlock");
    assert_eq!(released, Some(1), "the raw unlock was refused");
}

async fn measure(pairs: usize) {
    let server = MariaDbServer::start().await;
    // As the benchmark's MySQL rows run: client and server on CPUs of their own.
    let split = if pairs == PAIRS && std::env::var_os("LOCKINGKIT_BENCH_ANY_CPU").is_none() {
        server.pid().and_then(SplitCpus::pin)
    } else {
        None
    };
    println!(
        "{}",
        split.as_ref().map_or_else(
            || "client and server on any CPU".to_owned(),
            SplitCpus::describe
        )
    );
    let variants = Variants::connect(&server).await;
    let rounds = Rounds::new(pairs, WARM_UP, Order::Shuffled);
    let samples = interleaved(rounds, |variant| variants.pair(variant)).await;
    let [kit, peer, unpinged, raw, bare] = samples.map(|s| Percentiles::of(s).p50);
    print_medians(pairs, [kit, peer, unpinged, raw, bare]);
}

fn print_medians(pairs: usize, medians: [Duration; 5]) {
    let [kit, peer, unpinged, raw, bare] = medians.map(|d| d.as_secs_f64() * 1e6);
    println!("MySQL (MariaDB) try-lock + release, {pairs} interleaved pairs each, medians:");
    let line = |name: &str, us: f64| println!("  {name:<58} {us:>8.1} µs");
    line("lockingkit try_acquire+release (default options)", kit);
    line(
        "distributed-lock-mysql, MySqlLockProvider::new (pings)",
        peer,
    );
    line(
        "distributed-lock-mysql, sqlx pool without the ping",
        unpinged,
    );
    line(
        "lockingkit's statements raw (mysql_async, one connection)",
        raw,
    );
    line(
        "the peer's statements raw (mysql_async, one connection)",
        bare,
    );
    println!(
        "  ratio lockingkit / distributed-lock-mysql (default)        {:>8.3} (goal <= 1.00)",
        kit / peer
    );
    println!(
        "  ratio lockingkit / distributed-lock-mysql (no ping)        {:>8.3}",
        kit / unpinged
    );
    println!(
        "{{\"pairs\":{pairs},\"lockingkit_us\":{kit:.1},\"peer_us\":{peer:.1},\"peer_no_ping_us\":{unpinged:.1},\"raw_us\":{raw:.1},\"peer_raw_us\":{bare:.1},\"ratio_to_peer\":{:.3},\"ratio_to_peer_no_ping\":{:.3}}}",
        kit / peer,
        kit / unpinged
    );
}
