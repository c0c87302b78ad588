//! How rows print: units, the cells of the table, and a report's latency lines.

use std::fmt::Display;
use std::time::Duration;

use crate::samples::Percentiles;

/// `d` in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `d` in microseconds.
pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The result column of a row with a goal.
pub fn pass(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}

/// One row of the table: the measurement, LockingKit's figure, the baseline's, the goal and
/// the result. The figures are right-aligned in 12 columns; [`in_ms`], [`in_micros`] and
/// [`per_second`] fill them with a number and its unit.
pub fn row(name: &str, ours: impl Display, baseline: impl Display, goal: &str, result: &str) {
    println!("| {name:<52} | {ours:>12} | {baseline:>12} | {goal:<14} | {result:<6} |");
}

/// A figure cell in milliseconds.
pub fn in_ms(d: Duration) -> String {
    format!("{:>9.3} ms", ms(d))
}

/// A figure cell in microseconds.
pub fn in_micros(d: Duration) -> String {
    format!("{:>9.1} µs", micros(d))
}

/// A figure cell of a rate.
pub fn per_second(rate: f64) -> String {
    format!("{rate:>10.0}/s")
}

/// A goal cell showing the ratio measured.
pub fn ratio(ratio: f64) -> String {
    format!("ratio {ratio:.3}")
}

/// One line of a report: `name` padded to `width`, then the median and the 99th percentile
/// in microseconds.
pub fn latency_line(name: &str, width: usize, latency: Percentiles) -> String {
    format!(
        "  {name:<width$} median {:>8.1} µs   p99 {:>8.1} µs\n",
        micros(latency.p50),
        micros(latency.p99)
    )
}
