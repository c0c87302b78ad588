//! Samples and how they are taken: the percentiles a row reports, and interleaved rounds that
//! let every variant of one measurement meet the same machine noise.

use std::future::Future;
use std::time::{Duration, Instant};

/// Median and 99th percentile of a set of samples.
#[derive(Clone, Copy, Debug)]
pub struct Percentiles {
    /// The median.
    pub p50: Duration,
    /// The 99th percentile.
    pub p99: Duration,
}

impl Percentiles {
    /// The percentiles of `samples` (zero when empty).
    pub fn of(mut samples: Vec<Duration>) -> Percentiles {
        samples.sort_unstable();
        let at = |q: f64| {
            let index = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples.get(index).copied().unwrap_or_default()
        };
        Percentiles {
            p50: at(0.5),
            p99: at(0.99),
        }
    }

    /// This median over `baseline`'s: the ratio a row holds against its goal.
    pub fn ratio_to(self, baseline: Percentiles) -> f64 {
        self.p50.as_secs_f64() / baseline.p50.as_secs_f64()
    }
}

/// How the order of the variants changes from one round to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// A fresh random order every round, so no variant systematically follows another (the
    /// background work a LockingKit release leaves would otherwise land on one neighbour).
    Shuffled,
    /// Round `r` starts with variant `r mod N` and goes on in turn, so each variant follows
    /// every other equally often.
    Rotated,
    /// The same order every round.
    Fixed,
}

/// The rounds of one interleaved measurement: a warm-up whose samples are dropped, then the
/// rounds that are kept.
#[derive(Clone, Copy, Debug)]
pub struct Rounds {
    warm_up: usize,
    kept: usize,
    order: Order,
    only: Option<usize>,
}

impl Rounds {
    /// `kept` rounds in `order` after `warm_up` rounds, or after `kept` of them when that is
    /// fewer (a smoke run).
    pub fn new(kept: usize, warm_up: usize, order: Order) -> Rounds {
        Rounds {
            warm_up: warm_up.min(kept),
            kept,
            order,
            only: None,
        }
    }

    /// With `Some(variant)`, samples that variant alone, to profile it; the others answer no
    /// samples.
    pub fn only(self, only: Option<usize>) -> Rounds {
        Rounds { only, ..self }
    }
}

/// Runs `rounds`: each round samples every one of the `N` variants once, `sample(variant)`
/// answering the time it measured, and the samples of the rounds after the warm-up are
/// answered per variant.
pub async fn interleaved<const N: usize, Sample>(
    rounds: Rounds,
    sample: impl Fn(usize) -> Sample,
) -> [Vec<Duration>; N]
where
    Sample: Future<Output = Duration>,
{
    let mut samples: [Vec<Duration>; N] = std::array::from_fn(|_| Vec::new());
    let mut order: [usize; N] = std::array::from_fn(|variant| variant);
    let mut random = Shuffle::seeded();
    for round in 0..rounds.warm_up + rounds.kept {
        match rounds.order {
            Order::Shuffled => random.shuffle(&mut order),
            Order::Rotated => order = std::array::from_fn(|slot| (round + slot) % N),
            Order::Fixed => {}
        }
        for variant in order {
            if rounds.only.is_some_and(|only| only != variant) {
                continue;
            }
            let took = sample(variant).await;
            if round >= rounds.warm_up {
                samples[variant].push(took);
            }
        }
    }
    samples
}

/// How long `work` takes to finish.
pub async fn timed(work: impl Future<Output = ()>) -> Duration {
    let started = Instant::now();
    work.await;
    started.elapsed()
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
