//! One server process a fixture runs, written once: the command it was started with, its
//! ports, its log, its scratch directory, and the faults the chaos suites inject (SIGSTOP,
//! SIGKILL, a stop, a start again on the same ports).
//!
//! What differs between servers stays with their fixture: the command line, and how to ask a
//! just-started server whether it serves yet ([`Readiness`]).
//!
//! Nothing outlives a test that ends normally or panics: dropping a [`ServerProcess`] kills and
//! reaps its process and removes its directory. A test process killed outright (a nextest
//! timeout) never drops anything, so every [`ServerProcess`] records its pid in its
//! [`ScratchDir`], and the next scratch directory made under the same root kills that server
//! and removes the directory.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::os::{alive, children_of, free_port_with_partner, listens_on, signal, start_time};

/// How many sets of ports [`ServerProcess::start`] tries before it gives up: each failed try
/// is a port taken by another test process between the allocator's check and the server's bind.
const ATTEMPTS: usize = 10;
/// How long [`ServerProcess::start_again`] keeps trying: a port can stay taken for a moment
/// after its process died.
const RELAUNCH_FOR: Duration = Duration::from_secs(5);
/// Where a scratch directory records the pid and start time of its server's process.
const PID_FILE: &str = "server.pid";
/// The file a server's standard output and error go to, in its scratch directory.
const LOG_FILE: &str = "server.log";

/// The command line a server runs, kept so that it runs again exactly as it first did.
#[derive(Clone, Debug, Default)]
pub struct ServerCommand {
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    current_dir: Option<PathBuf>,
    owner: Option<(u32, u32)>,
    dies_with_thread: bool,
}

impl ServerCommand {
    /// Runs `program` (looked up on `PATH` unless it is a path).
    pub fn new(program: impl Into<PathBuf>) -> ServerCommand {
        ServerCommand {
            program: program.into(),
            ..ServerCommand::default()
        }
    }

    /// Adds one argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> ServerCommand {
        self.args.push(arg.into());
        self
    }

    /// Adds arguments.
    pub fn args<S: Into<OsString>>(mut self, args: impl IntoIterator<Item = S>) -> ServerCommand {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable for the server (on top of the test process's own).
    pub fn env(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> ServerCommand {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Runs the server in `dir`.
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> ServerCommand {
        self.current_dir = Some(dir.into());
        self
    }

    /// Runs the server as `(uid, gid)` when given (servers that refuse to run as root).
    pub fn run_as(mut self, owner: Option<(u32, u32)>) -> ServerCommand {
        self.owner = owner;
        self
    }

    /// Kills the server when the thread that started it exits (`PR_SET_PDEATHSIG`), so a test
    /// killed outright leaves no server behind. Only for a server started on a thread that
    /// lives as long as the test (a runtime worker), never on the blocking pool, whose idle
    /// threads exit after seconds.
    pub fn dies_with_thread(mut self) -> ServerCommand {
        self.dies_with_thread = true;
        self
    }

    /// Starts the process, its standard output and error appended to `log`.
    fn spawn(&self, log: &Path) -> io::Result<Child> {
        let log = OpenOptions::new().create(true).append(true).open(log)?;
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(name, value)| (name, value)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(dir) = &self.current_dir {
            command.current_dir(dir);
        }
        if let Some((uid, gid)) = self.owner {
            // std drops supplementary groups when root switches uid.
            command.uid(uid).gid(gid);
        }
        if self.dies_with_thread {
            // SAFETY: prctl is async-signal-safe and touches no memory of ours.
            unsafe {
                command.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        command.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot run {} ({e}); run its scripts/setup-*.sh",
                    self.program.display()
                ),
            )
        })
    }
}

/// How many loopback ports a server binds, from the allocator in `os.rs`.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    count: usize,
    partner_offset: u16,
}

impl Ports {
    /// `count` ports.
    pub const fn new(count: usize) -> Ports {
        Ports {
            count,
            partner_offset: 0,
        }
    }

