//! A throwaway PgBouncer on a free loopback port in front of a fixture PostgreSQL server, in
//! session, transaction or statement pooling mode; stopped and deleted on drop.
//!
//! `scripts/setup-pgbouncer.sh` installs Debian's `pgbouncer`. The binary is looked up on
//! `PATH`, then as `/usr/sbin/pgbouncer`. As root, it runs as the `postgres` user, like the
//! server: PgBouncer refuses to run as root. Authentication is `trust`, as on the server.

use std::fs;
use std::io;
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use lockingkit::PostgresOptions;

use crate::postgres::{server_owner, PostgresServer};
use crate::server::{Ports, Readiness, ScratchDir, ServerCommand, ServerProcess};

/// Where each fixture's directory lives.
const ROOT: &str = "/tmp/lockingkit-pgbouncer";

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
    process: ServerProcess,
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
        let process = PgBouncer::launch(server_port, mode, settings)
            .await
            .unwrap_or_else(|e| panic!("cannot start PgBouncer: {e}"));
        PgBouncer {
            process,
            server_port,
            mode,
            settings: settings.to_owned(),
        }
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// The pool mode it runs in now.
    pub fn mode(&self) -> PoolMode {
        self.mode
    }

    /// A libpq connection string of the `postgres` database through this PgBouncer.
    pub fn connection_string(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            self.port()
        )
    }

    /// Provider options for this PgBouncer with the given check interval.
    pub fn options(&self, check_interval: Duration) -> PostgresOptions {
        PostgresOptions::new(self.connection_string()).with_check_interval(check_interval)
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
        let dir = self.process.dir();
        let config = ini(dir, self.port(), self.server_port, mode) + &self.settings;
        fs::write(dir.join("pgbouncer.ini"), config).expect("write pgbouncer.ini");
        let admin = format!(
            "host=127.0.0.1 port={} user=postgres dbname=pgbouncer sslmode=disable",
            self.port()
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
        self.process.log()
    }

    /// A PgBouncer in `mode` with `settings` in front of the server on `server_port`, ready
    /// once it accepts connections. As root it runs as the server's owner, who owns its
    /// configuration too.
    async fn launch(server_port: u16, mode: PoolMode, settings: &str) -> io::Result<ServerProcess> {
        let binary = find_binary()?;
        let owner = server_owner()?;
        let scratch = ScratchDir::new(ROOT)?;
        // PgBouncer checks only that the user is listed, under `auth_type = trust`.
        fs::write(scratch.path().join("users.txt"), "\"postgres\" \"\"\n")?;
        let ready = Readiness::when(Duration::from_secs(10), |launch| {
            TcpStream::connect((Ipv4Addr::LOCALHOST, launch.port())).is_ok()
        });
        let command = |ports: &[u16], dir: &Path| {
            let config = dir.join("pgbouncer.ini");
            fs::write(&config, ini(dir, ports[0], server_port, mode) + settings)?;
            if let Some((uid, gid)) = owner {
                for file in ["", "users.txt", "pgbouncer.ini"] {
                    std::os::unix::fs::chown(dir.join(file), Some(uid), Some(gid))?;
                }
            }
            Ok(ServerCommand::new(&binary)
                .arg(config)
                .current_dir("/tmp")
                .run_as(owner))
        };
        ServerProcess::start("pgbouncer", scratch, Ports::new(1), ready, command).await
    }
}

/// The configuration of a PgBouncer in `dir` on `port` in front of the server on
/// `server_port`. It logs to standard error only, which the process's log takes.
fn ini(dir: &Path, port: u16, server_port: u16, mode: PoolMode) -> String {
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
