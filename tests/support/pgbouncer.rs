//! A throwaway PgBouncer on a free loopback port in front of a fixture PostgreSQL server, in
//! session, transaction or statement pooling mode; stopped and deleted on drop.
//!
//! `scripts/setup-pgbouncer.sh` installs Debian's `pgbouncer`. The binary is looked up on
//! `PATH`, then as `/usr/sbin/pgbouncer`. As root, it runs as the `postgres` user, like the
//! server: PgBouncer refuses to run as root. Authentication is `trust`, as on the server.

use std::fs;
use std::io;
use std::net::{Ipv4Addr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use lockingkit::PostgresOptions;

use crate::os::{alive, free_port, signal};
use crate::postgres::{server_owner, PostgresServer};

/// PgBouncer's `pool_mode`: when it gives a client's server connection back to the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// When the client disconnects: every session keeps its server connection.
    Session,
    /// When each transaction ends.
    Transaction,
    /// When each statement ends; transactions of several statements are refused.
    Statement,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
            PoolMode::Statement => "statement",
        }
    }
}

/// A running PgBouncer, killed and deleted on drop.
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
    server_port: u16,
    mode: PoolMode,
    settings: String,
}

impl PgBouncer {
    /// Starts a PgBouncer in `mode` in front of the local `server`.
    pub async fn start(server: &PostgresServer, mode: PoolMode) -> PgBouncer {
        Self::start_with(server, mode, "").await
    }

    /// Starts a PgBouncer in `mode` with `settings` (lines of the `[pgbouncer]` section, such
    /// as `"server_round_robin = 1\n"`) added to the fixture's own.
    pub async fn start_with(server: &PostgresServer, mode: PoolMode, settings: &str) -> PgBouncer {
        let server_port = server.port();
        let settings = settings.to_owned();
        tokio::task::spawn_blocking(move || PgBouncer::launch(server_port, mode, settings))
            .await
            .expect("the PgBouncer start task panicked")
            .unwrap_or_else(|e| panic!("cannot start PgBouncer: {e}"))
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The pool mode it runs in now.
    pub fn mode(&self) -> PoolMode {
        self.mode
    }

    /// A libpq connection string of the `postgres` database through this PgBouncer.
    pub fn connection_string(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            self.port
        )
    }

    /// Provider options for this PgBouncer with the given check interval.
    pub fn options(&self, check_interval: Duration) -> PostgresOptions {
        PostgresOptions {
            check_interval,
            ..PostgresOptions::new(self.connection_string())
        }
    }

