//! The one table of how a rejection is answered: for every situation a layer refuses or stops
//! a request in, its HTTP status, whether it sends `Retry-After`, its problem `code` and the
//! sentence for the client. The crate docs and docs/http.md quote it; a test below keeps the
//! quotes true.

use std::time::Duration;

use http::StatusCode;
use lockingkit::{ErrorKind, LockMode};

/// How long a client is told to wait after a busy or timed-out lock, by default.
pub const DEFAULT_BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long a client is told to wait after the lock backend was unavailable, by default.
pub const DEFAULT_UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(5);

/// Every situation a rejection can be in; each has exactly one [`Answer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Situation {
    Busy,
    Timeout,
    /// Every slot of a semaphore layer taken.
    SlotsTaken,
    SlotsTakenForTheWait,
    Unavailable,
    NoKey,
    InvalidKey,
    LostMidRequest,
    Misconfigured,
    Backend,
    Miswired,
}

/// Which of the layer's `Retry-After` durations an answer sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RetryAfter {
    /// [`LockLayer::busy_retry_after`](crate::LockLayer::busy_retry_after).
    Busy,
    /// [`LockLayer::unavailable_retry_after`](crate::LockLayer::unavailable_retry_after).
    Unavailable,
}

/// The `Retry-After` durations of one layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RetryAfters {
    pub(crate) busy: Duration,
    pub(crate) unavailable: Duration,
}

impl RetryAfters {
    pub(crate) const DEFAULT: RetryAfters = RetryAfters {
        busy: DEFAULT_BUSY_RETRY_AFTER,
        unavailable: DEFAULT_UNAVAILABLE_RETRY_AFTER,
    };

    pub(crate) fn of(self, retry: RetryAfter) -> Duration {
        match retry {
            RetryAfter::Busy => self.busy,
            RetryAfter::Unavailable => self.unavailable,
        }
    }
}

/// How one situation is answered by default.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Answer {
    pub(crate) situation: Situation,
    /// The situation in the words of the docs' table.
    pub(crate) when: &'static str,
    pub(crate) status: StatusCode,
    pub(crate) retry_after: Option<RetryAfter>,
    /// The kind whose code is the problem document's `code`.
    pub(crate) kind: ErrorKind,
    /// The sentence for the client: it names neither the key nor backend internals.
    pub(crate) detail: &'static str,
}

impl Situation {
    /// The situation of an error a layer in `mode` met while taking the lock.
    pub(crate) fn of_acquire(kind: ErrorKind, mode: LockMode) -> Self {
        let semaphore = matches!(mode, LockMode::Semaphore { .. });
        match kind {
            ErrorKind::Busy if semaphore => Situation::SlotsTaken,
            ErrorKind::Timeout if semaphore => Situation::SlotsTakenForTheWait,
            ErrorKind::Busy => Situation::Busy,
            ErrorKind::Timeout => Situation::Timeout,
            ErrorKind::Unavailable => Situation::Unavailable,
            ErrorKind::InvalidKey => Situation::InvalidKey,
            ErrorKind::Lost => Situation::LostMidRequest,
            ErrorKind::Misconfigured => Situation::Misconfigured,
            _ => Situation::Backend,
        }
    }

    /// Its row of [`ANSWERS`].
    pub(crate) fn answer(self) -> &'static Answer {
        &ANSWERS[self as usize]
    }
}

