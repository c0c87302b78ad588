//! Configuration problems as data: which setting (or section) one is about, and what is wrong.

use std::fmt;

use crate::error::LockError;

/// One thing wrong with a configuration: the setting it is about, and what is wrong with it.
///
/// Option structs list theirs with `problems()`, naming their own settings
/// (`max_sessions must be a whole number from 1 to 1024`); [`at`](Self::at) places a problem
/// in the section it came from (`Locking.Jobs.max_sessions …`). The registry collects the
/// problems of every section and writes them, each once, into one
/// [`Misconfigured`](crate::ErrorKind::Misconfigured) error. A problem quotes no value of a
/// setting except those its check chose to [show](Self::showing) — durations and counts a
/// comparison is about, never a secret.
///
/// ```
/// use lockingkit::config::Problem;
///
/// let problem = Problem::new("max_sessions", "must be a whole number from 1 to 1024");
/// assert_eq!(
///     problem.at("Locking.Jobs").to_string(),
///     "Locking.Jobs.max_sessions must be a whole number from 1 to 1024"
/// );
///
/// // A check that compares two settings shows both values; the registry adds "default" to
/// // the value of a setting the section did not write.
/// let problem = Problem::new("request_timeout", "must be at most a third of {lease_ttl}")
///     .involving("lease_ttl")
///     .showing("request_timeout", "5s")
///     .showing("lease_ttl", "10s");
/// assert_eq!(
///     problem.to_string(),
///     "request_timeout (5s) must be at most a third of lease_ttl (10s)"
/// );
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The section the problem was placed in by [`at`](Self::at); empty until then.
    section: String,
    /// The setting, relative to its section; empty for the section as a whole.
    setting: String,
    /// Other settings the problem is about (`min_retry_delay … must not exceed
    /// max_retry_delay` is about both), relative to the section.
    involves: Vec<String>,
    /// What is wrong, worded to follow the setting as `wording` says.
    message: String,
    wording: Wording,
    /// Values shown beside settings (see [`Problem::showing`]). A boxed slice, not a `Vec`:
    /// it keeps `Problem` within clippy's `result_large_err` bound, and `Result<_, Problem>`
    /// is returned all over the registry.
    shown: Box<[Shown]>,
}

/// A value a problem shows beside one of its settings.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Shown {
    setting: String,
    value: String,
    /// The section did not write the setting: the value is its default.
    default: bool,
}

impl fmt::Display for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.default {
            true => write!(f, "{} (default {})", self.setting, self.value),
            false => write!(f, "{} ({})", self.setting, self.value),
        }
    }
}

/// How a problem's message joins its setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wording {
    /// The rest of a sentence that starts with the setting: `account is required`.
    Sentence,
    /// A detail after a colon: `lease_duration: expected a duration …`.
    Detail,
}

impl Problem {
    /// A problem with `setting`, worded as the rest of a sentence that starts with it:
    /// `Problem::new("account", "is required")`.
    pub fn new(setting: impl Into<String>, rest: impl Into<String>) -> Self {
        Problem {
            section: String::new(),
            setting: setting.into(),
            involves: Vec::new(),
            message: rest.into(),
            wording: Wording::Sentence,
            shown: Box::default(),
        }
    }

    /// A problem with `setting`, worded as a detail after a colon:
    /// `Problem::detail("lease_duration", "expected a duration")`. An empty `setting` is the
    /// section as a whole.
    pub fn detail(setting: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem {
            section: String::new(),
            setting: setting.into(),
            involves: Vec::new(),
            message: detail.into(),
            wording: Wording::Detail,
            shown: Box::default(),
        }
    }

    /// A problem with the section as a whole, not one setting of it:
    /// `set connection_string, or service_url with a token credential`.
    pub fn of_section(detail: impl Into<String>) -> Self {
        Problem::detail(String::new(), detail)
    }

    /// The same problem, also about `setting` (of the same section). A check that compares
    /// two settings names both, so that it is left out when either did not parse: it would
    /// judge a default nobody wrote.
    #[must_use]
    pub fn involving(mut self, setting: impl Into<String>) -> Self {
        self.involves.push(setting.into());
        self
    }

    /// The same problem, showing `value` beside `setting`: right after the problem's own
    /// setting (`request_timeout (5s) must …`), and in place of `{setting}` in the message
    /// for another (`… a third of {lease_ttl}` reads `… a third of lease_ttl (10s)`). For
    /// values that explain a comparison — durations, counts — never a secret's.
    #[must_use]
    pub fn showing(mut self, setting: impl Into<String>, value: impl Into<String>) -> Self {
        let mut shown = std::mem::take(&mut self.shown).into_vec();
        shown.push(Shown {
            setting: setting.into(),
            value: value.into(),
            default: false,
        });
        self.shown = shown.into_boxed_slice();
        self
    }

    /// Marks the shown value of each setting that `written` says the section did not write
    /// as its default: `request_timeout (default 5s) must …`.
    pub(crate) fn mark_defaults(&mut self, written: impl Fn(&str) -> bool) {
        for shown in self.shown.iter_mut() {
            shown.default = !written(&shown.setting);
        }
    }

    /// The message with each shown setting's `{setting}` replaced by the setting and value.
    fn message(&self) -> String {
        self.shown
            .iter()
            .fold(self.message.clone(), |message, shown| {
                message.replace(&format!("{{{}}}", shown.setting), &shown.to_string())
            })
    }

    /// The problem's own setting with its value, if it shows one: `request_timeout (5s)`.
    fn subject(&self, path: String) -> String {
        match self
            .shown
            .iter()
            .find(|shown| shown.setting == self.setting)
        {
            Some(shown) => Shown {
                setting: path,
                ..shown.clone()
            }
            .to_string(),
            None => path,
        }
    }

