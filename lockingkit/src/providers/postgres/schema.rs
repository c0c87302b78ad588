//! The database objects the provider uses, and how they come to exist.
//!
//! - The fencing-token **sequence** (`lockingkit.fencing_tokens` by default): one `nextval` per
//!   lock taken, in the lock's own round trip.
//! - The **wait function** `<schema>.wait_advisory_lock(key, exclusive, slice_ms, sequence)`:
//!   waits up to a slice for the advisory lock `key` (exclusively or shared) and, when it is
//!   granted, keeps it and answers a fencing token from `sequence` in the same statement (NULL
//!   when the slice ended first, or the wait was withdrawn with `pg_cancel_backend`). A watcher
//!   (see `waiting`) calls it twice a second while a key it waits for stays taken, and the
//!   lock it is granted becomes its waiter's. A plain statement that waits under
//!   `lock_timeout` would end every slice with an ERROR in the server's log ("canceling
//!   statement due to lock timeout", and the statement) — some 170,000 lines a day per
//!   waiting process; an error caught in PL/pgSQL is not logged. A function made by an older
//!   version (it did not catch the cancel) counts as missing and is replaced; a role that may
//!   not replace it keeps it, and its waits are never withdrawn early (each ends with its
//!   slice).
//!
//! Both are created on first use by a role that may (serialized by a transaction-level
//! advisory lock, so processes starting together do not race); a role without `CREATE` needs
//! them created beforehand with [`setup_sql`]. Without the function the provider still works:
//! watchers fall back to `lock_timeout` slices, and the server logs their errors.

use super::options::PostgresOptions;

/// The transaction-level advisory lock that serializes creating the objects. It uses the
/// two-`int4` key space, which never meets the single-`bigint` keys of LockingKit locks.
const SETUP_LOCK: (i32, i32) = (0x6c6b_6974, 0x6665_6e63); // "lkit", "fenc"

/// The wait function's name within the fencing schema, and its argument types. (Versions
/// before it had `watch_advisory_lock`, which gave the lock straight back; it is left alone.)
const WATCH_FUNCTION: &str = "wait_advisory_lock";
const WATCH_ARGUMENTS: &str = "bigint, boolean, integer, regclass";

/// The provider's objects, named for one set of options.
#[derive(Debug)]
pub(super) struct Schema {
    /// `schema.sequence`.
    pub(super) sequence: String,
    /// `schema.wait_advisory_lock`.
    pub(super) watch_function: String,
    /// Whether the sequence and the function exist: two booleans.
    pub(super) exists: String,
    /// Creates whatever is missing.
    pub(super) setup: String,
    /// Creates only the function, under the setup lock.
    pub(super) setup_function: String,
}

impl Schema {
    pub(super) fn new(options: &PostgresOptions) -> Self {
        Schema::named(&options.fencing_schema, &options.fencing_sequence)
    }

    /// The objects of the fencing schema `schema` with the sequence `sequence` in it.
    pub(super) fn named(schema: &str, sequence: &str) -> Self {
        let sequence = format!("{schema}.{sequence}");
        let watch_function = format!("{schema}.{WATCH_FUNCTION}");
        let lock = format!(
            "SELECT pg_advisory_xact_lock({}, {});",
            SETUP_LOCK.0, SETUP_LOCK.1
        );
        Schema {
            exists: format!(
                "SELECT to_regclass('{sequence}') IS NOT NULL, {}",
                function_current(&watch_function)
            ),
            setup: format!(
                "{lock}CREATE SCHEMA IF NOT EXISTS {schema};{};{};",
                create_sequence(&sequence),
                create_function(&watch_function)
            ),
            setup_function: format!("{lock}{};", create_function(&watch_function)),
            sequence,
            watch_function,
        }
    }

    /// The statement a watcher sends with the function: the fencing token if `$1` was granted
    /// (exclusively if `$2`) within the slice `$3` (ms), and is now held; NULL otherwise.
    pub(super) fn watch_statement(&self) -> String {
        format!(
            "SELECT {}($1, $2, $3, '{}'::regclass)",
            self.watch_function, self.sequence
        )
    }

    /// For a waiting session choosing its statements: whether the function exists, whether it
    /// is this version's (a wait can be withdrawn), and the session's server process id (which
    /// a withdrawal names).
    pub(super) fn waiting_session_facts(&self) -> String {
        format!(
            "SELECT to_regprocedure('{}({WATCH_ARGUMENTS})') IS NOT NULL, {}, pg_backend_pid()",
            self.watch_function,
            function_current(&self.watch_function)
        )
    }
}

