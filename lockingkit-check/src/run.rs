//! One run: servers, register, clients, nemesis, progress lines, then the history and the
//! verdict.
//!
//! For the in-memory provider the clients are *simulated processes*: tasks of this process, each
//! with its own `DistributedLock` on one shared `MemoryStore`. For PostgreSQL and Redis they are
//! real OS processes: this binary started again in `client` mode, each behind its own
//! [`FaultProxy`] to the server, so a partition hits one client only.

use std::fmt::Write as _;
use std::fs::{self, File};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lockingkit::backend::BackendError;
use lockingkit::testing::Intercept;
use lockingkit::{MemoryBackend, MemoryStore};
use lockingkit_tests::proxy::{Fault, FaultProxy};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::checker::{self, Report, ViolationKind};
use crate::client::{self, Activity, ClientConfig, Holding, HoldingSlot, Journal, PauseGate};
use crate::error::CheckError;
use crate::history::{self, Event, FaultEvent, FaultKind, FaultPhase};
use crate::nemesis::{self, EndFuture, FaultLog, Fleet, StopFuture};
use crate::provider::LEASE;
use crate::provider::{backend_address, build, start_fixture, start_server, Provider, Server};
use crate::register::Register;

/// The ids of clock-rate faults start here, apart from the nemesis's numbering.
const CLOCK_FAULT_IDS: u64 = 1_000_000;

/// How long one hold in four keeps working: past the lease, so it is renewed under it.
pub const LONG_HOLD: Duration = Duration::from_millis(2_500);

/// What to run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The backend.
    pub provider: Provider,
    /// How long the clients run.
    pub duration: Duration,
    /// The seed of the fault schedule and of the clients' key choices.
    pub seed: u64,
    /// How many clients.
    pub clients: usize,
    /// How many keys they share.
    pub keys: usize,
    /// The clock rate of every client process, in percent of real time: 100 for a true clock.
    /// Client processes only.
    pub clock_rate_percent: u32,
}

/// Where Debian's libfaketime lives (`scripts/setup-faketime.sh` installs it).
fn libfaketime() -> Result<PathBuf, CheckError> {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ]
    .iter()
    .map(|dir| PathBuf::from(dir).join("faketime/libfaketime.so.1"))
    .find(|path| path.exists())
    .ok_or_else(|| {
        CheckError::Usage("a clock rate needs libfaketime: run scripts/setup-faketime.sh".into())
    })
}

/// The keys of a run.
pub fn keys(count: usize) -> Vec<String> {
    (0..count).map(|n| format!("check/{n}")).collect()
}

/// Runs one check and returns its report (printing the seed first, progress while it runs).
pub async fn run(config: &RunConfig) -> Result<Report, CheckError> {
    println!(
        "lockingkit-check: seed {} (replay: lockingkit-check run --provider {} --seconds {} --seed {} --clients {} --clock-rate {})",
        config.seed,
        config.provider.name(),
        config.duration.as_secs(),
        config.seed,
        config.clients,
        f64::from(config.clock_rate_percent) / 100.0
    );
    let dir = std::env::temp_dir().join("lockingkit-check").join(format!(
        "{}-{}-{}",
        config.provider.name(),
        config.seed,
        std::process::id()
    ));
    fs::create_dir_all(&dir)?;
    let register = Arc::new(Register::start().await?);
    let mut fleet = start_fleet(config, &register, &dir).await?;

    let plan = nemesis::schedule(
        config.seed,
        fleet.kinds(),
        config.clients,
        config.provider.lease(),
        config.duration,
    );
    let faults = FaultLog::default();
    let progress = tokio::spawn(progress(register.clone(), faults.clone()));
    let began = tokio::time::Instant::now();
    let view = register.clone();
    let mid_update = move || view.mid_update();
    let injected = nemesis::inject(&plan, fleet.as_mut(), &faults, &mid_update).await;
    tokio::time::sleep_until(began + config.duration).await;
    progress.abort();
    let client_events = fleet.stop().await;
    // Requests already on their way are answered before the final values are read.
    tokio::time::sleep(Duration::from_millis(200)).await;
    injected?;

    let mut events = client_events?;
    events.extend(faults.events());
    events.extend(register.history());
    let path = write_history(&dir, &events)?;
    drop(fleet);
    let report = checker::check_with(&events, config.provider.guarantees());
    println!("history: {}", path.display());
    println!("options: {}", config.provider.options());
    print!("{}", render(&report));
    checked_something(report)
}

