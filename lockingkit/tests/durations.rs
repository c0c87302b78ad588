//! Nothing panics on any duration or key a caller, a configuration file or a backend can
//! supply: each is either handled (a huge timeout means "wait as long as it takes") or refused
//! with `Misconfigured`. Property tests drive the public API with 0, 1 ns, `Duration::MAX`,
//! durations near the overflow of an instant, and arbitrary ones.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::time::Duration;

use lockingkit::{
    DistributedLock, ErrorKind, LockError, LockOptions, Locking, LockingConfig, MemoryBackend,
    MemoryStore,
};
use proptest::prelude::*;

/// Durations at the edges (0, 1 ns, near and at `Duration::MAX`) and anywhere between.
fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_nanos(1)),
        Just(Duration::MAX),
        (0u64..1_000_000).prop_map(|back| Duration::MAX - Duration::from_secs(back)),
        (0u64..u64::MAX / 2).prop_map(Duration::from_secs),
        (0u64..10_000_000_000).prop_map(Duration::from_nanos),
        (0u64..120_000).prop_map(Duration::from_millis),
    ]
}

/// Keys of any length and content, valid or not.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("🔒".repeat(512)),
        Just("x".repeat(513)),
        any::<String>(),
        "[a-z/._~%-]{1,40}",
    ]
}

/// Panics anywhere in this process, background tasks included (tokio catches those, so the
/// test would not see them otherwise).
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

/// Runs `work` on a fresh runtime with paused time (so waits cost nothing), for at most a
/// minute of that time; returns `None` if it was still waiting then. Fails the case if
/// anything panicked meanwhile, in a background task or not.
fn on_paused_time<F: Future>(work: F) -> Option<F::Output> {
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    let output = runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), work)
            .await
            .ok()
    });
    drop(runtime);
    assert_eq!(PANICS.load(Ordering::SeqCst), before, "something panicked");
    output
}

fn is_refusal(error: &LockError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Misconfigured | ErrorKind::InvalidKey
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn acquire_takes_any_timeout_and_any_key(timeout in duration(), key in key()) {
        on_paused_time(async {
            let store = MemoryStore::new();
            let locks = DistributedLock::in_memory_shared(&store);
            let other = DistributedLock::in_memory_shared(&store);
            match locks.acquire(&key, timeout).await {
                Ok(handle) => {
                    // Busy elsewhere: the other process waits up to its timeout (a minute at
                    // most here), and ends in a result.
                    let waited = tokio::time::timeout(
                        Duration::from_secs(5),
                        other.acquire(&key, timeout),
                    )
                    .await;
                    if let Ok(result) = waited {
                        prop_assert!(result.is_err());
                    }
                    prop_assert!(handle.release().await.is_ok());
                }
                Err(error) => prop_assert!(is_refusal(&error), "{error}"),
            }
            Ok(())
        })
        .unwrap_or(Ok(()))?;
    }

    #[test]
    fn any_lease_and_engine_option_is_handled_or_refused(
        lease in duration(),
        min in duration(),
        max in duration(),
        every in proptest::option::of(duration()),
        release in duration(),
        outage in duration(),
    ) {
        on_paused_time(async {
            let store = MemoryStore::new();
            let mut options = LockOptions::default()
                .with_min_retry_delay(min)
                .with_max_retry_delay(max)
                .with_release_timeout(release)
                .with_max_outage_retry_delay(outage);
            options.renew_every = every;
            let built = DistributedLock::builder(MemoryBackend::with_lease(store.clone(), lease))
                .options(options)
                .build();
            let locks = match built {
                Ok(locks) => locks,
                Err(error) => {
                    prop_assert_eq!(error.kind(), ErrorKind::Misconfigured);
                    return Ok(());
                }
            };
            // An outage, then a probe after the outage backoff, whatever its length.
            store.set_unavailable(true);
            for _ in 0..3 {
                let refused = locks.try_acquire("k").await;
                prop_assert_eq!(refused.err().map(|e| e.kind()), Some(ErrorKind::Unavailable));
            }
            store.set_unavailable(false);
            // The first probe is due at most `min` after the failure.
            let probe_due = min <= Duration::from_secs(3600);
            tokio::time::sleep(min.min(Duration::from_secs(3600))).await;
            let handle = locks.try_acquire("k").await;
            if probe_due {
                prop_assert!(handle.is_ok(), "{:?}", handle.as_ref().err());
            }
            let Ok(handle) = handle else { return Ok(()) };
            // Long enough for renewals and deadlines of short leases to come due.
            tokio::time::sleep(Duration::from_secs(20)).await;
            let _ = handle.is_held();
            let _ = handle.ensure_held();
            let _ = handle.release().await;
            let other = DistributedLock::in_memory_shared(&store);
            let waited = other.acquire("k", max).await;
            drop(waited);
            Ok(())
        })
        .unwrap_or(Ok(()))?;
    }

    #[test]
    fn the_config_binder_takes_any_duration_text(
        number in prop_oneof![
            Just("5000000000000000".to_owned()),
            Just("-5".to_owned()),
            Just("1.5".to_owned()),
            Just("18446744073709551615".to_owned()),
            Just("1e400".to_owned()),
            "[0-9]{1,25}",
            "[0-9]{1,12}\\.[0-9]{1,12}",
        ],
        unit in prop_oneof![Just(""), Just("ms"), Just("s"), Just("m"), Just("h"), Just("d")],
        field in prop_oneof![
            Just("lease_duration"),
            Just("min_retry_delay"),
            Just("max_retry_delay"),
            Just("renew_every"),
            Just("release_timeout"),
        ],
    ) {
        let config: LockingConfig = serde_json::from_value(serde_json::json!({
            "Default": {"provider": "in_memory", field: format!("{number}{unit}")},
        }))
        .expect("any section shape binds to a config");
        on_paused_time(async {
            match Locking::from_config(config) {
                Ok(locking) => {
                    let locks = locking.default_lock();
                    if let Ok(handle) = locks.try_acquire("k").await {
                        tokio::time::sleep(Duration::from_secs(20)).await;
                        let _ = handle.release().await;
                    }
                }
                Err(error) => prop_assert_eq!(error.kind(), ErrorKind::Misconfigured),
            }
            Ok(())
        })
        .unwrap_or(Ok(()))?;
    }
}

