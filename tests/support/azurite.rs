//! Azurite, the Azure Storage emulator, started from the npm package pinned in `tests/azurite`
//! (installed by `scripts/setup-azurite.sh`) on a free loopback port.
//!
//! Set `LOCKINGKIT_TEST_AZURE_CONNECTION_STRING` to run against an Azurite or storage account
//! that is already running instead; process control (kill, pause, restart) is then refused.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use azure_core::http::{ClientOptions, Transport, Url};
use azure_storage_blob::{BlobContainerClient, BlobContainerClientOptions};
use lockingkit::config::SecretString;
use lockingkit::providers::azure::SharedKeyPolicy;

use crate::os::{free_port, relaunch, signal};

/// The environment variable naming an external Azurite or storage account.
pub const EXTERNAL_ENV: &str = "LOCKINGKIT_TEST_AZURE_CONNECTION_STRING";

/// Azurite's well-known development account (public, documented values).
pub const DEV_ACCOUNT: &str = "devstoreaccount1";
pub const DEV_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Where blobs live while Azurite runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persistence {
    /// `--inMemoryPersistence`: fast, but a restart loses every blob (and fencing tokens restart).
    InMemory,
    /// `--location <temp dir>`: blobs survive `restart()`.
    OnDisk,
}

/// A running Azurite blob service (or an external one), stopped on drop.
pub struct Azurite {
    child: Option<Child>,
    port: u16,
    persistence: Persistence,
    workspace: Option<PathBuf>,
    external: Option<External>,
}

struct External {
    connection_string: String,
    account: String,
    key: String,
    endpoint: String,
}

impl Azurite {
    /// Azurite with in-memory persistence, or the external one named by [`EXTERNAL_ENV`]; the
    /// container `locks` exists.
    pub async fn start() -> Azurite {
        Self::start_with(Persistence::InMemory).await
    }

    /// Azurite with the given persistence (ignored for an external one).
    pub async fn start_with(persistence: Persistence) -> Azurite {
        let azurite = match std::env::var(EXTERNAL_ENV) {
            Ok(cs) if !cs.trim().is_empty() => Azurite {
                child: None,
                port: 0,
                persistence,
                workspace: None,
                external: Some(External::parse(&cs)),
            },
            _ => tokio::task::spawn_blocking(move || Self::spawn_local(persistence))
                .await
                .expect("the Azurite start task panicked"),
        };
        azurite.create_container("locks").await;
        azurite
    }

    /// A local Azurite this test controls (kill, pause, restart), whatever the environment
    /// says: tests that inject faults start their own instead of skipping.
    pub async fn start_local(persistence: Persistence) -> Azurite {
        let azurite = tokio::task::spawn_blocking(move || Self::spawn_local(persistence))
            .await
            .expect("the Azurite start task panicked");
        azurite.create_container("locks").await;
        azurite
    }

    fn spawn_local(persistence: Persistence) -> Azurite {
        let workspace = match persistence {
            Persistence::InMemory => None,
            Persistence::OnDisk => {
                let dir = std::env::temp_dir().join(format!(
                    "lockingkit-azurite-{}-{}",
                    std::process::id(),
                    free_port().expect("a free loopback port")
                ));
                std::fs::create_dir_all(&dir).expect("create the Azurite workspace");
                Some(dir)
            }
        };
        let mut last_error = String::new();
        // A free port can be taken between our probe and Azurite's bind: try a few.
        for _ in 0..5 {
            let port = free_port().expect("a free loopback port");
            match launch(port, workspace.as_deref()) {
                Ok(child) => {
                    return Azurite {
                        child: Some(child),
                        port,
                        persistence,
                        workspace,
                        external: None,
                    }
                }
                Err(error) => last_error = error,
            }
        }
        panic!("Azurite did not start: {last_error}");
    }

    /// Where this Azurite keeps its blobs.
    pub fn persistence(&self) -> Persistence {
        self.persistence
    }

    /// Whether this is an external service (no process control).
    pub fn is_external(&self) -> bool {
        self.external.is_some()
    }

