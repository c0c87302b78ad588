//! A throwaway PostgreSQL cluster, started from its binaries (`initdb`, `pg_ctl`, `postgres`)
//! on a free loopback port and removed on drop.
//!
//! `scripts/setup-postgres.sh` installs the binaries on a fresh Debian machine. The binaries
//! are looked up on `PATH`, then in `/usr/lib/postgresql/*/bin`. One `initdb` per machine
//! makes a template cluster (shared by every test process under a file lock); each server
//! copies it, which takes a tenth of the time. As root, the server runs as the `postgres`
//! user, because PostgreSQL refuses to run as root.
//!
//! Set `LOCKINGKIT_TEST_POSTGRES_URL` to run against a server that is already running
//! instead; process control (kill, pause, restart) is then refused. Tests use unique keys, so
//! they do not meet on a shared server.

use std::fs::{self, File};
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lockingkit::keys::PostgresLockKeys;
use lockingkit::PostgresOptions;

use crate::os::{alive, free_port, relaunch, signal};

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
    binaries: PathBuf,
    data: PathBuf,
    port: u16,
    owner: Option<(u32, u32)>,
    /// Processes stopped by `pause`, to be continued by `resume` or drop.
    paused: Vec<i32>,
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
        tokio::task::spawn_blocking(LocalCluster::start)
            .await
            .expect("the PostgreSQL start task panicked")
            .unwrap_or_else(|e| panic!("cannot start PostgreSQL: {e}"))
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
        PostgresOptions {
            check_interval,
            ..PostgresOptions::new(self.connection_string())
        }
    }

    /// The loopback port of a local server.
    pub fn port(&self) -> u16 {
        self.local().port
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
        let Some(postmaster) = running_postmaster(&self.local().data) else {
            return Duration::ZERO;
        };
        let mut ticks = cpu_ticks(postmaster, true);
        for child in children_of(postmaster) {
            ticks += cpu_ticks(child, false);
        }
        Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second())
    }

    /// What a local server has written to its log so far.
    pub fn server_log(&self) -> String {
        fs::read_to_string(self.local().data.join("server.log")).unwrap_or_default()
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
        let pids = local.server_pids();
        for &pid in &pids {
            signal(pid, libc::SIGSTOP);
        }
        let pids = local.server_pids();
        for &pid in &pids {
            signal(pid, libc::SIGKILL);
        }
        wait_until_gone(&pids);
    }

    /// Stops the server the fast way (`pg_ctl stop -m immediate`): every session ends at once.
    pub fn stop_immediate(&mut self) {
        let local = self.local_mut();
        local.resume();
        let pids = local.server_pids();
        let _ = local.pg_ctl(&["stop", "-m", "immediate", "-w", "-t", "30"]);
        wait_until_gone(&pids);
    }

    /// Starts a stopped or killed server again on the same port.
    pub async fn start_again(&mut self) {
        let mut local = self.local.take().expect("not a local server");
        let local = tokio::task::spawn_blocking(move || {
            relaunch("PostgreSQL", || local.launch());
            local
        })
        .await
        .expect("the PostgreSQL start task panicked");
        self.local = Some(local);
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
        for pid in local.server_pids() {
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
        let (cert, key) = (local.data.join("server.crt"), local.data.join("server.key"));
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
            local.resume();
            if local
                .pg_ctl(&["stop", "-m", "immediate", "-w", "-t", "10"])
                .is_err()
            {
                for pid in local.server_pids() {
                    signal(pid, libc::SIGKILL);
                }
            }
            let _ = fs::remove_dir_all(&local.data);
        }
    }
}

