//! Addresses: C socket addresses to and from Rust, the TCP port a bound id
//! holds, the local address a peer is reached from, and
//! `rdma_getaddrinfo`/`rdma_freeaddrinfo`.

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::raw::{c_char, c_int};
use std::sync::Mutex;

use tracing::error;

use super::{lock, CmResult};
use crate::ffi;

/// `AF_IB` (librdmacm's InfiniBand address family): not on iWARP.
const AF_IB: c_int = 27;

/// Read a C socket address (AF_INET or AF_INET6).
///
/// # Safety
/// `sa` is NULL or points to a socket address as large as its family says.
pub(crate) unsafe fn from_c(sa: *const ffi::sockaddr) -> CmResult<SocketAddr> {
    if sa.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: every sockaddr starts with the family (caller).
    let family = unsafe { (*sa).sa_family } as c_int;
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in (caller).
            let sin = unsafe { std::ptr::read_unaligned(sa as *const libc::sockaddr_in) };
            Ok(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6 (caller).
            let sin6 = unsafe { std::ptr::read_unaligned(sa as *const libc::sockaddr_in6) };
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        AF_IB => {
            error!("rdma_cm: AF_IB addresses do not exist on stag0 (iWARP: use IPv4/IPv6)");
            Err(libc::EAFNOSUPPORT)
        }
        _ => Err(libc::EAFNOSUPPORT),
    }
}

/// A C socket address for `addr`, and its length.
pub(crate) fn to_c(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and
            // suitably aligned.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Store `addr` (or zeros) into a `struct sockaddr_storage` inside a C
/// struct.
fn store(dst: &mut ffi::sockaddr_storage, addr: Option<&SocketAddr>) {
    let bytes: libc::sockaddr_storage = match addr {
        Some(a) => to_c(a).0,
        // SAFETY: sockaddr_storage is plain data; all zeros is valid.
        None => unsafe { std::mem::zeroed() },
    };
    let n = std::mem::size_of::<ffi::sockaddr_storage>()
        .min(std::mem::size_of::<libc::sockaddr_storage>());
    // SAFETY: copying `n` bytes between two valid, distinct storages.
    unsafe {
        std::ptr::copy_nonoverlapping(&bytes as *const _ as *const u8, dst as *mut _ as *mut u8, n)
    };
}

/// Set `id->route.addr.src_addr`.
pub(crate) fn set_src(id: &mut ffi::rdma_cm_id, addr: Option<&SocketAddr>) {
    // SAFETY: writing a union's storage member (plain data).
    store(
        unsafe { &mut id.route.addr.__bindgen_anon_1.src_storage },
        addr,
    );
}

/// Set `id->route.addr.dst_addr`.
pub(crate) fn set_dst(id: &mut ffi::rdma_cm_id, addr: Option<&SocketAddr>) {
    // SAFETY: writing a union's storage member (plain data).
    store(
        unsafe { &mut id.route.addr.__bindgen_anon_2.dst_storage },
        addr,
    );
}

/// The port (network order) of a C address in an id, as
/// `rdma_get_src_port` returns it.
pub(crate) fn port_be(ss: &ffi::sockaddr_storage) -> u16 {
    let ptr = ss as *const ffi::sockaddr_storage as *const ffi::sockaddr;
    // SAFETY: a storage holds whatever address was stored, or zeros
    // (family 0, port 0).
    match unsafe { from_c(ptr) } {
        Ok(a) => a.port().to_be(),
        Err(_) => 0,
    }
}

/// An IPv4-mapped IPv6 address as IPv4 (how a dual-stack listener sees
/// IPv4 peers).
pub(crate) fn unmap(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => addr,
        },
        v4 => v4,
    }
}

