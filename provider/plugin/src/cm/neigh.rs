//! Address resolution's neighbour step: `rdma_resolve_addr` completes
//! once the next hop towards the peer answers ARP, as the kernel's
//! rdma_cm does, and fails with ADDR_ERROR (-ETIMEDOUT) when it has not
//! within the call's `timeout_ms`. Without this a peer address nobody
//! answers for resolved at once, and the failure came only from the TCP
//! connect, much later and as another event.
//!
//! Unprivileged, so read from the kernel's tables: the next hop from
//! `/proc/net/route`, its state from `/proc/net/arp` (complete: ATF_COM).
//! Resolution is started with one empty UDP datagram to the peer's
//! discard port (9), which makes the kernel resolve the next hop. IPv4
//! only: IPv6 peers, local addresses and interfaces without ARP (NOARP:
//! loopback, tunnels, dummy) resolve at once, as before.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

/// `ATF_COM` in `/proc/net/arp`'s flags: the entry is complete.
const ATF_COM: u32 = 0x2;
/// `IFF_NOARP` in an interface's flags.
const IFF_NOARP: u32 = 0x80;
/// `RTF_UP` and `RTF_GATEWAY` in `/proc/net/route`'s flags.
const RTF_UP: u32 = 0x1;
const RTF_GATEWAY: u32 = 0x2;
/// How often the ARP table is read while waiting.
const POLL: Duration = Duration::from_millis(5);

/// The next hop towards `dst` that must answer ARP, with its interface;
/// None when nothing needs resolving.
pub(crate) fn hop_to_resolve(dst: IpAddr, local: IpAddr) -> Option<(Ipv4Addr, String)> {
    let IpAddr::V4(dst) = dst else { return None };
    if dst.is_loopback() || dst.is_multicast() || dst.is_broadcast() || IpAddr::V4(dst) == local {
        return None;
    }
    let routes = std::fs::read_to_string("/proc/net/route").ok()?;
    let (hop, iface) = next_hop(&routes, dst)?;
    let flags = iface_flags(&iface)?;
    (flags & IFF_NOARP == 0).then_some((hop, iface))
}

/// The interface's flags (SIOCGIFFLAGS: this network namespace's view,
/// which `/sys/class/net` is not unless sysfs was mounted in it).
fn iface_flags(iface: &str) -> Option<u32> {
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let name = iface.as_bytes();
    if name.len() >= req.ifr_name.len() {
        return None;
    }
    for (d, s) in req.ifr_name.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket(2); closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: SIOCGIFFLAGS reads the NUL-terminated name of `req` and
    // writes its flags member.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) };
    // SAFETY: our descriptor, closed once.
    unsafe { libc::close(fd) };
    if rc != 0 {
        return None;
    }
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    Some(unsafe { req.ifr_ifru.ifru_flags } as u16 as u32)
}

/// The longest-prefix route of `routes` (`/proc/net/route`) to `dst`: its
/// gateway, or `dst` itself on a directly connected network.
fn next_hop(routes: &str, dst: Ipv4Addr) -> Option<(Ipv4Addr, String)> {
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    // The table prints addresses as the kernel holds them (network order
    // read as a native integer).
    let dst_raw = u32::from_ne_bytes(dst.octets());
    let mut best: Option<(u32, Ipv4Addr, String)> = None;
    for line in routes.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 {
            continue;
        }
        let (Some(net), Some(gw), Some(flags), Some(mask)) =
            (hex(f[1]), hex(f[2]), hex(f[3]), hex(f[7]))
        else {
            continue;
        };
        if flags & RTF_UP == 0 || dst_raw & mask != net {
            continue;
        }
        let len = u32::from_be(mask).count_ones();
        if best.as_ref().is_some_and(|(l, _, _)| *l >= len) {
            continue;
        }
        let hop = if flags & RTF_GATEWAY != 0 {
            Ipv4Addr::from(gw.to_ne_bytes())
        } else {
            dst
        };
        best = Some((len, hop, f[0].to_string()));
    }
    best.map(|(_, hop, iface)| (hop, iface))
}

/// Whether `arp` (`/proc/net/arp`) holds a complete entry for `hop` on
/// `iface`.
fn complete(arp: &str, hop: Ipv4Addr, iface: &str) -> bool {
    arp.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.len() >= 6
            && f[0].parse::<Ipv4Addr>().ok() == Some(hop)
            && f[5] == iface
            && u32::from_str_radix(f[2].trim_start_matches("0x"), 16)
                .is_ok_and(|flags| flags & ATF_COM != 0)
    })
}

fn resolved(hop: Ipv4Addr, iface: &str) -> bool {
    std::fs::read_to_string("/proc/net/arp").is_ok_and(|arp| complete(&arp, hop, iface))
}

/// The hop of [`hop_to_resolve`] if it is not resolved yet.
pub(crate) fn pending_hop(dst: IpAddr, local: IpAddr) -> Option<(Ipv4Addr, String)> {
    hop_to_resolve(dst, local).filter(|(hop, iface)| !resolved(*hop, iface))
}

/// Whether `hop` answered ARP within `timeout` (resolution started by a
/// datagram to `dst`).
pub(crate) fn wait_resolved(dst: IpAddr, hop: Ipv4Addr, iface: &str, timeout: Duration) -> bool {
    if resolved(hop, iface) {
        return true;
    }
    let deadline = Instant::now() + timeout;
    // An unbound UDP socket: the datagram leaves through the route's
    // interface and only starts the kernel's resolution.
    if let Ok(sock) = UdpSocket::bind(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0)) {
        let _ = sock.send_to(&[], SocketAddr::new(dst, 9));
    }
    loop {
        if resolved(hop, iface) {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(POLL.min(deadline - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTES: &str =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
        eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
        eth0\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
        v0\t00004D0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";

    #[test]
    fn next_hop_is_the_longest_match_or_its_gateway() {
        assert_eq!(
            next_hop(ROUTES, Ipv4Addr::new(10, 77, 0, 2)),
            Some((Ipv4Addr::new(10, 77, 0, 2), "v0".into()))
        );
        assert_eq!(
            next_hop(ROUTES, Ipv4Addr::new(192, 168, 1, 9)),
            Some((Ipv4Addr::new(192, 168, 1, 9), "eth0".into()))
        );
        assert_eq!(
            next_hop(ROUTES, Ipv4Addr::new(8, 8, 8, 8)),
            Some((Ipv4Addr::new(192, 168, 1, 1), "eth0".into()))
        );
        assert_eq!(next_hop("Iface\n", Ipv4Addr::new(8, 8, 8, 8)), None);
    }

    #[test]
    fn only_complete_entries_count() {
        let arp =
            "IP address       HW type     Flags       HW address            Mask     Device\n\
            10.77.0.2        0x1         0x0         00:00:00:00:00:00     *        v0\n\
            10.77.0.3        0x1         0x2         96:b7:bd:5e:b7:0a     *        v0\n";
        assert!(!complete(arp, Ipv4Addr::new(10, 77, 0, 2), "v0"));
        assert!(complete(arp, Ipv4Addr::new(10, 77, 0, 3), "v0"));
        assert!(!complete(arp, Ipv4Addr::new(10, 77, 0, 3), "eth0"));
    }
}