    /// Each port with a partner `offset` above it that must be free too (a Redis Cluster
    /// node's bus port is its port + 10 000).
    pub const fn with_partners(self, offset: u16) -> Ports {
        Ports {
            partner_offset: offset,
            ..self
        }
    }

    /// Free ports, none handed out before in this process.
    pub fn allocate(self) -> io::Result<Vec<u16>> {
        (0..self.count)
            .map(|_| free_port_with_partner(self.partner_offset))
            .collect()
    }
}

/// One run of a server's process, as a readiness check sees it.
#[derive(Clone, Debug)]
pub struct Launch {
    pid: u32,
    port: u16,
    dir: PathBuf,
    log_start: u64,
}

impl Launch {
    /// The process id of this run.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The first port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's scratch directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What this run has logged so far (not what runs before it logged).
    pub fn log(&self) -> String {
        read_from(&self.dir.join(LOG_FILE), self.log_start)
    }
}

type ReadinessCheck = Arc<dyn Fn(&Launch) -> bool + Send + Sync>;

/// How a fixture asks its just-started server whether it serves yet, and how long it waits
/// for a yes. The check runs on the blocking pool, so it may block briefly (a connect, a read).
#[derive(Clone)]
pub struct Readiness {
    check: Option<ReadinessCheck>,
    within: Duration,
}

impl Readiness {
    /// Ready once `check` says so, within `within` of the start.
    pub fn when(
        within: Duration,
        check: impl Fn(&Launch) -> bool + Send + Sync + 'static,
    ) -> Readiness {
        Readiness {
            check: Some(Arc::new(check)),
            within,
        }
    }

    /// Not waited for here: the fixture waits itself (etcd members answer only once a quorum
    /// of them runs, so no member alone can be waited for).
    fn left_to_fixture() -> Readiness {
        Readiness {
            check: None,
            within: Duration::ZERO,
        }
    }
}

