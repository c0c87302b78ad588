//! The response future of a `LockService`: acquire, call, race against loss, release.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{Request, Response};
use http_body::Body;
use lockingkit::LockError;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::acquire::{Acquisition, Derived};
use super::handle::Handle;
use super::layer::{LockConfig, OnLoss};
use super::rejection::RejectionResponse;
use super::until_lost::UntilLost;
use super::{LockBody, LockRejection};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// The response future of a [`LockService`](crate::LockService).
    ///
    /// It derives the key and takes the lock, calls the inner service and races its future
    /// against the lock's loss signal, then releases the lock and waits for the release to be
    /// confirmed before yielding the response. A lost lock is answered the same way: the
    /// rejection is yielded once the keys of a multi-key hold that were still held have been
    /// released. Dropping it at any point gives the lock up: a
    /// pending acquisition is cancelled without leaking the lock, and a held lock is released
    /// in the background.
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
        // The request head is inside `acquire` while the key is derived and the lock taken.
        Acquiring {
            acquire: Acquisition,
            pending: Option<(S, ReqBody)>,
        },
        Calling {
            #[pin]
            response: UntilLost<S::Future>,
            handle: Option<Handle>,
        },
        // The answer waits for the release: after the handler's response, and after a loss
        // too, where a multi-key hold gives back the members it still held.
        Releasing {
            release: BoxFuture<Result<(), LockError>>,
            then: Option<Outcome<S::Response, S::Error>>,
        },
        Unlocked {
            #[pin]
            response: S::Future,
        },
        Done,
    }
}

/// What one state's poll leads to: another state, or the end of the future.
enum Step<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    Next(State<S, ReqBody>),
    Finish(Outcome<S::Response, S::Error>),
}

/// How the future ends, before the response body is wrapped and rejections are mapped.
enum Outcome<R, E> {
    Answer(Result<R, E>),
    /// The response's body holds the lock until it ends.
    Holding(R, Handle),
    Rejected(LockRejection),
}

impl<S, ReqBody, M> ResponseFuture<S, ReqBody, M>
where
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn new(
        service: S,
        request: Request<ReqBody>,
        config: Arc<LockConfig>,
        mapper: Arc<M>,
    ) -> Self {
        let (parts, body) = request.into_parts();
        let acquire = config.key.clone().acquire_for(parts, config.clone());
        ResponseFuture {
            state: State::Acquiring {
                acquire,
                pending: Some((service, body)),
            },
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
            let step = match this.state.as_mut().project() {
                StateProj::Acquiring { acquire, pending } => {
                    ready!(poll_acquiring(acquire, pending, this.config, cx))
                }
                StateProj::Calling { response, handle } => {
                    ready!(poll_calling(response, handle, this.config, cx))
                }
                StateProj::Releasing { release, then } => {
                    ready!(poll_releasing(release, then, this.config, cx))
                }
                StateProj::Unlocked { response } => {
                    Step::Finish(Outcome::Answer(ready!(response.poll(cx))))
                }
                // Polled after completion: there is nothing left to give, and panicking is not
                // an option for a library future.
                StateProj::Done => return Poll::Pending,
            };
            match step {
                Step::Next(state) => this.state.set(state),
                Step::Finish(outcome) => {
                    // Leaving the state drops the inner future, which is what stops a handler
                    // whose lock was lost.
                    this.state.set(State::Done);
                    return Poll::Ready(finish(outcome, this.config, &**this.mapper));
                }
            }
        }
    }
}

/// Waits for the key and the lock, then calls the inner service with the request rebuilt.
fn poll_acquiring<S, ReqBody>(
    acquire: &mut Acquisition,
    pending: &mut Option<(S, ReqBody)>,
    config: &LockConfig,
    cx: &mut Context<'_>,
) -> Poll<Step<S, ReqBody>>
where
    S: Service<Request<ReqBody>>,
{
    let (parts, derived) = ready!(acquire.as_mut().poll(cx));
    let Some((mut service, body)) = pending.take() else {
        return Poll::Ready(Step::Next(State::Done));
    };
    let mut request = Request::from_parts(parts, body);
    Poll::Ready(match derived {
        Derived::Acquired { handle } => {
            handle.insert_view(request.extensions_mut());
            Step::Next(State::Calling {
                response: UntilLost::new(service.call(request)),
                handle: Some(handle),
            })
        }
        Derived::NoKey if !config.pass_through_without_key => {
            Step::Finish(Outcome::Rejected(LockRejection::no_key(config.mode.mode())))
        }
        Derived::NotApplicable | Derived::NoKey => Step::Next(State::Unlocked {
            response: service.call(request),
        }),
        Derived::Miswired { explanation } => {
            report_miswiring(config, &explanation);
            let mode = config.mode.mode();
            Step::Finish(Outcome::Rejected(LockRejection::miswired(
                &explanation,
                mode,
            )))
        }
        Derived::Refused { error } => Step::Finish(Outcome::Rejected(LockRejection::acquire(
            error,
            config.mode.mode(),
            config.retry_after,
        ))),
    })
}