/// Marks the body of this version of the wait function, the one that answers NULL when its
/// wait is cancelled (older ones let the cancel fail the statement, which the server logs).
const FUNCTION_VERSION: &str = "lockingkit wait function 2";

/// An SQL expression: whether the function `name` exists and is this version's.
fn function_current(name: &str) -> String {
    format!(
        "coalesce((SELECT prosrc LIKE '%{FUNCTION_VERSION}%' FROM pg_catalog.pg_proc \
         WHERE oid = to_regprocedure('{name}({WATCH_ARGUMENTS})')), false)"
    )
}

fn create_sequence(sequence: &str) -> String {
    // CACHE 1: a cached sequence hands each session its own block of numbers, and tokens would
    // no longer grow across processes.
    format!("CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint MINVALUE 1 NO CYCLE CACHE 1")
}

/// The wait function. The slice is the caller's, or half the server's `deadlock_timeout` when
/// that is shorter (at least 10 ms): a wait ends before the deadlock detector looks at it, and
/// its snapshot lives no longer than the slice. `lock_timeout` is set for the statement's own
/// transaction only. A granted lock is kept (a session lock outlives the statement and its
/// subtransaction), and its fencing token is taken in the same statement; an error after the
/// grant leaves the lock held, and the caller closes the session.
///
/// A cancel (the wait withdrawn, see `waiting`) answers NULL like a slice that ran out. It may
/// land after the grant, while the token is taken: a session lock survives the rollback of the
/// statement's subtransaction, so the handler gives it back (it looks in `pg_locks` first, as
/// unlocking a lock the session does not hold logs a warning). A waiting session holds no other
/// advisory lock while it waits, so what it finds there is this grant.
fn create_function(name: &str) -> String {
    format!(
        "CREATE OR REPLACE FUNCTION {name}(key bigint, exclusive boolean, slice_ms integer, \
         sequence regclass) \
         RETURNS bigint LANGUAGE plpgsql SET search_path = pg_catalog AS $lockingkit$ \
         BEGIN \
           /* {FUNCTION_VERSION} */ \
           PERFORM set_config('lock_timeout', greatest(10, least(slice_ms, \
             (extract(epoch FROM current_setting('deadlock_timeout')::interval) * 500)::int))::text \
             || 'ms', true); \
           IF exclusive THEN \
             PERFORM pg_advisory_lock(key); \
           ELSE \
             PERFORM pg_advisory_lock_shared(key); \
           END IF; \
           RETURN nextval(sequence); \
         EXCEPTION \
           WHEN lock_not_available THEN \
             RETURN NULL; \
           WHEN query_canceled THEN \
             IF EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' \
                 AND pid = pg_backend_pid() AND objsubid = 1 AND granted \
                 AND classid = ((key >> 32) & 4294967295)::oid \
                 AND objid = (key & 4294967295)::oid) THEN \
               IF exclusive THEN \
                 PERFORM pg_advisory_unlock(key); \
               ELSE \
                 PERFORM pg_advisory_unlock_shared(key); \
               END IF; \
             END IF; \
             RETURN NULL; \
         END $lockingkit$"
    )
}

/// The SQL an administrator runs once for a role (`role`) that may not create objects itself:
/// the fencing schema, sequence and watch function of `options`, and the grants the role needs.
///
/// ```
/// use lockingkit::PostgresOptions;
/// use lockingkit::providers::postgres::setup_sql;
///
/// let sql = setup_sql(&PostgresOptions::default(), "app");
/// assert!(sql.contains("CREATE SEQUENCE IF NOT EXISTS lockingkit.fencing_tokens"));
/// assert!(sql.contains("GRANT USAGE, UPDATE ON SEQUENCE lockingkit.fencing_tokens TO app"));
/// ```
pub fn setup_sql(options: &PostgresOptions, role: &str) -> String {
    let schema = &options.fencing_schema;
    let sequence = format!("{schema}.{}", options.fencing_sequence);
    let function = format!("{schema}.{WATCH_FUNCTION}");
    format!(
        "CREATE SCHEMA IF NOT EXISTS {schema};\n{};\n{};\nGRANT USAGE ON SCHEMA {schema} TO {role};\n\
         GRANT USAGE, UPDATE ON SEQUENCE {sequence} TO {role};\n\
         GRANT EXECUTE ON FUNCTION {function}({WATCH_ARGUMENTS}) TO {role};\n",
        create_sequence(&sequence),
        create_function(&function),
    )
}