    /// The same problem, placed in `section` (such as `Locking.Jobs`): it reads
    /// `Locking.Jobs.max_sessions …`, or `Locking.Jobs: …` for a problem of the section itself.
    /// Placing a placed problem again puts `section` in front of its section.
    #[must_use]
    pub fn at(mut self, section: &str) -> Self {
        self.section = match self.section.as_str() {
            "" => section.to_owned(),
            inner => format!("{section}.{inner}"),
        };
        self
    }

    /// The setting the problem is about, within its section (`max_sessions`); empty for a
    /// problem of the section as a whole.
    pub fn setting(&self) -> &str {
        &self.setting
    }

    /// Where the problem is, as its message starts: `Locking.Jobs.max_sessions` once placed
    /// in `Locking.Jobs`, `max_sessions` before.
    pub fn path(&self) -> String {
        match (self.section.as_str(), self.setting.as_str()) {
            (section, "") => section.to_owned(),
            ("", setting) => setting.to_owned(),
            (section, setting) => format!("{section}.{setting}"),
        }
    }

    /// Whether the problem is about the setting `field` of its section, alone or with others.
    pub fn is_about(&self, field: &str) -> bool {
        (!field.is_empty() && self.setting == field) || self.involves.iter().any(|s| s == field)
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path();
        let message = self.message();
        if path.is_empty() {
            return f.write_str(&message);
        }
        let subject = self.subject(path);
        match self.wording {
            Wording::Sentence => write!(f, "{subject} {message}"),
            Wording::Detail => write!(f, "{subject}: {message}"),
        }
    }
}

/// The one `Misconfigured` error listing `problems` placed in `section`, each once: a problem
/// found by two checks (a static one and the provider's own) is listed the first time only.
pub(crate) fn misconfigured_at(
    section: &str,
    problems: impl IntoIterator<Item = Problem>,
) -> LockError {
    into_error(problems.into_iter().map(|problem| problem.at(section)))
}

/// The one `Misconfigured` error listing `problems` as placed, each once.
pub(crate) fn into_error(problems: impl IntoIterator<Item = Problem>) -> LockError {
    let mut listed: Vec<String> = Vec::new();
    for problem in problems.into_iter().map(|problem| problem.to_string()) {
        if !listed.contains(&problem) {
            listed.push(problem);
        }
    }
    LockError::misconfigured(listed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn each_wording_joins_its_setting_as_written() {
        let shown = [
            Problem::new("account", "is required"),
            Problem::detail("lease_duration", "expected a duration"),
            Problem::of_section("set connection_string or service_url"),
        ]
        .map(|problem| problem.at("Locking.Jobs").to_string());
        assert_eq!(
            shown,
            [
                "Locking.Jobs.account is required",
                "Locking.Jobs.lease_duration: expected a duration",
                "Locking.Jobs: set connection_string or service_url",
            ]
        );
    }

    #[test]
    fn a_problem_is_about_its_setting_and_those_it_involves_wherever_it_is_placed() {
        let problem = Problem::new("min_retry_delay", "must not exceed max_retry_delay")
            .involving("max_retry_delay")
            .at("Locking.Jobs");
        assert!(problem.is_about("min_retry_delay"));
        assert!(problem.is_about("max_retry_delay"));
        assert!(!problem.is_about("retry_delay"));
        assert!(!problem.is_about("Jobs"));
        assert_eq!(problem.setting(), "min_retry_delay");
        assert_eq!(problem.path(), "Locking.Jobs.min_retry_delay");
        let whole = Problem::of_section("whole").at("Locking.Jobs");
        assert!(!whole.is_about("") && !whole.is_about("Jobs"));
        assert_eq!(whole.path(), "Locking.Jobs");
    }

    #[test]
    fn shown_values_sit_beside_their_settings_and_say_which_are_defaults() {
        let problem = Problem::new("request_timeout", "must be at most a third of {lease_ttl}")
            .involving("lease_ttl")
            .showing("request_timeout", "5s")
            .showing("lease_ttl", "10s")
            .at("Locking.Cache");
        assert_eq!(
            problem.to_string(),
            "Locking.Cache.request_timeout (5s) must be at most a third of lease_ttl (10s)"
        );
        let mut only_lease_written = problem.clone();
        only_lease_written.mark_defaults(|s| s == "lease_ttl");
        assert_eq!(
            only_lease_written.to_string(),
            "Locking.Cache.request_timeout (default 5s) must be at most a third of lease_ttl (10s)"
        );
        let mut neither = problem;
        neither.mark_defaults(|_| false);
        assert_eq!(
            neither.to_string(),
            "Locking.Cache.request_timeout (default 5s) must be at most a third of lease_ttl \
             (default 10s)"
        );
        // Braces of a setting that shows no value are left as written.
        let plain = Problem::new("template", "must contain {id}");
        assert_eq!(plain.to_string(), "template must contain {id}");
    }

    #[test]
    fn the_error_lists_each_problem_once() {
        let twice = Problem::new("", "is missing");
        let error = into_error(vec![
            Problem::new("Locking.Default", "is missing"),
            Problem::detail("Locking.Jobs.x", "expected a string"),
            Problem::new("Locking.Default", "is missing"),
        ]);
        assert_eq!(error.kind(), ErrorKind::Misconfigured);
        assert_eq!(
            error.message(),
            "invalid lock configuration: Locking.Default is missing; Locking.Jobs.x: expected a string"
        );
        let placed = misconfigured_at("Locking.Default", [twice.clone(), twice]);
        assert_eq!(
            placed.message(),
            "invalid lock configuration: Locking.Default is missing"
        );
    }
}
