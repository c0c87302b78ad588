//! How etcd's failures map onto [`BackendError`]s, and what each says about the request: was
//! it never sent, refused before it could apply, or may it have applied? Messages name the
//! operation and the member's endpoint (which the options validate to carry no user
//! information), and for a member that could not be reached, the cause as the connection
//! reported it; never a key or a secret: etcd's own messages quote neither, and gRPC metadata
//! is never shown.

use etcd_client::Error;
use tonic::Code;

use crate::backend::BackendError;

/// What a failed request may have done at the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Effect {
    /// Nothing: it was never sent, or the server refused it before it could apply.
    None,
    /// Unknown: it reached (or may have reached) the server and its answer was lost or says
    /// only that the outcome is unknown ("request timed out", "leader changed").
    Unknown,
}

/// What to do with a failed request: tell the caller, or send it to another member first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Next {
    /// The failure is the answer.
    Answer,
    /// This member could not serve it (down, or cut off from its leader) and the request did
    /// nothing: another member may.
    OtherMember,
}

/// A failed request: the error for the caller, what the request may have done, and whether
/// another member should be asked.
#[derive(Clone, Debug)]
pub(super) struct Failure {
    pub(super) error: BackendError,
    pub(super) effect: Effect,
    pub(super) next: Next,
    /// The member itself failed (unreachable, no answer, no leader), as opposed to answering.
    pub(super) member_failed: bool,
    /// The member refused to authenticate us (wrong user or password, or no user where
    /// authentication is on). Every member would say the same (users are cluster state), and
    /// each login costs the server a password hash: the member is asked again only after its
    /// backoff, and the others are not asked instead.
    pub(super) credentials_refused: bool,
}

impl Failure {
    /// A request to the member at `at` that went unanswered within `timeout`: it may have
    /// applied.
    pub(super) fn timed_out(what: &'static str, at: &str, timeout: std::time::Duration) -> Self {
        Failure {
            error: BackendError::unreachable(format!(
                "etcd at {at} did not answer the {what} within {timeout:?}"
            )),
            effect: Effect::Unknown,
            next: Next::Answer,
            member_failed: true,
            credentials_refused: false,
        }
    }

    /// No request was sent: every member is failing, and none is due to be asked again.
    pub(super) fn refused(error: BackendError) -> Self {
        Failure {
            error,
            effect: Effect::None,
            next: Next::Answer,
            member_failed: false,
            credentials_refused: false,
        }
    }

    /// The same failure, marked as paced by the member's gate (see
    /// `BackendError::paced_by_provider`).
    pub(super) fn paced_by_member(mut self) -> Self {
        self.error = self.error.paced_by_provider();
        self
    }

    /// Whether the member's gate should hold it back for its backoff.
    pub(super) fn holds_member_back(&self) -> bool {
        self.member_failed || self.credentials_refused
    }

    /// Whether the request certainly did nothing.
    pub(super) fn had_no_effect(&self) -> bool {
        self.effect == Effect::None
    }
}

impl From<Failure> for BackendError {
    fn from(failure: Failure) -> Self {
        failure.error
    }
}

/// Messages of etcd's own statuses (`etcdserver: …`, from its `rpctypes`) that the provider
/// must tell apart.
mod message {
    /// A request naming a lease the server does not have (expired, revoked).
    pub(super) const LEASE_NOT_FOUND: &str = "requested lease not found";
    /// The member has no leader (sent because requests carry etcd's "require leader" flag):
    /// it refused the request without proposing it.
    pub(super) const NO_LEADER: &str = "no leader";
    /// The request's token expired or is unknown to this member (tokens are per member and
    /// expire after `--auth-token-ttl`): refused before anything applied.
    pub(super) const INVALID_AUTH_TOKEN: &str = "invalid auth token";
    /// The token predates a change of users or roles: refused before anything applied.
    pub(super) const AUTH_OLD_REVISION: &str = "revision of auth store is old";
    /// Wrong user or password (etcd does not say which).
    pub(super) const AUTH_FAILED: &str = "authentication failed";
    /// Authentication is on and the request carried no user.
    pub(super) const USER_EMPTY: &str = "user name is empty";
    /// The server sheds load: refused before proposing.
    pub(super) const TOO_MANY_REQUESTS: &str = "too many requests";
    /// The space quota is exceeded: writes are refused until an operator defragments.
    pub(super) const NO_SPACE: &str = "database space exceeded";
}

/// Whether the request failed before it was sent: no connection to its member could be made.
pub(super) fn never_sent(error: &Error) -> bool {
    match error {
        Error::GRpcStatus(status) => {
            status.code() == Code::Unavailable && status.message().contains("connect error")
        }
        Error::TransportError(_) => true,
        _ => false,
    }
}

/// Whether etcd said the lease named by a request is gone.
pub(super) fn is_lease_not_found(error: &Error) -> bool {
    matches!(error, Error::GRpcStatus(status) if status.message().contains(message::LEASE_NOT_FOUND))
        || matches!(error, Error::LeaseKeepAliveError(message) if message.contains("lease not found"))
}

