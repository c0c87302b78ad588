//! Connection strings in libpq's two forms (`postgres://…` URLs and `key=value` lists).
//!
//! tokio-postgres parses both, but knows only `sslmode=disable|prefer|require` and no
//! `sslrootcert`. Hosted servers hand out strings with `sslmode=verify-full` and a CA file, so
//! those two settings are taken out here, and the rest goes to tokio-postgres unchanged.
//! Error messages never repeat the string: it usually carries a password.

use std::path::PathBuf;
use std::str::FromStr;

/// How TLS is used, with libpq's meanings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS if the server offers it, without verifying the certificate (libpq's default).
    Prefer,
    /// TLS or nothing, without verifying the certificate.
    Require,
    /// TLS with a certificate chain that leads to a trusted root; any host name.
    VerifyCa,
    /// TLS with a trusted chain whose certificate names the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Option<Self> {
        match value {
            "disable" => Some(SslMode::Disable),
            "prefer" => Some(SslMode::Prefer),
            "require" => Some(SslMode::Require),
            "verify-ca" => Some(SslMode::VerifyCa),
            "verify-full" => Some(SslMode::VerifyFull),
            _ => None,
        }
    }

    /// The closest mode tokio-postgres knows; verification is the TLS connector's business.
    fn for_tokio_postgres(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        }
    }

    /// Whether the server certificate is checked against trusted roots.
    pub(crate) fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

/// A parsed connection string.
pub(crate) struct ConnectionSettings {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) ssl_mode: SslMode,
    /// `sslrootcert`: a PEM file whose certificates are the only trusted roots.
    pub(crate) root_cert: Option<PathBuf>,
}

/// Parses `text`; the error describes the problem without quoting the string.
pub(crate) fn parse(text: &str) -> Result<ConnectionSettings, String> {
    let text = text.trim();
    let (rest, tls) = if text.starts_with("postgres://") || text.starts_with("postgresql://") {
        split_url(text)?
    } else {
        split_key_value(text)?
    };
    let mut ssl_mode = SslMode::Prefer;
    let mut root_cert = None;
    for (key, value) in tls {
        match key {
            TlsSetting::Mode => {
                ssl_mode = SslMode::parse(&value).ok_or_else(|| {
                    "sslmode must be disable, prefer, require, verify-ca or verify-full".to_owned()
                })?;
            }
            TlsSetting::RootCert => root_cert = Some(PathBuf::from(value)),
        }
    }
    let mut config = tokio_postgres::Config::from_str(&rest)
        .map_err(|e| format!("it is not a PostgreSQL connection string ({e})"))?;
    config.ssl_mode(ssl_mode.for_tokio_postgres());
    Ok(ConnectionSettings {
        config,
        ssl_mode,
        root_cert,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TlsSetting {
    Mode,
    RootCert,
}

fn tls_setting(key: &str) -> Option<TlsSetting> {
    match key {
        "sslmode" => Some(TlsSetting::Mode),
        "sslrootcert" => Some(TlsSetting::RootCert),
        _ => None,
    }
}

type Split = (String, Vec<(TlsSetting, String)>);

fn split_url(text: &str) -> Result<Split, String> {
    let Some((base, query)) = text.split_once('?') else {
        return Ok((text.to_owned(), Vec::new()));
    };
    let mut kept = Vec::new();
    let mut tls = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match tls_setting(key) {
            Some(setting) => tls.push((setting, percent_decode(value)?)),
            None => kept.push(pair),
        }
    }
    let mut rest = base.to_owned();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    Ok((rest, tls))
}

fn percent_decode(value: &str) -> Result<String, String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| "a URL parameter has a malformed %-escape".to_owned())?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "a URL parameter is not UTF-8 once decoded".to_owned())
}

/// Splits a libpq `key = value` list, keeping every setting but the TLS ones, re-quoted so
/// tokio-postgres reads exactly the values libpq would.
fn split_key_value(text: &str) -> Result<Split, String> {
    let mut chars = text.chars().peekable();
    let mut kept = String::new();
    let mut tls = Vec::new();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        if key.is_empty() {
            if chars.peek().is_some() {
                return Err("a setting has no name before `=`".to_owned());
            }
            break;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err("every setting must be written as name=value".to_owned());
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\'') => break,
                    Some('\\') => value.extend(chars.next()),
                    Some(c) => value.push(c),
                    None => return Err("a quoted value is not terminated".to_owned()),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        match tls_setting(&key) {
            Some(setting) => tls.push((setting, value)),
            None => {
                if !kept.is_empty() {
                    kept.push(' ');
                }
                kept.push_str(&key);
                kept.push_str("='");
                for c in value.chars() {
                    if c == '\'' || c == '\\' {
                        kept.push('\\');
                    }
                    kept.push(c);
                }
                kept.push('\'');
            }
        }
    }
    Ok((kept, tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_strings_keep_quoted_values_and_take_out_tls_settings() {
        let parsed = parse(
            r"host=db.example.com port = 6432 user=app password='p a\'ss' dbname=locks sslmode=verify-full sslrootcert=/etc/ca.pem",
        )
        .expect("valid");
        assert_eq!(parsed.ssl_mode, SslMode::VerifyFull);
        assert_eq!(parsed.root_cert, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!(parsed.config.get_user(), Some("app"));
        assert_eq!(parsed.config.get_password(), Some(&b"p a'ss"[..]));
        assert_eq!(parsed.config.get_dbname(), Some("locks"));
        assert_eq!(parsed.config.get_ports(), &[6432]);
        assert_eq!(
            parsed.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
    }

    #[test]
    fn urls_take_out_tls_settings_and_decode_them() {
        let parsed = parse(
            "postgresql://app:s%40cret@127.0.0.1:5433/locks?sslmode=verify-ca&application_name=jobs&sslrootcert=%2Ftmp%2Fca.pem",
        )
        .expect("valid");
        assert_eq!(parsed.ssl_mode, SslMode::VerifyCa);
        assert_eq!(parsed.root_cert, Some(PathBuf::from("/tmp/ca.pem")));
        assert_eq!(parsed.config.get_password(), Some(&b"s@cret"[..]));
        assert_eq!(parsed.config.get_application_name(), Some("jobs"));
    }

    #[test]
    fn the_default_mode_is_prefer_as_in_libpq() {
        let parsed = parse("postgres://app@localhost/locks").expect("valid");
        assert_eq!(parsed.ssl_mode, SslMode::Prefer);
        let parsed = parse("host=localhost sslmode=disable").expect("valid");
        assert_eq!(parsed.ssl_mode, SslMode::Disable);
    }

    #[test]
    fn errors_never_quote_the_string() {
        for bad in [
            "host=localhost password='hunter2",
            "host=localhost sslmode=hunter2",
            "postgres://u:hunter2@h/db?sslmode=hunter2",
            "hunter2",
            "postgres://u:hunter2@h/db?sslrootcert=%zz",
            "postgres://u:hunter2@h:notaport/db",
        ] {
            let error = parse(bad).err().expect("invalid");
            assert!(!error.contains("hunter2"), "{error}");
        }
    }
}