    /// The loopback port Azurite listens on (0 for an external service).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The blob endpoint, such as `http://127.0.0.1:PORT/devstoreaccount1`.
    pub fn blob_endpoint(&self) -> String {
        match &self.external {
            Some(external) => external.endpoint.clone(),
            None => format!("http://127.0.0.1:{}/{DEV_ACCOUNT}", self.port),
        }
    }

    /// A connection string with the account key.
    pub fn connection_string(&self) -> String {
        match &self.external {
            Some(external) => external.connection_string.clone(),
            None => format!(
                "DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};\
                 BlobEndpoint={}",
                self.blob_endpoint()
            ),
        }
    }

    /// A connection string for the same endpoint with a wrong account key.
    pub fn connection_string_with_wrong_key(&self) -> String {
        let (account, endpoint) = self.account_and_endpoint();
        format!(
            "AccountName={account};AccountKey={};BlobEndpoint={endpoint}",
            "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXk="
        )
    }

    fn account_and_endpoint(&self) -> (String, String) {
        match &self.external {
            Some(external) => (external.account.clone(), external.endpoint.clone()),
            None => (DEV_ACCOUNT.to_owned(), self.blob_endpoint()),
        }
    }

    fn account_key(&self) -> String {
        match &self.external {
            Some(external) => external.key.clone(),
            None => DEV_KEY.to_owned(),
        }
    }

    /// A plain SDK client of `container`, independent of any lock backend: its own HTTP client
    /// and pipeline, signed with the account key.
    pub fn plain_container_client(&self, container: &str) -> BlobContainerClient {
        let (account, endpoint) = self.account_and_endpoint();
        let policy = SharedKeyPolicy::new(account, &SecretString::new(self.account_key()))
            .expect("a valid account key");
        let mut client_options = ClientOptions::default();
        client_options.per_try_policies.push(Arc::new(policy));
        client_options.transport = Some(plain_transport());
        let mut url = Url::parse(&endpoint).expect("a valid blob endpoint");
        url.path_segments_mut()
            .expect("a base URL")
            .pop_if_empty()
            .push(container);
        BlobContainerClient::new(
            url,
            None,
            Some(BlobContainerClientOptions {
                client_options,
                ..Default::default()
            }),
        )
        .expect("a container client")
    }

