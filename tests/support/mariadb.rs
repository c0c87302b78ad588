//! A throwaway MariaDB server, started from its binaries (`mariadb-install-db`, `mariadbd`) on
//! a free loopback port and removed on drop, and [`CliSession`]: a `mariadb` command-line
//! client kept open, as another program that takes named locks with plain SQL would be.
//!
//! `scripts/setup-mariadb.sh` installs the binaries on a fresh Debian machine. One
//! `mariadb-install-db` per machine makes a template data directory (shared by every test
//! process under a file lock) that already holds the database [`DATABASE`] and the account
//! [`APP_USER`]; each server copies it, so a start is a copy and a server's own startup. As
//! root, the server runs as the `mysql` user (switched to before `mariadbd` runs), because
//! `mariadbd` refuses to run as root unless told to switch users itself.
//!
//! A server listens on TCP on `127.0.0.1` only, and on a unix socket in its scratch directory,
//! where `root` logs in without a password (the fixture's own administration: [`sql`]). It
//! keeps the durable defaults (every commit flushed), has no binary log, and turns on the
//! performance schema with the metadata-lock instrument, so tests can read who holds a named
//! lock from `performance_schema.metadata_locks`. Servers die with the thread that started
//! them, so a test killed by a timeout leaves none behind.
//!
//! Set `LOCKINGKIT_TEST_MYSQL_URL` (`mysql://user:password@host:port/database`) to run against
//! a server that is already running instead; every statement then runs as that URL's user, and
//! process control (kill, pause, restart) and the error log are refused. Tests use unique lock
//! names, so they do not meet on a shared server.
//!
//! [`sql`]: MariaDbServer::sql

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use crate::server::{Launch, Ports, Readiness, ScratchDir, ServerCommand, ServerProcess};

/// The environment variable naming an external server, as a `mysql://` URL.
pub const EXTERNAL_ENV: &str = "LOCKINGKIT_TEST_MYSQL_URL";
/// The database the application account may use, on a local server.
pub const DATABASE: &str = "lockingkit";
/// The application account on a local server (`'lockingkit'@'127.0.0.1'`): everything on
/// [`DATABASE`], reading the process list and the performance schema, killing connections.
pub const APP_USER: &str = "lockingkit";
/// The application account's password on a local server.
pub const APP_PASSWORD: &str = "lockingkit-test";

/// Bumped whenever the template's setup changes, so stale templates are rebuilt.
const TEMPLATE_REVISION: u32 = 1;
/// How long a start may take: a start after a kill recovers InnoDB from its redo log first.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a graceful shutdown may take before the server is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a [`CliSession`] waits for the answer to one statement.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// The line a [`CliSession`] asks for after each statement, to know its answer is complete.
const DONE_MARKER: &str = "--done--";
/// In a server's scratch directory: its data directory, unix socket and error log.
const DATA_DIR: &str = "data";
const SOCKET: &str = "mariadbd.sock";
const ERROR_LOG: &str = "error.log";
/// The redo log's size, in the template and on every server: the default (96 MiB) would make
/// every copy of the template four times larger and slower.
const REDO_LOG_SIZE: &str = "--innodb-log-file-size=8M";
/// The buffer pool's size: six servers at a time share the machine with the build.
const BUFFER_POOL_SIZE: &str = "--innodb-buffer-pool-size=32M";

/// What the template runs once, after `mariadb-install-db`'s own setup.
const TEMPLATE_SQL: &str = "
-- Bootstrap runs without the grant tables; loading them makes the account statements work.
FLUSH PRIVILEGES;
-- root only on the socket. The accounts for the machine's host name are ignored under
-- --skip-name-resolve, with a warning at every start.
DELETE FROM mysql.global_priv WHERE User = 'root' AND Host <> 'localhost';
DELETE FROM mysql.proxies_priv WHERE Host <> 'localhost';
FLUSH PRIVILEGES;
CREATE DATABASE lockingkit;
CREATE USER 'lockingkit'@'127.0.0.1' IDENTIFIED BY 'lockingkit-test';
GRANT ALL ON lockingkit.* TO 'lockingkit'@'127.0.0.1';
GRANT PROCESS, CONNECTION ADMIN ON *.* TO 'lockingkit'@'127.0.0.1';
GRANT SELECT ON performance_schema.* TO 'lockingkit'@'127.0.0.1';
";