/// The local address packets to `dst` leave from (the routing table's
/// answer, through a connected UDP socket that sends nothing).
pub(crate) fn local_ip_for(dst: IpAddr) -> CmResult<IpAddr> {
    if dst.is_unspecified() || dst.is_loopback() {
        return Ok(dst_loopback(dst));
    }
    let bind: SocketAddr = match dst {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let sock = UdpSocket::bind(bind).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    sock.connect((dst, 9))
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EHOSTUNREACH))?;
    let local = sock
        .local_addr()
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    Ok(local.ip())
}

fn dst_loopback(dst: IpAddr) -> IpAddr {
    match dst {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
    }
}

/// Ports bound by ids of this process (the kernel's rdma_cm refuses a
/// second bind of a port; SO_REUSEADDR below would not).
/// With how many holders (RDMA_OPTION_ID_REUSEADDR shares a port).
static BOUND: Mutex<Option<HashMap<SocketAddr, usize>>> = Mutex::new(None);

/// The kernel backlog of a bound id's socket: connections that arrive
/// before `rdma_listen` (or beyond what its thread has accepted) wait here.
const BACKLOG: c_int = 1024;

/// A TCP port held by a bound id: a socket bound to it, and listening
/// unless the port is shared (RDMA_OPTION_ID_REUSEADDR).
///
/// Why listening already: programs tell their peer the port between
/// `rdma_bind_addr` and `rdma_listen` (qperf 0.4 sends it before
/// `rdma_listen`), and a connect that arrived in between was refused
/// (REJECTED, ECONNREFUSED). The kernel queues it in the backlog instead,
/// and `rdma_listen` takes the socket over with what waits there. An id
/// destroyed without listening closes the socket: what waited is reset,
/// as a refused connect would have been.
#[derive(Debug)]
pub(crate) struct Reservation {
    /// Held open: the port stays ours while it is (None once taken by
    /// [`Reservation::into_listener`]).
    sock: Option<OwnedFd>,
    /// Whether `sock` listens.
    listening: bool,
    /// The bound address, with the port the kernel picked for port 0.
    pub addr: SocketAddr,
    /// Whether the application named the port (not 0).
    pub named: bool,
    /// IPV6_V6ONLY, as bound.
    pub afonly: bool,
    /// The listener a destroyed id left on this very address, which
    /// `rdma_listen` takes over (then `sock` is None).
    pub retired: Option<super::listener::ListenHandle>,
}