/// The clients of `config`'s provider, with the server they lock on (none for memory).
async fn start_fleet(
    config: &RunConfig,
    register: &Register,
    dir: &std::path::Path,
) -> Result<Box<dyn Fleet + Send>, CheckError> {
    match start_server(config.provider).await? {
        Some(server) => Ok(Box::new(
            ProcessFleet::start(config, register.address(), server, dir).await?,
        )),
        None if config.clock_rate_percent != 100 => Err(CheckError::Usage(
            "a clock rate needs client processes; simulated clients share one clock".into(),
        )),
        None => Ok(Box::new(SimulatedFleet::start(config, register.address())?)),
    }
}

/// Writes the merged history as JSON lines into `dir`; returns the file's path.
fn write_history(
    dir: &std::path::Path,
    events: &[Event],
) -> Result<std::path::PathBuf, CheckError> {
    let mut text = String::new();
    for event in events {
        text.push_str(&history::to_line(event));
    }
    let path = dir.join("history.jsonl");
    fs::write(&path, text)?;
    Ok(path)
}

/// `report`, unless no write was acknowledged: a run that checked nothing is no pass.
fn checked_something(report: Report) -> Result<Report, CheckError> {
    let acknowledged = report
        .tally
        .ops
        .get(&("write".to_string(), "ok".to_string()))
        .copied()
        .unwrap_or(0);
    if acknowledged == 0 {
        return Err(CheckError::Server(
            "no write was acknowledged: nothing was checked".into(),
        ));
    }
    Ok(report)
}

async fn progress(register: Arc<Register>, faults: FaultLog) {
    let began = tokio::time::Instant::now();
    let mut last = 0usize;
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.tick().await;
    loop {
        tick.tick().await;
        let log = register.log();
        let refused = log.iter().filter(|e| !e.accepted).count();
        println!(
            "[{:>3}s] register requests {} ({}/s), refused {}, faults {}, anomalies {}",
            began.elapsed().as_secs(),
            log.len(),
            (log.len() - last) / 2,
            refused,
            faults.begun(),
            checker::check_register(&log),
        );
        last = log.len();
    }
}

/// How many violations the report details (the counts cover all).
const VIOLATIONS_SHOWN: usize = 10;

/// The report as the run prints it.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let t = &report.tally;
    let _ = writeln!(out, "== operations");
    let _ = writeln!(out, "{:<10} {:>8} {:>8} {:>8}", "op", "ok", "fail", "info");
    for op in ["acquire", "read", "write", "release"] {
        let n = |outcome: &str| {
            t.ops
                .get(&(op.to_string(), outcome.to_string()))
                .copied()
                .unwrap_or(0)
        };
        let _ = writeln!(
            out,
            "{op:<10} {:>8} {:>8} {:>8}",
            n("ok"),
            n("fail"),
            n("info")
        );
    }
    let _ = writeln!(
        out,
        "register: {} accepted, {} refused (stale token)",
        t.accepted, t.refused
    );
    render_faults(&mut out, t);
    let _ = writeln!(out, "== violations");
    let _ = writeln!(out, "{:<17} {:>5} {:>9}", "kind", "found", "expected");
    for kind in ViolationKind::ALL {
        let _ = writeln!(
            out,
            "{:<17} {:>5} {:>9}",
            kind.name(),
            report.count(kind),
            report.expected(kind)
        );
    }
    for (n, violation) in report.violations.iter().enumerate().take(VIOLATIONS_SHOWN) {
        let _ = writeln!(
            out,
            "-- #{} {} on {}: {}",
            n + 1,
            violation.kind.name(),
            violation.key,
            violation.detail
        );
        if let Some(reason) = &violation.expected {
            let _ = writeln!(out, "   expected: {reason}");
        }
        for op in &violation.ops {
            let _ = write!(out, "   op    {}", history::to_line(op));
        }
        for fault in &violation.faults {
            let _ = writeln!(
                out,
                "   fault {} on slot {} (process {:?}) at {}",
                fault.fault.name(),
                fault.slot,
                fault.process,
                fault.time
            );
        }
    }
    if report.violations.len() > VIOLATIONS_SHOWN {
        let _ = writeln!(
            out,
            "-- and {} more (all are in the counts above)",
            report.violations.len() - VIOLATIONS_SHOWN
        );
    }
    let verdict = if report.violations.is_empty() {
        "PASS: no violation"
    } else if report.passed() {
        "PASS: only violations the provider's guarantees allow"
    } else {
        "FAIL: violations found"
    };
    let _ = writeln!(out, "== {verdict}");
    out
}