/// A directory of one fixture's own, `{root}/{test process id}-{n}`, removed on drop. It holds
/// the server's log and pid file, and whatever else the fixture puts there (data, configuration,
/// certificates).
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// A new empty directory under `root`. Directories under `root` of test processes that no
    /// longer run are removed first, and the servers they recorded killed.
    pub fn new(root: impl AsRef<Path>) -> io::Result<ScratchDir> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let root = root.as_ref();
        remove_abandoned(root);
        let path = root.join(format!(
            "{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path)?;
        Ok(ScratchDir { path })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// A server process a fixture started: killed, reaped and its directory removed on drop.
///
/// At most one process runs at a time. [`pid`](Self::pid) is `Some` from a start until
/// [`kill`](Self::kill) or [`stop`](Self::stop) (a process that exits by itself keeps its pid
/// here until then, [`has_exited`](Self::has_exited) tells, unless a start saw it exit). A paused process is continued
/// before it is signalled to stop, so a test that pauses and then fails still cleans up.
pub struct ServerProcess {
    name: &'static str,
    command: ServerCommand,
    readiness: Readiness,
    ports: Vec<u16>,
    child: Option<Child>,
    paused: bool,
    /// The log's length when the running process started.
    log_start: u64,
    scratch: ScratchDir,
}

impl ServerProcess {
    /// Starts the server `name` on new `ports` in `scratch` and waits until `readiness` says it
    /// serves. `command` builds its command line for a set of ports and the scratch directory
    /// (and may write configuration there); when the server exits or never gets ready (it lost
    /// a port to another test process), it starts again on other ports, up to ten times.
    pub async fn start(
        name: &'static str,
        scratch: ScratchDir,
        ports: Ports,
        readiness: Readiness,
        mut command: impl FnMut(&[u16], &Path) -> io::Result<ServerCommand>,
    ) -> io::Result<ServerProcess> {
        let mut server = ServerProcess::new(name, scratch, readiness);
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            server.ports = ports.allocate()?;
            server.command = command(&server.ports, server.dir())?;
            // A program that cannot run fails the same on every port.
            server.spawn()?;
            match server.until_ready().await {
                Ok(()) => return Ok(server),
                Err(error) => last = error.to_string(),
            }
        }
        Err(io::Error::other(format!(
            "{name} did not start in {ATTEMPTS} tries: {last}"
        )))
    }

    /// Starts the server `name` on the `ports` its `command` names, without waiting (for
    /// servers that come up together, like an etcd cluster's members).
    pub fn spawn_on(
        name: &'static str,
        scratch: ScratchDir,
        ports: Vec<u16>,
        command: ServerCommand,
    ) -> io::Result<ServerProcess> {
        let mut server = ServerProcess::new(name, scratch, Readiness::left_to_fixture());
        server.ports = ports;
        server.command = command;
        server.spawn()?;
        Ok(server)
    }

    fn new(name: &'static str, scratch: ScratchDir, readiness: Readiness) -> ServerProcess {
        ServerProcess {
            name,
            command: ServerCommand::default(),
            readiness,
            ports: Vec::new(),
            child: None,
            paused: false,
            log_start: 0,
            scratch,
        }
    }

    /// Starts the server again with the command and ports it had (after a kill or stop; one
    /// still running is killed first) and waits until it is ready. Keeps trying for five
    /// seconds, then panics with the last failure.
    pub async fn start_again(&mut self) {
        let give_up = Instant::now() + RELAUNCH_FOR;
        loop {
            let launched = match self.spawn() {
                Ok(()) => self.until_ready().await,
                Err(error) => Err(error),
            };
            match launched {
                Ok(()) => return,
                Err(error) if Instant::now() > give_up => {
                    panic!("{} did not start again on its port: {error}", self.name)
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    fn spawn(&mut self) -> io::Result<()> {
        self.kill();
        let log = self.dir().join(LOG_FILE);
        self.log_start = fs::metadata(&log).map_or(0, |m| m.len());
        let child = self.command.spawn(&log)?;
        let started = start_time(child.id()).unwrap_or_default();
        // For `remove_abandoned`, should this test process die without dropping the server.
        let recorded = fs::write(
            self.dir().join(PID_FILE),
            format!("{} {started}", child.id()),
        );
        self.child = Some(child);
        self.paused = false;
        recorded
    }

    /// Waits until the readiness check says yes; an error (the process killed) if it exits
    /// first or takes too long.
    async fn until_ready(&mut self) -> io::Result<()> {
        let Some(check) = self.readiness.check.clone() else {
            return Ok(());
        };
        let give_up = Instant::now() + self.readiness.within;
        loop {
            if let Some(status) = self.try_wait() {
                // Reaped: the pid may name another process from here on.
                self.child = None;
                return Err(io::Error::other(format!(
                    "{} exited ({status}); log:\n{}",
                    self.name,
                    self.log_since_start()
                )));
            }
            let launch = self.launch()?;
            let (pid, port) = (launch.pid(), launch.port());
            let check = check.clone();
            let ready = tokio::task::spawn_blocking(move || check(&launch)).await;
            if ready.unwrap_or(false) && self.try_wait().is_none() {
                if listens_on(pid, port) == Some(false) {
                    // Another test process's server answered on the port ours lost to it.
                    self.kill();
                    return Err(io::Error::other(format!(
                        "{} lost port {port} to another process",
                        self.name
                    )));
                }
                return Ok(());
            }
            if Instant::now() > give_up {
                let log = self.log_since_start();
                self.kill();
                return Err(io::Error::other(format!(
                    "{} was not ready within {:?}; log:\n{log}",
                    self.name, self.readiness.within
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The running process's exit status, once it has exited by itself (the pid stays).
    fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// The running process as a readiness check sees it.
    fn launch(&self) -> io::Result<Launch> {
        let pid = self
            .pid()
            .ok_or_else(|| io::Error::other(format!("{} is not running", self.name)))?;
        Ok(Launch {
            pid,
            port: self.port(),
            dir: self.dir().to_path_buf(),
            log_start: self.log_start,
        })
    }

    /// The process id, from a start until a kill or stop.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process started last has exited by itself (false when none was started or
    /// it was killed or stopped since).
    pub fn has_exited(&self) -> bool {
        self.pid().is_some_and(|pid| !alive(pid))
    }

    /// Whether [`pause`](Self::pause) froze the process and nothing thawed it since.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// The first port.
    pub fn port(&self) -> u16 {
        self.ports[0]
    }

    /// Every port, in the order they were asked for.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// The scratch directory.
    pub fn dir(&self) -> &Path {
        self.scratch.path()
    }

    /// Everything the server has written to its standard output and error, over every run.
    pub fn log(&self) -> String {
        read_from(&self.dir().join(LOG_FILE), 0)
    }

    /// What the server has written since it was last started.
    pub fn log_since_start(&self) -> String {
        read_from(&self.dir().join(LOG_FILE), self.log_start)
    }

    /// Sends `signal` to the process, if one runs.
    pub fn signal(&self, signal_number: libc::c_int) {
        if let Some(pid) = self.pid() {
            signal(pid, signal_number);
        }
    }

    /// Freezes the process (SIGSTOP): its connections stay open and nothing answers.
    pub fn pause(&mut self) {
        if self.pid().is_some() {
            self.signal(libc::SIGSTOP);
            self.paused = true;
        }
    }

    /// Thaws a paused process (SIGCONT).
    pub fn resume(&mut self) {
        if self.paused {
            self.signal(libc::SIGCONT);
            self.paused = false;
        }
    }

    /// Kills the process (SIGKILL), a crash, and reaps it: gone when this returns.
    pub fn kill(&mut self) {
        self.resume();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the process with SIGTERM, or SIGKILL if it still runs after `bound`.
    pub fn stop(&mut self, bound: Duration) {
        self.stop_with(libc::SIGTERM, bound);
    }

    /// Stops the process with `signal_number` (a server's own shutdown signal: PostgreSQL's
    /// immediate mode is SIGQUIT), or SIGKILL if it still runs after `bound`.
    pub fn stop_with(&mut self, signal_number: libc::c_int, bound: Duration) {
        // A stopped process acts on no signal but SIGKILL until it is continued.
        self.signal(libc::SIGCONT);
        self.paused = false;
        self.signal(signal_number);
        let give_up = Instant::now() + bound;
        while Instant::now() < give_up {
            if self.child.is_none() || self.try_wait().is_some() {
                self.child = None;
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The file at `path` from byte `start` on (empty if it cannot be read).
fn read_from(path: &Path, start: u64) -> String {
    let mut bytes = Vec::new();
    let read = File::open(path).and_then(|mut file| {
        file.seek(SeekFrom::Start(start))?;
        file.read_to_end(&mut bytes)
    });
    match read {
        Ok(_) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::new(),
    }
}

/// Removes the directories (`{pid}-{n}`) under `root` of test processes that no longer run,
/// killing the server each recorded (and that server's children) if it still runs: a test
/// process killed outright never dropped them.
fn remove_abandoned(root: &Path) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let owner = entry
            .file_name()
            .to_str()
            .and_then(|name| name.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok());
        let Some(owner) = owner else {
            continue;
        };
        if owner == std::process::id() || alive(owner) {
            continue;
        }
        kill_recorded_server(&entry.path());
        let _ = fs::remove_dir_all(entry.path());
    }
}

/// Kills the process recorded in `dir`'s pid file and its children, if that pid still names
/// the same process (its start time says so: pids are reused).
fn kill_recorded_server(dir: &Path) {
    let recorded = fs::read_to_string(dir.join(PID_FILE)).unwrap_or_default();
    let mut fields = recorded.split_whitespace().map(str::parse::<u64>);
    let (Some(Ok(pid)), Some(Ok(started))) = (fields.next(), fields.next()) else {
        return;
    };
    let Ok(pid) = u32::try_from(pid) else {
        return;
    };
    if start_time(pid) != Some(started) {
        return;
    }
    // The children are found before their parent dies and they are handed to init.
    for process in std::iter::once(pid).chain(children_of(pid)) {
        signal(process, libc::SIGCONT);
        signal(process, libc::SIGKILL);
    }
}
