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
/// `inet_diag_msg.idiag_uid` (then `idiag_inode`), after the 16-byte `nlmsghdr`.
const UID_AT: usize = 16 + 4 + 48 + 12;
/// `inet_diag_msg.idiag_state`.
const STATE_AT: usize = 16 + 1;

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

/// Who owns the other end of a TCP connection, as far as this host can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// A process of this host (this network namespace) holds the peer's socket: its user.
    Local(u32),
    /// The peer's address is not this host's: a peer on another host (or network namespace).
    Remote,
    /// The peer's address is this host's, but no process holds a socket there any more (it
    /// closed or reset the connection, and the kernel lists nothing, or only what remains of
    /// it, such as a TIME_WAIT entry, which names uid 0): its owner cannot be established.
    Unknown,
}

/// The owner of the TCP socket at `peer` that is connected to `local` (an accepted
/// connection's two ends as this side sees them).
pub(crate) fn tcp_peer(local: SocketAddr, peer: SocketAddr) -> Owner {
    let (local, peer) = (canonical(local), canonical(peer));
    if let Some(d) = diag(local, peer)
        && d.held()
    {
        return Owner::Local(d.uid);
    }
    if is_this_hosts(peer.ip()) { Owner::Unknown } else { Owner::Remote }
}

/// What the kernel lists of one TCP socket.
struct Diag {
    uid: u32,
    inode: u32,
    state: u8,
}

impl Diag {
    /// Whether a process holds the socket (a file of it exists), or a listener still holds it
    /// in its queue (not yet accepted: it has no file yet, and the listener's owner): its uid
    /// is then its owner's. A socket whose own side was closed (FIN_WAIT, CLOSING, LAST_ACK,
    /// TIME_WAIT: what remains of a connection its process gave up; TIME_WAIT lists uid 0) is
    /// nobody's.
    fn held(&self) -> bool {
        const ESTABLISHED: u8 = 1;
        const SYN_RECV: u8 = 3;
        const CLOSE_WAIT: u8 = 8;
        const NEW_SYN_RECV: u8 = 12;
        self.inode != 0 || matches!(self.state, ESTABLISHED | SYN_RECV | CLOSE_WAIT | NEW_SYN_RECV)
    }
}

/// Whether `ip` is an address of this host (in this network namespace): loopback, or one of
/// its interfaces'. Unsure (the interfaces cannot be listed) counts as this host's, so that
/// a peer is never taken for a remote one by mistake.
fn is_this_hosts(ip: IpAddr) -> bool {
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else { return true };
    addrs.filter_map(|a| a.address).any(|a| {
        a.as_sockaddr_in().is_some_and(|v4| IpAddr::V4(v4.ip()) == ip)
            || a.as_sockaddr_in6().is_some_and(|v6| IpAddr::V6(v6.ip()) == ip)
    })
}

/// The TCP socket at `peer` connected to `local`, from one exact `NETLINK_SOCK_DIAG` lookup
/// of the 4-tuple, or `None` when the kernel has none.
fn diag(local: SocketAddr, peer: SocketAddr) -> Option<Diag> {
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
    let uid = u32::from_ne_bytes(reply.get(UID_AT..UID_AT + 4)?.try_into().ok()?);
    let inode = u32::from_ne_bytes(reply.get(UID_AT + 4..UID_AT + 8)?.try_into().ok()?);
    Some(Diag { uid, inode, state: *reply.get(STATE_AT)? })
}

/// Why a peer on this host may not talk to this process.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Refusal {
    /// It belongs to another user: its uid, and this process's.
    Foreign { uid: u32, mine: u32 },
    /// Its address is this host's but its owner cannot be established (see [`Owner::Unknown`]).
    Unknown,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Foreign { uid, mine } => {
                write!(f, "it belongs to another user on this host (uid {uid}, this process's is {mine})")
            }
            Refusal::Unknown => f.write_str(
                "it comes from this host, but no process holds its socket any more (it closed at once), so whose \
                 it is cannot be established",
            ),
        }
    }
}

/// Whether the other end of a connection between `local` and `peer` may talk to this process:
/// `Err` when it is on this host and another user's, or on this host and nobody's any more.
/// Peers on other hosts are not this check's business (the job's secret is).
pub(crate) fn same_user_or_remote(local: SocketAddr, peer: SocketAddr) -> Result<(), Refusal> {
    let mine = rustix::process::geteuid().as_raw();
    match tcp_peer(local, peer) {
        Owner::Local(uid) if uid != mine => Err(Refusal::Foreign { uid, mine }),
        Owner::Unknown => Err(Refusal::Unknown),
        Owner::Local(_) | Owner::Remote => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_user_of_a_loopback_peer_and_nobody_once_it_is_gone() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        let me = rustix::process::geteuid().as_raw();
        let local = s.local_addr().unwrap();
        assert_eq!(tcp_peer(local, peer), Owner::Local(me));
        assert!(same_user_or_remote(local, peer).is_ok());
        // A 4-tuple of this host with no socket behind it.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(tcp_peer(local, nobody), Owner::Unknown);
        assert!(matches!(same_user_or_remote(local, nobody), Err(Refusal::Unknown)));
        // The peer closes (FIN: its socket lingers, held by no process).
        drop(c);
        assert_eq!(tcp_peer(local, peer), Owner::Unknown);
        // A connection a listener holds and has not accepted yet (a client checking the
        // server it reached): the listener's owner.
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert_eq!(tcp_peer(c.local_addr().unwrap(), l.local_addr().unwrap()), Owner::Local(me));
        // An address that is not this host's.
        assert_eq!(tcp_peer(local, "192.0.2.7:4000".parse().unwrap()), Owner::Remote);
        assert!(is_this_hosts("::1".parse().unwrap()));
    }
}