/// A running MariaDB server (local or external); a local one is killed and deleted on drop.
pub struct MariaDbServer {
    local: Option<LocalServer>,
    endpoint: Endpoint,
    /// The URL as given, for an external server.
    external_url: Option<String>,
}

struct LocalServer {
    /// `mariadbd`; its scratch directory holds the data directory, socket and error log.
    process: ServerProcess,
    /// The `mariadb` client.
    client: PathBuf,
}

/// Where the application account connects, and as whom.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Endpoint {
    host: String,
    port: u16,
    user: String,
    password: String,
    database: String,
}

impl MariaDbServer {
    /// The external server named by [`EXTERNAL_ENV`], or a new local one.
    pub async fn start() -> MariaDbServer {
        match std::env::var(EXTERNAL_ENV) {
            Ok(url) if !url.trim().is_empty() => MariaDbServer {
                local: None,
                endpoint: Endpoint::parse(url.trim())
                    .unwrap_or_else(|e| panic!("{EXTERNAL_ENV} is no mysql:// URL: {e}")),
                external_url: Some(url.trim().to_owned()),
            },
            _ => Self::start_local().await,
        }
    }

    /// A new local server, whatever the environment says (for tests that kill, pause or
    /// restart it, or read its error log).
    pub async fn start_local() -> MariaDbServer {
        let local = LocalServer::start()
            .await
            .unwrap_or_else(|e| panic!("cannot start MariaDB: {e}"));
        MariaDbServer {
            endpoint: Endpoint {
                host: "127.0.0.1".to_owned(),
                port: local.process.port(),
                user: APP_USER.to_owned(),
                password: APP_PASSWORD.to_owned(),
                database: DATABASE.to_owned(),
            },
            local: Some(local),
            external_url: None,
        }
    }

    /// Whether this is an external server (no process control, no error log).
    pub fn is_external(&self) -> bool {
        self.local.is_none()
    }

    /// The application account's URL:
    /// `mysql://lockingkit:lockingkit-test@127.0.0.1:PORT/lockingkit` on a local server.
    pub fn url(&self) -> String {
        match &self.external_url {
            Some(url) => url.clone(),
            None => self.endpoint.url(&self.endpoint.password),
        }
    }

    /// [`url`](Self::url) with `password` in place of the account's own (for tests of a
    /// refused login).
    pub fn url_with_password(&self, password: &str) -> String {
        self.endpoint.url(password)
    }

    /// The server's TCP port (a local server's loopback port keeps it across restarts).
    pub fn port(&self) -> u16 {
        self.endpoint.port
    }

    /// The server's process id, while a local server runs.
    pub fn pid(&self) -> Option<u32> {
        self.local().process.pid()
    }

    /// Runs `statement` (one or more statements, `;`-separated) through the `mariadb` client
    /// in batch mode without column names: as `root` over the unix socket on a local server,
    /// as the URL's user over TCP on an external one. Returns standard output trimmed (one
    /// line per row, tab-separated columns), or standard error when the client fails.
    pub fn sql(&self, statement: &str) -> Result<String, String> {
        match &self.local {
            Some(local) => run_client(local.root_client(), statement),
            None => self.sql_as_app(statement),
        }
    }

    /// Runs `statement` like [`sql`](Self::sql), as the application account over TCP to
    /// `127.0.0.1`, as the library connects.
    pub fn sql_as_app(&self, statement: &str) -> Result<String, String> {
        run_client(self.app_client(), statement)
    }

    /// A `mariadb` client kept open as the application account over TCP: one session whose
    /// named locks last until it is dropped.
    pub fn session(&self) -> CliSession {
        let mut client = self.app_client();
        // Errors are answers too (stderr joins stdout), and the session goes on after one.
        client.args(["--force", "--unbuffered"]);
        CliSession::open(client)
    }

    /// Ends the connection `id` (`KILL id`, as root on a local server): its session's named
    /// locks are freed and the client sees its connection closed.
    pub fn kill_connection(&self, id: u64) -> Result<(), String> {
        self.sql(&format!("KILL {id}")).map(|_| ())
    }