/// The report's count of faults by kind.
fn render_faults(out: &mut String, t: &crate::checker::Tally) {
    let _ = writeln!(out, "== faults");
    for kind in FaultKind::ALL {
        let _ = writeln!(
            out,
            "{:<14} {:>5}",
            kind.name(),
            t.faults.get(&kind).copied().unwrap_or(0)
        );
    }
}

/// A client slot of the in-memory fleet: a task, its pause switch, the key it holds, its line.
struct SimulatedClient {
    task: JoinHandle<Result<(), CheckError>>,
    pause: watch::Sender<bool>,
    holding: HoldingSlot,
    line: Arc<AtomicU8>,
    process: u32,
}

/// A simulated client's line to the store passes renewals.
const LINE_OK: u8 = 0;
/// The next renewal reaches the store, its answer comes [`SLOW_ANSWER`] late, and the line is
/// cut behind it.
const LINE_SLOW: u8 = 1;
/// Renewals fail as unreachable.
const LINE_CUT: u8 = 2;

/// How late a slow renewal's answer comes: 0.4 of the lease. An engine that counted the
/// deadline from the answer would believe in a lease 0.3 of a lease after the store let it go.
const SLOW_ANSWER: Duration = Duration::from_millis(LEASE.as_millis() as u64 * 2 / 5);

/// A memory backend on `store` whose renewals go through `line`.
fn simulated_backend(store: MemoryStore, line: Arc<AtomicU8>) -> Intercept<MemoryBackend> {
    Intercept::new(MemoryBackend::with_lease(store, LEASE)).on_renew(move |renewal| {
        let line = line.clone();
        Box::pin(async move {
            match line.load(Ordering::Acquire) {
                LINE_OK => renewal.await,
                LINE_SLOW => {
                    line.store(LINE_CUT, Ordering::Release);
                    let answer = renewal.await;
                    tokio::time::sleep(SLOW_ANSWER).await;
                    answer
                }
                _ => Err(BackendError::unreachable("the line is cut")),
            }
        })
    })
}

/// Simulated processes on one `MemoryStore`.
struct SimulatedFleet {
    store: MemoryStore,
    register: SocketAddr,
    keys: Vec<String>,
    seed: u64,
    events: Arc<Mutex<Vec<Event>>>,
    slots: Vec<SimulatedClient>,
    next_process: u32,
}

impl SimulatedFleet {
    fn start(config: &RunConfig, register: SocketAddr) -> Result<Self, CheckError> {
        let mut fleet = SimulatedFleet {
            store: MemoryStore::new(),
            register,
            keys: keys(config.keys),
            seed: config.seed,
            events: Arc::default(),
            slots: Vec::new(),
            next_process: 1,
        };
        for _ in 0..config.clients {
            let client = fleet.spawn()?;
            fleet.slots.push(client);
        }
        Ok(fleet)
    }

    fn spawn(&mut self) -> Result<SimulatedClient, CheckError> {
        let process = self.next_process;
        self.next_process += 1;
        let line = Arc::new(AtomicU8::new(LINE_OK));
        let locks = build(simulated_backend(self.store.clone(), line.clone()))?;
        let (gate, pause, holding) = PauseGate::new();
        let config = ClientConfig {
            process,
            keys: self.keys.clone(),
            register: self.register,
            seed: self.seed ^ u64::from(process),
            long_hold: LONG_HOLD,
        };
        let journal = Journal::Shared(self.events.clone());
        let task = tokio::spawn(client::run(locks, config, journal, Some(gate)));
        Ok(SimulatedClient {
            task,
            pause,
            holding,
            line,
            process,
        })
    }
}

