//! A throwaway PostgreSQL cluster, started from its binaries (`initdb`, `postgres`) on a free
//! loopback port and removed on drop.
//!
//! `scripts/setup-postgres.sh` installs the binaries on a fresh Debian machine. The binaries
//! are looked up on `PATH`, then in `/usr/lib/postgresql/*/bin`. One `initdb` per machine
//! makes a template cluster (shared by every test process under a file lock); each server
//! copies it, which takes a tenth of the time. As root, the server runs as the `postgres`
//! user, because PostgreSQL refuses to run as root.
//!
//! The postmaster runs in the foreground as a [`ServerProcess`] (not through `pg_ctl start`,
//! which daemonizes it out of the fixture's hands); what the process type does not know is
//! that a server is the postmaster *and* its backends, which the postmaster forks and which
//! each lead a process group of their own. So a pause, a kill and a stop here reach the
//! backends one by one, besides the postmaster.
//!
//! Set `LOCKINGKIT_TEST_POSTGRES_URL` to run against a server that is already running
//! instead; process control (kill, pause, restart) is then refused. Tests use unique keys, so
//! they do not meet on a shared server.

use std::fs::{self, File};
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use lockingkit::keys::PostgresLockKeys;
use lockingkit::PostgresOptions;

use crate::os::{alive, children_of, signal, stat_fields};
use crate::server::{Launch, Ports, Readiness, ScratchDir, ServerCommand, ServerProcess};

/// The environment variable naming an external server (a libpq URL or key=value string).
pub const EXTERNAL_ENV: &str = "LOCKINGKIT_TEST_POSTGRES_URL";

/// The one role that must authenticate with a password (SCRAM) on a local server; every other
/// role is trusted. Create it with [`PostgresServer::create_password_role`].
pub const PASSWORD_ROLE: &str = "password_probe";

/// Bumped whenever the template cluster's setup changes, so stale templates are rebuilt.
const TEMPLATE_REVISION: u32 = 1;

/// A running PostgreSQL server (local or external), stopped and deleted on drop.
pub struct PostgresServer {
    local: Option<LocalCluster>,
    connection_string: String,
}

struct LocalCluster {
    /// The postmaster; its scratch directory is the data directory.
    postmaster: ServerProcess,
    owner: Option<(u32, u32)>,
    /// Backends stopped by `pause`, to be continued by `resume` or drop.
    paused: Vec<u32>,
}

impl PostgresServer {
    /// The external server named by [`EXTERNAL_ENV`], or a new local one.
    pub async fn start() -> PostgresServer {
        match std::env::var(EXTERNAL_ENV) {
            Ok(url) if !url.trim().is_empty() => PostgresServer {
                local: None,
                connection_string: url,
            },
            _ => Self::start_local().await,
        }
    }

    /// A new local server, whatever the environment says (for tests that kill or pause it).
    pub async fn start_local() -> PostgresServer {
        let local = LocalCluster::start()
            .await
            .unwrap_or_else(|e| panic!("cannot start PostgreSQL: {e}"));
        PostgresServer {
            connection_string: local.key_value_for("postgres"),
            local: Some(local),
        }
    }

    /// Whether this is an external server (no process control).
    pub fn is_external(&self) -> bool {
        self.local.is_none()
    }

    /// The libpq connection string of the `postgres` database as the `postgres` superuser.
    pub fn connection_string(&self) -> String {
        self.connection_string.clone()
    }

    /// Creates [`PASSWORD_ROLE`] with `password` and returns a connection string that logs in
    /// as it with `attempted` as the password.
    pub async fn create_password_role(&self, password: &str, attempted: &str) -> String {
        let client = self.connect().await;
        client
            .batch_execute(&format!(
                "CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{password}'"
            ))
            .await
            .expect("CREATE ROLE");
        format!(
            "host=127.0.0.1 port={} user={PASSWORD_ROLE} password='{attempted}' dbname=postgres sslmode=disable",
            self.port()
        )
    }

    /// Provider options for this server with the given check interval.
    pub fn options(&self, check_interval: Duration) -> PostgresOptions {
        PostgresOptions::new(self.connection_string()).with_check_interval(check_interval)
    }

    /// The loopback port of a local server.
    pub fn port(&self) -> u16 {
        self.local().postmaster.port()
    }

