//! The registry while [`LockingBuilder::build`](super::LockingBuilder::build) makes it: the
//! names taken, the providers built, and every problem found on the way.

use serde_json::Value;

use super::builtin::BUILT_IN;
use super::from_config::{build_section, CustomProvider};
use super::lenient::canonical;
use super::setup::{HostResources, ProviderResult, ProviderSetup, Registration};
use super::Locking;
use crate::config::{self, Problem};
use crate::engine::LockOptions;
use crate::error::LockError;
use crate::lock::{DistributedLock, DEFAULT_NAME};

/// A registry being built. Each step adds providers or problems; nothing fails before
/// [`finish`](Self::finish), so the one error lists every problem.
pub(super) struct Draft<'a> {
    host: HostResources<'a>,
    /// The names taken so far, as shown.
    names: Vec<String>,
    providers: Vec<DistributedLock>,
    problems: Vec<Problem>,
}

impl<'a> Draft<'a> {
    pub(super) fn new(host: HostResources<'a>) -> Self {
        Draft {
            host,
            names: Vec::new(),
            providers: Vec::new(),
            problems: Vec::new(),
        }
    }

    /// Checks that custom providers have names a section can write and that are their own.
    pub(super) fn check_custom_providers(&mut self, custom: &[CustomProvider]) {
        for provider in custom {
            let wanted = canonical(&provider.name);
            if wanted.is_empty() {
                self.problems
                    .push(Problem::new("a custom provider", "needs a non-empty name"));
            } else if BUILT_IN.iter().any(|b| canonical(b.name) == wanted) {
                self.problems.push(Problem::new(
                    format!("the custom provider {}", provider.name),
                    "has the name of a built-in provider",
                ));
            }
        }
    }

    /// Builds a provider registered in code.
    pub(super) fn add_registered(&mut self, name: &str, register: Registration) {
        let Some(name) = self.take_name(name) else {
            return;
        };
        let result = register(ProviderSetup {
            name: &name,
            options: LockOptions::default(),
            host: self.host,
        });
        self.keep(result);
    }

    /// Builds the provider of a configuration section.
    pub(super) fn add_section(&mut self, name: &str, section: Value, custom: &[CustomProvider]) {
        let Some(name) = self.take_name(name) else {
            return;
        };
        let Value::Object(settings) = section else {
            self.problems.push(Problem::new(
                format!("Locking.{name}"),
                "must be a table of settings",
            ));
            return;
        };
        let built = build_section(&name, settings, custom, self.host, &mut self.problems);
        self.providers.extend(built);
    }

    /// Checks that `Default` and every name in `required` were given.
    pub(super) fn check_present(&mut self, required: &[String]) {
        // Exactly: only the name shown as `Default` is put first, where `default_lock` looks.
        if !self.names.iter().any(|name| name == DEFAULT_NAME) {
            self.problems.push(Problem::new(
                format!("Locking.{DEFAULT_NAME}"),
                format!("is missing: every registry needs a {DEFAULT_NAME} provider"),
            ));
        }
        for name in required {
            if !self.is_taken(name) {
                self.problems.push(Problem::new(
                    format!("Locking.{name}"),
                    "is missing, and this application requires it",
                ));
            }
        }
    }

    /// The registry, or the one error that lists every problem found.
    pub(super) fn finish(mut self) -> Result<Locking, LockError> {
        if !self.problems.is_empty() {
            return Err(config::into_error(self.problems));
        }
        // Default first, so `Locking::default_lock` is an index, then in registration order.
        self.providers
            .sort_by_key(|lock| lock.name() != DEFAULT_NAME);
        Ok(Locking {
            providers: self.providers.into(),
        })
    }

    fn keep(&mut self, result: ProviderResult) {
        match result {
            Ok(lock) => self.providers.push(lock),
            Err(problems) => self.problems.extend(problems),
        }
    }

    fn is_taken(&self, name: &str) -> bool {
        self.names
            .iter()
            .any(|taken| taken.eq_ignore_ascii_case(name))
    }

    /// Takes `name` for a provider and returns it as shown (`Default` whatever its case), or
    /// `None` after noting why it cannot be used.
    fn take_name(&mut self, written: &str) -> Option<String> {
        let written = written.trim();
        if written.is_empty() {
            self.problems
                .push(Problem::new("a lock provider", "needs a non-empty name"));
            return None;
        }
        let name = display_name(written);
        if let Some(earlier) = self.names.iter().find(|n| n.eq_ignore_ascii_case(&name)) {
            self.problems.push(Problem::new(
                format!("Locking.{written}"),
                format!("is defined twice (as {earlier} too; names ignore case)"),
            ));
            return None;
        }
        self.names.push(name.clone());
        Some(name)
    }
}

/// How a provider name is shown (in messages, `name()` and telemetry): a name written in one
/// case only, as environment variables deliver them (`REPORTS`, or `reports` once a
/// configuration crate has lower-cased it), is capitalised (`Reports`); a name with both
/// cases (`NightlyJobs`) is kept as written. So `default` is `Default`, like the docs spell it.
fn display_name(name: &str) -> String {
    let has_upper = name.chars().any(|c| c.is_ascii_uppercase());
    let has_lower = name.chars().any(|c| c.is_ascii_lowercase());
    if has_upper && has_lower {
        return name.to_owned();
    }
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return String::new();
    };
    let mut shown = first.to_ascii_uppercase().to_string();
    shown.push_str(&chars.as_str().to_ascii_lowercase());
    shown
}