    /// Everything a local server has written to its error log (`--log-error`), over every run.
    pub fn error_log(&self) -> String {
        let path = self.local().process.dir().join(ERROR_LOG);
        fs::read_to_string(path).unwrap_or_default()
    }

    /// The lines of the error log at level `[ERROR]`.
    pub fn error_lines(&self) -> Vec<String> {
        self.error_log()
            .lines()
            .filter(|line| line.contains("[ERROR]"))
            .map(str::to_owned)
            .collect()
    }

    /// Fails the test if the server logged an error: what LockingKit sends in normal operation
    /// must not make the server complain.
    #[track_caller]
    pub fn assert_no_errors_logged(&self) {
        let errors = self.error_lines();
        assert!(
            errors.is_empty(),
            "MariaDB logged {} error lines:\n{}",
            errors.len(),
            errors.join("\n")
        );
    }

    /// Kills the server (SIGKILL): a crash. [`start_again`](Self::start_again) recovers every
    /// committed transaction from the redo log.
    pub fn kill(&mut self) {
        self.local_mut().process.kill();
    }

    /// Freezes the server (SIGSTOP): connections stay open, the kernel still acknowledges
    /// packets, and no statement ever answers.
    pub fn pause(&mut self) {
        self.local_mut().process.pause();
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&mut self) {
        self.local_mut().process.resume();
    }

    /// Stops the server gracefully (SIGTERM: every connection is closed, the data flushed),
    /// killing it if it still runs after thirty seconds.
    pub fn stop(&mut self) {
        self.local_mut().process.stop(STOP_TIMEOUT);
    }

    /// Starts a stopped or killed server again on the same port, with its data.
    pub async fn start_again(&mut self) {
        self.local_mut().process.start_again().await;
    }

    /// Stops the server gracefully and starts it again on the same port, with its data.
    pub async fn restart(&mut self) {
        self.stop();
        self.start_again().await;
    }

    /// The `mariadb` client as the application account over TCP, in batch mode.
    fn app_client(&self) -> Command {
        let client = self
            .local
            .as_ref()
            .map_or_else(|| PathBuf::from("mariadb"), |local| local.client.clone());
        let endpoint = &self.endpoint;
        let mut command = client_command(&client);
        command
            .args(["--protocol=tcp", "-h", &endpoint.host, "-P"])
            .arg(endpoint.port.to_string())
            .arg(format!("--user={}", endpoint.user))
            .arg(format!("--password={}", endpoint.password))
            .arg(format!("--database={}", endpoint.database));
        command
    }

    fn local(&self) -> &LocalServer {
        self.local.as_ref().unwrap_or_else(|| {
            panic!("an external server ({EXTERNAL_ENV}) cannot be controlled or inspected")
        })
    }

    fn local_mut(&mut self) -> &mut LocalServer {
        self.local.as_mut().unwrap_or_else(|| {
            panic!("an external server ({EXTERNAL_ENV}) cannot be controlled or inspected")
        })
    }
}

impl LocalServer {
    /// A copy of the template, started on a free port; ready once `root` can run a statement
    /// over the socket.
    async fn start() -> io::Result<LocalServer> {
        let DataCopy {
            binaries,
            owner,
            scratch,
        } = tokio::task::spawn_blocking(copy_template)
            .await
            .map_err(io::Error::other)??;
        let client = binaries.client.clone();
        let ready = Readiness::when(STARTUP_TIMEOUT, move |launch| answers(&client, launch));
        let command = |ports: &[u16], dir: &Path| {
            Ok(ServerCommand::new(&binaries.server)
                // The machine's /etc/mysql (socket, data directory, log) is not ours.
                .arg("--no-defaults")
                .arg(with_path("--datadir=", &dir.join(DATA_DIR)))
                .arg(with_path("--socket=", &dir.join(SOCKET)))
                .arg(with_path("--pid-file=", &dir.join("mariadbd.pid")))
                .arg(with_path("--log-error=", &dir.join(ERROR_LOG)))
                // Servers running side by side name their temporary files alike: each keeps
                // them in its own directory, so one never deletes another's.
                .arg(with_path("--tmpdir=", dir))
                .arg(format!("--port={}", ports[0]))
                .args(server_settings())
                // The server user may not be allowed into the caller's working directory.
                .current_dir("/tmp")
                .run_as(owner)
                // Started on the test's own thread (not the blocking pool).
                .dies_with_thread())
        };
        let process =
            ServerProcess::start("MariaDB", scratch, Ports::new(1), ready, command).await?;
        Ok(LocalServer {
            process,
            client: binaries.client,
        })
    }

