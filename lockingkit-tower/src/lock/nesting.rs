//! Nesting detection: a layer inside another layer of the same provider that locks the same
//! key on the same request, which would refuse every request as busy.

use http::request::Parts;
use lockingkit::{DistributedLock, LockMode, LockView, MultiLockView};

use super::mode::same_namespace;

/// Why two layers locking one key on one request are refused.
pub(crate) const NESTED: &str = "two lock layers of one provider lock the same key on this \
     request, and locks are not reentrant (with axum, each Router::route_layer wraps every \
     route added before it)";

/// Whether a layer outside this one already holds `key` of `locks`, in the namespace of
/// `mode`, for this request: locks are not reentrant, so taking it again would be refused as
/// busy on every request.
pub(crate) fn held_by_an_outer_layer(
    parts: &Parts,
    key: &str,
    mode: LockMode,
    locks: &DistributedLock,
) -> bool {
    let one = parts.extensions.get::<LockView>().is_some_and(|outer| {
        outer.key() == key && same_namespace(outer.mode(), mode) && outer.is_from(locks)
    });
    let many = parts
        .extensions
        .get::<MultiLockView>()
        .is_some_and(|outer| {
            outer.keys().any(|held| held == key)
                && same_namespace(outer.mode(), mode)
                && outer.is_from(locks)
        });
    one || many
}
