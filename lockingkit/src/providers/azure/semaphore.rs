//! Semaphores on blob leases: a semaphore of N holders is N *slot* guard blobs, one lease
//! each, and holding a slot is holding its blob's lease.
//!
//! An attempt probes the slots one at a time, starting from a random slot and wrapping around,
//! and stops at the first lease it is granted, so it never holds two slots. Each probe is an
//! ordinary guard-blob acquire (`guard_blob`): a slot blob is created empty on first use, its
//! lease id is fresh per attempt — so a slot this very process holds answers busy like any
//! other — and it keeps its own fencing token in its own metadata.
//!
//! Blob leases are exclusive only, so there is no reader-writer lock here: Azure has no shared
//! lease, and building one from exclusive leases would need a protocol this provider does not
//! claim to have proven.

use azure_core::Uuid;

use super::guard_blob::GuardBlobs;
use super::keys::AzureLockKeys;
use super::AzureBlobLease;
use crate::backend::BackendError;

/// The largest `max_count` a semaphore may have on Azure, below the engine's own limit
/// ([`MAX_SEMAPHORE_COUNT`](crate::backend::MAX_SEMAPHORE_COUNT)) because every slot is a blob an attempt
/// may have to try.
///
/// An attempt when every slot is taken costs one request per slot, sent one after another (a
/// busy answer is one round trip, a few milliseconds within a region), and a waiter repeats
/// that at every retry. At 32 slots a fully taken semaphore costs a waiter 32 requests per
/// retry — still under a tenth of a second in a region — while Azure's targets (about 500
/// requests per second per blob, 20,000 per account) leave room for many such waiters. A
/// larger pool of holders is better served by several semaphores or another provider.
pub const MAX_SEMAPHORE_SLOTS: u32 = 32;

/// Whether a semaphore of `max_count` holders can be held on Azure.
pub(crate) fn supported_count(max_count: u32) -> bool {
    (1..=MAX_SEMAPHORE_SLOTS).contains(&max_count)
}

/// One attempt to take a free slot of the semaphore `key`: `Ok(None)` when all `max_count`
/// slots are taken.
///
/// The first failure that is not "busy" ends the attempt: a slot the service did not answer
/// for is most likely not the only one, and probing the others would stretch one attempt to
/// `max_count` request timeouts against a hung endpoint.
pub(crate) async fn try_acquire_slot(
    guards: &GuardBlobs,
    key: &str,
    max_count: u32,
) -> Result<Option<AzureBlobLease>, BackendError> {
    let first = first_slot(max_count);
    for step in 0..max_count {
        // Both are below max_count, so the sum cannot overflow.
        let slot = (first + step) % max_count;
        let name = AzureLockKeys::semaphore_slot_blob_name(key, slot);
        if let Some(lease) = guards.try_acquire_named(name, Some(slot)).await? {
            return Ok(Some(lease));
        }
    }
    Ok(None)
}

/// A random slot in `0..max_count` to start probing from.
///
/// Starting everyone at slot 0 would make every attempt walk past every taken low slot; a
/// random start spreads attempts over the slots, so with `f` of `n` slots free an attempt
/// expects about `(n + 1) / (f + 1)` probes instead of up to `n - f + 1`.
fn first_slot(max_count: u32) -> u32 {
    let random = Uuid::new_v4().as_u128() % u128::from(max_count.max(1));
    u32::try_from(random).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_one_to_the_limit_are_supported() {
        assert!(!supported_count(0));
        assert!(supported_count(1));
        assert!(supported_count(MAX_SEMAPHORE_SLOTS));
        assert!(!supported_count(MAX_SEMAPHORE_SLOTS + 1));
        assert!(!supported_count(u32::MAX));
    }

    #[test]
    fn the_first_slot_is_spread_over_every_slot() {
        for max_count in [1, 2, 3, MAX_SEMAPHORE_SLOTS] {
            let mut seen = vec![false; max_count as usize];
            for _ in 0..2000 {
                let slot = first_slot(max_count);
                assert!(slot < max_count);
                seen[slot as usize] = true;
            }
            assert!(seen.iter().all(|&s| s), "{max_count}: {seen:?}");
        }
    }
}
