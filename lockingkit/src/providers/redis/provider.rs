//! The Redis provider as a registry builds it (`provider = "redis"`).

use super::{RedisBackend, RedisOptions};
use crate::config::{Problem, WholeNumbers};
use crate::engine::LockOptions;
use crate::registry::{HostResources, LockingBuilder, Provider};

/// Redis keys written by Lua scripts, on one server or a Redis Cluster. The writer's intent
/// against the engine's `max_retry_delay` is the engine's rule (the backend reports its
/// intent), checked however the lock is built.
pub(crate) struct Redis;

impl Provider for Redis {
    const NAME: &'static str = "redis";
    type Options = RedisOptions;
    type Backend = RedisBackend;
    const WHOLE_NUMBERS: &'static [WholeNumbers] = RedisOptions::WHOLE_NUMBERS;

    fn problems(options: &RedisOptions) -> Vec<Problem> {
        options.problems()
    }

    fn open(options: RedisOptions, _: HostResources<'_>) -> Result<RedisBackend, Vec<Problem>> {
        RedisBackend::open(options)
    }
}

impl LockingBuilder {
    /// Adds a Redis provider; its options are checked when the registry is built.
    pub fn redis(self, name: impl Into<String>, redis: RedisOptions, options: LockOptions) -> Self {
        self.built_in::<Redis>(name, redis, options)
    }
}