    /// The `mariadb` client as `root` over the unix socket, in batch mode.
    fn root_client(&self) -> Command {
        root_client(&self.client, self.process.dir())
    }
}

/// The server's settings besides its paths and port.
fn server_settings() -> [&'static str; 10] {
    [
        "--bind-address=127.0.0.1",
        "--skip-name-resolve",
        "--skip-log-bin",
        "--max-connections=500",
        BUFFER_POOL_SIZE,
        REDO_LOG_SIZE,
        "--performance-schema=ON",
        "--performance-schema-instrument=wait/lock/metadata/sql/mdl=ON",
        // What Debian's packaged configuration sets; the compiled-in default is latin1.
        "--character-set-server=utf8mb4",
        "--collation-server=utf8mb4_general_ci",
    ]
}

/// Whether the server of `launch` runs a statement for `root` over its socket.
fn answers(client: &Path, launch: &Launch) -> bool {
    if !launch.dir().join(SOCKET).exists() {
        return false;
    }
    let mut command = root_client(client, launch.dir());
    command.arg("--connect-timeout=1");
    run_client(command, "SELECT 1").is_ok()
}

/// `option` followed by `path`, as one argument (`--datadir=/tmp/…`).
fn with_path(option: &str, path: &Path) -> std::ffi::OsString {
    let mut argument = std::ffi::OsString::from(option);
    argument.push(path);
    argument
}

/// The `mariadb` client, reading no option file, in batch mode without column names.
fn client_command(client: &Path) -> Command {
    let mut command = Command::new(client);
    command.args(["--no-defaults", "--batch", "--skip-column-names"]);
    // Statements are UTF-8 (Rust strings); without this the client takes its character set
    // from the locale, latin1 under C, and non-ASCII text would reach the server re-encoded.
    command.arg("--default-character-set=utf8mb4");
    // An error is its one `ERROR …` line, without the statement echoed around it.
    command.arg("--skip-print-query-on-error");
    command
}

/// The `mariadb` client as `root` over the socket in scratch directory `dir`.
fn root_client(client: &Path, dir: &Path) -> Command {
    let mut command = client_command(client);
    command
        .args(["--protocol=socket", "--user=root"])
        .arg(with_path("--socket=", &dir.join(SOCKET)));
    command
}

/// Runs `statement` with `command` (`-e`): standard output trimmed, or standard error.
fn run_client(mut command: Command, statement: &str) -> Result<String, String> {
    let output = command
        .arg("-e")
        .arg(statement)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            format!("cannot run the mariadb client ({e}); run scripts/setup-mariadb.sh")
        })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_owned())
    }
}

impl Endpoint {
    /// Parses `mysql://user:password@host:port/database` (the port defaults to 3306; user and
    /// password may be percent-encoded; a query string is ignored).
    fn parse(url: &str) -> Result<Endpoint, String> {
        let rest = url
            .strip_prefix("mysql://")
            .or_else(|| url.strip_prefix("mariadb://"))
            .ok_or("it does not start with mysql://")?;
        let rest = rest.split(['?', '#']).next().unwrap_or_default();
        let (authority, database) = rest.split_once('/').unwrap_or((rest, ""));
        let (credentials, address) = authority
            .rsplit_once('@')
            .ok_or("it names no user (user:password@)")?;
        let (user, password) = credentials.split_once(':').unwrap_or((credentials, ""));
        let (host, port) = match address.rsplit_once(':') {
            Some((host, port)) if !port.contains(']') => (
                host,
                port.parse().map_err(|_| format!("bad port {port:?}"))?,
            ),
            _ => (address, 3306),
        };
        Ok(Endpoint {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port,
            user: percent_decode(user)?,
            password: percent_decode(password)?,
            database: percent_decode(database)?,
        })
    }

    /// This endpoint's URL with `password`.
    fn url(&self, password: &str) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!(
            "mysql://{}:{}@{host}:{}/{}",
            percent_encode(&self.user),
            percent_encode(password),
            self.port,
            percent_encode(&self.database)
        )
    }
}

