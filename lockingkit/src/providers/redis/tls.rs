//! `rediss://` on one server: the backend opens the TCP connection and the TLS session itself
//! (rustls on ring, the server's certificate checked against the platform's trust store or the
//! roots of `tls_root_cert`, see `crate::tls`), and hands the stream to the library's
//! multiplexed or pub/sub connection. So the provider needs none of the library's TLS features,
//! and PostgreSQL and Redis share one TLS stack.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{MultiplexedConnection, PubSub};
use redis::io::tcp::socket2;
use redis::{AsyncConnectionConfig, ConnectionAddr, ConnectionInfo};
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::errors::{self, Stage};
use crate::backend::BackendError;
use crate::config::Problem;

/// The client configuration for every `rediss://` connection of a backend, checking servers
/// against the roots in `root_cert` (a PEM file) or, without one, the platform's trust store.
pub(super) fn client_config(root_cert: Option<&Path>) -> Result<Arc<ClientConfig>, Problem> {
    let provider = crate::tls::provider();
    let verifier =
        crate::tls::verifier(&provider, root_cert).map_err(|problem| match root_cert {
            Some(_) => Problem::new("tls_root_cert", problem),
            None => Problem::new("url", format!("uses TLS, but {problem}; set tls_root_cert")),
        })?;
    crate::tls::client_config(provider, verifier)
        .map(Arc::new)
        .map_err(|problem| Problem::detail("url", problem))
}

/// TLS to one server: the configuration, and the name its certificate must carry (the URL's
/// host, a DNS name or an IP address).
#[derive(Clone)]
pub(super) struct Tls {
    connector: TlsConnector,
    name: ServerName<'static>,
}

impl Tls {
    /// TLS to the server of `info` with `config`; the problem, if its host cannot be checked
    /// against a certificate, follows the URL field's name.
    pub(super) fn new(config: Arc<ClientConfig>, info: &ConnectionInfo) -> Result<Tls, String> {
        let ConnectionAddr::Tcp(host, _) = info.addr() else {
            return Err("uses TLS, which needs a host and port, not a Unix socket".to_owned());
        };
        let name = ServerName::try_from(host.to_owned()).map_err(|_| {
            "uses TLS with a host that is neither a DNS name nor an IP address".to_owned()
        })?;
        Ok(Tls {
            connector: TlsConnector::from(config),
            name,
        })
    }

    /// A multiplexed connection over TLS, its driver running as a task of its own (it ends
    /// when the connection's last handle is dropped or the server closes the connection).
    pub(super) async fn multiplexed(
        &self,
        info: &ConnectionInfo,
        timeout: Duration,
    ) -> Result<MultiplexedConnection, BackendError> {
        let stream = self.stream(info, timeout).await?;
        let config = AsyncConnectionConfig::new().set_response_timeout(Some(timeout));
        let opened = MultiplexedConnection::new_with_config(info.redis_settings(), stream, config);
        let (connection, driver) = tokio::time::timeout(timeout, opened)
            .await
            .map_err(|_| errors::timed_out(Stage::Connect, timeout))?
            .map_err(|error| errors::request_error(&error, Stage::Connect))?;
        tokio::spawn(driver);
        Ok(connection)
    }

    /// A pub/sub connection over TLS.
    pub(super) async fn pubsub(
        &self,
        info: &ConnectionInfo,
        timeout: Duration,
    ) -> Result<PubSub, BackendError> {
        let stream = self.stream(info, timeout).await?;
        tokio::time::timeout(timeout, PubSub::new(info.redis_settings(), stream))
            .await
            .map_err(|_| errors::timed_out(Stage::Connect, timeout))?
            .map_err(|error| errors::request_error(&error, Stage::Connect))
    }

    /// A TCP connection (no Nagle delay, keepalive probes) with a TLS session on it, both
    /// within `timeout`.
    async fn stream(
        &self,
        info: &ConnectionInfo,
        timeout: Duration,
    ) -> Result<TlsStream<TcpStream>, BackendError> {
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return Err(BackendError::misconfigured(
                "connecting to Redis: TLS needs a host and port",
            ));
        };
        let deadline = crate::clock::in_(timeout);
        let tcp = tokio::time::timeout_at(deadline, TcpStream::connect((host.as_str(), *port)))
            .await
            .map_err(|_| errors::timed_out(Stage::Connect, timeout))?
            .map_err(|error| unreachable(&error))?;
        let _ = tcp.set_nodelay(true);
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&super::connection::keepalive());
        tokio::time::timeout_at(deadline, self.connector.connect(self.name.clone(), tcp))
            .await
            .map_err(|_| handshake_timed_out(timeout))?
            .map_err(|error| handshake_error(&error))
    }
}

/// A TCP connection that could not be opened.
fn unreachable(error: &std::io::Error) -> BackendError {
    BackendError::unreachable(format!(
        "connecting to Redis: Redis could not be reached ({})",
        error.kind()
    ))
}

/// A TLS handshake left unanswered: a slow server, or one that does not serve TLS on that
/// port (a plain Redis port waits for the end of a command line that never comes). Either may
/// pass, so it is transient like any connect that times out.
fn handshake_timed_out(timeout: Duration) -> BackendError {
    BackendError::unreachable(format!(
        "connecting to Redis: no answer to the TLS handshake within {timeout:?} (does the \
         server serve TLS on this port?)"
    ))
}

/// A failed TLS handshake: a certificate we do not trust, or a server that does not speak TLS on
/// that port, is a misconfiguration no retry fixes; a connection that failed meanwhile is not.
fn handshake_error(error: &std::io::Error) -> BackendError {
    match error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(why)) => BackendError::misconfigured(format!(
            "connecting to Redis: the server's TLS certificate is not trusted ({why:?}); check \
             the host name in the URL and tls_root_cert"
        )),
        Some(other) => BackendError::misconfigured(format!(
            "connecting to Redis: the TLS handshake failed ({other}); does the server serve TLS \
             on this port?"
        )),
        None => unreachable(error),
    }
}