impl Reservation {
    /// Bind a TCP socket to `addr` (port 0 picks one). SO_REUSEADDR, as
    /// the listener that replaces it will have, so that a port another
    /// process left in TIME_WAIT binds as it does on the kernel's rdma_cm
    /// (whose port space is not TCP's).
    /// `reuse` (RDMA_OPTION_ID_REUSEADDR) lets it share a port another id
    /// of this process holds without listening.
    pub fn bind(addr: SocketAddr, afonly: bool, reuse: bool) -> CmResult<Reservation> {
        let named = addr.port() != 0;
        // A listener retired on this port: taken over if bound exactly so,
        // else closed, freeing the port.
        if let Some(h) = super::listener::take_retired(addr, afonly, reuse) {
            let mut bound = lock(&BOUND);
            let holders = bound
                .get_or_insert_with(HashMap::new)
                .entry(addr)
                .or_insert(0);
            if *holders > 0 {
                return Err(libc::EADDRINUSE);
            }
            *holders += 1;
            return Ok(Reservation {
                sock: None,
                listening: true,
                addr,
                named,
                afonly,
                retired: Some(h),
            });
        }
        let family = match addr {
            SocketAddr::V4(_) => libc::AF_INET,
            SocketAddr::V6(_) => libc::AF_INET6,
        };
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(super::verbs::last_errno(libc::EMFILE));
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let one: c_int = 1;
        let set = |level, name, v: &c_int| {
            // SAFETY: setsockopt with a valid int option value.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    level,
                    name,
                    (v as *const c_int).cast(),
                    std::mem::size_of::<c_int>() as libc::socklen_t,
                )
            }
        };
        set(libc::SOL_SOCKET, libc::SO_REUSEADDR, &one);
        if family == libc::AF_INET6 && afonly {
            set(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &one);
        }
        let (ss, len) = to_c(&addr);
        if !reuse
            && addr.port() != 0
            && lock(&BOUND)
                .get_or_insert_with(HashMap::new)
                .contains_key(&addr)
        {
            return Err(libc::EADDRINUSE);
        }
        // SAFETY: binding to a valid address of `len` bytes.
        if unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &ss as *const _ as *const libc::sockaddr,
                len,
            )
        } != 0
        {
            let e = super::verbs::last_errno(libc::EADDRINUSE);
            // Sharing a port another id of ours holds, listening: its
            // socket keeps the port; this id only counts as a holder.
            let mut bound = lock(&BOUND);
            match bound.get_or_insert_with(HashMap::new).get_mut(&addr) {
                Some(holders) if reuse && e == libc::EADDRINUSE => {
                    *holders += 1;
                    return Ok(Reservation {
                        sock: None,
                        listening: false,
                        addr,
                        named,
                        afonly,
                        retired: None,
                    });
                }
                _ => return Err(e),
            }
        }
        // SAFETY: sockaddr_storage is plain data.
        let mut got: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut glen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: getsockname into a storage of `glen` bytes.
        if unsafe {
            libc::getsockname(
                fd.as_raw_fd(),
                &mut got as *mut _ as *mut libc::sockaddr,
                &mut glen,
            )
        } != 0
        {
            return Err(super::verbs::last_errno(libc::EIO));
        }
        // SAFETY: getsockname filled a valid address.
        let addr = unsafe { from_c(&got as *const _ as *const ffi::sockaddr) }?;
        let mut bound = lock(&BOUND);
        let holders = bound
            .get_or_insert_with(HashMap::new)
            .entry(addr)
            .or_insert(0);
        if *holders > 0 && !reuse {
            return Err(libc::EADDRINUSE);
        }
        *holders += 1;
        // A shared port is bound by several sockets, which cannot all
        // listen; its listener binds at rdma_listen as before.
        // SAFETY: listen(2) on the socket we own.
        let listening = !reuse && unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) } == 0;
        Ok(Reservation {
            sock: Some(fd),
            listening,
            addr,
            named,
            afonly,
            retired: None,
        })
    }

    /// For an active id: the address the application bound with a port it
    /// named, for the connection to leave from (the kernel's rdma_cm
    /// honours it); the reservation's socket closes so that the
    /// connection can bind it, and the port stays this process's until
    /// the id goes. None for a port the kernel picked.
    pub fn release_for_connect(&mut self) -> Option<SocketAddr> {
        if !self.named {
            return None;
        }
        self.sock = None;
        self.retired = None;
        Some(self.addr)
    }

    /// The reserved socket, listening, for `rdma_listen` to take over: the
    /// connections queued since `rdma_bind_addr` come with it, and so do
    /// the options it was bound with (`IPV6_V6ONLY` for
    /// RDMA_OPTION_ID_AFONLY, so that `[::]` and `0.0.0.0` on one port can
    /// both listen, as tgt's iSER portal does). A shared port's socket
    /// starts listening only now (EADDRINUSE if another already does).
    pub fn into_listener(mut self) -> CmResult<std::net::TcpListener> {
        let fd = self.sock.take().ok_or(libc::EINVAL)?;
        // SAFETY: listen(2) on a bound stream socket we own.
        if !self.listening && unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) } != 0 {
            return Err(super::verbs::last_errno(libc::EADDRINUSE));
        }
        Ok(std::net::TcpListener::from(fd))
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(b) = lock(&BOUND).as_mut() {
            if let Some(n) = b.get_mut(&self.addr) {
                *n -= 1;
                if *n == 0 {
                    b.remove(&self.addr);
                }
            }
        }
    }
}

