//! LockingKit's Redis try_acquire + release next to rslock's `lock` + `unlock` (Redlock with one
//! server, the most used Rust Redis lock) and the same Lua scripts LockingKit runs, sent raw,
//! interleaved in one run against one throwaway server.
//!
//! ```text
//! scripts/setup-redis.sh
//! cd bench-peers && cargo bench --bench rslock
//! ```
//!
//! Variants, in a fresh random order every round:
//! - LockingKit `try_acquire` + `release` with the default options (30 s lease, renewed in the
//!   background and fenced: the token is minted in the acquire script);
//! - rslock `LockManager::lock` (30 s TTL) + `unlock` on one server: no renewal (only manual
//!   `extend`), no fencing token;
//! - LockingKit's acquire and release scripts sent raw (`EVALSHA`) on one multiplexed
//!   connection.

use std::time::{Duration, Instant};

use lockingkit_benches::mode::{in_task, two_worker_runtime, BenchMode};
use lockingkit_benches::redis_rows::{lock, RawScripts};
use lockingkit_benches::samples::{Percentiles, Shuffle};
use lockingkit_tests::redis::RedisServer;

const PAIRS: usize = 5000;
const WARM_UP: usize = 200;

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let pairs = mode.pick(PAIRS, 20);
    in_task(
        &two_worker_runtime(),
        "the rslock benchmark",
        measure(pairs),
    );
}

async fn measure(pairs: usize) {
    let server = RedisServer::start().await;
    let pid = std::process::id();
    let locks = lock(&server);
    let kit_key = format!("peers/lockingkit/{pid}");
    let manager = rslock::LockManager::new(vec![format!("{}/", server.url())]);
    let peer_key = format!("peers/rslock/{pid}");
    let raw = RawScripts::new();
    let mut connection = server.client().await;
    let raw_key = format!("peers/raw/{pid}");

    let mut samples: [Vec<Duration>; 3] = Default::default();
    let mut order = [0usize, 1, 2];
    let mut random = Shuffle::seeded();
    for round in 0..WARM_UP + pairs {
        random.shuffle(&mut order);
        for variant in order {
            let started = Instant::now();
            match variant {
                0 => locks
                    .try_acquire(&kit_key)
                    .await
                    .expect("lockingkit acquire")
                    .release()
                    .await
                    .expect("lockingkit release"),
                1 => {
                    let held = manager
                        .lock(peer_key.as_str(), Duration::from_secs(30))
                        .await
                        .expect("rslock lock");
                    manager.unlock(&held).await;
                }
                _ => raw.pair(&mut connection, &raw_key).await,
            }
            if round >= WARM_UP {
                samples[variant].push(started.elapsed());
            }
        }
    }
    let [kit, peer, raw] = samples.map(Percentiles::of);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("Redis lock + release, {pairs} interleaved pairs each (median / p99):");
    println!(
        "  lockingkit try_acquire+release (renewed, fenced)   {:>8.1} / {:>8.1} µs",
        us(kit.p50),
        us(kit.p99)
    );
    println!(
        "  rslock lock+unlock, one server (no renewal/fence)  {:>8.1} / {:>8.1} µs",
        us(peer.p50),
        us(peer.p99)
    );
    println!(
        "  the same scripts as lockingkit, sent raw            {:>8.1} / {:>8.1} µs",
        us(raw.p50),
        us(raw.p99)
    );
    println!(
        "  ratio lockingkit / rslock (median)                 {:.3} (goal <= 1.0)",
        kit.p50.as_secs_f64() / peer.p50.as_secs_f64()
    );
}
