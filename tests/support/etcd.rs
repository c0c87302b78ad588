//! Throwaway etcd clusters — one member or three, with or without authentication — started
//! from the `etcd` binary on free loopback ports, killed and removed on drop.
//!
//! `scripts/setup-etcd.sh` installs the binary (Debian's etcd-server, 3.4). Data directories
//! live on `/dev/shm` (when the machine has it): etcd syncs its write-ahead log on every
//! commit, and a disk shared with parallel builds turns those syncs into multi-second stalls
//! that look like a slow cluster. Directories left by test processes that died are removed at
//! the next launch. Members die with the thread that started them (`PR_SET_PDEATHSIG`: a
//! runtime worker of the test, which lives as long as the test), so a test killed by a timeout
//! leaves no server behind. Members can be killed, restarted on their ports with their data,
//! and paused (SIGSTOP).

use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use lockingkit::EtcdOptions;

use crate::os::{free_port, listens_on};
use crate::server::{ScratchDir, ServerCommand, ServerProcess};

/// The root user's password on clusters with authentication.
const ROOT_PASSWORD: &str = "fixture-root-password";

/// How a cluster authenticates its clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Auth {
    /// Anyone may do anything.
    Off,
    /// Only `root` (password known to the fixture); its tokens expire this many seconds after
    /// they were issued (etcd's `--auth-token-ttl`).
    Root { token_ttl_secs: u32 },
}

/// A running etcd cluster on loopback, killed and deleted on drop.
pub struct EtcdCluster {
    /// Member `i` is named `m{i}`; its ports are its client port, then its peer port.
    members: Vec<ServerProcess>,
    auth: Auth,
}

impl EtcdCluster {
    /// A single-member cluster.
    pub async fn single() -> EtcdCluster {
        Self::start(1, Auth::Off).await
    }

    /// A three-member cluster (quorum 2).
    pub async fn three() -> EtcdCluster {
        Self::start(3, Auth::Off).await
    }

    /// A cluster of `size` members, every member answering before this returns.
    pub async fn start(size: usize, auth: Auth) -> EtcdCluster {
        let mut last = String::new();
        for _ in 0..5 {
            // Launched on this thread, not a blocking-pool one: the members' death signal is
            // tied to the thread that spawned them, and idle pool threads exit after seconds.
            let cluster = match Self::launch(size, auth) {
                Ok(cluster) => cluster,
                Err(error) => {
                    last = error.to_string();
                    continue;
                }
            };
            // A member that exits at once lost a race for its port: start over on others.
            match cluster.until_ready().await {
                Ok(()) => {}
                Err(error) => {
                    last = error;
                    continue;
                }
            }
            if let Auth::Root { .. } = auth {
                cluster.enable_root_auth().await;
            }
            return cluster;
        }
        panic!("cannot start an etcd cluster of {size}: {last}");
    }

    fn launch(size: usize, auth: Auth) -> io::Result<EtcdCluster> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let token = format!(
            "lockingkit-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let ports = (0..size)
            .map(|_| Ok((free_port()?, free_port()?)))
            .collect::<io::Result<Vec<_>>>()?;
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for (i, &(client, peer)) in ports.iter().enumerate() {
            let scratch = ScratchDir::new(scratch_base())?;
            let mut command = member_command(i, client, peer, scratch.path()).args([
                "--initial-cluster",
                &initial,
                "--initial-cluster-token",
                &token,
            ]);
            if let Auth::Root { token_ttl_secs } = auth {
                command = command.args(["--auth-token-ttl", &token_ttl_secs.to_string()]);
            }
            members.push(ServerProcess::spawn_on(
                "etcd",
                scratch,
                vec![client, peer],
                command,
            )?);
        }
        Ok(EtcdCluster { members, auth })
    }

