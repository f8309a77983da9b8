//! Where ranks run: this host's identity, the cores this process may use, and a group's host
//! map (which ranks share a host, and each host's leader), computed once per rendezvous.
//!
//! Layer: a foundation (uses `config`).

#![forbid(unsafe_code)]

use std::sync::OnceLock;

/// This host's identity: ranks with the same identity map each other's memory. By default the
/// hostname and the kernel's boot id; `SYMMEM_HOST_ID` overrides it (for hosts whose names
/// collide, or to make one machine play several hosts).
pub fn this_host() -> String {
    if let Some(id) = crate::config::host_id() {
        return id.to_string();
    }
    let name = rustix::system::uname().nodename().to_string_lossy().into_owned();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{name}/{}", boot.trim())
}

/// The CPUs this process may use. Cached: `available_parallelism` reads cgroup files, far too
/// slow for a wait's policy.
pub fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Which ranks of a group share a host: hosts are numbered in order of their lowest rank, and a
/// host's lowest rank is its leader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostMap {
    host_of: Vec<usize>,
    ranks_of: Vec<Vec<usize>>,
}

impl HostMap {
    /// The map of ranks whose host identities are `hosts` (rank `r` runs on `hosts[r]`).
    pub fn new(hosts: &[impl AsRef<str>]) -> HostMap {
        let mut distinct: Vec<&str> = Vec::new();
        let host_of: Vec<usize> = hosts
            .iter()
            .map(|h| {
                let h = h.as_ref();
                distinct.iter().position(|d| *d == h).unwrap_or_else(|| {
                    distinct.push(h);
                    distinct.len() - 1
                })
            })
            .collect();
        let mut ranks_of = vec![Vec::new(); distinct.len()];
        for (r, &h) in host_of.iter().enumerate() {
            ranks_of[h].push(r);
        }
        HostMap { host_of, ranks_of }
    }

    /// The host (index) of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// The ranks on host `host`, in order.
    pub fn ranks_on(&self, host: usize) -> &[usize] {
        &self.ranks_of[host]
    }

    /// How many hosts.
    pub fn hosts(&self) -> usize {
        self.ranks_of.len()
    }

    /// The leader (lowest rank) of `rank`'s host.
    pub fn leader_of(&self, rank: usize) -> usize {
        self.ranks_of[self.host_of[rank]][0]
    }

    /// Every host's leader, in order.
    pub fn leaders(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranks_of.iter().map(|ranks| ranks[0])
    }

    /// The most ranks any one host has.
    pub fn max_ranks_per_host(&self) -> usize {
        self.ranks_of.iter().map(Vec::len).max().unwrap_or(1)
    }

    /// Whether `a` and `b` share a host.
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        self.host_of[a] == self.host_of[b]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_numbered_by_their_lowest_rank() {
        let m = HostMap::new(&["b", "a", "b", "c", "a"]);
        assert_eq!(m.hosts(), 3);
        assert_eq!((m.host_of(0), m.host_of(1), m.host_of(3)), (0, 1, 2));
        assert_eq!(m.ranks_on(0), &[0, 2]);
        assert_eq!(m.leaders().collect::<Vec<_>>(), vec![0, 1, 3]);
        assert_eq!((m.leader_of(4), m.max_ranks_per_host()), (1, 2));
        assert!(m.same_host(1, 4) && !m.same_host(0, 1));
    }
}
