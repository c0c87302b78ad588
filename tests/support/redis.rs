//! Throwaway Redis servers and a three-primary Redis Cluster, started from Debian's
//! `redis-server` (installed by `scripts/setup-redis.sh`) on free loopback ports, with no
//! persistence (`--save '' --appendonly no`) and a scratch directory each; stopped and removed
//! on drop.
//!
//! A server can be killed (SIGKILL), frozen (SIGSTOP) and thawed, and started again on its port
//! — empty, as a server without persistence comes back. [`RedisServer::replica_of`] starts a
//! replica, and [`RedisServer::promote`] makes it a primary, for failover cases.
//! [`TlsRedisServer`] serves TLS too, with a certificate from a throwaway authority made with
//! `openssl`.

use std::fs;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::server::{Ports, Readiness, ScratchDir, ServerCommand, ServerProcess};

const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `redis-server`, killed and removed on drop.
pub struct RedisServer {
    process: ServerProcess,
}

impl RedisServer {
    /// A new server on a free loopback port.
    pub async fn start() -> RedisServer {
        Self::start_with(Vec::new()).await
    }

    /// A new server started with `extra` arguments besides the fixture's own.
    pub async fn start_with(extra: Vec<String>) -> RedisServer {
        // A cluster node listens on its port + 10 000 too, for the cluster bus.
        let ports = if extra.iter().any(|a| a == "--cluster-enabled") {
            Ports::new(1).with_partners(10_000)
        } else {
            Ports::new(1)
        };
        Self::start_on(ports, move |_| extra.clone()).await
    }