    /// Waits until every running member answers a linearizable read; `Err` if one exited.
    async fn until_ready(&self) -> Result<(), String> {
        for index in 0..self.members.len() {
            if self.members[index].pid().is_none() {
                continue;
            }
            let ready = tokio::time::timeout(Duration::from_secs(60), async {
                loop {
                    if self.exited(index) {
                        return false;
                    }
                    if self.answers(index).await {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
            match ready {
                Ok(true) => self.owns_its_ports(index)?,
                Ok(false) => return Err(format!("member {index} exited: {}", self.log(index))),
                Err(_) => {
                    return Err(format!(
                        "member {index} never answered: {}",
                        self.log(index)
                    ))
                }
            }
        }
        Ok(())
    }

    /// `Err` when another test process's server holds a port of member `index`: a member that
    /// lost its port cannot bind it, and what answered there was someone else's cluster.
    fn owns_its_ports(&self, index: usize) -> Result<(), String> {
        let member = &self.members[index];
        let Some(pid) = member.pid() else {
            return Ok(());
        };
        match member
            .ports()
            .iter()
            .find(|&&port| listens_on(pid, port) == Some(false))
        {
            Some(port) => Err(format!(
                "member {index} lost port {port} to another process"
            )),
            None => Ok(()),
        }
    }

    /// Whether member `index`'s process has ended.
    fn exited(&self, index: usize) -> bool {
        self.members[index].has_exited()
    }

    /// Whether member `index` answers a read (any answer: authentication may be on).
    async fn answers(&self, index: usize) -> bool {
        let endpoint = self.endpoint(index);
        let connected =
            tokio::time::timeout(Duration::from_secs(2), Client::connect([endpoint], None)).await;
        let Ok(Ok(mut client)) = connected else {
            return false;
        };
        let read = tokio::time::timeout(Duration::from_secs(2), client.get("ready", None)).await;
        match read {
            Ok(Ok(_)) => true,
            // A cluster with authentication on refuses anonymous reads: it answered.
            Ok(Err(etcd_client::Error::GRpcStatus(status))) => {
                status.message().contains("user name is empty")
            }
            _ => false,
        }
    }

    /// Creates `root` and turns authentication on.
    async fn enable_root_auth(&self) {
        let mut client = Client::connect(self.endpoints(), None)
            .await
            .expect("an etcd client");
        let _ = client.role_add("root").await;
        add_user(&mut client, "root", ROOT_PASSWORD, "root").await;
        client.auth_enable().await.expect("enable authentication");
    }

    /// The client URL of member `index`.
    pub fn endpoint(&self, index: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[index].port())
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Provider options for this cluster with the given lease TTL: requests may take 2 s (a
    /// third of the TTL if that is less), so a loaded machine does not fail them, and the
    /// root user's credentials when authentication is on.
    pub fn options(&self, lease_ttl: Duration) -> EtcdOptions {
        let options = EtcdOptions::new(self.endpoints())
            .with_lease_ttl(lease_ttl)
            .with_request_timeout(Duration::from_secs(2).min(lease_ttl / 3));
        match self.auth {
            Auth::Off => options,
            Auth::Root { .. } => options.with_user("root").with_password(ROOT_PASSWORD),
        }
    }

    /// A plain etcd client of every member, as any other program would open (as `root` when
    /// authentication is on).
    pub async fn client(&self) -> Client {
        let options = match self.auth {
            Auth::Off => None,
            Auth::Root { .. } => Some(
                ConnectOptions::new()
                    .with_user("root", ROOT_PASSWORD)
                    .with_auto_token_refresh(true),
            ),
        };
        Client::connect(self.endpoints(), options)
            .await
            .expect("an etcd client")
    }

    /// How many keys start with `prefix`.
    pub async fn count(&self, prefix: &str) -> i64 {
        let mut client = self.client().await;
        let options = etcd_client::GetOptions::new()
            .with_prefix()
            .with_count_only();
        client
            .get(prefix, Some(options))
            .await
            .expect("count")
            .count()
    }

    /// The index of the member that leads now, asking the members that run.
    pub async fn leader(&self) -> usize {
        for _ in 0..200 {
            for index in 0..self.members.len() {
                let member = &self.members[index];
                if member.pid().is_none() || member.is_paused() {
                    continue;
                }
                let Ok(Ok(mut client)) = tokio::time::timeout(
                    Duration::from_secs(1),
                    Client::connect([self.endpoint(index)], None),
                )
                .await
                else {
                    continue;
                };
                if let Ok(Ok(status)) =
                    tokio::time::timeout(Duration::from_secs(1), client.status()).await
                {
                    let me = status.header().map(|h| h.member_id());
                    if status.leader() != 0 && Some(status.leader()) == me {
                        return index;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("no etcd member leads");
    }

    /// Kills member `index` (SIGKILL): a crash.
    pub fn kill(&mut self, index: usize) {
        self.members[index].kill();
    }

    /// Starts a killed member again, on its ports, from its data.
    pub async fn restart(&mut self, index: usize) {
        self.members[index].start_again().await;
    }

    /// Waits until every running member answers again (after restarts).
    pub async fn until_serving(&self) {
        if let Err(error) = self.until_ready().await {
            panic!("the etcd cluster does not serve again: {error}");
        }
    }

    /// Freezes member `index` (SIGSTOP): its connections stay open and nothing answers.
    pub fn pause(&mut self, index: usize) {
        self.members[index].pause();
    }

    /// Thaws a paused member (SIGCONT).
    pub fn resume(&mut self, index: usize) {
        self.members[index].resume();
    }

    /// A plain etcd client of member `index` alone (as `root` when authentication is on):
    /// another program writing through that one member.
    pub async fn client_of(&self, index: usize) -> Client {
        let options = match self.auth {
            Auth::Off => None,
            Auth::Root { .. } => Some(ConnectOptions::new().with_user("root", ROOT_PASSWORD)),
        };
        Client::connect([self.endpoint(index)], options)
            .await
            .expect("an etcd client of one member")
    }

    /// How many watchers member `index` serves now, as the member itself counts them (its
    /// `etcd_debugging_mvcc_watcher_total` gauge on the client port's `/metrics`).
    pub async fn watchers(&self, index: usize) -> u64 {
        let metrics = http_get(self.members[index].port(), "/metrics").await;
        metrics
            .lines()
            .find_map(|line| line.strip_prefix("etcd_debugging_mvcc_watcher_total "))
            .and_then(|value| value.trim().parse::<f64>().ok())
            .map_or(0, |value| value as u64)
    }

    /// How many logins the members refused (wrong user or password), as they logged them:
    /// each is a password hash etcd computed for nothing.
    pub fn failed_logins(&self) -> usize {
        (0..self.members.len())
            .map(|index| {
                self.log(index)
                    .lines()
                    .filter(|line| line.contains("invalid authentication was requested"))
                    .count()
            })
            .sum()
    }

    /// What member `index` has logged (warnings and errors only).
    pub fn log(&self, index: usize) -> String {
        self.members[index].log()
    }

    /// Every line a member logged at level error or worse, each prefixed with its member.
    pub fn error_lines(&self) -> Vec<String> {
        (0..self.members.len())
            .flat_map(|index| {
                self.log(index)
                    .lines()
                    .filter(|line| is_error_line(line))
                    .map(|line| format!("m{index}: {line}"))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Fails the test if a member logged an error: what LockingKit sends in normal operation
    /// must not make the server complain.
    #[track_caller]
    pub fn assert_no_errors_logged(&self) {
        let errors = self.error_lines();
        assert!(
            errors.is_empty(),
            "etcd logged {} error lines:\n{}",
            errors.len(),
            errors.join("\n")
        );
    }

    /// How many members there are.
    pub fn size(&self) -> usize {
        self.members.len()
    }
}

/// Member `index`'s command line on its `client` and `peer` ports with its data in `dir`,
/// logging to standard error, which the process's log takes; the cluster's members and token
/// come on top.
fn member_command(index: usize, client: u16, peer: u16, dir: &Path) -> ServerCommand {
    let client = format!("http://127.0.0.1:{client}");
    let peer = format!("http://127.0.0.1:{peer}");
    ServerCommand::new("etcd")
        .args(["--name", &format!("m{index}")])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args([
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
        ])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args(["--initial-cluster-state", "new", "--logger", "zap"])
        .args(["--log-outputs", "stderr", "--log-level", "warn"])
        // Launched on a runtime worker, not a blocking-pool thread (see `EtcdCluster::start`).
        .dies_with_thread()
}

/// The body of a plain HTTP/1.0 GET of `path` on the loopback `port` (empty if it fails).
async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await?;
        io::Result::Ok(answer)
    };
    match tokio::time::timeout(Duration::from_secs(2), exchange).await {
        Ok(Ok(answer)) => answer
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default(),
        _ => String::new(),
    }
}

/// Adds `user` with `password` and grants it `role` (which must exist), through `client`.
pub async fn add_user(client: &mut Client, user: &str, password: &str, role: &str) {
    client
        .user_add(user, password, None)
        .await
        .unwrap_or_else(|e| panic!("add user {user}: {e}"));
    client
        .user_grant_role(user, role)
        .await
        .unwrap_or_else(|e| panic!("grant {role} to {user}: {e}"));
}

/// A zap JSON line at level error, dpanic, panic or fatal.
fn is_error_line(line: &str) -> bool {
    ["error", "dpanic", "panic", "fatal"]
        .iter()
        .any(|level| line.contains(&format!("\"level\":\"{level}\"")))
}

/// Where clusters' data directories go: memory-backed `/dev/shm` when there is one.
fn scratch_base() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    base.join("lockingkit-etcd")
}
