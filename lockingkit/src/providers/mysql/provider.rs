//! The MySQL and MariaDB provider as a registry builds it (`provider = "mysql"`).

use super::{MysqlBackend, MysqlOptions};
use crate::backend::LeaseTiming;
use crate::config::{Problem, WholeNumbers};
use crate::engine::LockOptions;
use crate::registry::{HostResources, LockingBuilder, Provider};

/// MySQL and MariaDB named locks, one per key, held by the provider's sessions.
pub(crate) struct Mysql;

impl Provider for Mysql {
    const NAME: &'static str = "mysql";
    type Options = MysqlOptions;
    type Backend = MysqlBackend;
    const WHOLE_NUMBERS: &'static [WholeNumbers] = MysqlOptions::WHOLE_NUMBERS;

    fn problems(options: &MysqlOptions) -> Vec<Problem> {
        options.problems()
    }

    /// Its locks are held by connections whatever the options say: the engine's renewal rules
    /// for such a backend apply even when the options are bad.
    fn timing_without_options() -> Option<LeaseTiming> {
        Some(LeaseTiming::ConnectionHeld(
            MysqlOptions::default().check_interval,
        ))
    }

    fn open(options: MysqlOptions, _: HostResources<'_>) -> Result<MysqlBackend, Vec<Problem>> {
        MysqlBackend::open(options)
    }
}

impl LockingBuilder {
    /// Adds a MySQL or MariaDB provider; its options are checked when the registry is built.
    pub fn mysql(self, name: impl Into<String>, mysql: MysqlOptions, options: LockOptions) -> Self {
        self.built_in::<Mysql>(name, mysql, options)
    }
}