/// A backend that `build` makes for a server nobody listens at (port 1 of loopback refuses
/// at once): either its options are refused with `Misconfigured`, or a try is `Unavailable`.
#[cfg(any(feature = "postgres", feature = "redis"))]
fn unreachable_is_refused_or_unavailable<B: lockingkit::backend::LockBackend>(
    build: impl FnOnce() -> Result<B, LockError>,
) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        match build().and_then(|backend| DistributedLock::builder(backend).build()) {
            Ok(locks) => {
                let result = locks.try_acquire("k").await;
                prop_assert_eq!(result.err().map(|e| e.kind()), Some(ErrorKind::Unavailable));
            }
            Err(error) => prop_assert_eq!(error.kind(), ErrorKind::Misconfigured),
        }
        Ok(())
    })
}

#[cfg(feature = "postgres")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn postgres_options_take_any_duration(check in duration(), query in duration()) {
        use lockingkit::{PostgresBackend, PostgresOptions};
        unreachable_is_refused_or_unavailable(|| {
            PostgresBackend::new(
                PostgresOptions::new("postgres://nobody@127.0.0.1:1/none")
                    .with_check_interval(check)
                    .with_query_timeout(query),
            )
        })?;
    }
}

#[cfg(feature = "azure")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn azure_options_take_any_duration(lease in duration(), request in duration()) {
        use lockingkit::{AzureBlobBackend, AzureBlobOptions};
        let built = AzureBlobBackend::new(
            AzureBlobOptions::from_connection_string("UseDevelopmentStorage=true")
                .with_lease_duration(lease)
                .with_request_timeout(request),
        );
        if let Err(error) = built {
            prop_assert_eq!(error.kind(), ErrorKind::Misconfigured);
        }
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn redis_options_take_any_duration(
        lease in duration(),
        request in duration(),
        replica in duration(),
        intent in duration(),
    ) {
        use lockingkit::{RedisBackend, RedisOptions};
        unreachable_is_refused_or_unavailable(|| {
            RedisBackend::new(
                RedisOptions::new("redis://127.0.0.1:1")
                    .with_lease_duration(lease)
                    .with_request_timeout(request)
                    .with_replicas(1)
                    .with_replica_timeout(replica)
                    .with_writer_intent(intent),
            )
        })?;
    }
}

#[test]
fn a_lease_of_five_quadrillion_hours_from_a_configuration_file_is_handled() {
    for (field, value) in [
        ("lease_duration", "5000000000000000h"),
        ("renew_every", "5000000000000000h"),
        ("max_retry_delay", "5000000000000000h"),
        ("release_timeout", "5000000000000000h"),
    ] {
        let config: LockingConfig = serde_json::from_value(serde_json::json!({
            "Default": {"provider": "in_memory", field: value},
        }))
        .expect("config");
        on_paused_time(async {
            match Locking::from_config(config) {
                Ok(locking) => {
                    let handle = locking.default_lock().try_acquire("k").await.expect("free");
                    tokio::time::sleep(Duration::from_secs(20)).await;
                    assert!(handle.is_held(), "{field} = {value}");
                    handle.release().await.expect("release");
                }
                Err(error) => assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}"),
            }
        });
    }
}
