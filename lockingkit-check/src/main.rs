//! `lockingkit-check run --provider memory|postgres|pgbouncer|redis|etcd|etcd3 --seconds N --seed S --clients 5
//! --clock-rate 1.0`:
//! one checked run; exit code 0 when no violation, 1 when any, 2 on a harness error.
//!
//! `lockingkit-check client ...` is the client-process mode the harness starts itself in.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use lockingkit_check::client::{self, ClientConfig, Journal};
use lockingkit_check::clock::monotonic_ns;
use lockingkit_check::provider::{self, Provider};
use lockingkit_check::run::{self, RunConfig};
use lockingkit_check::CheckError;

const USAGE: &str =
    "lockingkit-check run --provider memory|postgres|pgbouncer|redis|etcd|etcd3 [--seconds 20] \
[--seed S] [--clients 5] [--keys 3] [--clock-rate 1.0]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let outcome = match args.first().map(String::as_str) {
        Some("run") => flags(&args[1..]).and_then(|f| run_mode(&f)),
        Some("client") => flags(&args[1..]).and_then(|f| client_mode(&f)),
        _ => Err(CheckError::Usage(USAGE.into())),
    };
    match outcome {
        Ok(code) => code,
        Err(error) => {
            eprintln!("lockingkit-check: {error}");
            ExitCode::from(2)
        }
    }
}

/// `--name value` pairs.
fn flags(args: &[String]) -> Result<HashMap<String, String>, CheckError> {
    let mut flags = HashMap::new();
    let mut rest = args.iter();
    while let Some(name) = rest.next() {
        let Some(name) = name.strip_prefix("--") else {
            return Err(CheckError::Usage(format!("unexpected {name:?}; {USAGE}")));
        };
        let value = rest
            .next()
            .ok_or_else(|| CheckError::Usage(format!("--{name} needs a value")))?;
        flags.insert(name.to_string(), value.clone());
    }
    Ok(flags)
}

fn number(flags: &HashMap<String, String>, name: &str, default: u64) -> Result<u64, CheckError> {
    flags.get(name).map_or(Ok(default), |v| {
        v.parse()
            .map_err(|_| CheckError::Usage(format!("--{name} wants a number, not {v:?}")))
    })
}

fn required<'a>(flags: &'a HashMap<String, String>, name: &str) -> Result<&'a str, CheckError> {
    flags
        .get(name)
        .map(String::as_str)
        .ok_or_else(|| CheckError::Usage(format!("--{name} is required; {USAGE}")))
}

fn runtime(multi_thread: bool) -> Result<tokio::runtime::Runtime, CheckError> {
    let mut builder = if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    Ok(builder.enable_all().build()?)
}

fn run_mode(flags: &HashMap<String, String>) -> Result<ExitCode, CheckError> {
    let config = RunConfig {
        provider: Provider::parse(required(flags, "provider")?)?,
        duration: Duration::from_secs(number(flags, "seconds", 20)?),
        // Without a seed, one from the clock; printed first, so the run can be replayed.
        seed: number(flags, "seed", monotonic_ns() % 1_000_000)?,
        clients: usize::try_from(number(flags, "clients", 5)?).unwrap_or(5),
        keys: usize::try_from(number(flags, "keys", 3)?).unwrap_or(3),
        clock_rate_percent: clock_rate(flags)?,
    };
    let report = runtime(true)?.block_on(run::run(&config))?;
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `--clock-rate R` (0.5 to 2.0, default 1.0) as a percentage of real time.
fn clock_rate(flags: &HashMap<String, String>) -> Result<u32, CheckError> {
    let Some(text) = flags.get("clock-rate") else {
        return Ok(100);
    };
    match text.parse::<f64>() {
        Ok(rate) if (0.5..=2.0).contains(&rate) => Ok((rate * 100.0).round() as u32),
        _ => Err(CheckError::Usage(format!(
            "--clock-rate wants a rate from 0.5 to 2.0, not {text:?}"
        ))),
    }
}

fn client_mode(flags: &HashMap<String, String>) -> Result<ExitCode, CheckError> {
    let provider = Provider::parse(required(flags, "provider")?)?;
    let backend = required(flags, "backend")?.to_string();
    let register: SocketAddr = required(flags, "register")?
        .parse()
        .map_err(|_| CheckError::Usage("--register wants host:port".into()))?;
    let config = ClientConfig {
        process: std::process::id(),
        keys: run::keys(usize::try_from(number(flags, "keys", 3)?).unwrap_or(3)),
        register,
        seed: number(flags, "seed", 0)?,
        long_hold: run::LONG_HOLD,
    };
    runtime(false)?.block_on(async {
        let locks = provider::server_lock(provider, &backend)?;
        client::run(locks, config, Journal::Stdout, None).await
    })?;
    Ok(ExitCode::SUCCESS)
}
