//! The layer takes any wait timeout and any key without panicking: `wait(Duration::MAX)`
//! means "as long as it takes", and every request gets a response.

use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use lockingkit::{DistributedLock, MemoryStore};

use lockingkit_tower::LockLayer;
use proptest::prelude::*;
use tower::{service_fn, Layer, ServiceExt};

fn duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_nanos(1)),
        Just(Duration::MAX),
        (0u64..1_000_000).prop_map(|back| Duration::MAX - Duration::from_secs(back)),
        any::<u64>().prop_map(Duration::from_secs),
        (0u64..120_000).prop_map(Duration::from_millis),
    ]
}

/// A current-thread runtime on paused time: waits cost nothing.
fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime")
}

/// The inner service: 200 with an empty body.
async fn ok(_: Request<()>) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    Ok(Response::new(Full::new(Bytes::new())))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_wait_and_any_key_gets_a_response(wait in duration(), key in any::<String>()) {
        paused_runtime().block_on(async {
            let locks = DistributedLock::in_memory();
            let layer = LockLayer::new(locks, move |_: &Parts| Some(key.clone())).wait(wait);
            let service = layer.layer(service_fn(ok));
            let response = service
                .clone()
                .oneshot(Request::new(()))
                .await
                .expect("infallible");
            prop_assert!(matches!(
                response.status(),
                StatusCode::OK | StatusCode::BAD_REQUEST
            ));
            Ok(())
        })?;
    }

    #[test]
    fn a_busy_key_with_any_wait_answers_409_or_keeps_waiting(wait in duration()) {
        paused_runtime().block_on(async {
            let store = MemoryStore::new();
            let holder = DistributedLock::in_memory_shared(&store);
            let _held = holder.try_acquire("busy").await.expect("free");
            let locks = DistributedLock::in_memory_shared(&store);
            let layer = LockLayer::new(locks, |_: &Parts| Some("busy".to_owned())).wait(wait);
            let service = layer.layer(service_fn(ok));
            let answered =
                tokio::time::timeout(Duration::from_secs(60), service.oneshot(Request::new(())))
                    .await;
            if let Ok(response) = answered {
                prop_assert_eq!(response.expect("infallible").status(), StatusCode::CONFLICT);
            }
            Ok(())
        })?;
    }
}
