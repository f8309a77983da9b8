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

/// The address this process's peers reach it at, and where its listeners bind: the tcp
/// transport's endpoints (and through them symmetric memory's links across hosts).
///
/// `SYMMEM_TRANSPORT_TCP_HOST` if set; else, in a job (`MASTER_ADDR` set), the local address
/// of the route to the job's store, the address this process's own store connection comes
/// from, so hosts need no setting: a job on one host stays on loopback, a job across hosts
/// listens on the interface that reaches its peers, never on every interface. If that route
/// is loopback although the job spans hosts and the store's address is a name (one that this
/// host resolves to itself, as Debian's `127.0.1.1 hostname` line does), the first non-loopback address of an
/// interface that is up, with a warning. Outside a job: `127.0.0.1`. Computed once.
pub fn advertised_host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        if let Some(h) = crate::config::tcp_host() {
            return h.to_string();
        }
        let Some(master) = crate::config::value(crate::config::env::MASTER_ADDR) else {
            return "127.0.0.1".into();
        };
        let port = crate::config::value(crate::config::env::MASTER_PORT).and_then(|p| p.trim().parse().ok()).unwrap_or(9);
        let ip = match route_to(master, port) {
            Ok(ip) => ip,
            Err(why) => {
                tracing::warn!(
                    "no route to the job's store at {master} ({why}); listening on 127.0.0.1 (set SYMMEM_TRANSPORT_TCP_HOST to this host's address)"
                );
                return "127.0.0.1".into();
            }
        };
        // A loopback address given literally means what it says (hosts played on one machine).
        let named = master.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().is_err();
        let spans_hosts = crate::config::hosts() > 1 || world_exceeds_host();
        if ip.is_loopback()
            && named
            && spans_hosts
            && let Some(other) = first_interface_address()
        {
            tracing::warn!(
                "the job's store at {master} is this host's loopback but the job spans hosts; publishing {other}, \
                 the first address of an interface that is up (set SYMMEM_TRANSPORT_TCP_HOST to choose)"
            );
            return bracket(other);
        }
        bracket(ip)
    })
}

fn bracket(ip: std::net::IpAddr) -> String {
    if ip.is_ipv6() { format!("[{ip}]") } else { ip.to_string() }
}