impl LocalCluster {
    fn start() -> io::Result<PostgresServer> {
        let binaries = find_binaries()?;
        let owner = server_owner()?;
        let root = scratch_root()?;
        let template = ensure_template(&binaries, &root, owner)?;
        remove_abandoned_clusters(&binaries, &root, owner);
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        // Short, because the socket path inside must stay under 107 bytes.
        let data = root.join(format!(
            "c{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&data);
        checked(Command::new("cp").arg("-a").arg(&template).arg(&data))?;
        let mut cluster = LocalCluster {
            binaries,
            data,
            port: 0,
            owner,
            paused: Vec::new(),
        };
        let mut last = None;
        for _ in 0..10 {
            cluster.port = free_port()?;
            match cluster.launch() {
                Ok(()) => {
                    let connection_string = cluster.key_value();
                    return Ok(PostgresServer {
                        local: Some(cluster),
                        connection_string,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        let _ = fs::remove_dir_all(&cluster.data);
        Err(last.unwrap_or_else(|| io::Error::other("no free port")))
    }

    fn key_value(&self) -> String {
        self.key_value_for("postgres")
    }

    fn key_value_for(&self, database: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={database} sslmode=disable",
            self.port
        )
    }

    /// `pg_ctl start` on the current port; fails if the port is taken.
    fn launch(&mut self) -> io::Result<()> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off",
            self.port,
            self.data.display()
        );
        let log = self.data.join("server.log");
        let _ = fs::remove_file(&log);
        let data = self.data.display().to_string();
        let log = log.display().to_string();
        self.pg_ctl(&[
            "start", "-w", "-t", "60", "-D", &data, "-l", &log, "-o", &options,
        ])
        .map(|_| ())
        .map_err(|e| {
            let tail = fs::read_to_string(&log).unwrap_or_default();
            io::Error::other(format!("{e}; server log:\n{tail}"))
        })
    }

    fn pg_ctl(&self, args: &[&str]) -> io::Result<Output> {
        let mut command = Command::new(self.binaries.join("pg_ctl"));
        command.args(args);
        if !args.contains(&"-D") {
            command.arg("-D").arg(&self.data);
        }
        as_owner(&mut command, self.owner);
        checked(&mut command)
    }

    /// The postmaster and its children.
    fn server_pids(&self) -> Vec<i32> {
        let Some(postmaster) = running_postmaster(&self.data) else {
            return Vec::new();
        };
        let mut pids = vec![postmaster];
        pids.extend(children_of(postmaster));
        pids
    }

    fn resume(&mut self) {
        for pid in self.paused.drain(..) {
            signal(pid, libc::SIGCONT);
        }
    }
}

/// The postmaster of the cluster in `data`, if it runs.
fn running_postmaster(data: &Path) -> Option<i32> {
    fs::read_to_string(data.join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
        .filter(|&pid| alive(pid))
}

fn wait_until_gone(pids: &[i32]) {
    for _ in 0..500 {
        if pids.iter().all(|&p| !alive(p)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Where `initdb`, `pg_ctl` and `postgres` live.
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
        .find(|dir| ["initdb", "pg_ctl", "postgres"].iter().all(|b| dir.join(b).is_file()))
        .map(|dir| fs::canonicalize(&dir).unwrap_or(dir))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "initdb/pg_ctl/postgres not found on PATH or in /usr/lib/postgresql/*/bin; run scripts/setup-postgres.sh",
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

/// Stops and deletes clusters left by test processes that died without dropping their server
/// (killed by a test timeout, say): their directory names start with the dead process's id.
fn remove_abandoned_clusters(binaries: &Path, root: &Path, owner: Option<(u32, u32)>) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix('c')
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() as i32 || alive(pid) {
            continue;
        }
        let data = entry.path();
        if let Some(postmaster) = running_postmaster(&data) {
            // A server left paused would ignore the stop request.
            for pid in std::iter::once(postmaster).chain(children_of(postmaster)) {
                signal(pid, libc::SIGCONT);
            }
            let mut stop = Command::new(binaries.join("pg_ctl"));
            stop.args(["stop", "-m", "immediate", "-w", "-t", "10", "-D"])
                .arg(&data);
            as_owner(&mut stop, owner);
            let _ = checked(&mut stop);
        }
        let _ = fs::remove_dir_all(&data);
    }
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

/// Every process whose parent is `parent` (PostgreSQL backends are direct children).
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let (_, rest) = stat.rsplit_once(')')?;
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// User and system CPU ticks of `pid` (with its waited-for children's when `children`).
fn cpu_ticks(pid: i32, children: bool) -> u64 {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    // After the command: state, ppid, … utime is field 14 of the line, the 12th after `)`.
    let fields: Vec<&str> = rest.split_whitespace().collect();
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
    Duration::from_secs_f64(
        cpu_ticks(std::process::id() as i32, false) as f64 / clock_ticks_per_second(),
    )
}
