//! The transactions locks can be taken in, and how each sends an attempt.
//!
//! Two shapes, one statement: a plain tokio-postgres transaction sends it unnamed, with its
//! parameter's type, every time (parsed and planned by the server on each call, and nothing
//! left behind on the server session); a deadpool-postgres transaction prepares it once per
//! connection through the pool's statement cache and then only binds and executes it (the
//! `deadpool` feature). The trait is sealed: the crate decides which transactions qualify,
//! because a lock outside a transaction block would end with its own statement.

use std::future::Future;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

/// A transaction [`PostgresTransactionLocks`](super::PostgresTransactionLocks) can lock in:
/// [`tokio_postgres::Transaction`], and with the `deadpool` feature
/// [`deadpool_postgres::Transaction`].
///
/// Sealed: it cannot be implemented outside LockingKit. A client outside a transaction block
/// does not qualify, since its transaction-level locks would end with each statement. (Without
/// the `deadpool` feature, a deadpool-postgres transaction passes as `&*transaction`, the
/// tokio-postgres transaction it wraps: attempts are then sent unnamed.)
///
/// [`deadpool_postgres::Transaction`]: https://docs.rs/deadpool-postgres/0.14/deadpool_postgres/struct.Transaction.html
pub trait LockableTransaction: sealed::Sealed + Sync {}

pub(super) mod sealed {
    use super::*;

    /// How an attempt's one statement is sent.
    pub trait Sealed {
        /// Runs `sql` (one `bigint` parameter, one row answered) with `key`.
        fn lock_row<'a>(
            &'a self,
            sql: &'a str,
            key: &'a i64,
        ) -> impl Future<Output = Result<Row, tokio_postgres::Error>> + Send + 'a;
    }
}

impl sealed::Sealed for tokio_postgres::Transaction<'_> {
    async fn lock_row(&self, sql: &str, key: &i64) -> Result<Row, tokio_postgres::Error> {
        // Unnamed and typed: one round trip, and no prepared statement left on a server
        // session that a transaction-mode pooler may hand to someone else afterwards.
        let params: [(&(dyn ToSql + Sync), Type); 1] = [(key, Type::INT8)];
        self.query_typed_one(sql, &params).await
    }
}

impl LockableTransaction for tokio_postgres::Transaction<'_> {}

#[cfg(feature = "deadpool")]
impl sealed::Sealed for deadpool_postgres::Transaction<'_> {
    async fn lock_row(&self, sql: &str, key: &i64) -> Result<Row, tokio_postgres::Error> {
        // Prepared once per connection (the first call costs one more round trip), then only
        // bound and executed: the server plans it once. Behind a transaction-mode pooler that
        // does not carry prepared statements across server sessions (PgBouncer before 1.21,
        // or without max_prepared_statements) it fails with SQLSTATE 26000.
        let statement = self.prepare_typed_cached(sql, &[Type::INT8]).await?;
        self.query_one(&statement, &[key]).await
    }
}

#[cfg(feature = "deadpool")]
impl LockableTransaction for deadpool_postgres::Transaction<'_> {}
