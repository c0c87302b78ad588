//! Keeps a measurement's client and server off each other's CPU.
//!
//! On a machine with few CPUs a client and a server that share them measure the scheduler more
//! than the client: a request's answer either finds the client's thread on a CPU that is awake
//! or has to wake one, and which it is changes from one moment to the next, so the latencies of
//! a pair fall into two bands some 50 µs apart on the 2-CPU VM, and a median lands in either
//! (ratios of identical code ranged from 0.98 to 1.47 from run to run). With the client on one
//! CPU and the server on another, every round trip crosses between them, as it crosses a
//! network to a server on another host, and a row's samples fall into one band.

use std::process::Command;

/// This process pinned to one CPU and a server process to another, until dropped: then this
/// process may run where it could before.
#[derive(Debug)]
pub struct SplitCpus {
    before: String,
    client: usize,
    server: usize,
}

impl SplitCpus {
    /// Pins every thread of this process to the first CPU it may run on and every thread of
    /// the process `server` to the second; `None` (and nothing changed) when this process may
    /// run on only one CPU or `taskset` (util-linux) fails.
    pub fn pin(server: u32) -> Option<SplitCpus> {
        let me = std::process::id();
        let before = cpu_list(me)?;
        let cpus = expand(&before);
        let (&client, &server_cpu) = (cpus.first()?, cpus.get(1)?);
        if !taskset(me, &client.to_string()) || !taskset(server, &server_cpu.to_string()) {
            taskset(me, &before);
            return None;
        }
        Some(SplitCpus {
            before,
            client,
            server: server_cpu,
        })
    }

    /// What the rows print about it.
    pub fn describe(&self) -> String {
        format!(
            "client on CPU {}, server on CPU {} (taskset)",
            self.client, self.server
        )
    }
}

impl Drop for SplitCpus {
    fn drop(&mut self) {
        taskset(std::process::id(), &self.before);
    }
}

/// The CPU list `pid` may run on, as `taskset` prints it (`0,1` or `0-3`).
fn cpu_list(pid: u32) -> Option<String> {
    let output = Command::new("taskset")
        .args(["-p", "-c", &pid.to_string()])
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    Some(text.rsplit(':').next()?.trim().to_owned()).filter(|list| !list.is_empty())
}

/// Sets the CPU list of every thread of `pid`.
fn taskset(pid: u32, list: &str) -> bool {
    Command::new("taskset")
        .args(["-a", "-p", "-c", list, &pid.to_string()])
        .output()
        .is_ok_and(|output| output.status.success())
}

/// The CPUs of a list such as `0,2-3`, in order.
fn expand(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.split(',') {
        let mut ends = part.trim().splitn(2, '-').map(|end| end.parse::<usize>());
        match (ends.next(), ends.next()) {
            (Some(Ok(first)), None) => cpus.push(first),
            (Some(Ok(first)), Some(Ok(last))) => cpus.extend(first..=last),
            _ => {}
        }
    }
    cpus
}

#[cfg(test)]
mod tests {
    use super::expand;

    #[test]
    fn cpu_lists_expand() {
        assert_eq!(expand("0,1"), [0, 1]);
        assert_eq!(expand("0-3"), [0, 1, 2, 3]);
        assert_eq!(expand("1,4-5"), [1, 4, 5]);
        assert_eq!(expand("x"), Vec::<usize>::new());
    }
}