/// A TCP connection to `dst` from `src` (SO_REUSEADDR, as the port's
/// reservation had), giving up after `timeout` (SO_SNDTIMEO bounds
/// connect(2); cleared after).
pub(crate) fn dial_from(
    src: SocketAddr,
    dst: SocketAddr,
    timeout: std::time::Duration,
) -> std::io::Result<std::net::TcpStream> {
    let family = match dst {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // Both in the destination's family.
    let src = match (src, dst) {
        (SocketAddr::V4(s), SocketAddr::V6(_)) => {
            SocketAddr::new(IpAddr::V6(s.ip().to_ipv6_mapped()), s.port())
        }
        (SocketAddr::V6(s), SocketAddr::V4(_)) => match s.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), s.port()),
            None => return Err(std::io::Error::from_raw_os_error(libc::EAFNOSUPPORT)),
        },
        _ => src,
    };
    // SAFETY: plain socket(2).
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: c_int = 1;
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    let zero = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let set_tv = |v: &libc::timeval| {
        // SAFETY: setsockopt with a valid timeval.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDTIMEO,
                (v as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        }
    };
    // SAFETY: setsockopt with a valid int option value.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const c_int).cast(),
            std::mem::size_of::<c_int>() as libc::socklen_t,
        )
    };
    set_tv(&tv);
    let (ss, len) = to_c(&src);
    // SAFETY: binding to a valid address of `len` bytes.
    if unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &ss as *const _ as *const libc::sockaddr,
            len,
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    let (ds, dlen) = to_c(&dst);
    // SAFETY: connecting to a valid address of `dlen` bytes.
    if unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &ds as *const _ as *const libc::sockaddr,
            dlen,
        )
    } != 0
    {
        let e = std::io::Error::last_os_error();
        // A connect that ran out of SO_SNDTIMEO says EINPROGRESS.
        return Err(if e.raw_os_error() == Some(libc::EINPROGRESS) {
            std::io::Error::from_raw_os_error(libc::ETIMEDOUT)
        } else {
            e
        });
    }
    set_tv(&zero);
    Ok(std::net::TcpStream::from(fd))
}

/// Allocate a copy of `addr` with malloc (freed by rdma_freeaddrinfo).
#[cfg(test)]
fn malloc_addr(addr: &SocketAddr) -> CmResult<(*mut ffi::sockaddr, ffi::socklen_t)> {
    let (ss, len) = to_c(addr);
    // SAFETY: plain malloc.
    let p = unsafe { libc::malloc(len as usize) } as *mut u8;
    if p.is_null() {
        return Err(libc::ENOMEM);
    }
    // SAFETY: `p` holds `len` bytes; `ss` at least as many.
    unsafe { std::ptr::copy_nonoverlapping(&ss as *const _ as *const u8, p, len as usize) };
    Ok((p.cast(), len as ffi::socklen_t))
}

/// Allocate a copy of a C address of `len` bytes.
///
/// # Safety
/// `sa` points to `len` readable bytes.
unsafe fn malloc_copy(
    sa: *const ffi::sockaddr,
    len: ffi::socklen_t,
) -> CmResult<*mut ffi::sockaddr> {
    // SAFETY: plain malloc.
    let p = unsafe { libc::malloc(len as usize) } as *mut u8;
    if p.is_null() {
        return Err(libc::ENOMEM);
    }
    // SAFETY: `sa` has `len` bytes (caller), `p` as many.
    unsafe { std::ptr::copy_nonoverlapping(sa as *const u8, p, len as usize) };
    Ok(p.cast())
}

/// What `rdma_getaddrinfo` returns: 0, an `EAI_*` code from getaddrinfo(3)
/// (as librdmacm passes it on), or -1 with `errno`.
pub(crate) enum GaiError {
    Gai(c_int),
    Errno(c_int),
}

impl From<c_int> for GaiError {
    fn from(e: c_int) -> Self {
        GaiError::Errno(e)
    }
}

