//! Several key templates for one route, locked together: `lock_route_all`.

use std::fmt;

use http::request::Parts;
use lockingkit::DistributedLock;
use lockingkit_tower::{LockKey, LockKeys, LockLayer};

use crate::PathTemplate;

/// Several [`PathTemplate`]s, each filled from the route's path parameters, naming the keys a
/// route locks together (see [`lock_route_all`]).
#[derive(Clone)]
pub struct KeyTemplates {
    templates: Vec<PathTemplate>,
}

impl KeyTemplates {
    /// The templates, each parsed as [`PathTemplate::new`] parses one.
    pub fn new<T: AsRef<str>>(templates: &[T]) -> Self {
        KeyTemplates {
            templates: templates
                .iter()
                .map(|t| PathTemplate::new(t.as_ref()))
                .collect(),
        }
    }

    /// The templates.
    pub fn templates(&self) -> &[PathTemplate] {
        &self.templates
    }
}

impl LockKeys for KeyTemplates {
    async fn applies_to(&self, request: &mut Parts) -> bool {
        // Every template answers alike (it asks whether the router matched a route); one with
        // no templates at all is refused as naming no key.
        match self.templates.first() {
            Some(template) => template.applies_to(request).await,
            None => true,
        }
    }

    async fn miswired(&self, request: &mut Parts) -> Option<String> {
        for template in &self.templates {
            if let Some(explanation) = template.miswired(request).await {
                return Some(explanation);
            }
        }
        None
    }

    async fn lock_keys(&self, request: &mut Parts) -> Option<Vec<String>> {
        let mut keys = Vec::with_capacity(self.templates.len());
        for template in &self.templates {
            keys.push(template.lock_key(request).await?);
        }
        Some(keys)
    }
}

impl fmt::Debug for KeyTemplates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.templates).finish()
    }
}

/// A layer that locks every template in `templates` (e.g. `["accounts/{from}",
/// "accounts/{to}"]`), each filled from the route's path parameters, together — for
/// `Router::route_layer`, like [`lock_route`](crate::lock_route).
///
/// The keys are held as one hold (see [`LockLayer::all`]): taken in their canonical order, so
/// `POST /transfers/1/2` and `POST /transfers/2/1` at once never deadlock, all or nothing, and
/// a transfer from an account to itself locks it once. One attempt per request: `409` while
/// any key is busy (or wait with [`wait`](LockLayer::wait), one timeout for all), `503` when
/// the backend is unavailable, `500` with `locking.lost` if any key is lost mid-request. The
/// handler extracts [`HeldLocks`](crate::HeldLocks) for each key's fencing token.
///
/// ```
/// use axum::{extract::Path, routing::post, Router};
/// use lockingkit::DistributedLock;
/// use lockingkit_axum::{lock_route_all, HeldLocks};
///
/// async fn transfer(Path((from, to)): Path<(u64, u64)>, locks: HeldLocks) -> String {
///     let debit = locks.fencing_token(&format!("accounts/{from}"));
///     let credit = locks.fencing_token(&format!("accounts/{to}"));
///     format!("moved under tokens {debit:?} and {credit:?}")
/// }
///
/// let locks = DistributedLock::in_memory();
/// let app: Router = Router::new()
///     .route("/transfers/{from}/{to}", post(transfer))
///     .route_layer(lock_route_all(locks, &["accounts/{from}", "accounts/{to}"]));
/// # let _ = app;
/// ```
pub fn lock_route_all<T: AsRef<str>>(locks: DistributedLock, templates: &[T]) -> LockLayer {
    LockLayer::with_keys(locks, KeyTemplates::new(templates))
}
