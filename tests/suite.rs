//! The suites against real servers (PostgreSQL, PgBouncer, Azurite, Redis, etcd, MariaDB), one
//! module each, built as one test binary. The fixtures they share are the `lockingkit_tests`
//! library (`support/`).

// The Azure Blob provider against Azurite: the contract suite, leases, semaphores, interop.
mod azure;
// Faults injected into real PostgreSQL and Azurite (kill, pause, restart, proxy faults).
mod chaos;
// Named providers bound from a TOML file and environment variables, validated at startup.
mod configuration;
// Short waits (0 to 60 ms) on a contended, healthy PostgreSQL and Redis: 409, never 503.
mod contention;
// The contract's release cases that need the backend itself, on PostgreSQL and Azurite.
mod contract;
// The etcd provider against single-member and three-member clusters: contract, FIFO across
// processes, queue places, interop.
mod etcd;
// Faults injected into etcd clusters: members killed, quorum lost, whole cluster restarted,
// holders killed, paused or robbed of their key.
mod etcd_chaos;
// Leader election fails over when the leader's session is terminated or its process killed.
mod leader_failover;
// Two leader processes hand one key back and forth, sampled every millisecond: never two
// leaders at once.
mod leader_handover;
// The MariaDB fixture itself: a server that answers, named locks between two client sessions,
// data kept across a restart and a crash.
mod mariadb_fixture;
// Two processes take {a, b} and {b, a} with acquire_all, round after round: no deadlock, no
// lost update on a counter row written only under the hold.
mod multi_key_processes;
// The MySQL provider on MariaDB: the contract suite, interop with the command-line client,
// loss on a killed session, fencing across a restart, a thousand locks on eight sessions.
mod mysql;
// The MySQL chaos suite: a killed session, a killed, restarted and frozen server, a
// blackholed and a reset line.
mod mysql_chaos;
// The outage experiment: a locked route under load while PostgreSQL is frozen, unreachable,
// restarted or refusing our password (503/500, never 409; connections and log lines counted).
mod outages;
// The PostgreSQL provider through a real PgBouncer in each pooling mode.
mod pgbouncer;
// The PostgreSQL provider against a real server: the contract suite, sessions, interop.
mod postgres;
// Transaction-scoped locks on the caller's own transaction (PostgresTransactionLocks).
mod postgres_transaction;
// Writers the server grants the key: writer preference against every kind of reader, no
// ghost holder after a hand-off.
mod postgres_writers;
// The Redis provider against real servers and a real Redis Cluster: the contract suite, interop
// with plain Redis commands, key mapping against the server's slot rule.
mod redis;
// Faults injected into real Redis servers (kill, pause, restart, failover, proxy faults).
mod redis_chaos;
// A service stopped with SIGTERM leaves no lease and no session behind.
mod shutdown;