/// `rdma_getaddrinfo`.
///
/// # Safety
/// `node`/`service` are NULL or NUL-terminated strings; `hints` is NULL or
/// a valid `rdma_addrinfo` whose address pointers hold their lengths; `res`
/// is a valid out-pointer.
pub(crate) unsafe fn getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const ffi::rdma_addrinfo,
    res: *mut *mut ffi::rdma_addrinfo,
) -> Result<(), GaiError> {
    if res.is_null() || (node.is_null() && service.is_null() && hints.is_null()) {
        return Err(libc::EINVAL.into());
    }
    let nohints = ffi::rdma_addrinfo::default();
    let h = if hints.is_null() {
        &nohints
    } else {
        // SAFETY: not NULL, so valid (the caller's contract).
        unsafe { &*hints }
    };
    if h.ai_family == AF_IB {
        error!("rdma_cm: rdma_getaddrinfo: AF_IB does not exist on stag0 (iWARP)");
        return Err(libc::EAFNOSUPPORT.into());
    }
    // SAFETY: plain calloc.
    let rai = unsafe { libc::calloc(1, std::mem::size_of::<ffi::rdma_addrinfo>()) }
        as *mut ffi::rdma_addrinfo;
    if rai.is_null() {
        return Err(libc::ENOMEM.into());
    }
    // SAFETY: rai is a fresh zeroed allocation, owned here until returned.
    let r = unsafe { fill(node, service, h, hints.is_null(), &mut *rai) };
    match r {
        Ok(()) => {
            // SAFETY: valid out-pointer (caller).
            unsafe { *res = rai };
            Ok(())
        }
        Err(e) => {
            // SAFETY: rai and what fill allocated are ours.
            unsafe { freeaddrinfo(rai) };
            Err(e)
        }
    }
}