/// What a failed request to the member at `at` means.
pub(super) fn classify(what: &'static str, at: &str, error: Error) -> Failure {
    if never_sent(&error) {
        return Failure {
            error: BackendError::unreachable(format!(
                "etcd at {at} could not be reached for the {what}: {}",
                cause(&error)
            ))
            .with_source(error),
            effect: Effect::None,
            next: Next::OtherMember,
            member_failed: true,
            credentials_refused: false,
        };
    }
    if is_lease_not_found(&error) {
        // A transaction naming a missing lease fails as a whole: nothing applied.
        return answered(
            BackendError::lease_gone(format!("etcd says the lease is gone ({what})")),
            Effect::None,
        );
    }
    let failure = match &error {
        Error::GRpcStatus(status) => from_status(what, at, status),
        Error::IoError(_) => unanswered(format!(
            "etcd at {at} could not be reached for the {what}: {}",
            cause(&error)
        )),
        Error::InvalidArgs(_) | Error::InvalidUri(_) | Error::EndpointError(_) => answered(
            BackendError::misconfigured(format!("etcd refused the {what} as invalid")),
            Effect::None,
        ),
        // The watch and keep-alive streams ended under us: the connection went away.
        Error::WatchError(_) | Error::LeaseKeepAliveError(_) => unanswered(format!(
            "the etcd stream for the {what} at {at} ended: {}",
            cause(&error)
        )),
        _ => answered(
            BackendError::permanent(format!("unexpected etcd failure in the {what} at {at}")),
            Effect::Unknown,
        ),
    };
    Failure {
        error: failure.error.with_source(error),
        ..failure
    }
}

/// Why a connection failed, as the transport said it: a gRPC status's message (never its
/// metadata) or an I/O or transport error, and the root of its causes (the layers between
/// mostly repeat one another).
fn cause(error: &Error) -> String {
    use std::error::Error as _;
    let (text, mut source) = match error {
        Error::GRpcStatus(status) => (status.message().to_owned(), status.source()),
        Error::IoError(io) => (io.to_string(), io.source()),
        Error::TransportError(transport) => (transport.to_string(), transport.source()),
        Error::WatchError(message) | Error::LeaseKeepAliveError(message) => (message.clone(), None),
        _ => ("unknown cause".to_owned(), None),
    };
    let mut root = None;
    while let Some(inner) = source {
        root = Some(inner);
        source = inner.source();
    }
    match root.map(ToString::to_string) {
        Some(root) if !text.contains(&root) => format!("{text}: {root}"),
        _ => text,
    }
}

/// A failure the server answered with.
fn answered(error: BackendError, effect: Effect) -> Failure {
    Failure {
        error,
        effect,
        next: Next::Answer,
        member_failed: false,
        credentials_refused: false,
    }
}

/// A request whose answer never came: it may have applied.
fn unanswered(message: String) -> Failure {
    Failure {
        error: BackendError::unreachable(message),
        effect: Effect::Unknown,
        next: Next::Answer,
        member_failed: true,
        credentials_refused: false,
    }
}

/// The member would not authenticate us: nothing applied (see
/// [`Failure::credentials_refused`]).
fn login_refused(message: String) -> Failure {
    Failure {
        credentials_refused: true,
        ..answered(BackendError::misconfigured(message), Effect::None)
    }
}

fn from_status(what: &'static str, at: &str, status: &tonic::Status) -> Failure {
    let text = status.message();
    // Statuses etcd itself sends carry its `etcdserver:` prefix; tonic makes up the others
    // when a connection fails under a request.
    if !text.starts_with("etcdserver:") {
        return match status.code() {
            Code::Unauthenticated | Code::PermissionDenied => refused_credentials(what, status),
            _ => unanswered(format!("etcd at {at} failed the {what}: {text}")),
        };
    }
    if text.contains(message::NO_LEADER) {
        return Failure {
            error: BackendError::transient(format!("etcd at {at} failed the {what}: {text}")),
            effect: Effect::None,
            next: Next::OtherMember,
            member_failed: true,
            credentials_refused: false,
        };
    }
    let refused_before_applying = [
        message::INVALID_AUTH_TOKEN,
        message::AUTH_OLD_REVISION,
        message::TOO_MANY_REQUESTS,
        message::NO_SPACE,
    ];
    if refused_before_applying.iter().any(|m| text.contains(m)) {
        return answered(
            BackendError::transient(format!("etcd failed the {what}: {text}")),
            Effect::None,
        );
    }
    if text.contains(message::AUTH_FAILED) {
        return login_refused(format!(
            "etcd refused the credentials for the {what}: wrong user or password"
        ));
    }
    if text.contains(message::USER_EMPTY) {
        return login_refused(format!(
            "etcd has authentication on and the options name no user (set `user` and \
             `password`): it refused the {what}"
        ));
    }
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied => refused_credentials(what, status),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => answered(
            BackendError::permanent(format!("etcd refused the {what}: {text}")),
            Effect::None,
        ),
        // "request timed out", "leader changed", "server stopped" and the like: the request
        // was proposed and its outcome is unknown.
        _ => answered(
            BackendError::transient(format!("etcd failed the {what}: {text}")),
            Effect::Unknown,
        ),
    }
}

