//! A tracing layer that writes every span field, recorded value and event field into one
//! string, for tests that search what reached the logs (keys must never).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::Context;
use tracing_subscriber::Layer;

/// Writes every span field and event field that reaches the subscriber into one string, so the
/// key search covers log events as well as what the OpenTelemetry bridge keeps.
#[derive(Clone, Default)]
pub struct FieldLog(Arc<Mutex<String>>);

struct FieldWriter<'a>(&'a mut String);

impl Visit for FieldWriter<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl FieldLog {
    fn write(&self, line: impl FnOnce(&mut String)) {
        let mut log = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        line(&mut log);
        log.push('\n');
    }

    /// Everything written so far, one line per span, record or event.
    pub fn text(&self) -> String {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl<S: tracing::Subscriber> Layer<S> for FieldLog {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: Context<'_, S>,
    ) {
        self.write(|log| {
            log.push_str(attrs.metadata().name());
            attrs.record(&mut FieldWriter(log));
        });
    }

    fn on_record(
        &self,
        _: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _: Context<'_, S>,
    ) {
        self.write(|log| {
            log.push_str("record");
            values.record(&mut FieldWriter(log));
        });
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        self.write(|log| {
            log.push_str(event.metadata().target());
            event.record(&mut FieldWriter(log));
        });
    }
}