/// Fill a zeroed `rai` from getaddrinfo(3) or the hints (librdmacm's
/// ucma_getaddrinfo/ucma_convert_to_rai).
///
/// # Safety
/// As [`getaddrinfo`].
unsafe fn fill(
    node: *const c_char,
    service: *const c_char,
    h: &ffi::rdma_addrinfo,
    no_hints: bool,
    rai: &mut ffi::rdma_addrinfo,
) -> Result<(), GaiError> {
    let passive = h.ai_flags as u32 & ffi::RAI_PASSIVE != 0;
    if !node.is_null() || !service.is_null() {
        // SAFETY: addrinfo is plain data; all-zero is valid hints.
        let mut ai_hints: libc::addrinfo = unsafe { std::mem::zeroed() };
        if passive {
            ai_hints.ai_flags |= libc::AI_PASSIVE;
        }
        if h.ai_flags as u32 & ffi::RAI_NUMERICHOST != 0 {
            ai_hints.ai_flags |= libc::AI_NUMERICHOST;
        }
        ai_hints.ai_family = h.ai_family;
        ai_hints.ai_socktype = match h.ai_qp_type as ffi::ibv_qp_type {
            ffi::IBV_QPT_RC | ffi::IBV_QPT_UC | ffi::IBV_QPT_XRC_SEND | ffi::IBV_QPT_XRC_RECV => {
                libc::SOCK_STREAM
            }
            ffi::IBV_QPT_UD => libc::SOCK_DGRAM,
            _ => 0,
        };
        ai_hints.ai_protocol = match h.ai_port_space as ffi::rdma_port_space {
            ffi::RDMA_PS_TCP => libc::IPPROTO_TCP,
            ffi::RDMA_PS_UDP | ffi::RDMA_PS_IPOIB => libc::IPPROTO_UDP,
            ffi::RDMA_PS_IB => match ai_hints.ai_socktype {
                libc::SOCK_STREAM => libc::IPPROTO_TCP,
                libc::SOCK_DGRAM => libc::IPPROTO_UDP,
                _ => 0,
            },
            _ => 0,
        };
        let mut ai: *mut libc::addrinfo = std::ptr::null_mut();
        let hp = if no_hints {
            std::ptr::null()
        } else {
            &ai_hints as *const libc::addrinfo
        };
        // SAFETY: strings valid or NULL (caller); `ai` a valid out-pointer.
        let rc = unsafe { libc::getaddrinfo(node, service, hp, &mut ai) };
        if rc != 0 {
            return Err(GaiError::Gai(rc));
        }
        // SAFETY: getaddrinfo succeeded: `ai` is a valid list, freed below.
        let first = unsafe { &*ai };
        let out = (|| -> CmResult<()> {
            rai.ai_qp_type = if h.ai_qp_type != 0 {
                h.ai_qp_type
            } else {
                match first.ai_socktype {
                    libc::SOCK_STREAM => ffi::IBV_QPT_RC as c_int,
                    libc::SOCK_DGRAM => ffi::IBV_QPT_UD as c_int,
                    _ => 0,
                }
            };
            rai.ai_port_space = if h.ai_port_space != 0 {
                h.ai_port_space
            } else {
                match first.ai_protocol {
                    libc::IPPROTO_TCP => ffi::RDMA_PS_TCP as c_int,
                    libc::IPPROTO_UDP => ffi::RDMA_PS_UDP as c_int,
                    _ => 0,
                }
            };
            rai.ai_family = first.ai_family;
            // SAFETY: getaddrinfo's address holds ai_addrlen bytes.
            let addr = unsafe { malloc_copy(first.ai_addr.cast(), first.ai_addrlen as _) }?;
            let canon = if first.ai_canonname.is_null() {
                std::ptr::null_mut()
            } else {
                // SAFETY: a NUL-terminated string from getaddrinfo.
                unsafe { libc::strdup(first.ai_canonname) }
            };
            if passive {
                rai.ai_flags = ffi::RAI_PASSIVE as c_int;
                rai.ai_src_addr = addr;
                rai.ai_src_len = first.ai_addrlen as _;
                rai.ai_src_canonname = canon;
            } else {
                rai.ai_dst_addr = addr;
                rai.ai_dst_len = first.ai_addrlen as _;
                rai.ai_dst_canonname = canon;
            }
            Ok(())
        })();
        // SAFETY: the list from getaddrinfo, freed once.
        unsafe { libc::freeaddrinfo(ai) };
        out?;
    } else {
        rai.ai_flags = h.ai_flags;
        rai.ai_family = h.ai_family;
        rai.ai_qp_type = h.ai_qp_type;
        rai.ai_port_space = h.ai_port_space;
        if h.ai_dst_len != 0 && !h.ai_dst_addr.is_null() {
            // SAFETY: the hints' address holds ai_dst_len bytes (caller).
            rai.ai_dst_addr = unsafe { malloc_copy(h.ai_dst_addr, h.ai_dst_len) }?;
            rai.ai_dst_len = h.ai_dst_len;
        }
    }
    if rai.ai_src_len == 0 && h.ai_src_len != 0 && !h.ai_src_addr.is_null() {
        // SAFETY: the hints' address holds ai_src_len bytes (caller).
        rai.ai_src_addr = unsafe { malloc_copy(h.ai_src_addr, h.ai_src_len) }?;
        rai.ai_src_len = h.ai_src_len;
    }
    Ok(())
}

/// `rdma_freeaddrinfo`.
///
/// # Safety
/// `res` is NULL or a list returned by [`getaddrinfo`], not freed yet.
pub(crate) unsafe fn freeaddrinfo(mut res: *mut ffi::rdma_addrinfo) {
    while !res.is_null() {
        // SAFETY: a node of our list; each pointer is ours (malloc'd) or
        // NULL, and free(NULL) is a no-op.
        unsafe {
            let next = (*res).ai_next;
            libc::free((*res).ai_connect);
            libc::free((*res).ai_route);
            libc::free((*res).ai_src_canonname.cast());
            libc::free((*res).ai_dst_canonname.cast());
            libc::free((*res).ai_src_addr.cast());
            libc::free((*res).ai_dst_addr.cast());
            libc::free(res.cast());
            res = next;
        }
    }
}