fn refused_credentials(what: &'static str, status: &tonic::Status) -> Failure {
    answered(
        BackendError::misconfigured(format!(
            "etcd refused the {what}: the user lacks permission or the credentials are wrong ({})",
            status.message()
        )),
        Effect::None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendErrorKind;

    const AT: &str = "http://10.0.0.1:2379";

    fn status(code: Code, message: &str) -> Error {
        Error::GRpcStatus(tonic::Status::new(code, message))
    }

    fn kind(failure: &Failure) -> BackendErrorKind {
        failure.error.kind()
    }

    #[test]
    fn an_expired_token_is_transient_and_did_nothing() {
        let failure = classify(
            "lock attempt",
            AT,
            status(Code::Unauthenticated, "etcdserver: invalid auth token"),
        );
        assert_eq!(
            kind(&failure),
            BackendErrorKind::Transient { reached: true }
        );
        assert_eq!(failure.effect, Effect::None);
        assert_eq!(failure.next, Next::Answer);
    }

    #[test]
    fn wrong_credentials_and_missing_permissions_are_misconfiguration() {
        for error in [
            status(
                Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password",
            ),
            status(Code::PermissionDenied, "etcdserver: permission denied"),
            status(Code::InvalidArgument, "etcdserver: user name is empty"),
        ] {
            let failure = classify("lock attempt", AT, error);
            assert_eq!(kind(&failure), BackendErrorKind::Misconfigured);
            assert_eq!(failure.effect, Effect::None);
        }
    }

    #[test]
    fn a_refused_login_holds_the_member_back_and_a_refused_permission_does_not() {
        let wrong = classify(
            "connection",
            AT,
            status(
                Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password",
            ),
        );
        assert!(wrong.credentials_refused && wrong.holds_member_back());
        assert_eq!(wrong.next, Next::Answer, "every member would refuse it");
        let no_user = classify(
            "lock attempt",
            AT,
            status(Code::InvalidArgument, "etcdserver: user name is empty"),
        );
        assert!(no_user.credentials_refused);
        assert!(
            no_user.error.message().contains("no user"),
            "{}",
            no_user.error.message()
        );
        assert!(!no_user.error.message().contains("refused the credentials"));
        let denied = classify(
            "lock attempt",
            AT,
            status(Code::PermissionDenied, "etcdserver: permission denied"),
        );
        assert!(
            !denied.holds_member_back(),
            "the member answered the request"
        );
    }

    #[test]
    fn a_member_that_cannot_be_reached_is_named_with_the_cause() {
        let down = classify(
            "lock attempt",
            AT,
            status(
                Code::Unavailable,
                "tcp connect error: Connection refused (os error 111)",
            ),
        );
        assert_eq!(
            down.error.message(),
            "etcd at http://10.0.0.1:2379 could not be reached for the lock attempt: tcp \
             connect error: Connection refused (os error 111)"
        );
        let silent = Failure::timed_out("lease grant", AT, std::time::Duration::from_secs(5));
        assert!(silent.error.message().contains(AT));
    }

    #[test]
    fn requests_whose_outcome_is_unknown_may_have_applied() {
        for message in [
            "etcdserver: request timed out",
            "etcdserver: leader changed",
            "etcdserver: request timed out, possibly due to previous leader failure",
            "etcdserver: server stopped",
        ] {
            let failure = classify("lock attempt", AT, status(Code::Unavailable, message));
            assert_eq!(
                kind(&failure),
                BackendErrorKind::Transient { reached: true }
            );
            assert_eq!(failure.effect, Effect::Unknown, "{message}");
        }
        let cut = classify(
            "lock attempt",
            AT,
            status(Code::Unavailable, "error trying to connect: broken pipe"),
        );
        assert_eq!(cut.effect, Effect::Unknown);
        assert_eq!(kind(&cut), BackendErrorKind::Transient { reached: false });
    }

    #[test]
    fn a_member_without_leader_or_connection_sends_the_request_elsewhere() {
        let no_leader = classify(
            "lock attempt",
            AT,
            status(Code::Unavailable, "etcdserver: no leader"),
        );
        assert_eq!(no_leader.next, Next::OtherMember);
        assert_eq!(no_leader.effect, Effect::None);
        let down = classify(
            "lock attempt",
            AT,
            status(Code::Unavailable, "tcp connect error: Connection refused"),
        );
        assert_eq!(down.next, Next::OtherMember);
        assert_eq!(down.effect, Effect::None);
        assert_eq!(kind(&down), BackendErrorKind::Transient { reached: false });
    }

    #[test]
    fn a_missing_lease_is_lease_gone_and_did_nothing() {
        let failure = classify(
            "lock attempt",
            AT,
            status(Code::NotFound, "etcdserver: requested lease not found"),
        );
        assert_eq!(kind(&failure), BackendErrorKind::LeaseGone);
        assert_eq!(failure.effect, Effect::None);
    }
}