    /// A plain tokio-postgres session, as any other program would open.
    pub async fn connect(&self) -> tokio_postgres::Client {
        let (client, connection) =
            tokio_postgres::connect(&self.connection_string, tokio_postgres::NoTls)
                .await
                .expect("a plain PostgreSQL session");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    /// A deadpool-postgres pool of up to `size` plain sessions, as an application that takes
    /// advisory locks by hand (or locks on deadpool transactions) would use.
    pub fn plain_pool(&self, size: usize) -> deadpool_postgres::Pool {
        use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
        let config: tokio_postgres::Config = self.connection_string.parse().expect("config");
        let manager = Manager::from_config(
            config,
            tokio_postgres::NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        Pool::builder(manager).max_size(size).build().expect("pool")
    }

    /// The server processes (`pid`s) whose sessions hold the advisory lock of `key`.
    pub async fn lock_holders(&self, key: &str) -> Vec<i32> {
        let client = self.connect().await;
        let rows = client
            .query(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted \
                 AND ((classid::bigint << 32) | objid::bigint) = $1",
                &[&PostgresLockKeys::advisory_key(key)],
            )
            .await
            .expect("pg_locks");
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Terminates (`pg_terminate_backend`) the sessions holding `key`; returns how many.
    pub async fn terminate_lock_holders(&self, key: &str) -> usize {
        let pids = self.lock_holders(key).await;
        let client = self.connect().await;
        for pid in &pids {
            client
                .execute("SELECT pg_terminate_backend($1)", &[pid])
                .await
                .expect("pg_terminate_backend");
        }
        pids.len()
    }

    /// Terminates every other client session whose `application_name` is `name` (LockingKit
    /// sets `lockingkit` unless the connection string says otherwise); returns how many.
    pub async fn terminate_backends(&self, application_name: &str) -> usize {
        let client = self.connect().await;
        let rows = client
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = $1 AND pid <> pg_backend_pid()",
                &[&application_name],
            )
            .await
            .expect("pg_terminate_backend");
        rows.len()
    }

    /// The CPU time a local server has used so far: the postmaster and every server process,
    /// live or ended (an ended session's time is counted into the postmaster's children).
    pub fn cpu_time(&self) -> Duration {
        let Some(postmaster) = self.local().running_postmaster() else {
            return Duration::ZERO;
        };
        let mut ticks = cpu_ticks(postmaster, true);
        for child in children_of(postmaster) {
            ticks += cpu_ticks(child, false);
        }
        Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second())
    }

    /// What a local server has written to its log since it was last started.
    pub fn server_log(&self) -> String {
        self.local().postmaster.log_since_start()
    }

    /// Creates a database (advisory locks are per database).
    pub async fn create_database(&self, name: &str) {
        let client = self.connect().await;
        client
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .expect("CREATE DATABASE");
    }

    /// A connection string for database `name` on a local server.
    pub fn connection_string_for_database(&self, name: &str) -> String {
        self.local().key_value_for(name)
    }

    /// Kills the postmaster and every server process (SIGKILL): a crash. Clients see their
    /// connections reset; [`start_again`](Self::start_again) recovers from the WAL.
    pub fn kill(&mut self) {
        let local = self.local_mut();
        local.resume();
        // Stopped first, so the postmaster cannot fork or restart children while they die.
        local.postmaster.signal(libc::SIGSTOP);
        let backends = local.backends();
        for &pid in &backends {
            signal(pid, libc::SIGSTOP);
        }
        for &pid in &backends {
            signal(pid, libc::SIGKILL);
        }
        local.postmaster.kill();
        wait_until_gone(&backends);
    }

    /// Stops the server the fast way (immediate mode): every session ends at once.
    pub fn stop_immediate(&mut self) {
        self.local_mut().stop_immediate(Duration::from_secs(30));
    }

    /// Starts a stopped or killed server again on the same port.
    pub async fn start_again(&mut self) {
        self.local_mut().postmaster.start_again().await;
    }

    /// Stops the server (immediate mode) and starts it again on the same port.
    pub async fn restart(&mut self) {
        self.stop_immediate();
        self.start_again().await;
    }

    /// Freezes the postmaster and every backend (SIGSTOP): connections stay open, the kernel
    /// still acknowledges packets, and no statement ever answers.
    pub fn pause(&mut self) {
        let local = self.local_mut();
        local.postmaster.pause();
        for pid in local.backends() {
            signal(pid, libc::SIGSTOP);
            local.paused.push(pid);
        }
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&mut self) {
        self.local_mut().resume();
    }

    /// Turns TLS on for a local server with a fresh self-signed certificate (made by the
    /// `openssl` command), by configuration reload: plain connections keep working, and
    /// `sslmode=require` (which encrypts without verifying) connects encrypted.
    pub async fn enable_tls(&self) {
        let local = self.local();
        let data = local.postmaster.dir();
        let (cert, key) = (data.join("server.crt"), data.join("server.key"));
        let made = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .args(["-subj", "/CN=127.0.0.1", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stdin(Stdio::null())
            .output()
            .expect("openssl runs");
        assert!(
            made.status.success(),
            "openssl: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        // The server refuses a key that others may read.
        fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod the key");
        if let Some((uid, gid)) = local.owner {
            for file in [&cert, &key] {
                std::os::unix::fs::chown(file, Some(uid), Some(gid)).expect("chown");
            }
        }
        let client = self.connect().await;
        // One statement each: ALTER SYSTEM refuses to run in the implicit transaction of a
        // multi-statement query.
        for setting in [
            format!("ssl_cert_file = '{}'", cert.display()),
            format!("ssl_key_file = '{}'", key.display()),
            "ssl = on".to_owned(),
        ] {
            client
                .batch_execute(&format!("ALTER SYSTEM SET {setting}"))
                .await
                .expect("ALTER SYSTEM");
        }
        client
            .batch_execute("SELECT pg_reload_conf()")
            .await
            .expect("reload");
        // The postmaster rereads its configuration when it gets to the signal; sessions
        // started after that offer TLS.
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let row = self.connect().await.query_one("SHOW ssl", &[]).await;
            if row.expect("SHOW ssl").get::<_, String>(0) == "on" {
                return;
            }
            assert!(std::time::Instant::now() < give_up, "TLS never came on");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn local(&self) -> &LocalCluster {
        self.local.as_ref().unwrap_or_else(|| {
            panic!("an external server ({EXTERNAL_ENV}) cannot be controlled or inspected")
        })
    }

    fn local_mut(&mut self) -> &mut LocalCluster {
        self.local.as_mut().unwrap_or_else(|| {
            panic!("an external server ({EXTERNAL_ENV}) cannot be controlled or inspected")
        })
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(local) = self.local.as_mut() {
            local.stop_immediate(Duration::from_secs(10));
        }
    }
}

impl LocalCluster {
    /// A copy of the template cluster, started on a free port; ready once the postmaster says
    /// it accepts connections.
    async fn start() -> io::Result<LocalCluster> {
        let DataCopy {
            binaries,
            owner,
            data,
        } = tokio::task::spawn_blocking(copy_template)
            .await
            .map_err(io::Error::other)??;
        let ready = Readiness::when(Duration::from_secs(60), accepts_connections);
        let command = |ports: &[u16], data: &Path| {
            Ok(ServerCommand::new(binaries.join("postgres"))
                .arg("-D")
                .arg(data)
                .args(["-p", &ports[0].to_string(), "-k"])
                .arg(data)
                .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
                .args(["-c", "full_page_writes=off"])
                // The server user may not be allowed into the caller's working directory.
                .current_dir("/tmp")
                .run_as(owner))
        };
        let postmaster =
            ServerProcess::start("PostgreSQL", data, Ports::new(1), ready, command).await?;
        Ok(LocalCluster {
            postmaster,
            owner,
            paused: Vec::new(),
        })
    }

    fn key_value_for(&self, database: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={database} sslmode=disable",
            self.postmaster.port()
        )
    }

    /// The postmaster's pid while it runs.
    fn running_postmaster(&self) -> Option<u32> {
        self.postmaster.pid().filter(|&pid| alive(pid))
    }

    /// The postmaster's children, while it runs.
    fn backends(&self) -> Vec<u32> {
        self.running_postmaster()
            .map(children_of)
            .unwrap_or_default()
    }

    /// Immediate shutdown (SIGQUIT): the postmaster ends every backend and exits; killed if it
    /// still runs after `bound`, and backends still running five seconds later with it.
    fn stop_immediate(&mut self, bound: Duration) {
        self.resume();
        let backends = self.backends();
        self.postmaster.stop_with(libc::SIGQUIT, bound);
        wait_until_gone(&backends);
        for pid in backends {
            signal(pid, libc::SIGKILL);
        }
    }

    fn resume(&mut self) {
        self.postmaster.resume();
        for pid in self.paused.drain(..) {
            signal(pid, libc::SIGCONT);
        }
    }
}

/// Whether the postmaster of `launch` accepts connections, as its lock file says (what
/// `pg_ctl start -w` waits for): its own pid on the first line, `ready` on the eighth.
fn accepts_connections(launch: &Launch) -> bool {
    let lock_file = fs::read_to_string(launch.dir().join("postmaster.pid")).unwrap_or_default();
    let lines: Vec<&str> = lock_file.lines().map(str::trim).collect();
    let pid = launch.pid().to_string();
    lines.first() == Some(&pid.as_str()) && lines.get(7) == Some(&"ready")
}

/// A new data directory, copied from the template, and what runs a server on it.
struct DataCopy {
    binaries: PathBuf,
    owner: Option<(u32, u32)>,
    data: ScratchDir,
}

/// Finds the binaries, makes the template if it is missing, and copies it into a new scratch
/// directory (which takes the template's owner and mode).
fn copy_template() -> io::Result<DataCopy> {
    let binaries = find_binaries()?;
    let owner = server_owner()?;
    let root = scratch_root()?;
    let template = ensure_template(&binaries, &root, owner)?;
    let data = ScratchDir::new(&root)?;
    checked(
        Command::new("cp")
            .arg("-a")
            .arg(template.join("."))
            .arg(data.path()),
    )?;
    Ok(DataCopy {
        binaries,
        owner,
        data,
    })
}

fn wait_until_gone(pids: &[u32]) {
    for _ in 0..500 {
        if pids.iter().all(|&p| !alive(p)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Where `initdb` and `postgres` live.
fn find_binaries() -> io::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Ok(entries) = fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        candidates.extend(versions.into_iter().rev());
    }
    candidates
        .into_iter()
        .find(|dir| ["initdb", "postgres"].iter().all(|b| dir.join(b).is_file()))
        .map(|dir| fs::canonicalize(&dir).unwrap_or(dir))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "initdb/postgres not found on PATH or in /usr/lib/postgresql/*/bin; run scripts/setup-postgres.sh",
            )
        })
}

/// The uid and gid to run the server (and PgBouncer) as: `postgres` when we are root, ourselves
/// otherwise.
pub fn server_owner() -> io::Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd")?;
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&"postgres") && f.len() > 3)
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .map(Some)
        .ok_or_else(|| {
            io::Error::other(
                "running as root needs a `postgres` user; run scripts/setup-postgres.sh",
            )
        })
}

