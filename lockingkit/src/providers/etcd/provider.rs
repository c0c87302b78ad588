//! The etcd provider as a registry builds it (`provider = "etcd"`).

use super::{EtcdBackend, EtcdOptions};
use crate::config::Problem;
use crate::engine::LockOptions;
use crate::registry::{HostResources, LockingBuilder, Provider};

/// Keys under one etcd lease per process, waiters in line by revision.
pub(crate) struct Etcd;

impl Provider for Etcd {
    const NAME: &'static str = "etcd";
    type Options = EtcdOptions;
    type Backend = EtcdBackend;

    fn problems(options: &EtcdOptions) -> Vec<Problem> {
        options.problems()
    }

    /// The constructor also finds what the options cannot say alone (a TLS file it cannot
    /// read).
    fn open(options: EtcdOptions, _: HostResources<'_>) -> Result<EtcdBackend, Vec<Problem>> {
        EtcdBackend::open(options)
    }
}

impl LockingBuilder {
    /// Adds an etcd provider; its options are checked when the registry is built.
    pub fn etcd(self, name: impl Into<String>, etcd: EtcdOptions, options: LockOptions) -> Self {
        self.built_in::<Etcd>(name, etcd, options)
    }
}
