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

use std::fs;
use std::io;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use lockingkit::config::SecretString;
use lockingkit::EtcdOptions;

use crate::os::{alive, free_port, signal};

/// The root user's password on clusters with authentication.
const ROOT_PASSWORD: &str = "fixture-root-password";

/// One member: its ports, its data and its process while it runs.
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data: PathBuf,
    process: Option<Child>,
    paused: bool,
}

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
    members: Vec<Member>,
    root: PathBuf,
    token: String,
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
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let base = scratch_base();
        remove_dirs_of_dead_processes(&base);
        let root = base.join(format!("{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root)?;
        let mut members = Vec::new();
        for i in 0..size {
            members.push(Member {
                name: format!("m{i}"),
                client_port: free_port()?,
                peer_port: free_port()?,
                data: root.join(format!("m{i}")),
                process: None,
                paused: false,
            });
        }
        let mut cluster = EtcdCluster {
            members,
            root,
            token: format!("lockingkit-{}-{n}", std::process::id()),
            auth,
        };
        for i in 0..size {
            cluster.spawn(i)?;
        }
        Ok(cluster)
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, index: usize) -> io::Result<()> {
        let initial = self.initial_cluster();
        let token = self.token.clone();
        let auth = self.auth;
        let member = &mut self.members[index];
        fs::create_dir_all(&member.data)?;
        let client = format!("http://127.0.0.1:{}", member.client_port);
        let peer = format!("http://127.0.0.1:{}", member.peer_port);
        let log = member.data.join("etcd.log");
        let mut command = Command::new("etcd");
        command
            .args(["--name", &member.name])
            .arg("--data-dir")
            .arg(member.data.join("data"))
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
            .args([
                "--initial-cluster",
                &initial,
                "--initial-cluster-token",
                &token,
            ])
            .args(["--initial-cluster-state", "new", "--logger", "zap"])
            .arg("--log-outputs")
            .arg(&log)
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Auth::Root { token_ttl_secs } = auth {
            command.args(["--auth-token-ttl", &token_ttl_secs.to_string()]);
        }
        // SAFETY: prctl is async-signal-safe and touches no memory of ours.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        member.process = Some(command.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot run etcd ({e}); run scripts/setup-etcd.sh"),
            )
        })?);
        member.paused = false;
        Ok(())
    }

    /// Waits until every running member answers a linearizable read; `Err` if one exited.
    async fn until_ready(&self) -> Result<(), String> {
        for index in 0..self.members.len() {
            if self.members[index].process.is_none() {
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
                Ok(true) => {}
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

    /// Whether member `index`'s process has ended.
    fn exited(&self, index: usize) -> bool {
        // `try_wait` needs `&mut`; a zero-signal `kill` asks the same without reaping.
        self.members[index]
            .process
            .as_ref()
            .is_some_and(|child| !alive(child.id()))
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
        format!("http://127.0.0.1:{}", self.members[index].client_port)
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Provider options for this cluster with the given lease TTL: requests may take 2 s (a
    /// third of the TTL if that is less), so a loaded machine does not fail them, and the
    /// root user's credentials when authentication is on.
    pub fn options(&self, lease_ttl: Duration) -> EtcdOptions {
        let (user, password) = match self.auth {
            Auth::Off => (None, None),
            Auth::Root { .. } => (
                Some("root".to_owned()),
                Some(SecretString::from(ROOT_PASSWORD)),
            ),
        };
        EtcdOptions {
            lease_ttl,
            request_timeout: Duration::from_secs(2).min(lease_ttl / 3),
            user,
            password,
            ..EtcdOptions::new(self.endpoints())
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
                if self.members[index].process.is_none() || self.members[index].paused {
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
        let member = &mut self.members[index];
        if let Some(mut child) = member.process.take() {
            if member.paused {
                signal(child.id(), libc::SIGCONT);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        member.paused = false;
    }

    /// Starts a killed member again, on its ports, from its data.
    pub async fn restart(&mut self, index: usize) {
        self.spawn(index).expect("restart an etcd member");
    }

    /// Waits until every running member answers again (after restarts).
    pub async fn until_serving(&self) {
        if let Err(error) = self.until_ready().await {
            panic!("the etcd cluster does not serve again: {error}");
        }
    }

    /// Freezes member `index` (SIGSTOP): its connections stay open and nothing answers.
    pub fn pause(&mut self, index: usize) {
        let member = &mut self.members[index];
        if let Some(child) = &member.process {
            signal(child.id(), libc::SIGSTOP);
            member.paused = true;
        }
    }

    /// Thaws a paused member (SIGCONT).
    pub fn resume(&mut self, index: usize) {
        let member = &mut self.members[index];
        if let Some(child) = &member.process {
            signal(child.id(), libc::SIGCONT);
            member.paused = false;
        }
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
        let metrics = http_get(self.members[index].client_port, "/metrics").await;
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
        fs::read_to_string(self.members[index].data.join("etcd.log")).unwrap_or_default()
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

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for index in 0..self.members.len() {
            self.kill(index);
        }
        let _ = fs::remove_dir_all(&self.root);
    }
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

/// Removes the cluster directories (`{pid}-{n}`) of test processes that no longer run: a
/// process killed with SIGKILL never ran its clusters' `Drop`, and `/dev/shm` is memory.
fn remove_dirs_of_dead_processes(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|name| name.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if pid.is_some_and(|pid| !alive(pid)) {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}