/// `text` with every byte but URL-unreserved ones percent-encoded.
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

/// `text` with its `%XX` escapes decoded.
fn percent_decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%' {
            let hex = text
                .get(at + 1..at + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| format!("bad percent escape in {text:?}"))?;
            decoded.push(hex);
            at += 3;
        } else {
            decoded.push(bytes[at]);
            at += 1;
        }
    }
    String::from_utf8(decoded).map_err(|_| format!("{text:?} decodes to no UTF-8"))
}

/// One `mariadb` client process kept open, as another program holding a session would be:
/// each statement runs in the same connection, so a named lock it takes (`GET_LOCK`) stays
/// held until it releases it or the session ends. Dropping it kills the client, which ends
/// the session and frees its locks.
///
/// The client runs in batch mode without column names: an answer is one line per row,
/// tab-separated columns; an error is the client's `ERROR …` line, and the session goes on.
pub struct CliSession {
    child: Child,
    stdin: ChildStdin,
    /// The client's output lines (standard output and error), read on a thread of their own.
    lines: Receiver<String>,
}

impl CliSession {
    /// Starts `client` with its standard input and output piped, its errors joined to them.
    fn open(mut client: Command) -> CliSession {
        let (reader, writer) = io::pipe().expect("a pipe for the mariadb client");
        client
            .stdin(Stdio::piped())
            .stdout(writer.try_clone().expect("a pipe for the mariadb client"))
            .stderr(writer);
        let mut child = client.spawn().unwrap_or_else(|e| {
            panic!("cannot run the mariadb client ({e}); run scripts/setup-mariadb.sh")
        });
        // The command holds the pipe's write end: without closing it, the reader never sees
        // the end of the output when the client exits.
        drop(client);
        let stdin = child.stdin.take().expect("the client's piped stdin");
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        CliSession {
            child,
            stdin,
            lines,
        }
    }

    /// Runs `sql` (one statement or several, the last `;` optional) and returns its answer:
    /// every line the client printed for it, errors included.
    pub fn run(&mut self, sql: &str) -> Vec<String> {
        self.send(sql);
        self.answer()
    }

    /// Sends `sql` without waiting for its answer (a `GET_LOCK` that waits, say); read the
    /// answer later with [`answer`](Self::answer).
    pub fn send(&mut self, sql: &str) {
        let sql = sql.trim();
        let terminator = if sql.ends_with(';') { "" } else { ";" };
        let written = writeln!(self.stdin, "{sql}{terminator}\nSELECT '{DONE_MARKER}';")
            .and_then(|()| self.stdin.flush());
        if let Err(error) = written {
            panic!("the mariadb client took no statement ({error}); has it exited?");
        }
    }

    /// The answer to the oldest statement sent and not yet answered; panics if none comes
    /// within a minute or the client exits.
    pub fn answer(&mut self) -> Vec<String> {
        let give_up = Instant::now() + ANSWER_TIMEOUT;
        let mut answer = Vec::new();
        loop {
            let left = give_up.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line == DONE_MARKER => return answer,
                Ok(line) => answer.push(line),
                Err(RecvTimeoutError::Timeout) => {
                    panic!("the mariadb client gave no answer within {ANSWER_TIMEOUT:?}; so far: {answer:?}")
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the mariadb client exited; its last lines: {answer:?}")
                }
            }
        }
    }

    /// The session's connection id (`CONNECTION_ID()`), as `performance_schema` and
    /// `IS_USED_LOCK` name it and [`MariaDbServer::kill_connection`] takes it.
    pub fn connection_id(&mut self) -> u64 {
        let answer = self.run("SELECT CONNECTION_ID()");
        answer
            .first()
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("CONNECTION_ID() answered {answer:?}"))
    }
}

