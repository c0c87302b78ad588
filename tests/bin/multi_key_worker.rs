//! A worker for the cross-process multi-key test (tests/multi_key_processes.rs): it takes a
//! set of keys with `acquire_all` in the order it is given, round after round, and under the
//! hold adds one to a shared counter row by reading it and writing it back (a lost update if
//! two holds ever overlap), fenced by the hold's highest fencing token.
//!
//! Arguments: `<keys, comma-separated> <rounds> <table>`; `MULTI_KEY_WORKER_CONNECTION` is
//! the connection string. The table has one row, `(id = 1, value, fence)`. Each acquire may
//! wait up to `MULTI_KEY_WORKER_TIMEOUT_MS` (20 s by default); a timeout is a failure, not a
//! retry, so a deadlock shows as a non-zero exit. It prints `done <rounds>` at the end.

use std::time::Duration;

use lockingkit::{DistributedLock, PostgresBackend, PostgresOptions};

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
        let hold = locks
            .acquire_all(&keys, timeout)
            .await
            .map_err(|e| format!("round {round}: acquire_all({keys:?}): {e}"))?;
        let fence = hold
            .members()
            .iter()
            .map(|member| member.fencing_token())
            .max()
            .ok_or("a hold without members")?;
        let fence = i64::try_from(fence)?;
        hold.ensure_held()?;
        let value: i64 = client.query_one(&read, &[]).await?.get(0);
        // Held briefly between the read and the write: an overlapping hold would read the
        // same value here, and one of the two increments would be lost.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let updated = client.execute(&write, &[&(value + 1), &fence]).await?;
        if updated != 1 {
            return Err(format!("round {round}: fence {fence} was refused").into());
        }
        hold.release().await?;
    }
    locks.shutdown(Duration::from_secs(5)).await?;
    println!("done {rounds}");
    Ok(())
}