/// Logs a wiring mistake the first time this layer meets it: it is a bug in the server that
/// every request on the route meets, and one line names it.
fn report_miswiring(config: &LockConfig, explanation: &str) {
    let mut seen = config
        .miswirings
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Bounded, should a custom `LockKey` word its explanations per request.
    if seen.len() < 64 && seen.insert(explanation.to_owned()) {
        tracing::error!(
            lock = config.locks.name(),
            "requests are refused with 500: the lock layer is wired wrong: {explanation}"
        );
    }
}

/// Races the inner service against loss (loss first); on success, releases or hands the lock
/// to the body.
fn poll_calling<S, ReqBody, ResBody>(
    response: Pin<&mut UntilLost<S::Future>>,
    handle: &mut Option<Handle>,
    config: &LockConfig,
    cx: &mut Context<'_>,
) -> Poll<Step<S, ReqBody>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body,
{
    let watched = match config.on_loss {
        OnLoss::Cancel => handle.as_ref(),
        OnLoss::Signal => None,
    };
    let Some(result) = ready!(response.poll_under(watched, cx)) else {
        let error = handle
            .as_ref()
            .and_then(|handle| handle.ensure_held().err())
            .unwrap_or_else(|| LockError::lost(None));
        tracing::warn!(
            lock = config.locks.name(),
            fencing_token = handle.as_ref().and_then(Handle::fencing_token),
            key_digest = handle.as_ref().and_then(Handle::key_digest),
            reason = error.message(),
            "the lock was lost while the request was being handled; the handler was stopped and \
             the client is told the outcome is unknown"
        );
        let rejection = Outcome::Rejected(LockRejection::lost(error, config.mode.mode()));
        // "Lost" is answered once nothing of the hold is held any more: a lost single lock
        // releases at once, a multi-key hold once its other members' releases are answered.
        return Poll::Ready(match handle.take() {
            Some(handle) => Step::Next(State::Releasing {
                release: handle.release(),
                then: Some(rejection),
            }),
            None => Step::Finish(rejection),
        });
    };
    let Some(handle) = handle.take() else {
        return Poll::Ready(Step::Next(State::Done));
    };
    Poll::Ready(match result {
        Ok(response) if config.hold_until_body_ends && !response.body().is_end_stream() => {
            Step::Finish(Outcome::Holding(response, handle))
        }
        result => Step::Next(State::Releasing {
            release: handle.release(),
            then: Some(Outcome::Answer(result)),
        }),
    })
}

/// Waits for the release to be answered, then hands the outcome on.
fn poll_releasing<S, ReqBody>(
    release: &mut BoxFuture<Result<(), LockError>>,
    then: &mut Option<Outcome<S::Response, S::Error>>,
    config: &LockConfig,
    cx: &mut Context<'_>,
) -> Poll<Step<S, ReqBody>>
where
    S: Service<Request<ReqBody>>,
{
    let released = ready!(release.as_mut().poll(cx));
    let Some(then) = then.take() else {
        return Poll::Ready(Step::Next(State::Done));
    };
    // After a loss the release says "lost", which the rejection already tells.
    if let (Err(error), Outcome::Answer(_)) = (&released, &then) {
        // The response stands: the work is done, and an unconfirmed release ends when the lease
        // expires. Fencing tokens cover the rest.
        tracing::warn!(
            lock = config.locks.name(),
            code = error.code(),
            error = %error,
            "the lock was not confirmed released after the response"
        );
    }
    Poll::Ready(Step::Finish(then))
}

/// Wraps the response body, or turns a rejection into the mapper's response.
fn finish<ResBody, E, M>(
    outcome: Outcome<Response<ResBody>, E>,
    config: &LockConfig,
    mapper: &M,
) -> Result<Response<LockBody<ResBody>>, E>
where
    M: RejectionResponse<ResBody>,
{
    match outcome {
        Outcome::Answer(result) => result.map(|response| response.map(LockBody::new)),
        Outcome::Holding(response, handle) => {
            Ok(response.map(|body| LockBody::holding(body, handle)))
        }
        Outcome::Rejected(rejection) => {
            log_rejection(config, &rejection);
            Ok(mapper.rejection_response(rejection))
        }
    }
}

/// Refusals are logged at debug level: contention is routine, an outage is logged once by the
/// provider when it starts and once when it ends (not per request, which would flood the log
/// exactly when it matters), and a loss and a wiring mistake are logged where they are found.
/// The line names the rejection's situation as the table in `answers.rs` words it.
fn log_rejection(config: &LockConfig, rejection: &LockRejection) {
    tracing::debug!(
        lock = config.locks.name(),
        code = rejection.code(),
        error = ?rejection.error(),
        "request refused: {}",
        rejection.answer().when
    );
}

impl<S, ReqBody, M> fmt::Debug for ResponseFuture<S, ReqBody, M>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
