//! The response future of a `LockService`: acquire, call, race against loss, release.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use http_body::Body;
use lockingkit::{ErrorKind, LockError, LockHandle};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::layer::LockConfig;
use super::rejection::RejectionResponse;
use super::until_lost::UntilLost;
use super::{LockBody, LockRejection, RequestLock};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// The response future of a [`LockService`](crate::LockService).
    ///
    /// It takes the lock, calls the inner service and races its future against the lock's loss
    /// signal, then releases the lock and waits for the release to be confirmed before yielding
    /// the response. Dropping it at any point gives the lock up: a pending acquisition is
    /// cancelled without leaking the lock, and a held lock is released in the background.
    pub struct ResponseFuture<S, ReqBody, M>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S, ReqBody>,
        config: Arc<LockConfig>,
        mapper: Arc<M>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        Rejected {
            rejection: Option<LockRejection>,
        },
        Acquiring {
            acquire: BoxFuture<Result<LockHandle, LockError>>,
            pending: Option<(S, Request<ReqBody>)>,
            // An outer lock layer already holds this key for this request.
            nested: bool,
        },
        Calling {
            #[pin]
            response: UntilLost<S::Future>,
            handle: Option<LockHandle>,
        },
        Releasing {
            release: BoxFuture<Result<(), LockError>>,
            result: Option<Result<S::Response, S::Error>>,
        },
        Unlocked {
            #[pin]
            response: S::Future,
        },
        Done,
    }
}

impl<S, ReqBody, M> ResponseFuture<S, ReqBody, M>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn new(
        mut service: S,
        request: Request<ReqBody>,
        config: Arc<LockConfig>,
        mapper: Arc<M>,
    ) -> Self {
        let (mut parts, body) = request.into_parts();
        let applies = config.key.applies_to(&mut parts);
        let key = if applies {
            config.key.lock_key(&mut parts)
        } else {
            None
        };
        let request = Request::from_parts(parts, body);
        let state = match key {
            Some(key) => {
                let nested = request
                    .extensions()
                    .get::<RequestLock>()
                    .is_some_and(|outer| outer.key() == key);
                let locks = config.locks.clone();
                let wait = config.wait;
                State::Acquiring {
                    acquire: Box::pin(async move {
                        match wait {
                            None => locks.try_acquire(&key).await,
                            Some(timeout) => locks.acquire(&key, timeout).await,
                        }
                    }),
                    pending: Some((service, request)),
                    nested,
                }
            }
            None if !applies || config.pass_through_without_key => State::Unlocked {
                response: service.call(request),
            },
            None => State::Rejected {
                rejection: Some(LockRejection::no_key()),
            },
        };
        ResponseFuture {
            state,
            config,
            mapper,
        }
    }
}

impl<S, ReqBody, ResBody, M> Future for ResponseFuture<S, ReqBody, M>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body,
    M: RejectionResponse<ResBody>,
{
    type Output = Result<Response<LockBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Rejected { rejection } => {
                    let rejection = rejection.take();
                    this.state.set(State::Done);
                    if let Some(rejection) = rejection {
                        log_rejection(this.config, &rejection);
                        return Poll::Ready(Ok(this.mapper.rejection_response(rejection)));
                    }
                }
                StateProj::Acquiring {
                    acquire,
                    pending,
                    nested,
                } => {
                    let acquired = ready!(acquire.as_mut().poll(cx));
                    let pending = pending.take();
                    match (acquired, pending) {
                        (Ok(handle), Some((mut service, mut request))) => {
                            let view = RequestLock::from_handle(&handle);
                            let lost = view.loss_signal();
                            request.extensions_mut().insert(view);
                            let response = UntilLost::new(lost, service.call(request));
                            this.state.set(State::Calling {
                                response,
                                handle: Some(handle),
                            });
                        }
                        (Err(error), _) => {
                            let config: &LockConfig = this.config;
                            if *nested && error.is_contention() {
                                tracing::warn!(
                                    lock = config.locks.name(),
                                    "a lock layer found its key already held by an outer lock \
                                     layer on the same request; locks are not reentrant, so the \
                                     request is refused (with axum, each Router::route_layer \
                                     wraps every route added before it)"
                                );
                            }
                            let rejection = LockRejection::acquire(
                                error,
                                config.busy_retry_after,
                                config.unavailable_retry_after,
                            );
                            this.state.set(State::Rejected {
                                rejection: Some(rejection),
                            });
                        }
                        (Ok(_), None) => this.state.set(State::Done),
                    }
                }
                StateProj::Calling { response, handle } => {
                    // Loss is checked first: once the lock is gone the handler must not resume.
                    let Some(result) = ready!(response.poll(cx)) else {
                        let error = handle
                            .as_ref()
                            .and_then(|handle| handle.ensure_held().err())
                            .unwrap_or_else(|| LockError::lost(None));
                        // Dropping the inner future here is what stops the handler's work.
                        this.state.set(State::Rejected {
                            rejection: Some(LockRejection::lost(error)),
                        });
                        continue;
                    };
                    let Some(handle) = handle.take() else {
                        this.state.set(State::Done);
                        continue;
                    };
                    match result {
                        Ok(response)
                            if this.config.hold_until_body_ends
                                && !response.body().is_end_stream() =>
                        {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(
                                response.map(|body| LockBody::holding(body, handle))
                            ));
                        }
                        result => this.state.set(State::Releasing {
                            release: Box::pin(handle.release()),
                            result: Some(result),
                        }),
                    }
                }
                StateProj::Releasing { release, result } => {
                    let released = ready!(release.as_mut().poll(cx));
                    if let Err(error) = released {
                        // The response stands: the work is done, and an unconfirmed release
                        // ends when the lease expires. Fencing tokens cover the rest.
                        tracing::warn!(
                            lock = this.config.locks.name(),
                            code = error.code(),
                            error = %error,
                            "the lock was not confirmed released after the response"
                        );
                    }
                    let result = result.take();
                    this.state.set(State::Done);
                    if let Some(result) = result {
                        return Poll::Ready(result.map(|response| response.map(LockBody::new)));
                    }
                }
                StateProj::Unlocked { response } => {
                    let result = ready!(response.poll(cx));
                    this.state.set(State::Done);
                    return Poll::Ready(result.map(|response| response.map(LockBody::new)));
                }
                // Polled after completion: there is nothing left to give, and panicking is not
                // an option for a library future.
                StateProj::Done => return Poll::Pending,
            }
        }
    }
}

fn log_rejection(config: &LockConfig, rejection: &LockRejection) {
    let lock = config.locks.name();
    let code = rejection.code();
    match rejection.kind() {
        ErrorKind::Busy | ErrorKind::Timeout => {
            tracing::debug!(lock, code, "request refused: the lock is busy");
        }
        ErrorKind::InvalidKey => {
            tracing::debug!(lock, code, "request refused: no valid lock key");
        }
        ErrorKind::Unavailable | ErrorKind::Lost => {
            tracing::warn!(lock, code, error = ?rejection.error(), "request refused: {}", rejection.detail());
        }
        _ => {
            tracing::error!(lock, code, error = ?rejection.error(), "request refused: {}", rejection.detail());
        }
    }
}

impl<S, ReqBody, M> fmt::Debug for ResponseFuture<S, ReqBody, M>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
