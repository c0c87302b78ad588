//! The PostgreSQL provider as a registry builds it (`provider = "postgres"`).

use super::{PostgresBackend, PostgresOptions};
use crate::backend::LeaseTiming;
use crate::config::{Problem, WholeNumbers};
use crate::engine::LockOptions;
use crate::registry::{HostResources, LockingBuilder, Provider};

/// PostgreSQL advisory locks, one per key, held by the provider's sessions.
pub(crate) struct Postgres;

impl Provider for Postgres {
    const NAME: &'static str = "postgres";
    type Options = PostgresOptions;
    type Backend = PostgresBackend;
    const WHOLE_NUMBERS: &'static [WholeNumbers] = PostgresOptions::WHOLE_NUMBERS;

    fn problems(options: &PostgresOptions) -> Vec<Problem> {
        options.problems()
    }

    /// Its locks are held by connections whatever the options say: the engine's renewal rules
    /// for such a backend apply even when the options are bad.
    fn timing_without_options() -> Option<LeaseTiming> {
        Some(LeaseTiming::ConnectionHeld(
            PostgresOptions::default().check_interval,
        ))
    }

    fn open(
        options: PostgresOptions,
        _: HostResources<'_>,
    ) -> Result<PostgresBackend, Vec<Problem>> {
        PostgresBackend::open(options)
    }
}

impl LockingBuilder {
    /// Adds a PostgreSQL provider; its options are checked when the registry is built.
    pub fn postgres(
        self,
        name: impl Into<String>,
        postgres: PostgresOptions,
        options: LockOptions,
    ) -> Self {
        self.built_in::<Postgres>(name, postgres, options)
    }
}
