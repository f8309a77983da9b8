//! Helpers shared by the integration tests.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::process::{Command, Output};

/// Runs `ip` with `args`.
pub fn ip(args: &[&str]) -> std::io::Result<Output> {
    Command::new("ip").args(args).output()
}

/// Two namespaces and the link between them; removed on drop, even when the test fails.
pub struct Hosts {
    /// The namespaces' names; host i has address `10.213.0.{i+1}`.
    pub names: [String; 2],
    /// The veth ends, in namespace 0 and 1.
    pub devs: [String; 2],
}

impl Hosts {
    /// Creates both namespaces and the link, or says why it cannot.
    pub fn create() -> Result<Hosts, String> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = std::process::id();
        let names = [format!("symm-a-{id}-{n}"), format!("symm-b-{id}-{n}")];
        let (va, vb) = (format!("va{}x{n}", id % 100_000), format!("vb{}x{n}", id % 100_000));
        let hosts = Hosts { names: names.clone(), devs: [va.clone(), vb.clone()] };
        let run = |args: &[&str]| -> Result<(), String> {
            let out = ip(args).map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
            if !out.status.success() {
                return Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
            }
            Ok(())
        };
        run(&["netns", "add", &names[0]])?;
        run(&["netns", "add", &names[1]])?;
        run(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        run(&["link", "set", &va, "netns", &names[0]])?;
        run(&["link", "set", &vb, "netns", &names[1]])?;
        for (ns, dev, addr) in [(&names[0], &va, "10.213.0.1/30"), (&names[1], &vb, "10.213.0.2/30")] {
            run(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            run(&["-n", ns, "link", "set", dev, "up"])?;
            run(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}
