//! A worker for the cross-process multi-key test (tests/multi_key_processes.rs): it takes a
//! set of keys with `acquire_all` in the order it is given, round after round, and under the
//! hold adds one to a shared counter row by reading it and writing it back (a lost update if
//! two holds ever overlap), fenced by the hold's highest fencing token.
//!
//! Arguments: `<keys, comma-separated> <rounds> <table>`; `MULTI_KEY_WORKER_CONNECTION` is
//! the connection string. The table has one row, `(id = 1, value, fence)`. Each acquire may
//! wait up to `MULTI_KEY_WORKER_TIMEOUT_MS` (20 s by default); a timeout is a failure, not a
//! retry, so a deadlock shows as a non-zero exit. An outage (`Unavailable`: on a loaded machine
//! the server may not answer within the patience) is retried, as a worker would, and so is a
//! round whose hold was lost before its write landed: only a refused write under a hold that
//! still holds is an overlap. It prints `done <rounds>` at the end.

use std::time::Duration;

use lockingkit::{DistributedLock, ErrorKind, PostgresBackend, PostgresOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, keys, rounds, table] = args.as_slice() else {
        return Err("usage: multi_key_worker <keys> <rounds> <table>".into());
    };
    let keys: Vec<&str> = keys.split(',').collect();
    let rounds: u32 = rounds.parse()?;
    let timeout = match std::env::var("MULTI_KEY_WORKER_TIMEOUT_MS") {
        Ok(ms) => Duration::from_millis(ms.parse()?),
        Err(_) => Duration::from_secs(20),
    };
    let connection = std::env::var("MULTI_KEY_WORKER_CONNECTION")?;
    let locks = DistributedLock::builder(PostgresBackend::new(PostgresOptions::new(
        connection.clone(),
    ))?)
    .build()?;
    let (client, session) = tokio_postgres::connect(&connection, tokio_postgres::NoTls).await?;
    tokio::spawn(session);
    let read = format!("SELECT value FROM {table} WHERE id = 1");
    let write = format!("UPDATE {table} SET value = $1, fence = $2 WHERE id = 1 AND fence < $2");
    for round in 0..rounds {
        while !one_round(&locks, &client, &keys, timeout, round, &read, &write).await? {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    locks.shutdown(Duration::from_secs(5)).await?;
    println!("done {rounds}");
    Ok(())
}

/// One round: `true` once its increment landed under the hold, `false` when it is to be tried
/// again (an outage, or the hold lost before the write landed).
async fn one_round(
    locks: &DistributedLock,
    client: &tokio_postgres::Client,
    keys: &[&str],
    timeout: Duration,
    round: u32,
    read: &str,
    write: &str,
) -> Result<bool, Box<dyn std::error::Error>> {
    let hold = match locks.acquire_all(keys, timeout).await {
        Ok(hold) => hold,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            eprintln!("round {round}: acquire_all: {e}; trying again");
            return Ok(false);
        }
        Err(e) => return Err(format!("round {round}: acquire_all({keys:?}): {e}").into()),
    };
    let fence = hold
        .members()
        .iter()
        .map(|member| member.fencing_token())
        .max()
        .ok_or("a hold without members")?;
    let fence = i64::try_from(fence)?;
    if !hold.is_held() {
        return Ok(false);
    }
    let value: i64 = client.query_one(read, &[]).await?.get(0);
    // Held briefly between the read and the write: an overlapping hold would read the
    // same value here, and one of the two increments would be lost.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let updated = client.execute(write, &[&(value + 1), &fence]).await?;
    if updated != 1 {
        if !hold.is_held() {
            // Lost, and a later holder wrote with a higher fence: fencing did its work.
            eprintln!("round {round}: the hold was lost before its write; trying again");
            return Ok(false);
        }
        return Err(format!("round {round}: fence {fence} was refused").into());
    }
    // The increment landed: an unanswered release is the engine's to settle (it closes the
    // session, which frees the keys), not a reason to count the round again.
    if let Err(e) = hold.release().await {
        eprintln!("round {round}: release: {e}");
    }
    Ok(true)
}