impl Fleet for SimulatedFleet {
    // Drawn uniformly from this list; the long pause is listed twice because it is the fault
    // that makes stale holders, the ones fencing must stop, and the slow-then-cut line twice
    // because only a long hold (one in four) renews under it.
    fn kinds(&self) -> &'static [FaultKind] {
        &[
            FaultKind::Kill,
            FaultKind::PauseShort,
            FaultKind::PauseLong,
            FaultKind::PauseLong,
            FaultKind::SlowThenCut,
            FaultKind::SlowThenCut,
        ]
    }

    fn process(&self, slot: usize) -> Option<u32> {
        self.slots.get(slot).map(|c| c.process)
    }

    // A slow line matters only to a hold renewed under it: aimed at a long hold young enough
    // that its next renewal and the lease after it end before it does, and one that another
    // client is trying to take, if there is one: only a waiter can be let in too early.
    fn aim(&self, kind: FaultKind, planned: usize) -> Option<usize> {
        if kind != FaultKind::SlowThenCut {
            return None;
        }
        let activities: Vec<Activity> = self
            .slots
            .iter()
            .map(|c| {
                c.holding
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone()
            })
            .collect();
        let young: Vec<usize> = (0..activities.len())
            .filter(|&slot| {
                let holding = activities[slot].holding.as_ref();
                holding.is_some_and(|h| h.long && h.since.elapsed() < LEASE)
            })
            .collect();
        let wanted: Vec<usize> = young
            .iter()
            .copied()
            .filter(|&slot| {
                let key = activities[slot].holding.as_ref().map(|h| h.key.as_str());
                activities.iter().any(|a| a.wants.as_deref() == key)
            })
            .collect();
        let pick = if wanted.is_empty() { young } else { wanted };
        (!pick.is_empty()).then(|| pick[planned % pick.len()])
    }

    fn begin(&mut self, kind: FaultKind, slot: usize) -> EndFuture<'_> {
        let Some(client) = self.slots.get(slot) else {
            return Box::pin(async { Ok(()) });
        };
        match kind {
            FaultKind::Kill => client.task.abort(),
            FaultKind::PauseShort => {
                client.pause.send_replace(true);
            }
            FaultKind::PauseLong => {
                client.pause.send_replace(true);
                // A frozen process stops renewing and its lease runs out; a paused task's
                // renewals go on in the engine's own task, so the lease is broken instead,
                // once the task has parked at its next step (its work ends well within the wait).
                let holding = client.holding.clone();
                let store = self.store.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(client::WORK * 5).await;
                    let held = holding
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .holding
                        .clone();
                    // Only this client's lease: the key's other readers or slots keep theirs,
                    // and a key someone else has taken since is left alone.
                    if let Some(Holding {
                        lease: Some(lease), ..
                    }) = held
                    {
                        store.break_lease_of(&lease);
                    }
                });
            }
            FaultKind::SlowThenCut => client.line.store(LINE_SLOW, Ordering::Release),
            _ => {}
        }
        Box::pin(async { Ok(()) })
    }

    fn end(&mut self, kind: FaultKind, slot: usize) -> EndFuture<'_> {
        let ended = if kind == FaultKind::Kill {
            self.spawn().map(|replacement| {
                if let Some(client) = self.slots.get_mut(slot) {
                    *client = replacement;
                }
            })
        } else {
            if let Some(client) = self.slots.get(slot) {
                client.pause.send_replace(false);
                client.line.store(LINE_OK, Ordering::Release);
            }
            Ok(())
        };
        Box::pin(async move { ended })
    }

    fn stop(&mut self) -> StopFuture<'_> {
        Box::pin(async move {
            for client in &self.slots {
                client.task.abort();
            }
            for client in self.slots.drain(..) {
                // A cancelled task is a stopped client; one that returned an error could not
                // write its history.
                if let Ok(Err(error)) = client.task.await {
                    return Err(error);
                }
            }
            Ok(self
                .events
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone())
        })
    }
}

/// A client process and its proxies to the server (one for each of the server's ports).
struct ClientProcess {
    child: tokio::process::Child,
    pid: u32,
    proxies: Vec<FaultProxy>,
}

impl ClientProcess {
    fn set_fault(&self, fault: Fault) {
        for proxy in &self.proxies {
            proxy.set_fault(fault);
        }
    }

    fn set_latency(&self, latency: Duration) {
        for proxy in &self.proxies {
            proxy.set_latency(latency);
        }
    }
}

