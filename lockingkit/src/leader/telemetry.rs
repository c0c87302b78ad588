//! Terms won and ended, as spans and metrics. Keys are never recorded.
//!
//! Span `lead {name}` (kind internal) covers one term, with `lockingkit.lock`,
//! `lockingkit.provider`, `lockingkit.term` (the term number, which is the fencing token) and
//! `lockingkit.term.end` (`lost`, `finished` or `resigned`). Metrics, each with
//! `lockingkit.lock` and `lockingkit.provider`: `lockingkit.leader.terms.won` (counter),
//! `lockingkit.leader.terms.ended` (counter, plus `lockingkit.term.end`),
//! `lockingkit.leader.term.duration` (histogram, s, plus `lockingkit.term.end`) and
//! `lockingkit.leader.leading` (up-down counter: 1 while this campaign leads).

use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter, UpDownCounter};
use opentelemetry::KeyValue;
use tracing::field::Empty;
use tracing::Span;

/// How a term ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TermEnd {
    /// The lock was lost; the work was dropped.
    Lost,
    /// The work returned; the lock was released.
    Finished,
    /// The campaign was resigned; the work was dropped and the lock released.
    Resigned,
}

impl TermEnd {
    const fn as_str(self) -> &'static str {
        match self {
            TermEnd::Lost => "lost",
            TermEnd::Finished => "finished",
            TermEnd::Resigned => "resigned",
        }
    }
}

/// The instruments of one campaign, and its attribute sets built once.
pub(super) struct LeaderTelemetry {
    span_name: Box<str>,
    lock: Box<str>,
    provider: Box<str>,
    base: [KeyValue; 2],
    won: Counter<u64>,
    ended: Counter<u64>,
    duration: Histogram<f64>,
    leading: UpDownCounter<i64>,
}

impl LeaderTelemetry {
    pub(super) fn new(lock: &str, provider: &str, meter: &Meter) -> Self {
        LeaderTelemetry {
            span_name: format!("lead {lock}").into(),
            lock: lock.into(),
            provider: provider.into(),
            base: [
                KeyValue::new("lockingkit.lock", lock.to_owned()),
                KeyValue::new("lockingkit.provider", provider.to_owned()),
            ],
            won: meter
                .u64_counter("lockingkit.leader.terms.won")
                .with_unit("{term}")
                .with_description("Terms of leadership won")
                .build(),
            ended: meter
                .u64_counter("lockingkit.leader.terms.ended")
                .with_unit("{term}")
                .with_description("Terms of leadership ended: lost, finished or resigned")
                .build(),
            duration: meter
                .f64_histogram("lockingkit.leader.term.duration")
                .with_unit("s")
                .with_description("How long terms of leadership lasted")
                .build(),
            leading: meter
                .i64_up_down_counter("lockingkit.leader.leading")
                .with_unit("{campaign}")
                .with_description("Campaigns leading now")
                .build(),
        }
    }

    /// The span of one term; the leader work runs inside it.
    pub(super) fn term_span(&self, number: u64) -> Span {
        let span = tracing::info_span!(
            target: "lockingkit",
            "lockingkit.lead",
            "otel.name" = &*self.span_name,
            "otel.kind" = "internal",
            "lockingkit.lock" = &*self.lock,
            "lockingkit.provider" = &*self.provider,
            "lockingkit.term" = Empty,
            "lockingkit.term.end" = Empty,
        );
        // Numeric where it fits, exact as text beyond (as the acquire spans record tokens).
        match i64::try_from(number) {
            Ok(number) => span.record("lockingkit.term", number),
            Err(_) => span.record("lockingkit.term", number.to_string()),
        };
        span
    }

    pub(super) fn term_won(&self) {
        self.won.add(1, &self.base);
        self.leading.add(1, &self.base);
    }

    pub(super) fn term_ended(&self, span: &Span, end: TermEnd, lasted: Duration) {
        span.record("lockingkit.term.end", end.as_str());
        let attrs = [
            self.base[0].clone(),
            self.base[1].clone(),
            KeyValue::new("lockingkit.term.end", end.as_str()),
        ];
        self.leading.add(-1, &self.base);
        self.ended.add(1, &attrs);
        self.duration.record(lasted.as_secs_f64(), &attrs);
        if end == TermEnd::Lost {
            tracing::warn!(
                target: "lockingkit",
                parent: span,
                lock = &*self.lock,
                provider = &*self.provider,
                "leadership lost; campaigning again"
            );
        }
    }
}