/// The table: one row per [`Situation`], in the order the situations are declared (checked
/// below when the crate is compiled, so that [`Situation::answer`] can index it).
const ANSWERS: [Answer; 11] = [
    Answer {
        situation: Situation::Busy,
        when: "another request holds the lock",
        status: StatusCode::CONFLICT,
        retry_after: Some(RetryAfter::Busy),
        kind: ErrorKind::Busy,
        detail: "The resource is locked by another request. Retry later.",
    },
    Answer {
        situation: Situation::Timeout,
        when: "waited the whole timeout (wait mode)",
        status: StatusCode::CONFLICT,
        retry_after: Some(RetryAfter::Busy),
        kind: ErrorKind::Timeout,
        detail: "The resource stayed locked by another request for the whole wait. Retry later.",
    },
    Answer {
        situation: Situation::SlotsTaken,
        when: "every slot of a `.semaphore(n)` layer taken",
        status: StatusCode::TOO_MANY_REQUESTS,
        retry_after: Some(RetryAfter::Busy),
        kind: ErrorKind::Busy,
        detail: "Too many requests for this resource are in progress. Retry later.",
    },
    Answer {
        situation: Situation::SlotsTakenForTheWait,
        when: "every slot of a `.semaphore(n)` layer taken for the whole wait",
        status: StatusCode::TOO_MANY_REQUESTS,
        retry_after: Some(RetryAfter::Busy),
        kind: ErrorKind::Timeout,
        detail: "Too many requests for this resource stayed in progress for the whole wait. \
                 Retry later.",
    },
    Answer {
        situation: Situation::Unavailable,
        when: "lock backend down, frozen or failing (never for contention)",
        status: StatusCode::SERVICE_UNAVAILABLE,
        retry_after: Some(RetryAfter::Unavailable),
        kind: ErrorKind::Unavailable,
        detail: "The lock service is unavailable. Retry later.",
    },
    Answer {
        situation: Situation::NoKey,
        when: "no key derivable from the request",
        status: StatusCode::BAD_REQUEST,
        retry_after: None,
        kind: ErrorKind::InvalidKey,
        detail: "No lock key could be derived from the request.",
    },
    Answer {
        situation: Situation::InvalidKey,
        when: "the derived key is empty or over 512 characters",
        status: StatusCode::BAD_REQUEST,
        retry_after: None,
        kind: ErrorKind::InvalidKey,
        detail: "The lock key derived from the request is not valid.",
    },
    // Not 503, and no `Retry-After`: the handler may have applied some or all of its
    // effects, and 503 is what clients and proxies retry blindly.
    Answer {
        situation: Situation::LostMidRequest,
        when: "lock lost while the handler ran (handler dropped): the outcome is unknown",
        status: StatusCode::INTERNAL_SERVER_ERROR,
        retry_after: None,
        kind: ErrorKind::Lost,
        detail: "The lock protecting this request was lost while the request was being \
                 processed. The outcome is unknown: some or all of its effects may have been \
                 applied. Check the resource's state before retrying.",
    },
    Answer {
        situation: Situation::Misconfigured,
        when: "misconfigured backend (credentials refused, missing container)",
        status: StatusCode::INTERNAL_SERVER_ERROR,
        retry_after: None,
        kind: ErrorKind::Misconfigured,
        detail: "The lock service failed.",
    },
    Answer {
        situation: Situation::Backend,
        when: "the backend failed in a way no retry fixes",
        status: StatusCode::INTERNAL_SERVER_ERROR,
        retry_after: None,
        kind: ErrorKind::Backend,
        detail: "The lock service failed.",
    },
    Answer {
        situation: Situation::Miswired,
        when: "the server is wired wrong (two layers locking one key, a template naming a \
                 parameter its route does not capture), logged once",
        status: StatusCode::INTERNAL_SERVER_ERROR,
        retry_after: None,
        kind: ErrorKind::Misconfigured,
        detail: "The server is configured so that this request cannot be locked.",
    },
];

const _: () = {
    let mut row = 0;
    while row < ANSWERS.len() {
        assert!(ANSWERS[row].situation as usize == row);
        row += 1;
    }
    // `Miswired` is the last situation: a new one needs a row.
    assert!(Situation::Miswired as usize == ANSWERS.len() - 1);
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The table as the docs quote it, one line per row after the header.
    fn markdown(prefix: &str) -> String {
        let mut lines = vec![
            "| situation | status | `Retry-After` | `code` |".to_owned(),
            "|---|---|---|---|".to_owned(),
        ];
        for answer in &ANSWERS {
            let retry_after = match answer.retry_after {
                Some(retry) => {
                    let (after, method) = match retry {
                        RetryAfter::Busy => (DEFAULT_BUSY_RETRY_AFTER, "busy_retry_after"),
                        RetryAfter::Unavailable => {
                            (DEFAULT_UNAVAILABLE_RETRY_AFTER, "unavailable_retry_after")
                        }
                    };
                    format!("{} s (`{method}`)", after.as_secs())
                }
                None => "no".to_owned(),
            };
            lines.push(format!(
                "| {} | {} | {retry_after} | `{}` |",
                answer.when,
                answer.status,
                answer.kind.code()
            ));
        }
        lines
            .iter()
            .map(|line| format!("{prefix}{line}\n"))
            .collect()
    }

    #[test]
    fn the_code_of_an_acquire_error_is_its_kinds_in_every_mode() {
        // Every kind has a row, so the table's kinds are all of them.
        let kinds = ANSWERS.map(|answer| answer.kind);
        let modes = [
            LockMode::Exclusive,
            LockMode::Shared,
            LockMode::Semaphore { max_count: 2 },
        ];
        for (kind, mode) in kinds.into_iter().flat_map(|k| modes.map(|m| (k, m))) {
            let answer = Situation::of_acquire(kind, mode).answer();
            assert_eq!(answer.kind, kind, "{kind:?} in {mode:?}");
        }
    }

    #[test]
    fn the_crate_docs_and_docs_http_md_quote_the_table_whole() {
        for (file, text, prefix) in [
            ("src/lib.rs", include_str!("../lib.rs"), "//! "),
            ("docs/http.md", include_str!("../../../docs/http.md"), ""),
        ] {
            let table = markdown(prefix);
            assert!(
                text.contains(&table),
                "{file} must quote the table of answers exactly:\n{table}"
            );
        }
    }

    #[test]
    fn every_problem_document_docs_http_md_shows_is_a_row_of_the_table() {
        let documents: Vec<serde_json::Value> = include_str!("../../../docs/http.md")
            .lines()
            .filter(|line| line.starts_with("{\"type\":\"about:blank\""))
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert!(!documents.is_empty());
        for document in documents {
            let row = ANSWERS.iter().find(|answer| {
                document["status"] == answer.status.as_u16()
                    && document["title"] == answer.status.canonical_reason().unwrap()
                    && document["code"] == answer.kind.code()
                    && document["detail"] == answer.detail
            });
            assert!(row.is_some(), "not a row of the table: {document}");
        }
    }
}
