//! Who is at the other end of a TCP connection from this host: the user owning the peer's
//! socket, asked of the kernel with one exact `NETLINK_SOCK_DIAG` lookup of its 4-tuple (the
//! same query `ss -e` makes). Unix sockets have `SO_PEERCRED`; TCP has this, for peers in this
//! network namespace. A peer on another host (or namespace) has no socket here to find.

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};

use rustix::net::netlink::{self, SocketAddrNetlink};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 1;
const IPPROTO_TCP: u8 = 6;
/// `inet_diag_msg.idiag_uid`, after the 16-byte `nlmsghdr`.
const UID_AT: usize = 16 + 4 + 48 + 12;

/// The address as the kernel's socket table holds it: IPv4-mapped IPv6 addresses are IPv4.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

fn put_addr(out: &mut Vec<u8>, ip: IpAddr) {
    let mut words = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => words[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => words.copy_from_slice(&v6.octets()),
    }
    out.extend_from_slice(&words);
}

/// The uid owning the TCP socket at `peer` that is connected to `local` (an accepted
/// connection's two ends as this side sees them), or `None` when the peer's socket is not in
/// this host's network namespace: a peer on another host, or one the kernel cannot find.
pub(crate) fn tcp_peer_uid(local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    let (local, peer) = (canonical(local), canonical(peer));
    let family = match (local.ip(), peer.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => AddressFamily::INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => AddressFamily::INET6,
        _ => return None,
    };
    // The request: nlmsghdr, then inet_diag_req_v2 naming the peer's socket, whose source is
    // the peer and whose destination is us. Ports and addresses in network order.
    let mut req = Vec::with_capacity(72);
    req.extend_from_slice(&72u32.to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    req.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    req.push(family.as_raw() as u8);
    req.push(IPPROTO_TCP);
    req.push(0); // no extensions
    req.push(0);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // any state
    req.extend_from_slice(&peer.port().to_be_bytes());
    req.extend_from_slice(&local.port().to_be_bytes());
    put_addr(&mut req, peer.ip());
    put_addr(&mut req, local.ip());
    req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    req.extend_from_slice(&[0xff; 8]); // INET_DIAG_NOCOOKIE
    debug_assert_eq!(req.len(), 72);

    let fd = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        Some(netlink::SOCK_DIAG),
    )
    .ok()?;
    rustix::net::sendto(&fd, &req, SendFlags::empty(), &SocketAddrNetlink::new(0, 0)).ok()?;
    let mut reply = [0u8; 512];
    let (_, n) = rustix::net::recv(&fd, &mut reply[..], RecvFlags::empty()).ok()?;
    let reply = reply.get(..n)?;
    let kind = u16::from_ne_bytes(reply.get(4..6)?.try_into().ok()?);
    if kind != SOCK_DIAG_BY_FAMILY {
        // NLMSG_ERROR (ENOENT when there is no such socket here), or anything else.
        return None;
    }
    Some(u32::from_ne_bytes(reply.get(UID_AT..UID_AT + 4)?.try_into().ok()?))
}

/// A peer on this host that belongs to another user: its uid, and this process's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Foreign {
    pub(crate) uid: u32,
    pub(crate) mine: u32,
}

impl std::fmt::Display for Foreign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "it belongs to another user on this host (uid {}, this process's is {})", self.uid, self.mine)
    }
}

/// Whether the other end of a connection between `local` and `peer` may talk to this process:
/// `Err` when its socket is on this host and owned by another user. Peers on other hosts are
/// not this check's business (the job's secret is).
pub(crate) fn same_user_or_remote(local: SocketAddr, peer: SocketAddr) -> Result<(), Foreign> {
    let mine = rustix::process::geteuid().as_raw();
    match tcp_peer_uid(local, peer) {
        Some(uid) if uid != mine => Err(Foreign { uid, mine }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_user_of_a_loopback_peer_and_nobody_elsewhere() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        let me = rustix::process::geteuid().as_raw();
        assert_eq!(tcp_peer_uid(s.local_addr().unwrap(), peer), Some(me));
        assert!(same_user_or_remote(s.local_addr().unwrap(), peer).is_ok());
        // A 4-tuple with no socket behind it.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(tcp_peer_uid(s.local_addr().unwrap(), nobody), None);
        drop(c);
    }
}