fn scratch_root() -> io::Result<PathBuf> {
    let root = PathBuf::from("/tmp/lockingkit-pg");
    fs::create_dir_all(&root)?;
    Ok(root)
}

/// The template cluster for these binaries, made once per machine under a file lock so that
/// test processes starting together do not race.
fn ensure_template(binaries: &Path, root: &Path, owner: Option<(u32, u32)>) -> io::Result<PathBuf> {
    let tag: String = binaries
        .display()
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let template = root.join(format!("template{tag}"));
    let ready = root.join(format!("template{tag}.ready{TEMPLATE_REVISION}"));
    let lock = File::create(root.join(format!("template{tag}.lock")))?;
    lock.lock()?;
    if ready.exists() && template.join("PG_VERSION").exists() {
        return Ok(template);
    }
    let _ = fs::remove_dir_all(&template);
    fs::create_dir_all(&template)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&template, Some(uid), Some(gid))?;
    }
    let mut initdb = Command::new(binaries.join("initdb"));
    initdb
        .args([
            "-A",
            "trust",
            "--no-sync",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "-D",
        ])
        .arg(&template);
    as_owner(&mut initdb, owner);
    checked(&mut initdb)?;
    let hba = template.join("pg_hba.conf");
    let rules = fs::read_to_string(&hba)?;
    // First match wins: this role alone must prove its password.
    fs::write(
        &hba,
        format!("host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n{rules}"),
    )?;
    File::create(&ready)?;
    Ok(template)
}

fn as_owner(command: &mut Command, owner: Option<(u32, u32)>) {
    if let Some((uid, gid)) = owner {
        // std drops supplementary groups when root switches uid.
        command.uid(uid).gid(gid);
    }
    // The server user may not be allowed into the caller's working directory.
    command.current_dir("/tmp");
}

fn checked(command: &mut Command) -> io::Result<Output> {
    let output = command.stdin(Stdio::null()).output()?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(io::Error::other(format!(
            "{:?} failed ({}): {}{}",
            command.get_program(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )))
    }
}

/// User and system CPU ticks of `pid` (with its waited-for children's when `children`).
fn cpu_ticks(pid: u32, children: bool) -> u64 {
    // After the command: state, ppid, … utime is field 14 of the line, the 12th after `)`.
    let fields = stat_fields(pid.into()).unwrap_or_default();
    let take = if children { 4 } else { 2 };
    fields
        .iter()
        .skip(11)
        .take(take)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum()
}

/// The kernel's clock ticks per second, the unit of `/proc/*/stat` CPU times.
pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// The CPU time this process has used so far.
pub fn own_cpu_time() -> Duration {
    Duration::from_secs_f64(cpu_ticks(std::process::id(), false) as f64 / clock_ticks_per_second())
}
