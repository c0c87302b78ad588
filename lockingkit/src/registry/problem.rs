//! Configuration problems as data: which setting or section, and what is wrong with it.
//!
//! Every check of a build adds [`Problem`]s to one list; only when the list is complete is it
//! written into the one `Misconfigured` error, with [`LockError::misconfigured`]. Nothing
//! downstream reads a problem back out of a message.

use std::fmt;

use crate::error::LockError;

/// One configuration problem: the setting (or section) it is about, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Problem {
    /// The setting or section, such as `Locking.Jobs.lease_duration` or `Locking.Jobs`
    /// (or, for a problem of code rather than configuration, what it is about: "the custom
    /// provider file").
    path: String,
    /// What is wrong, worded to follow `path` as `wording` says.
    message: String,
    wording: Wording,
}

/// How a problem's message joins its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wording {
    /// The rest of a sentence that starts with the path: `Locking.Jobs.account is required`.
    Sentence,
    /// A detail after a colon: `Locking.Jobs.lease_duration: expected a duration …`.
    Detail,
    /// A sentence its check wrote whole, path included, as the option structs' `problems`
    /// methods do (`Locking.Jobs.lease_duration must be between 15s and 60s …`).
    Whole,
}

impl Problem {
    /// `path` followed by the rest of a sentence: `Locking.Jobs.account is required`.
    pub(crate) fn sentence(path: impl Into<String>, rest: impl Into<String>) -> Self {
        Problem {
            path: path.into(),
            message: rest.into(),
            wording: Wording::Sentence,
        }
    }

    /// `path`, a colon and a detail: `Locking.Jobs.lease_duration: expected a duration …`.
    pub(crate) fn detail(path: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem {
            path: path.into(),
            message: detail.into(),
            wording: Wording::Detail,
        }
    }

    /// Problems an option struct's `problems(section)` found: each already starts with the
    /// section it was given, so it is kept whole.
    pub(crate) fn checked(section: &str, problems: Vec<String>) -> Vec<Self> {
        problems
            .into_iter()
            .map(|message| Problem {
                path: section.to_owned(),
                message,
                wording: Wording::Whole,
            })
            .collect()
    }

    /// The problem a `Misconfigured` error from another layer (the engine, a provider's
    /// constructor, a custom provider's factory) reports about the section at `path`.
    ///
    /// Such an error is the one place a problem arrives as text, because [`LockError`] carries
    /// only its message. Its message is kept whole: problems may contain "; " themselves, so
    /// it is not split. Only the preamble of [`LockError::misconfigured`] is dropped, as the
    /// registry's own error writes it once for all problems; a message that does not name its
    /// section gets the section's path in front.
    pub(crate) fn from_error(path: &str, error: &LockError) -> Self {
        let message = error.message();
        let message = message.strip_prefix(preamble().as_str()).unwrap_or(message);
        if message.starts_with(path) {
            Problem {
                path: path.to_owned(),
                message: message.to_owned(),
                wording: Wording::Whole,
            }
        } else {
            Problem::detail(path, message)
        }
    }

    /// The problem of a provider constructor's error, worded for a section the constructor
    /// names after its options type (such as `PostgresOptions`), moved to the section at
    /// `path` where the options came from.
    #[cfg(any(feature = "postgres", feature = "etcd"))]
    pub(crate) fn from_constructor(own: &str, path: &str, error: &LockError) -> Self {
        let problem = Problem::from_error(own, error);
        Problem {
            path: path.to_owned(),
            message: problem.message.replace(own, path),
            wording: problem.wording,
        }
    }

    /// Whether the problem names `field`, so that a check which involves a setting that did
    /// not parse can be left out (it would judge a default nobody wrote).
    pub(crate) fn mentions(&self, field: &str) -> bool {
        self.path.contains(field) || self.message.contains(field)
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.wording {
            Wording::Sentence => write!(f, "{} {}", self.path, self.message),
            Wording::Detail => write!(f, "{}: {}", self.path, self.message),
            Wording::Whole => f.write_str(&self.message),
        }
    }
}

/// The one `Misconfigured` error listing `problems`, each once: a problem found by two checks
/// (a static one and the provider's own) is listed the first time only.
pub(crate) fn into_error(problems: Vec<Problem>) -> LockError {
    let mut listed: Vec<String> = Vec::with_capacity(problems.len());
    for problem in problems.iter().map(ToString::to_string) {
        if !listed.contains(&problem) {
            listed.push(problem);
        }
    }
    LockError::misconfigured(listed)
}

/// What [`LockError::misconfigured`] writes before its problems, asked of the constructor
/// itself so that the two cannot drift apart.
fn preamble() -> String {
    LockError::misconfigured(std::iter::empty::<&str>())
        .message()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn each_wording_joins_its_path_as_written() {
        let shown = [
            Problem::sentence("Locking.Jobs.account", "is required"),
            Problem::detail("Locking.Jobs.lease_duration", "expected a duration"),
            Problem::checked("Locking.Jobs", vec!["Locking.Jobs.x must be 1".to_owned()]).remove(0),
        ]
        .map(|problem| problem.to_string());
        assert_eq!(
            shown,
            [
                "Locking.Jobs.account is required",
                "Locking.Jobs.lease_duration: expected a duration",
                "Locking.Jobs.x must be 1",
            ]
        );
    }

    #[test]
    fn an_error_from_another_layer_loses_only_the_preamble() {
        let engine =
            LockError::misconfigured(["Locking.Jobs.renew_every (9s) is too long; really"]);
        assert_eq!(
            Problem::from_error("Locking.Jobs", &engine).to_string(),
            "Locking.Jobs.renew_every (9s) is too long; really"
        );
        let bare = LockError::new(ErrorKind::Misconfigured, "the file is read-only");
        assert_eq!(
            Problem::from_error("Locking.Jobs", &bare).to_string(),
            "Locking.Jobs: the file is read-only"
        );
    }

    #[test]
    fn the_error_lists_each_problem_once_after_the_constructors_preamble() {
        let twice = Problem::sentence("Locking.Default", "is missing");
        let error = into_error(vec![
            twice.clone(),
            Problem::detail("Locking.Jobs.x", "expected a string"),
            twice,
        ]);
        assert_eq!(error.kind(), ErrorKind::Misconfigured);
        assert_eq!(
            error.message(),
            "invalid lock configuration: Locking.Default is missing; Locking.Jobs.x: expected a string"
        );
    }
}