/// Read a C string for logs.
///
/// # Safety
/// NULL or NUL-terminated.
pub(crate) unsafe fn cstr_lossy(s: *const c_char) -> String {
    if s.is_null() {
        "(null)".into()
    } else {
        // SAFETY: NUL-terminated (caller).
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

/// `malloc_addr` for callers outside (rdma_create_ep keeps none; tests).
#[cfg(test)]
pub(crate) fn malloc_addr_for_test(addr: &SocketAddr) -> (*mut ffi::sockaddr, ffi::socklen_t) {
    malloc_addr(addr).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    fn gai(
        node: Option<&str>,
        service: Option<&str>,
        hints: Option<&ffi::rdma_addrinfo>,
    ) -> Result<*mut ffi::rdma_addrinfo, GaiError> {
        let node = node.map(|s| CString::new(s).unwrap());
        let service = service.map(|s| CString::new(s).unwrap());
        let mut res = std::ptr::null_mut();
        // SAFETY: valid strings/hints and out-pointer.
        unsafe {
            getaddrinfo(
                node.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                service.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                hints.map_or(std::ptr::null(), |h| h as *const _),
                &mut res,
            )
        }
        .map(|()| res)
    }

    fn tcp_hints(flags: u32) -> ffi::rdma_addrinfo {
        ffi::rdma_addrinfo {
            ai_flags: flags as c_int,
            ai_port_space: ffi::RDMA_PS_TCP as c_int,
            ..Default::default()
        }
    }

    #[test]
    fn numeric_active_fills_destination() {
        let h = tcp_hints(0);
        let r = gai(Some("127.0.0.1"), Some("7471"), Some(&h)).ok().unwrap();
        // SAFETY: a list we just got.
        let ai = unsafe { &*r };
        assert_eq!(ai.ai_flags, 0);
        assert_eq!(ai.ai_port_space, ffi::RDMA_PS_TCP as c_int);
        assert_eq!(ai.ai_qp_type, ffi::IBV_QPT_RC as c_int);
        assert_eq!(ai.ai_family, libc::AF_INET);
        assert!(ai.ai_src_addr.is_null());
        // SAFETY: a valid sockaddr_in copy.
        let dst = unsafe { from_c(ai.ai_dst_addr) }.unwrap();
        assert_eq!(dst, "127.0.0.1:7471".parse().unwrap());
        assert_eq!(
            ai.ai_dst_len as usize,
            std::mem::size_of::<libc::sockaddr_in>()
        );
        // SAFETY: ours, freed once.
        unsafe { freeaddrinfo(r) };
    }

    #[test]
    fn passive_without_node_is_wildcard_source() {
        let h = tcp_hints(ffi::RAI_PASSIVE);
        let r = gai(None, Some("echo"), Some(&h)).ok().unwrap();
        // SAFETY: a list we just got.
        let ai = unsafe { &*r };
        assert_eq!(ai.ai_flags, ffi::RAI_PASSIVE as c_int);
        assert!(ai.ai_dst_addr.is_null());
        // SAFETY: a valid socket address copy.
        let src = unsafe { from_c(ai.ai_src_addr) }.unwrap();
        assert!(src.ip().is_unspecified());
        assert_eq!(src.port(), 7);
        // SAFETY: ours, freed once.
        unsafe { freeaddrinfo(r) };
    }

    #[test]
    fn hostname_resolves() {
        let r = gai(Some("localhost"), Some("1234"), None).ok().unwrap();
        // SAFETY: a list we just got.
        let ai = unsafe { &*r };
        // SAFETY: a valid socket address copy.
        let dst = unsafe { from_c(ai.ai_dst_addr) }.unwrap();
        assert!(dst.ip().is_loopback());
        assert_eq!(dst.port(), 1234);
        assert_eq!(ai.ai_port_space, ffi::RDMA_PS_TCP as c_int);
        // SAFETY: ours, freed once.
        unsafe { freeaddrinfo(r) };
    }

    #[test]
    fn bare_addresses_from_hints() {
        let (dst, dlen) = malloc_addr_for_test(&"10.1.2.3:99".parse().unwrap());
        let (src, slen) = malloc_addr_for_test(&"10.1.2.4:0".parse().unwrap());
        let h = ffi::rdma_addrinfo {
            ai_dst_addr: dst,
            ai_dst_len: dlen,
            ai_src_addr: src,
            ai_src_len: slen,
            ai_qp_type: ffi::IBV_QPT_RC as c_int,
            ai_port_space: ffi::RDMA_PS_TCP as c_int,
            ..Default::default()
        };
        let r = gai(None, None, Some(&h)).ok().unwrap();
        // SAFETY: a list we just got; addresses are valid copies.
        unsafe {
            let ai = &*r;
            assert_eq!(
                from_c(ai.ai_dst_addr).unwrap(),
                "10.1.2.3:99".parse().unwrap()
            );
            assert_eq!(
                from_c(ai.ai_src_addr).unwrap(),
                "10.1.2.4:0".parse().unwrap()
            );
            assert_ne!(ai.ai_dst_addr, dst);
            freeaddrinfo(r);
            libc::free(dst.cast());
            libc::free(src.cast());
        }
    }

    #[test]
    fn errors_follow_librdmacm() {
        assert!(matches!(
            gai(None, None, None),
            Err(GaiError::Errno(libc::EINVAL))
        ));
        let h = tcp_hints(ffi::RAI_NUMERICHOST);
        assert!(matches!(
            gai(Some("not-a-number.invalid"), Some("1"), Some(&h)),
            Err(GaiError::Gai(_))
        ));
        let ib = ffi::rdma_addrinfo {
            ai_family: AF_IB,
            ..Default::default()
        };
        assert!(matches!(
            gai(Some("::1"), None, Some(&ib)),
            Err(GaiError::Errno(libc::EAFNOSUPPORT))
        ));
    }

    #[test]
    fn reservation_holds_a_port_once() {
        let r = Reservation::bind("127.0.0.1:0".parse().unwrap(), false, false).unwrap();
        assert_ne!(r.addr.port(), 0);
        assert_eq!(
            Reservation::bind(r.addr, false, false).unwrap_err(),
            libc::EADDRINUSE
        );
        // RDMA_OPTION_ID_REUSEADDR shares it.
        let shared = Reservation::bind(r.addr, false, true).unwrap();
        let a = r.addr;
        drop(r);
        assert_eq!(
            Reservation::bind(a, false, false).unwrap_err(),
            libc::EADDRINUSE
        );
        drop(shared);
        let again = Reservation::bind(a, false, false).unwrap();
        assert_eq!(again.addr, a);
    }

    #[test]
    fn addresses_round_trip_through_c() {
        for s in ["127.0.0.1:80", "[::1]:443"] {
            let a: SocketAddr = s.parse().unwrap();
            let (ss, _) = to_c(&a);
            // SAFETY: a valid socket address.
            let b = unsafe { from_c(&ss as *const _ as *const ffi::sockaddr) }.unwrap();
            assert_eq!(a, b);
        }
        let mut id = ffi::rdma_cm_id::default();
        set_src(&mut id, Some(&"1.2.3.4:5".parse().unwrap()));
        // SAFETY: reading the storage member just written.
        let src = unsafe { &id.route.addr.__bindgen_anon_1.src_storage };
        assert_eq!(port_be(src), 5u16.to_be());
        assert_eq!(
            unmap("[::ffff:127.0.0.1]:9".parse().unwrap()),
            "127.0.0.1:9".parse().unwrap()
        );
    }
}
