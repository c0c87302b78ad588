//! [`Provider`]: what the registry needs of a built-in provider, implemented in the provider's
//! own folder, so that its rules run however it is registered.

use super::setup::HostResources;
use crate::backend::{LeaseTiming, LockBackend};
use crate::config::{Problem, WholeNumbers};

/// A built-in provider as the registry builds it, from a configuration section that says
/// `provider = "<NAME>"` or from options given to [`LockingBuilder`](super::LockingBuilder).
///
/// Each provider implements this beside its backend (`providers/<name>/provider.rs`), and
/// `registry/builtin.rs` lists them; nothing else in the registry names a provider. Both ways
/// of registering one end in [`open`](Self::open) and then in the engine's checks of the
/// backend (`DistributedLock::builder` runs the same checks), so a provider's rules hold on
/// every path.
pub(crate) trait Provider {
    /// The name configuration sections write, matched ignoring case, `_` and `-`.
    const NAME: &'static str;
    /// The provider's own settings, bound from its section or given in code.
    type Options: serde::de::DeserializeOwned + Send + 'static;
    /// The backend [`open`](Self::open) makes.
    type Backend: LockBackend;
    /// Settings whose values are whole numbers in a range (bound leniently from strings).
    const WHOLE_NUMBERS: &'static [WholeNumbers] = &[];

    /// Every problem with `options` that can be found without opening anything, each about
    /// one of their settings.
    fn problems(options: &Self::Options) -> Vec<Problem>;

    /// The lease timing to check the engine options against when the options could not be
    /// bound: `Some` for a provider whose locks have that kind of timing whatever its options
    /// say, so the engine's renewal rules join the same error instead of a second round.
    fn timing_without_options() -> Option<LeaseTiming> {
        None
    }

    /// The backend for `options`, or every problem found on the way (its own checks included:
    /// this is also the path of options given in code, which were never checked before).
    fn open(options: Self::Options, host: HostResources<'_>)
        -> Result<Self::Backend, Vec<Problem>>;
}
