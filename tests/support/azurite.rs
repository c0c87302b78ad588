//! Azurite, the Azure Storage emulator, started from the npm package pinned in `tests/azurite`
//! (installed by `scripts/setup-azurite.sh`) on a free loopback port.
//!
//! Set `LOCKINGKIT_TEST_AZURE_CONNECTION_STRING` to run against an Azurite or storage account
//! that is already running instead; process control (kill, pause, restart) is then refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use azure_core::http::{ClientOptions, Transport, Url};
use azure_storage_blob::{BlobContainerClient, BlobContainerClientOptions};
use lockingkit::config::SecretString;
use lockingkit::providers::azure::SharedKeyPolicy;

use crate::server::{Ports, Readiness, ScratchDir, ServerCommand, ServerProcess};

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
    /// The local Azurite's process; `None` for an external service.
    process: Option<ServerProcess>,
    persistence: Persistence,
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
                process: None,
                persistence,
                external: Some(External::parse(&cs)),
            },
            _ => Self::launch(persistence).await,
        };
        azurite.create_container("locks").await;
        azurite
    }

    /// A local Azurite this test controls (kill, pause, restart), whatever the environment
    /// says: tests that inject faults start their own instead of skipping.
    pub async fn start_local(persistence: Persistence) -> Azurite {
        let azurite = Self::launch(persistence).await;
        azurite.create_container("locks").await;
        azurite
    }

    /// Starts a local Azurite and waits until it says it listens.
    async fn launch(persistence: Persistence) -> Azurite {
        let ready = Readiness::when(STARTUP_TIMEOUT, |launch| {
            launch.log().contains("successfully listen")
        });
        let command = |ports: &[u16], dir: &Path| {
            let command = ServerCommand::new(azurite_blob())
                .args([
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    &ports[0].to_string(),
                ])
                .args(["--disableTelemetry", "--silent"]);
            // The two are mutually exclusive.
            Ok(match persistence {
                Persistence::OnDisk => command.arg("--location").arg(dir.join("blobs")),
                Persistence::InMemory => command.arg("--inMemoryPersistence"),
            })
        };
        let started = match ScratchDir::new(std::env::temp_dir().join("lockingkit-azurite")) {
            Ok(scratch) => {
                ServerProcess::start("Azurite", scratch, Ports::new(1), ready, command).await
            }
            Err(e) => Err(e),
        };
        Azurite {
            process: Some(started.unwrap_or_else(|e| panic!("Azurite did not start: {e}"))),
            persistence,
            external: None,
        }
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
        self.process.as_ref().map_or(0, ServerProcess::port)
    }

    /// The blob endpoint, such as `http://127.0.0.1:PORT/devstoreaccount1`.
    pub fn blob_endpoint(&self) -> String {
        match &self.external {
            Some(external) => external.endpoint.clone(),
            None => format!("http://127.0.0.1:{}/{DEV_ACCOUNT}", self.port()),
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

    fn process(&mut self) -> &mut ServerProcess {
        self.process.as_mut().unwrap_or_else(|| {
            panic!("an external storage service ({EXTERNAL_ENV}) cannot be controlled")
        })
    }

    /// Kills Azurite (SIGKILL), as a crash would: every request fails to connect until
    /// [`restart`](Self::restart).
    pub fn kill(&mut self) {
        self.process().kill();
    }

    /// Freezes Azurite (SIGSTOP): connections are accepted by the kernel but never answered.
    pub fn pause(&mut self) {
        self.process().pause();
    }

    /// Thaws a paused Azurite (SIGCONT).
    pub fn resume(&mut self) {
        self.process().resume();
    }

    /// Stops Azurite gracefully (SIGTERM, so an on-disk workspace is saved) and waits for it,
    /// ten seconds at most before it is killed.
    pub fn stop(&mut self) {
        self.process().stop(Duration::from_secs(10));
    }

    /// Stops Azurite gracefully if it runs and starts it again on the same port. With
    /// in-memory persistence every blob is gone afterwards, so fencing tokens restart; on disk
    /// they survive (after [`kill`](Self::kill), Azurite may have lost its last seconds of
    /// writes). The `locks` container exists afterwards either way.
    pub async fn restart(&mut self) {
        self.stop();
        self.process().start_again().await;
        self.create_container("locks").await;
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