    /// Creates `container` if it does not exist.
    pub async fn create_container(&self, container: &str) {
        let client = self.plain_container_client(container);
        // Azurite can take a moment after "listening" before it serves requests.
        let mut last = String::new();
        for _ in 0..50 {
            match client.create(None).await {
                Ok(_) => return,
                Err(e) if e.http_status().map(u16::from) == Some(409) => return,
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("could not create container {container}: {last}");
    }

    fn child(&mut self) -> &mut Child {
        assert!(
            self.external.is_none(),
            "an external storage service ({EXTERNAL_ENV}) cannot be controlled"
        );
        self.child
            .as_mut()
            .expect("Azurite is not running (killed and not restarted)")
    }

    /// Kills Azurite (SIGKILL), as a crash would: every request fails to connect until
    /// [`restart`](Self::restart).
    pub fn kill(&mut self) {
        let child = self.child();
        let _ = child.kill();
        let _ = child.wait();
        self.child = None;
    }

    /// Freezes Azurite (SIGSTOP): connections are accepted by the kernel but never answered.
    pub fn pause(&mut self) {
        let pid = self.child().id();
        signal(pid, libc::SIGSTOP);
    }

    /// Thaws a paused Azurite (SIGCONT).
    pub fn resume(&mut self) {
        let pid = self.child().id();
        signal(pid, libc::SIGCONT);
    }

    /// Stops Azurite gracefully (SIGTERM, so an on-disk workspace is saved) and waits for it.
    pub fn stop(&mut self) {
        let child = self.child();
        let pid = child.id();
        // A paused process must be thawed to act on the signal.
        signal(pid, libc::SIGCONT);
        signal(pid, libc::SIGTERM);
        for _ in 0..100 {
            if matches!(child.try_wait(), Ok(Some(_))) {
                self.child = None;
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.kill();
    }

    /// Stops Azurite gracefully if it runs and starts it again on the same port. With
    /// in-memory persistence every blob is gone afterwards, so fencing tokens restart; on disk
    /// they survive (after [`kill`](Self::kill), Azurite may have lost its last seconds of
    /// writes). The `locks` container exists afterwards either way.
    pub async fn restart(&mut self) {
        if self.child.is_some() {
            self.stop();
        }
        assert!(
            self.external.is_none(),
            "cannot restart an external service"
        );
        let port = self.port;
        let workspace = self.workspace.clone();
        let child = tokio::task::spawn_blocking(move || {
            relaunch("Azurite", || launch(port, workspace.as_deref()))
        })
        .await
        .expect("the Azurite restart task panicked");
        self.child = Some(child);
        self.create_container("locks").await;
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), libc::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.workspace.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl External {
    fn parse(connection_string: &str) -> External {
        let mut account = None;
        let mut key = None;
        let mut endpoint = None;
        let mut development = false;
        for part in connection_string.split(';') {
            let Some((name, value)) = part.split_once('=') else {
                continue;
            };
            match name.trim().to_ascii_lowercase().as_str() {
                "accountname" => account = Some(value.trim().to_owned()),
                "accountkey" => key = Some(value.trim().to_owned()),
                "blobendpoint" => endpoint = Some(value.trim().to_owned()),
                "usedevelopmentstorage" => development = value.trim() == "true",
                _ => {}
            }
        }
        if development {
            return External {
                connection_string: connection_string.to_owned(),
                account: DEV_ACCOUNT.to_owned(),
                key: DEV_KEY.to_owned(),
                endpoint: format!("http://127.0.0.1:10000/{DEV_ACCOUNT}"),
            };
        }
        let account = account.unwrap_or_else(|| panic!("{EXTERNAL_ENV} needs AccountName"));
        External {
            connection_string: connection_string.to_owned(),
            endpoint: endpoint
                .unwrap_or_else(|| format!("https://{account}.blob.core.windows.net")),
            key: key.unwrap_or_else(|| panic!("{EXTERNAL_ENV} needs AccountKey")),
            account,
        }
    }
}

/// The npm-installed `azurite-blob` launcher.
fn azurite_blob() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("azurite/node_modules/.bin/azurite-blob");
    assert!(
        path.exists(),
        "{} is missing: run scripts/setup-azurite.sh (or set {EXTERNAL_ENV})",
        path.display()
    );
    path
}

/// Starts Azurite on `port` and waits until it says it listens.
fn launch(port: u16, workspace: Option<&Path>) -> Result<Child, String> {
    let mut command = Command::new(azurite_blob());
    command
        .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
        .args(["--disableTelemetry", "--silent"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match workspace {
        // The two are mutually exclusive.
        Some(dir) => command.arg("--location").arg(dir),
        None => command.arg("--inMemoryPersistence"),
    };
    let mut child = command.spawn().map_err(|e| format!("spawn: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref().map_while(Result::ok) {
            if line.contains("successfully listen") {
                let _ = ready_tx.send(());
                break;
            }
        }
        // Keep draining so Azurite never blocks on a full pipe.
        for _ in lines {}
    });
    match ready_rx.recv_timeout(STARTUP_TIMEOUT) {
        Ok(()) => {
            // Nothing reads stderr from here on; drain it the same way.
            if let Some(mut stderr) = child.stderr.take() {
                std::thread::spawn(move || {
                    let mut sink = Vec::new();
                    let _ = stderr.read_to_end(&mut sink);
                });
            }
            Ok(child)
        }
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut stderr);
            }
            Err(format!(
                "no 'listening' line on port {port}; stderr: {stderr}"
            ))
        }
    }
}

/// An HTTP transport for plain SDK clients in tests (rustls on ring, short timeouts).
pub fn plain_transport() -> Transport {
    // reqwest is built without a default crypto provider; tests may install one process-wide.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTP client");
    Transport::new(Arc::new(client))
}