    /// A replica of the server listening on `primary_port` (which may be a proxy in front of
    /// it, to cut replication).
    pub async fn replica_of(primary_port: u16) -> RedisServer {
        Self::start_with(vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary_port.to_string(),
        ])
        .await
    }

    /// A new server on `ports` (the first is its plain port), started with the arguments
    /// `extra` gives for them besides the fixture's own; ready once it answers PING.
    async fn start_on(ports: Ports, extra: impl Fn(&[u16]) -> Vec<String>) -> RedisServer {
        let ready = Readiness::when(STARTUP_TIMEOUT, |launch| ping(launch.port()));
        let command = |ports: &[u16], dir: &Path| {
            Ok(ServerCommand::new("redis-server")
                .args(["--port", &ports[0].to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                // A replica syncs at once, not after the default 5 s wait for more replicas.
                .args(["--repl-diskless-sync-delay", "0"])
                .arg("--dir")
                .arg(dir)
                // The log goes to standard output, which the process's log file takes.
                .args(["--daemonize", "no"])
                .args(extra(ports)))
        };
        let started = match ScratchDir::new(std::env::temp_dir().join("lockingkit-redis")) {
            Ok(scratch) => {
                ServerProcess::start("redis-server", scratch, ports, ready, command).await
            }
            Err(e) => Err(e),
        };
        let process = started.unwrap_or_else(|e| panic!("cannot start redis-server: {e}"));
        RedisServer { process }
    }

    /// The URL of this server.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port())
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// The loopback address.
    pub fn address(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port()))
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// A plain client connection, as any other program would open.
    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("a Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a plain Redis connection")
    }

    /// Runs `redis-cli -p PORT args…` and returns its standard output, trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port(), args)
    }

    /// What the server has written to its log so far.
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// The warnings (level `#`) the server logged after it was ready to accept connections:
    /// what a client can provoke.
    pub fn warnings_since_ready(&self) -> Vec<String> {
        let log = self.log();
        let after = log
            .rfind("Ready to accept connections")
            .map_or("", |at| &log[at..]);
        after
            .lines()
            .filter(|line| line.split_whitespace().nth(4) == Some("#"))
            .map(str::to_owned)
            .collect()
    }

    /// The error replies the server has sent to clients since it started, by error code
    /// (`INFO errorstats`), except those of `redis-cli` calls made here.
    pub fn error_replies(&self) -> Vec<(String, u64)> {
        self.cli(&["INFO", "errorstats"])
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix("errorstat_")?;
                let (code, count) = rest.split_once(":count=")?;
                Some((code.to_owned(), count.trim().parse().ok()?))
            })
            .collect()
    }

    /// How many error replies with `code` (`NOSCRIPT`, `ERR`, …) the server has sent since it
    /// started or since [`reset_stats`](Self::reset_stats).
    pub fn error_count(&self, code: &str) -> u64 {
        self.error_replies()
            .into_iter()
            .find_map(|(found, count)| (found == code).then_some(count))
            .unwrap_or(0)
    }

    /// How many times the server ran `command` (as `INFO commandstats` names it: `evalsha`,
    /// `script|load`, `client|setinfo`) since it started or since
    /// [`reset_stats`](Self::reset_stats).
    pub fn calls_of(&self, command: &str) -> u64 {
        let prefix = format!("cmdstat_{command}:calls=");
        self.cli(&["INFO", "commandstats"])
            .lines()
            .find_map(|line| {
                let rest = line.strip_prefix(&prefix)?;
                rest.split(',').next()?.parse().ok()
            })
            .unwrap_or(0)
    }

    /// Zeroes the server's statistics (`CONFIG RESETSTAT`): error and command counts.
    pub fn reset_stats(&self) {
        assert_eq!(self.cli(&["CONFIG", "RESETSTAT"]), "OK");
    }

    /// Empties the server's script cache (`SCRIPT FLUSH`), as an operator may.
    pub fn flush_scripts(&self) {
        assert_eq!(self.cli(&["SCRIPT", "FLUSH"]), "OK");
    }

    /// Kills the server (SIGKILL): a crash. Without persistence it comes back empty.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers.
    pub fn pause(&mut self) {
        self.process.pause();
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&mut self) {
        self.process.resume();
    }

    /// Starts a killed server again on the same port (empty: nothing was persisted).
    pub async fn start_again(&mut self) {
        self.process.start_again().await;
    }

    /// Kills the server and starts it again on the same port.
    pub async fn restart(&mut self) {
        self.kill();
        self.start_again().await;
    }

    /// Makes a replica a primary (`REPLICAOF NO ONE`), as a failover does.
    pub fn promote(&self) {
        assert_eq!(self.cli(&["REPLICAOF", "NO", "ONE"]), "OK");
    }

    /// Waits until this replica has caught up with its primary's replication stream.
    pub async fn wait_until_replicating(&self) {
        let started = Instant::now();
        while !self
            .cli(&["INFO", "replication"])
            .contains("master_link_status:up")
        {
            assert!(
                started.elapsed() < STARTUP_TIMEOUT,
                "the replica never connected to its primary"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A Redis Cluster of three primaries (and, if asked, one replica each), every slot assigned.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Three primaries, no replicas.
    pub async fn start() -> RedisCluster {
        Self::start_with_replicas(0).await
    }

    /// Three primaries with `replicas` replicas each; a replica takes over from a primary that
    /// stops answering for two seconds. Every node's statistics are zeroed once it is ready.
    pub async fn start_with_replicas(replicas: usize) -> RedisCluster {
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            nodes.push(
                RedisServer::start_with(vec![
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-node-timeout".into(),
                    "2000".into(),
                    "--cluster-config-file".into(),
                    "nodes.conf".into(),
                ])
                .await,
            );
        }
        let cluster = RedisCluster { nodes };
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let replicas = replicas.to_string();
        tokio::task::spawn_blocking(move || {
            let mut args = vec!["--cluster", "create"];
            args.extend(addresses.iter().map(String::as_str));
            args.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
            let output = run_cli(&args).expect("redis-cli --cluster create");
            assert!(
                output.status.success(),
                "cluster create failed: {}",
                String::from_utf8_lossy(&output.stdout)
            );
        })
        .await
        .expect("the cluster create task");
        cluster.wait_until_ok().await;
        // `--cluster create` draws error replies of its own (a `CLUSTER REPLICATE` it retries):
        // what the statistics count from here is the tests' doing.
        for node in &cluster.nodes {
            node.reset_stats();
        }
        cluster
    }

    async fn wait_until_ok(&self) {
        let ports: Vec<u16> = self.nodes.iter().map(RedisServer::port).collect();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            while !ports
                .iter()
                .all(|&port| cli(port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"))
            {
                assert!(
                    started.elapsed() < STARTUP_TIMEOUT,
                    "the cluster never reached state ok"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        })
        .await
        .expect("the cluster wait task");
    }

    /// Every node's URL, for the provider's `url` (comma-separated) or a cluster client.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The nodes, for process control.
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }

    /// The node serving `slot` as primary now.
    pub fn primary_of(&self, slot: u16) -> &RedisServer {
        let port = self
            .nodes
            .iter()
            .filter(|node| node.pid().is_some())
            .find_map(|node| primary_port(&node.cli(&["CLUSTER", "NODES"]), slot))
            .expect("a primary for the slot");
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .expect("the primary is a node of this cluster")
    }

    /// `CLUSTER KEYSLOT name`, as the server computes it.
    pub fn keyslot(&self, name: &str) -> u16 {
        self.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", name])
            .parse()
            .expect("a slot number")
    }
}

/// The port of the live primary serving `slot`, from `CLUSTER NODES` output: one line per node,
/// `id ip:port@bus flags primary-id ping pong epoch link slot-ranges…`.
fn primary_port(nodes: &str, slot: u16) -> Option<u16> {
    nodes.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let flags = fields.get(2)?;
        if !flags.contains("master") || flags.contains("fail") {
            return None;
        }
        let serves = fields.iter().skip(8).any(|range| {
            let mut bounds = range.splitn(2, '-').map(|b| b.parse::<u16>());
            match (bounds.next(), bounds.next()) {
                (Some(Ok(start)), Some(Ok(end))) => (start..=end).contains(&slot),
                (Some(Ok(only)), None) => only == slot,
                _ => false,
            }
        });
        let address = fields.get(1)?.split('@').next()?;
        serves
            .then(|| address.rsplit(':').next()?.parse().ok())
            .flatten()
    })
}