impl Drop for CliSession {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the binaries are.
struct Binaries {
    server: PathBuf,
    install_db: PathBuf,
    client: PathBuf,
}

/// A new scratch directory holding a copy of the template, and what runs a server on it.
struct DataCopy {
    binaries: Binaries,
    owner: Option<(u32, u32)>,
    scratch: ScratchDir,
}

/// Finds the binaries, makes the template if it is missing, and copies it into a new scratch
/// directory (which the server's user owns, for its socket and error log).
fn copy_template() -> io::Result<DataCopy> {
    let binaries = Binaries {
        server: find_program("mariadbd")?,
        install_db: find_program("mariadb-install-db")?,
        client: find_program("mariadb")?,
    };
    let owner = server_owner()?;
    let root = PathBuf::from("/tmp/lockingkit-mariadb");
    fs::create_dir_all(&root)?;
    let template = ensure_template(&binaries, &root, owner)?;
    let scratch = ScratchDir::new(&root)?;
    checked(
        Command::new("cp")
            .arg("-a")
            .arg(&template)
            .arg(scratch.path().join(DATA_DIR)),
    )?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(scratch.path(), Some(uid), Some(gid))?;
    }
    Ok(DataCopy {
        binaries,
        owner,
        scratch,
    })
}

/// `name` on `PATH`, or in the directories Debian puts it in (`mariadbd` is in `/usr/sbin`,
/// which is not on a regular user's `PATH`).
fn find_program(name: &str) -> io::Result<PathBuf> {
    let path: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    path.into_iter()
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{name} not found on PATH or in /usr/sbin; run scripts/setup-mariadb.sh"),
            )
        })
}

/// The uid and gid to run the server as: `mysql` when we are root, ourselves otherwise.
fn server_owner() -> io::Result<Option<(u32, u32)>> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd")?;
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&"mysql") && f.len() > 3)
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .map(Some)
        .ok_or_else(|| {
            io::Error::other("running as root needs a `mysql` user; run scripts/setup-mariadb.sh")
        })
}

/// The template data directory for this server binary, made once per machine under a file
/// lock so that test processes starting together do not race. The binary's modification time
/// is in its name: a package upgrade gets a template of its own version.
fn ensure_template(
    binaries: &Binaries,
    root: &Path,
    owner: Option<(u32, u32)>,
) -> io::Result<PathBuf> {
    let modified = fs::metadata(&binaries.server)?
        .modified()?
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |age| age.as_secs());
    let tag: String = format!("{}_{modified}", binaries.server.display())
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let template = root.join(format!("template{tag}"));
    let ready = root.join(format!("template{tag}.ready{TEMPLATE_REVISION}"));
    let lock = File::create(root.join(format!("template{tag}.lock")))?;
    lock.lock()?;
    if ready.exists() && template.join("mysql").is_dir() {
        return Ok(template);
    }
    let _ = fs::remove_dir_all(&template);
    fs::create_dir_all(&template)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(&template, Some(uid), Some(gid))?;
    }
    let setup = root.join(format!("template{tag}.sql"));
    fs::write(&setup, TEMPLATE_SQL)?;
    let mut install = Command::new(&binaries.install_db);
    install
        .arg("--no-defaults")
        .arg(with_path("--datadir=", &template))
        .arg(with_path("--extra-file=", &setup))
        .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
        .args(["--skip-name-resolve", REDO_LOG_SIZE, BUFFER_POOL_SIZE])
        // The server user may not be allowed into the caller's working directory.
        .current_dir("/tmp");
    if let Some((uid, gid)) = owner {
        // std drops supplementary groups when root switches uid.
        install.uid(uid).gid(gid);
    }
    checked(&mut install)?;
    File::create(&ready)?;
    Ok(template)
}

fn checked(command: &mut Command) -> io::Result<()> {
    let output = command.stdin(Stdio::null()).output()?;
    if output.status.success() {
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_parses_into_its_parts_and_back() {
        let endpoint =
            Endpoint::parse("mysql://app:p%40ss@db.example:3307/locks?ssl-mode=REQUIRED")
                .expect("a valid URL");
        assert_eq!(
            endpoint,
            Endpoint {
                host: "db.example".into(),
                port: 3307,
                user: "app".into(),
                password: "p@ss".into(),
                database: "locks".into(),
            }
        );
        assert_eq!(
            endpoint.url("x y"),
            "mysql://app:x%20y@db.example:3307/locks"
        );
    }

    #[test]
    fn a_url_without_a_port_names_3306() {
        let endpoint = Endpoint::parse("mysql://app@[::1]/locks").expect("a valid URL");
        assert_eq!((endpoint.host.as_str(), endpoint.port), ("::1", 3306));
        assert_eq!(endpoint.url(""), "mysql://app:@[::1]:3306/locks");
    }
}
