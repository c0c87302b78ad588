//! Throwaway etcd clusters — one member or three — started from the `etcd` binary on free
//! loopback ports, with data directories in a scratch directory, killed and removed on drop.
//!
//! `scripts/setup-etcd.sh` installs the binary (Debian's etcd-server, 3.4). Members die with
//! the thread that started them (`PR_SET_PDEATHSIG`: a runtime worker of the test, which lives
//! as long as the test), so a test killed by a timeout leaves no server behind. Members can be killed, restarted on their ports with their data,
//! and paused (SIGSTOP).

use std::fs;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use etcd_client::Client;
use lockingkit::EtcdOptions;

/// One member: its ports, its data and its process while it runs.
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data: PathBuf,
    process: Option<Child>,
    paused: bool,
}

/// A running etcd cluster on loopback, killed and deleted on drop.
pub struct EtcdCluster {
    members: Vec<Member>,
    root: PathBuf,
    token: String,
}

impl EtcdCluster {
    /// A single-member cluster.
    pub async fn single() -> EtcdCluster {
        Self::start(1).await
    }

    /// A three-member cluster (quorum 2).
    pub async fn three() -> EtcdCluster {
        Self::start(3).await
    }

    /// A cluster of `size` members, every member answering before this returns.
    pub async fn start(size: usize) -> EtcdCluster {
        let mut last = String::new();
        for _ in 0..5 {
            // Launched on this thread, not a blocking-pool one: the members' death signal is
            // tied to the thread that spawned them, and idle pool threads exit after seconds.
            match Self::launch(size) {
                Ok(cluster) => {
                    cluster.until_ready().await;
                    return cluster;
                }
                Err(error) => last = error.to_string(),
            }
        }
        panic!("cannot start an etcd cluster of {size}: {last}");
    }

    fn launch(size: usize) -> io::Result<EtcdCluster> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let root =
            std::env::temp_dir().join(format!("lockingkit-etcd/c{}-{n}", std::process::id()));
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

    /// Waits until every running member answers a linearizable read.
    async fn until_ready(&self) {
        for (index, member) in self.members.iter().enumerate() {
            if member.process.is_none() {
                continue;
            }
            let endpoint = self.endpoint(index);
            let ready = tokio::time::timeout(Duration::from_secs(60), async {
                loop {
                    if let Ok(Ok(mut client)) = tokio::time::timeout(
                        Duration::from_secs(2),
                        Client::connect([endpoint.clone()], None),
                    )
                    .await
                    {
                        let read = client.get("lockingkit-ready", None);
                        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), read).await
                        {
                            return;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
            assert!(
                ready.is_ok(),
                "etcd member {index} never answered: {}",
                self.log(index)
            );
        }
    }

    /// The client URL of member `index`.
    pub fn endpoint(&self, index: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[index].client_port)
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Provider options for this cluster with the given lease TTL.
    pub fn options(&self, lease_ttl: Duration) -> EtcdOptions {
        EtcdOptions {
            lease_ttl,
            request_timeout: Duration::from_millis(500).min(lease_ttl / 3),
            ..EtcdOptions::new(self.endpoints())
        }
    }

    /// A plain etcd client of every member, as any other program would open.
    pub async fn client(&self) -> Client {
        Client::connect(self.endpoints(), None)
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
        self.until_ready().await;
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

    /// What member `index` has logged (warnings and errors only).
    pub fn log(&self, index: usize) -> String {
        fs::read_to_string(self.members[index].data.join("etcd.log")).unwrap_or_default()
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

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: kill has no memory-safety preconditions; a stale pid only yields ESRCH.
    unsafe {
        libc::kill(pid as i32, signal);
    }
}