/// Runs `redis-cli -p port args…`, returning standard output trimmed (empty on failure).
pub fn cli(port: u16, args: &[&str]) -> String {
    let port = port.to_string();
    let mut all = vec!["-p", port.as_str()];
    all.extend_from_slice(args);
    run_cli(&all)
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn run_cli(args: &[&str]) -> io::Result<Output> {
    Command::new("redis-cli")
        .args(["-h", "127.0.0.1"])
        .args(args)
        .stdin(Stdio::null())
        .output()
}

/// Whether a server on `port` answers PING (or asks for a password first: it is up).
fn ping(port: u16) -> bool {
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut answer = [0u8; 7];
    stream.read_exact(&mut answer).is_ok()
        && (&answer == b"+PONG\r\n" || answer.starts_with(b"-NOAUTH"))
}

/// A server that also serves TLS, on a port of its own, with a certificate for `127.0.0.1`
/// signed by a throwaway certificate authority (made with `openssl`, removed on drop); its plain
/// port stays open for `redis-cli`.
pub struct TlsRedisServer {
    server: RedisServer,
    certs: ScratchDir,
}

impl TlsRedisServer {
    pub async fn start() -> TlsRedisServer {
        let certs = tokio::task::spawn_blocking(|| {
            let certs = ScratchDir::new(std::env::temp_dir().join("lockingkit-redis"))?;
            make_certificates(certs.path())?;
            io::Result::Ok(certs)
        })
        .await
        .expect("the certificate task")
        .unwrap_or_else(|e| panic!("cannot make certificates: {e}"));
        let dir = certs.path().to_owned();
        let file = move |name: &str| dir.join(name).to_string_lossy().into_owned();
        // The second port serves TLS.
        let server = RedisServer::start_on(Ports::new(2), move |ports| {
            vec![
                "--tls-port".into(),
                ports[1].to_string(),
                "--tls-cert-file".into(),
                file("server.pem"),
                "--tls-key-file".into(),
                file("server.key"),
                "--tls-ca-cert-file".into(),
                file("ca.pem"),
                "--tls-auth-clients".into(),
                "no".into(),
            ]
        })
        .await;
        TlsRedisServer { server, certs }
    }

    /// `rediss://127.0.0.1:{tls port}`.
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port())
    }

    pub fn tls_port(&self) -> u16 {
        self.server.process.ports()[1]
    }

    /// The PEM file of the authority that signed the server's certificate.
    pub fn ca(&self) -> PathBuf {
        self.certs.path().join("ca.pem")
    }

    /// The server, for its plain port and process control.
    pub fn server(&self) -> &RedisServer {
        &self.server
    }
}

/// `ca.pem` (a certificate authority) and `server.pem`/`server.key` (signed by it, for the IP
/// address 127.0.0.1 only, so `localhost` is a name it does not carry) in `dir`.
fn make_certificates(dir: &Path) -> io::Result<()> {
    let openssl = |args: &[&str]| -> io::Result<()> {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()?;
        if output.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            )))
        }
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec![
        "req",
        "-x509",
        "-days",
        "2",
        "-subj",
        "/CN=LockingKit test CA",
    ];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    ca.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
    ca.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
    openssl(&ca)?;
    let mut request = vec!["req", "-subj", "/CN=127.0.0.1"];
    request.extend(ec);
    request.extend(["-keyout", "server.key", "-out", "server.csr"]);
    openssl(&request)?;
    fs::write(
        dir.join("server.ext"),
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n\
         subjectAltName=IP:127.0.0.1\n",
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
    ])
}