/// Client processes, this binary in `client` mode, and the server they lock on.
struct ProcessFleet {
    server: Box<dyn Server>,
    exe: PathBuf,
    provider: Provider,
    register: SocketAddr,
    keys: usize,
    seed: u64,
    dir: PathBuf,
    slots: Vec<ClientProcess>,
    killed: Vec<tokio::process::Child>,
    histories: Vec<PathBuf>,
    /// The clients' clock rate (percent), and libfaketime when it is not 100.
    clock: (u32, Option<PathBuf>),
    /// The clock-rate faults begun so far (one per client process when the rate is not 100).
    clocks: Vec<FaultEvent>,
}

impl ProcessFleet {
    async fn start(
        config: &RunConfig,
        register: SocketAddr,
        server: Box<dyn Server>,
        dir: &std::path::Path,
    ) -> Result<Self, CheckError> {
        let server_ports = server.ports();
        let mut fleet = ProcessFleet {
            server,
            exe: std::env::current_exe()?,
            provider: config.provider,
            register,
            keys: config.keys,
            seed: config.seed,
            dir: dir.to_path_buf(),
            slots: Vec::new(),
            killed: Vec::new(),
            histories: Vec::new(),
            clock: match config.clock_rate_percent {
                100 => (100, None),
                rate => (rate, Some(libfaketime()?)),
            },
            clocks: Vec::new(),
        };
        let proxied = fleet.server.proxied();
        for slot in 0..config.clients {
            let mut proxies = Vec::new();
            for &port in &server_ports {
                if proxied {
                    proxies.push(start_fixture("proxy", FaultProxy::to_port(port)).await?);
                }
            }
            let client = fleet.spawn(slot, proxies, &server_ports)?;
            fleet.slots.push(client);
        }
        Ok(fleet)
    }

    /// Starts the client of `slot`, through `proxies`, or straight to `server_ports` when the
    /// server is not proxied.
    fn spawn(
        &mut self,
        slot: usize,
        proxies: Vec<FaultProxy>,
        server_ports: &[u16],
    ) -> Result<ClientProcess, CheckError> {
        let ports: Vec<u16> = if proxies.is_empty() {
            server_ports.to_vec()
        } else {
            proxies.iter().map(FaultProxy::port).collect()
        };
        let n = self.histories.len();
        let history = self.dir.join(format!("client-{slot}-{n}.jsonl"));
        let log = self.dir.join(format!("client-{slot}-{n}.log"));
        let mut command = tokio::process::Command::new(&self.exe);
        command
            .arg("client")
            .args(["--provider", self.provider.name()])
            .args(["--backend", &backend_address(self.provider, &ports)])
            .args(["--register", &self.register.to_string()])
            .args(["--keys", &self.keys.to_string()])
            .args(["--seed", &(self.seed ^ (n as u64 + 1)).to_string()])
            .stdin(Stdio::null())
            .stdout(File::create(&history)?)
            .stderr(File::create(&log)?)
            .kill_on_drop(true);
        let (rate, faketime) = &self.clock;
        let skewed = match faketime {
            Some(library) => {
                // Every clock of the process, monotonic included, runs at the rate from now.
                let rate = format!("+0 x{}", f64::from(*rate) / 100.0);
                command.env("LD_PRELOAD", library).env("FAKETIME", rate);
                true
            }
            None => false,
        };
        let child = command.spawn()?;
        self.histories.push(history);
        let pid = child
            .id()
            .ok_or_else(|| CheckError::Server("a client exited at once".into()))?;
        if skewed {
            self.clocks.push(FaultEvent {
                time: crate::clock::monotonic_ns(),
                id: CLOCK_FAULT_IDS + self.clocks.len() as u64,
                fault: FaultKind::ClockRate,
                slot,
                process: Some(pid),
                phase: FaultPhase::Start,
                rate_percent: Some(*rate),
            });
        }
        Ok(ClientProcess {
            child,
            pid,
            proxies,
        })
    }
}