    /// A plain tokio-postgres client through this PgBouncer.
    pub async fn connect(&self) -> tokio_postgres::Client {
        let (client, connection) =
            tokio_postgres::connect(&self.connection_string(), tokio_postgres::NoTls)
                .await
                .expect("a session through PgBouncer");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    /// Switches the pool mode while running (`RELOAD` on PgBouncer's admin console). Client
    /// connections already open follow the new mode from their next transaction on.
    pub async fn switch_to(&mut self, mode: PoolMode) {
        let config = ini(&self.dir, self.port, self.server_port, mode) + &self.settings;
        fs::write(self.dir.join("pgbouncer.ini"), config).expect("write pgbouncer.ini");
        let admin = format!(
            "host=127.0.0.1 port={} user=postgres dbname=pgbouncer sslmode=disable",
            self.port
        );
        let (client, connection) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
            .await
            .expect("PgBouncer's admin console");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        // The admin console speaks the simple query protocol only.
        client.simple_query("RELOAD").await.expect("RELOAD");
        self.mode = mode;
    }

    /// What PgBouncer has logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn launch(server_port: u16, mode: PoolMode, settings: String) -> io::Result<PgBouncer> {
        let binary = find_binary()?;
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let root = PathBuf::from(ROOT);
        stop_abandoned(&root);
        let dir = root.join(format!(
            "b{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)?;
        // PgBouncer checks only that the user is listed, under `auth_type = trust`.
        fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n")?;
        let owner = server_owner()?;
        let mut last = None;
        for _ in 0..10 {
            let port = free_port()?;
            let config = ini(&dir, port, server_port, mode) + &settings;
            fs::write(dir.join("pgbouncer.ini"), config)?;
            if let Some((uid, gid)) = owner {
                for file in ["", "users.txt", "pgbouncer.ini"] {
                    std::os::unix::fs::chown(dir.join(file), Some(uid), Some(gid))?;
                }
            }
            let mut command = Command::new(&binary);
            command
                .arg(dir.join("pgbouncer.ini"))
                .current_dir("/tmp")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if let Some((uid, gid)) = owner {
                command.uid(uid).gid(gid);
            }
            let mut child = command.spawn()?;
            // For `stop_abandoned`, should this test process die without dropping the fixture.
            fs::write(dir.join("child.pid"), child.id().to_string())?;
            match wait_until_listening(&mut child, port, &dir) {
                Ok(()) => {
                    return Ok(PgBouncer {
                        child,
                        dir,
                        port,
                        server_port,
                        mode,
                        settings,
                    })
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    last = Some(e);
                }
            }
        }
        let _ = fs::remove_dir_all(&dir);
        Err(last.unwrap_or_else(|| io::Error::other("no free port")))
    }
}

/// Waits until the PgBouncer in `dir` accepts connections on `port`; fails if it exits first
/// (a port taken meanwhile).
fn wait_until_listening(child: &mut Child, port: u16, dir: &std::path::Path) -> io::Result<()> {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait()? {
            let log = fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default();
            return Err(io::Error::other(format!(
                "pgbouncer exited ({status}): {log}"
            )));
        }
        if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(());
        }
        if Instant::now() > give_up {
            return Err(io::Error::other("pgbouncer did not listen within 10 s"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The configuration of a PgBouncer in `dir` on `port` in front of the server on
/// `server_port`.
fn ini(dir: &std::path::Path, port: u16, server_port: u16, mode: PoolMode) -> String {
    let dir = dir.display();
    format!(
        "[databases]\n\
         * = host=127.0.0.1 port={server_port}\n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         auth_type = trust\n\
         auth_file = {dir}/users.txt\n\
         admin_users = postgres\n\
         pool_mode = {mode}\n\
         logfile = {dir}/pgbouncer.log\n\
         max_client_conn = 500\n\
         default_pool_size = 40\n\
         ignore_startup_parameters = extra_float_digits\n",
        mode = mode.as_str(),
    )
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Where each fixture's directory lives: `b{test process id}-{n}`.
const ROOT: &str = "/tmp/lockingkit-pgbouncer";

/// Stops the PgBouncers of test processes that died without dropping their fixture (killed by
/// a test timeout, say), and deletes their directories: each name starts with the dead
/// process's id, and holds the PgBouncer's in `child.pid`.
fn stop_abandoned(root: &std::path::Path) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let owner = name
            .strip_prefix('b')
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<i32>().ok());
        let Some(owner) = owner else {
            continue;
        };
        if owner == std::process::id() as i32 || alive(owner) {
            continue;
        }
        let child = fs::read_to_string(entry.path().join("child.pid"))
            .ok()
            .and_then(|pid| pid.trim().parse::<i32>().ok());
        // Only a PgBouncer started with this directory's configuration: the pid may be reused.
        let ours = |pid: &i32| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                String::from_utf8_lossy(&cmdline).contains(&*entry.path().to_string_lossy())
            })
        };
        if let Some(child) = child.filter(|pid| alive(*pid) && ours(pid)) {
            signal(child, libc::SIGKILL);
        }
        let _ = fs::remove_dir_all(entry.path());
    }
}

fn find_binary() -> io::Result<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|path| path.is_file())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "pgbouncer not found on PATH or in /usr/sbin; run scripts/setup-pgbouncer.sh",
            )
        })
}