/// The local address the kernel picks to reach `host:port` (a connected UDP socket sends
/// nothing).
fn route_to(host: &str, port: u16) -> std::io::Result<std::net::IpAddr> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the name resolves to no address");
    for to in (bare, port).to_socket_addrs()? {
        let any: std::net::SocketAddr = if to.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
        match UdpSocket::bind(any).and_then(|s| s.connect(to).and_then(|()| s.local_addr())) {
            Ok(local) => return Ok(local.ip()),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Whether `WORLD_SIZE` exceeds `LOCAL_WORLD_SIZE`: ranks run on more than this host.
fn world_exceeds_host() -> bool {
    let n = |k: &str| crate::config::value(k).and_then(|v| v.trim().parse::<usize>().ok());
    matches!((n(crate::config::env::WORLD_SIZE), n(crate::config::env::LOCAL_WORLD_SIZE)), (Some(w), Some(l)) if w > l)
}

/// The first address (IPv4 first) of an interface that is up and not loopback.
fn first_interface_address() -> Option<std::net::IpAddr> {
    use nix::net::if_::InterfaceFlags;
    let addrs: Vec<std::net::IpAddr> = nix::ifaddrs::getifaddrs()
        .ok()?
        .filter(|a| a.flags.contains(InterfaceFlags::IFF_UP) && !a.flags.contains(InterfaceFlags::IFF_LOOPBACK))
        .filter_map(|a| {
            let a = a.address?;
            let ip = match a.as_sockaddr_in() {
                Some(v4) => std::net::IpAddr::V4(v4.ip()),
                None => std::net::IpAddr::V6(a.as_sockaddr_in6()?.ip()),
            };
            (!is_link_local(&ip)).then_some(ip)
        })
        .collect();
    addrs.iter().find(|a| a.is_ipv4()).or_else(|| addrs.first()).copied()
}

fn is_link_local(ip: &std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_link_local(),
        std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// The CPUs this process may use. Cached: `available_parallelism` reads cgroup files, far too
/// slow for a wait's policy.
pub fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The CPUs this process may run on now (its affinity mask), as inclusive ranges; empty if the
/// kernel will not say.
pub fn affinity() -> Vec<[u32; 2]> {
    let Ok(set) = rustix::thread::sched_getaffinity(None) else { return Vec::new() };
    let mut ranges: Vec<[u32; 2]> = Vec::new();
    for cpu in (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c)) {
        let cpu = cpu as u32;
        match ranges.last_mut() {
            Some(last) if last[1] + 1 == cpu => last[1] = cpu,
            _ => ranges.push([cpu, cpu]),
        }
    }
    ranges
}

/// Whether `ranks` processes whose affinity masks are `masks` (as [`affinity`] gives them,
/// from peers) outnumber the CPUs they may use together: then a waiting rank should hand its
/// core to the one it waits for rather than spin. Each rank's own mask counts, so ranks pinned
/// to distinct cores are not crowded even when each has a single core, and ranks all bound to
/// the same two cores are. An empty mask (unknown) counts as this process's [`cores`]. Ranges
/// beyond the kernel's largest CPU number, and a mask's ranges past the most a real mask can
/// have, are ignored (peer input: the work stays bounded).
pub fn crowded<'a>(ranks: usize, masks: impl IntoIterator<Item = &'a [[u32; 2]]>) -> bool {
    const MAX: usize = rustix::thread::CpuSet::MAX_CPU;
    let mut union = [false; MAX];
    let mut unknown = false;
    for mask in masks {
        unknown |= mask.is_empty();
        for &[first, last] in mask.iter().take(MAX / 2 + 1) {
            let (first, last) = (first as usize, (last as usize).min(MAX - 1));
            for cpu in union.iter_mut().take(last + 1).skip(first) {
                *cpu = true;
            }
        }
    }
    let known = union.iter().filter(|&&c| c).count();
    let cpus = if unknown { known.max(cores()) } else { known };
    ranks > cpus.max(1)
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
    fn crowding_counts_the_cpus_a_hosts_ranks_may_use_together() {
        let one = |c: u32| vec![[c, c]];
        // Pinned to distinct cores, one each: not crowded (each process sees one CPU).
        assert!(!crowded(2, [one(0).as_slice(), one(1).as_slice()]));
        // Both bound to the same core, or four ranks to the same two: crowded.
        assert!(crowded(2, [one(0).as_slice(), one(0).as_slice()]));
        let two = vec![[0, 1]];
        assert!(crowded(4, [two.as_slice(); 4]));
        assert!(!crowded(2, [two.as_slice(); 2]));
        // Ranges are a peer's input: beyond the kernel's largest CPU they are ignored, a
        // reversed one is empty, and a huge one costs no more than the largest CPU count.
        let far = vec![[u32::MAX - 1, u32::MAX]];
        assert!(crowded(2, [far.as_slice(), far.as_slice()]));
        assert!(crowded(2, [vec![[5, 1]].as_slice(), vec![[9, 2]].as_slice()]));
        let all = vec![[0, u32::MAX]];
        assert!(!crowded(64, [all.as_slice(); 2]));
        // A flood of ranges is read no further than a real mask goes: the tail is ignored.
        let mut flood = vec![[5000, 6000]; 1 << 20];
        flood.push([0, 63]);
        assert!(crowded(2, [flood.as_slice()]));
        // An unknown mask counts as this process's CPUs.
        assert_eq!(crowded(2, [[].as_slice(), [].as_slice()]), 2 > cores());
        // This process's own mask has at least one CPU, in order and without overlaps.
        let mine = affinity();
        assert!(!mine.is_empty() && mine.windows(2).all(|w| w[0][1] + 1 < w[1][0]), "{mine:?}");
    }

    #[test]
    fn the_route_to_a_loopback_store_is_loopback_and_interfaces_skip_it() {
        assert!(route_to("127.0.0.1", 29500).unwrap().is_loopback());
        assert!(route_to("[::1]", 29500).is_ok_and(|ip| ip.is_loopback()) || route_to("[::1]", 1).is_err());
        if let Some(ip) = first_interface_address() {
            assert!(!ip.is_loopback() && !is_link_local(&ip), "{ip}");
        }
        assert!(is_link_local(&"169.254.1.1".parse().unwrap()) && is_link_local(&"fe80::1".parse().unwrap()));
        assert!(!is_link_local(&"10.0.0.1".parse().unwrap()));
    }

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
