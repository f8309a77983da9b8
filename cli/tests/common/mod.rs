//! Helpers shared by the integration tests.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::process::{Command, Output};

/// Runs `ip` with `args`.
pub fn ip(args: &[&str]) -> std::io::Result<Output> {
    Command::new("ip").args(args).output()
}

/// The prefix of every namespace [`Hosts`] names, followed by the creating process's id.
const PREFIX: &str = "symm-";

/// Played hosts: network namespaces joined by a switch (a bridge in a namespace of its own, one
/// veth pair from each host to it); all removed on drop, even when the test fails. No link is
/// ever in this process's namespace: deleting the namespaces deletes every link, and what a
/// test binary killed with SIGKILL leaves, the next [`Hosts::create`] removes.
pub struct Hosts {
    /// The hosts' namespaces; host i has address `10.213.0.{i+1}/24`.
    pub names: Vec<String>,
    /// Each host's end of its link to the switch, inside that host's namespace.
    pub devs: Vec<String>,
    /// The switch's namespace.
    switch: String,
}

impl Hosts {
    /// Creates `k` hosts (2 to 200) and the switch joining them, or says why it cannot.
    pub fn create(k: usize) -> Result<Hosts, String> {
        assert!((2..=200).contains(&k), "{k} hosts");
        sweep();
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = std::process::id();
        let hosts = Hosts {
            names: (0..k).map(|i| format!("{PREFIX}{id}-{n}-h{i}")).collect(),
            devs: (0..k).map(|_| "veth0".to_string()).collect(),
            switch: format!("{PREFIX}{id}-{n}-sw"),
        };
        let run = |args: &[&str]| -> Result<(), String> {
            let out = ip(args).map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
            if !out.status.success() {
                return Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
            }
            Ok(())
        };
        // From here on, a failure returns and `hosts` drops, deleting what was made.
        let sw = hosts.switch.as_str();
        run(&["netns", "add", sw])?;
        run(&["-n", sw, "link", "add", "br0", "type", "bridge"])?;
        run(&["-n", sw, "link", "set", "br0", "up"])?;
        for (i, (ns, dev)) in hosts.names.iter().zip(&hosts.devs).enumerate() {
            let port = format!("p{i}");
            run(&["netns", "add", ns])?;
            // Made in the switch's namespace, its peer straight in the host's.
            run(&["-n", sw, "link", "add", &port, "type", "veth", "peer", "name", dev, "netns", ns])?;
            run(&["-n", sw, "link", "set", &port, "master", "br0", "up"])?;
            run(&["-n", ns, "addr", "add", &format!("10.213.0.{}/24", i + 1), "dev", dev])?;
            run(&["-n", ns, "link", "set", dev, "up"])?;
            run(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in self.names.iter().chain([&self.switch]) {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// Deletes the namespaces of test processes that are gone (killed before their drops ran).
fn sweep() {
    let Ok(out) = ip(&["netns", "list"]) else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else { continue };
        // `symm-PID-...`, or the older `symm-a-PID-...`.
        let rest = rest.strip_prefix("a-").or_else(|| rest.strip_prefix("b-")).unwrap_or(rest);
        let Some(Ok(pid)) = rest.split('-').next().map(str::parse::<u32>) else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}
