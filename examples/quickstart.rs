//! LockingKit in one minute, on the in-memory provider (no server needed):
//!
//! ```text
//! cargo run -p lockingkit-examples --example quickstart
//! ```
//!
//! It shows a busy lock, a waiter that gets the lock when it is released, fencing tokens, and
//! work that stops when its lock is lost.

use std::time::Duration;

use lockingkit::{DistributedLock, ErrorKind, LockError, MemoryBackend, MemoryStore};

#[tokio::main]
async fn main() -> Result<(), LockError> {
    // Two "processes" sharing one backend. In production each would be its own service
    // instance on Azure Blob leases or PostgreSQL; the code would not change.
    let store = MemoryStore::new();
    let worker_a = DistributedLock::in_memory_shared(&store);
    let worker_b = DistributedLock::in_memory_shared(&store);

    // 1. Busy is an answer, not an exception.
    let export = worker_a.try_acquire("jobs/nightly-export").await?;
    println!(
        "worker A holds jobs/nightly-export with fencing token {}",
        export.fencing_token()
    );
    match worker_b.try_acquire("jobs/nightly-export").await {
        Err(e) if e.kind() == ErrorKind::Busy => println!("worker B: {e}"),
        other => println!("worker B: unexpected {other:?}"),
    }

    // 2. Waiting: B waits up to 5 s; A finishes and releases after 200 ms.
    let waiter = tokio::spawn({
        let worker_b = worker_b.clone();
        async move {
            worker_b
                .acquire("jobs/nightly-export", Duration::from_secs(5))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let first_token = export.fencing_token();
    export.release().await?;
    println!("worker A released the lock");
    let export = waiter
        .await
        .map_err(|e| LockError::new(ErrorKind::Backend, e.to_string()))??;

    // 3. Fencing: the new holder's token is higher, so a resource that remembers the highest
    //    token it has seen can turn away a former holder that wakes up late.
    println!(
        "worker B got it after waiting; token {} > {}",
        export.fencing_token(),
        first_token
    );
    export.release().await?;

    // 4. Loss: run work under the lock; when the lease is lost the work is dropped. A 3 s lease
    //    (renewed every second) keeps the demo short; the default is 30 s.
    let short_leases = DistributedLock::builder(MemoryBackend::with_lease(
        store.clone(),
        Duration::from_secs(3),
    ))
    .build()?;
    let report = short_leases.try_acquire("reports/daily").await?;
    let lost = report.lost_token();
    // Simulate another client breaking the lease (the in-memory store has test controls).
    store.break_lease("reports/daily");
    let work = report.run(async {
        for batch in 1.. {
            println!("exporting batch {batch}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    // The next renewal finds the lease gone, and the work is dropped at its next await.
    match work.await {
        Err(e) if e.kind() == ErrorKind::Lost => println!(
            "work stopped: {e} (lost token fired: {})",
            lost.is_cancelled()
        ),
        other => println!("unexpected: {other:?}"),
    }
    Ok(())
}
