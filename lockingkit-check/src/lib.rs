//! A history checker for LockingKit (issue 35, first part).
//!
//! Clients take locks and read-modify-write a fenced register under faults; every client, the
//! register and the nemesis write a history; the checker reads the histories and reports
//! mutual-exclusion violations, fencing violations and lost or doubled updates. See
//! `docs/reliability.md` for what runs, what is checked and what is not covered yet.
//!
//! - [`history`]: the events, as JSON lines.
//! - [`checker`]: the verdict on a history, a pure function.
//! - [`register`]: the fenced register server and its client.
//! - [`client`]: one client's loop.
//! - [`nemesis`]: the seeded fault schedule.
//! - [`provider`]: the providers a run checks, their servers and their guarantees.
//! - [`run`]: one run, start to report.
#![deny(missing_docs)]

pub mod checker;
pub mod client;
pub mod clock;
pub mod error;
pub mod history;
pub mod nemesis;
pub mod provider;
pub mod register;
pub mod rng;
pub mod run;

pub use error::CheckError;
