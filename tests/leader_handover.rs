//! Two leader processes on real PostgreSQL (`bin/leader_handover.rs`) hand one key back and
//! forth, each term ending by its work returning: sampled every 100 µs, the two never report
//! leading at once. The server grants the queued campaigner the key the moment the
//! leader's release frees it, before the leader has the server's answer, so the leader must
//! stop reading as leader before its release is sent.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use lockingkit::testing::unique_prefix;
use lockingkit_tests::postgres::PostgresServer;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// Terms each process leads before it resigns.
const TERMS: usize = 40;

/// A bound on how long a process may take, should the hand-over hang.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// Where one term was seen leading: surely at or before `first`, surely at or after `last`
/// (wall-clock nanoseconds; see `bin/leader_handover.rs`).
#[derive(Clone, Copy, Debug)]
struct Seen {
    process: usize,
    first: u128,
    last: u128,
}

/// Runs one instance to its end and returns the terms it saw itself lead.
async fn instance(server: &PostgresServer, key: &str, process: usize) -> Vec<(u64, Seen)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_leader_handover"))
        .env("LEADER_HANDOVER_CONNECTION", server.connection_string())
        .env("LEADER_HANDOVER_KEY", key)
        .env("LEADER_HANDOVER_TERMS", TERMS.to_string())
        .env("LEADER_HANDOVER_TERM_MS", "15")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the leader process starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    while let Some(line) = lines.next_line().await.expect("its output") {
        let fields: Vec<&str> = line.split(' ').collect();
        let ["term", term, first, last] = fields[..] else {
            panic!("unexpected output {line:?}");
        };
        let parse = |field: &str| field.parse::<u128>().expect("a number");
        let term = u64::try_from(parse(term)).expect("a term number");
        seen.push((
            term,
            Seen {
                process,
                first: parse(first),
                last: parse(last),
            },
        ));
    }
    let status = child.wait().await.expect("exit status");
    assert!(status.success(), "instance {process} failed: {status}");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_leader_processes_handing_over_never_both_report_leading() {
    let server = PostgresServer::start_local().await;
    let key = unique_prefix("leader/handover");
    let (first, second) = tokio::time::timeout(HANG_GUARD, async {
        tokio::join!(instance(&server, &key, 0), instance(&server, &key, 1))
    })
    .await
    .expect("both instances finished");
    let terms: BTreeMap<u64, Seen> = first.into_iter().chain(second).collect();
    assert!(terms.len() >= TERMS, "only {} terms seen", terms.len());
    // Terms are fencing tokens: in the order they began. A later term seen leading before an
    // earlier one was last seen leading proves an instant with two leaders.
    let mut overlaps = Vec::new();
    let mut handovers = 0;
    let ordered: Vec<(u64, Seen)> = terms.into_iter().collect();
    for (i, (term, seen)) in ordered.iter().enumerate() {
        for (later, next) in &ordered[i + 1..] {
            if next.process != seen.process && next.first < seen.last {
                overlaps.push((*term, *later, seen.last - next.first));
            }
        }
        if ordered
            .get(i + 1)
            .is_some_and(|(_, next)| next.process != seen.process)
        {
            handovers += 1;
        }
    }
    eprintln!(
        "{} terms, {handovers} hand-overs between the processes, {} seen with two leaders",
        ordered.len(),
        overlaps.len()
    );
    assert!(handovers >= TERMS / 2, "only {handovers} hand-overs");
    assert!(
        overlaps.is_empty(),
        "two leaders at once (earlier term, later term, nanoseconds): {overlaps:?}"
    );
}