impl ProcessFleet {
    /// Lifts a fault of one client.
    fn end_on_client(&mut self, kind: FaultKind, slot: usize) -> Result<(), CheckError> {
        if slot >= self.slots.len() {
            return Ok(());
        }
        match kind {
            FaultKind::Kill => {
                // The replacement keeps the slot's proxies; the dead process is reaped at the end.
                let dead = self.slots.remove(slot);
                let ports = self.server.ports();
                let replacement = self.spawn(slot, dead.proxies, &ports)?;
                self.killed.push(dead.child);
                self.slots.insert(slot, replacement);
                Ok(())
            }
            FaultKind::PauseShort | FaultKind::PauseLong => {
                signal(self.slots[slot].pid, libc::SIGCONT)
            }
            FaultKind::Blackhole | FaultKind::Reset => {
                self.slots[slot].set_fault(Fault::Pass);
                Ok(())
            }
            FaultKind::Delay => {
                self.slots[slot].set_latency(Duration::ZERO);
                Ok(())
            }
            FaultKind::SlowThenCut
            | FaultKind::ServerCrash
            | FaultKind::ServerPause
            | FaultKind::ClockRate => Ok(()),
        }
    }
}

fn signal(pid: u32, signal: libc::c_int) -> Result<(), CheckError> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| CheckError::Server(format!("pid {pid} out of range")))?;
    // SAFETY: kill(2) with a pid of a child this harness started and has not reaped.
    if unsafe { libc::kill(pid, signal) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(())
}

impl Fleet for ProcessFleet {
    fn kinds(&self) -> &'static [FaultKind] {
        self.provider.kinds()
    }

    fn process(&self, slot: usize) -> Option<u32> {
        self.slots.get(slot).map(|c| c.pid)
    }

    fn begin(&mut self, kind: FaultKind, slot: usize) -> EndFuture<'_> {
        match kind {
            FaultKind::ServerCrash => return self.server.crash(),
            FaultKind::ServerPause => return self.server.pause(),
            _ => {}
        }
        let latency = self.provider.lease() / 2;
        let begun = match self.slots.get(slot) {
            None => Ok(()),
            Some(client) => match kind {
                FaultKind::Kill => signal(client.pid, libc::SIGKILL),
                FaultKind::PauseShort | FaultKind::PauseLong => signal(client.pid, libc::SIGSTOP),
                FaultKind::Blackhole => {
                    client.set_fault(Fault::Blackhole);
                    Ok(())
                }
                FaultKind::Reset => {
                    client.set_fault(Fault::Reset);
                    Ok(())
                }
                FaultKind::Delay => {
                    client.set_latency(latency);
                    Ok(())
                }
                // Drawn only for simulated clients; a clock rate is set at a client's start;
                // the server's faults are above.
                FaultKind::SlowThenCut
                | FaultKind::ClockRate
                | FaultKind::ServerCrash
                | FaultKind::ServerPause => Ok(()),
            },
        };
        Box::pin(async move { begun })
    }

    fn end(&mut self, kind: FaultKind, slot: usize) -> EndFuture<'_> {
        match kind {
            FaultKind::ServerCrash => return self.server.start_again(),
            FaultKind::ServerPause => self.server.resume(),
            _ => {}
        }
        let ended = self.end_on_client(kind, slot);
        Box::pin(async move { ended })
    }

    fn stop(&mut self) -> StopFuture<'_> {
        Box::pin(async move {
            for client in &mut self.slots {
                // A client that exited by itself could not run: its log says why.
                if let Ok(Some(status)) = client.child.try_wait() {
                    return Err(CheckError::Server(format!(
                        "client process {} exited ({status}); see its log in {}",
                        client.pid,
                        self.dir.display()
                    )));
                }
                // A stopped process is killed all the same; its half-done operations are
                // unknown, which the checker allows.
                let _ = client.child.start_kill();
            }
            for mut client in self.slots.drain(..) {
                let _ = client.child.wait().await;
            }
            for mut child in self.killed.drain(..) {
                let _ = child.wait().await;
            }
            let mut events = Vec::new();
            for path in &self.histories {
                events.extend(history::parse_lines(&fs::read_to_string(path)?)?);
            }
            // A skewed clock is a fault for the client's whole life (ended here at the latest).
            let ended = crate::clock::monotonic_ns();
            for start in self.clocks.drain(..) {
                let end = FaultEvent {
                    time: ended,
                    phase: FaultPhase::End,
                    ..start.clone()
                };
                events.push(Event::Nemesis(start));
                events.push(Event::Nemesis(end));
            }
            Ok(events)
        })
    }
}
