//! The id operations around connections: create/destroy, bind, address
//! and route resolution, options, migration between channels.

use std::net::{IpAddr, SocketAddr};
use std::os::raw::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use provider::thread::SpawnMasked;
use tracing::{debug, error};

use super::addr::{from_c, local_ip_for, set_dst, set_src, unmap, Reservation};
use super::channel::Channel;
use super::conn::complete;
use super::event::ack_held;
use super::id::{Id, Op, Pending, Phase};
use super::{conn, neigh, verbs, CmResult};
use crate::ffi;

/// `rdma_create_id` (NULL channel: a synchronous id with a private one).
pub(crate) fn create_id(
    channel: *mut ffi::rdma_event_channel,
    context: *mut c_void,
    ps: ffi::rdma_port_space,
    qp_type: Option<ffi::ibv_qp_type>,
) -> CmResult<Arc<Id>> {
    let qp_type = match ps {
        ffi::RDMA_PS_TCP | ffi::RDMA_PS_IB => qp_type.unwrap_or(ffi::IBV_QPT_RC),
        ffi::RDMA_PS_UDP | ffi::RDMA_PS_IPOIB => {
            error!(
                ps,
                "rdma_cm: stag0 is an iWARP device: no UD QPs, so no UDP/IPoIB port space"
            );
            return Err(libc::EPROTONOSUPPORT);
        }
        _ => return Err(libc::EINVAL),
    };
    let (channel, sync) = if channel.is_null() {
        // Registered like any channel: the application may poll
        // id->channel->fd or call rdma_get_cm_event on it.
        let ch = Channel::new()?;
        ch.register();
        (ch, true)
    } else {
        (Channel::lookup(channel)?, false)
    };
    Ok(Id::create(channel, sync, context, ps, qp_type))
}

/// `rdma_destroy_id`.
pub(crate) fn destroy_id(ptr: *mut ffi::rdma_cm_id) -> CmResult<()> {
    let id = Id::unregister(ptr).ok_or(libc::EINVAL)?;
    conn::teardown(&id);
    ack_held(&id);
    let st = id.state();
    if st.sync {
        Channel::unregister(st.channel.raw());
    }
    Ok(())
}

/// Give the id stag0: `id->verbs`, `id->pd`, `id->port_num`.
fn attach_device(id: &Id) -> CmResult<()> {
    let stag = verbs::stag()?;
    // SAFETY: application thread inside a cm call on `id`.
    let c = unsafe { id.c() };
    c.verbs = stag.ctx;
    if c.pd.is_null() {
        c.pd = stag.pd;
    }
    c.port_num = 1;
    Ok(())
}

/// `rdma_bind_addr`.
pub(crate) fn bind(id: &Arc<Id>, addr: SocketAddr) -> CmResult<()> {
    let mut st = id.state();
    if !st.phase.allows(Op::Bind) {
        return Err(libc::EINVAL);
    }
    let r = Reservation::bind(addr, st.options.afonly, st.options.reuseaddr)?;
    let bound = r.addr;
    st.reservation = Some(r);
    st.src = Some(bound);
    st.phase = Phase::Bound;
    drop(st);
    debug!(%bound, "rdma_cm: bound");
    // SAFETY: application thread inside rdma_bind_addr.
    set_src(unsafe { id.c() }, Some(&bound));
    // A specific address belongs to a device (every interface address is
    // stag0's); a wildcard binds none yet, as with the kernel. Nor does
    // loopback, which no kernel RDMA device has: libfabric's verbs
    // provider binds `localhost` to learn its source address and, finding
    // no device there, takes the address of the interface it chose
    // (FI_VERBS_IFACE) instead of 127.0.0.1, which no other host reaches.
    if !bound.ip().is_unspecified() && !unmap(bound).ip().is_loopback() {
        attach_device(id)?;
    }
    Ok(())
}

/// `rdma_resolve_addr`: ADDR_RESOLVED once the next hop answers ARP (at
/// once if it did before, or needs none), ADDR_ERROR with -ETIMEDOUT if it
/// does not within `timeout`, with -EHOSTUNREACH at once without a route;
/// the local address is the routing table's choice for the peer.
pub(crate) fn resolve_addr(
    id: &Arc<Id>,
    src: Option<SocketAddr>,
    dst: SocketAddr,
    timeout: Duration,
) -> CmResult<()> {
    {
        let st = id.state();
        if !st.phase.allows(Op::ResolveAddr) {
            return Err(libc::EINVAL);
        }
    }
    if let Some(src) = src {
        if id.state().phase == Phase::Idle {
            bind(id, src)?;
        }
    }
    attach_device(id)?;
    let mut st = id.state();
    let local = match local_ip_for(dst.ip()) {
        Ok(ip) => Some(ip),
        Err(e) => {
            debug!(%dst, errno = e, "rdma_cm: no route to the peer");
            None
        }
    };
    let Some(ip) = local else {
        st.channel.push(Pending::new(
            id.clone(),
            ffi::RDMA_CM_EVENT_ADDR_ERROR,
            -libc::EHOSTUNREACH,
        ));
        drop(st);
        return complete(id);
    };
    let src = match st.src {
        Some(s) if !s.ip().is_unspecified() => s,
        Some(s) => SocketAddr::new(same_family(ip, dst.ip()), s.port()),
        None => SocketAddr::new(same_family(ip, dst.ip()), 0),
    };
    st.src = Some(src);
    st.dst = Some(dst);
    let before = st.phase;
    st.phase = Phase::AddrResolved;
    {
        // The addresses are in place before another thread can take the
        // event.
        // SAFETY: application thread inside rdma_resolve_addr.
        let c = unsafe { id.c() };
        set_src(c, Some(&src));
        set_dst(c, Some(&dst));
    }
    // The next hop must answer ARP first (neigh's comment); a thread
    // waits for it, up to the call's timeout.
    if let Some((hop, iface)) = neigh::pending_hop(unmap(dst).ip(), ip) {
        drop(st);
        debug!(%dst, %hop, %iface, ?timeout, "rdma_cm: resolving the next hop");
        let id2 = id.clone();
        let resolve = move || {
            let ok = neigh::wait_resolved(unmap(dst).ip(), hop, &iface, timeout);
            let mut st = id2.state();
            if st.destroyed || st.phase != Phase::AddrResolved {
                return;
            }
            if ok {
                debug!(%src, %dst, "rdma_cm: address resolved");
                st.channel.push(Pending::new(
                    id2.clone(),
                    ffi::RDMA_CM_EVENT_ADDR_RESOLVED,
                    0,
                ));
            } else {
                debug!(%dst, %hop, "rdma_cm: the next hop did not answer ARP in time");
                st.phase = before;
                st.channel.push(Pending::new(
                    id2.clone(),
                    ffi::RDMA_CM_EVENT_ADDR_ERROR,
                    -libc::ETIMEDOUT,
                ));
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("stag-cm-resolve".into())
            .spawn_masked(resolve)
        {
            debug!(error = %e, "rdma_cm: no resolver thread");
            id.state().phase = before;
            return Err(libc::EAGAIN);
        }
        return complete(id);
    }
    st.channel.push(Pending::new(
        id.clone(),
        ffi::RDMA_CM_EVENT_ADDR_RESOLVED,
        0,
    ));
    drop(st);
    debug!(%src, %dst, "rdma_cm: address resolved");
    complete(id)
}

fn same_family(ip: IpAddr, like: IpAddr) -> IpAddr {
    match (ip, like) {
        (IpAddr::V4(v4), IpAddr::V6(_)) => IpAddr::V6(v4.to_ipv6_mapped()),
        _ => ip,
    }
}

/// `rdma_resolve_route`. TCP has no path to query, but the next hop
/// towards the peer must still answer ARP: ROUTE_RESOLVED at once when its
/// neighbour entry is valid (what `rdma_resolve_addr` left, unless it was
/// flushed or failed since), else once it answers, and ROUTE_ERROR with
/// -ETIMEDOUT (the id back to address-resolved, as the kernel's) if it has
/// not within `timeout`.
pub(crate) fn resolve_route(id: &Arc<Id>, timeout: Duration) -> CmResult<()> {
    let st = id.state();
    if !st.phase.allows(Op::ResolveRoute) {
        return Err(libc::EINVAL);
    }
    let hop = match (st.src, st.dst) {
        (Some(src), Some(dst)) => {
            neigh::pending_hop(unmap(dst).ip(), src.ip()).map(|(hop, iface)| (dst, hop, iface))
        }
        _ => None,
    };
    {
        // No path records (TCP); written here, on the application's
        // thread, before any event of this call can be taken.
        // SAFETY: application thread inside rdma_resolve_route.
        let c = unsafe { id.c() };
        c.route.num_paths = 0;
        c.route.path_rec = std::ptr::null_mut();
    }
    drop(st);
    let Some((dst, hop, iface)) = hop else {
        route_resolved(id, true);
        return complete(id);
    };
    debug!(%dst, %hop, %iface, ?timeout, "rdma_cm: the next hop must answer ARP again");
    let id2 = id.clone();
    let resolve = move || {
        let ok = neigh::wait_resolved(unmap(dst).ip(), hop, &iface, timeout);
        if !ok {
            debug!(%dst, %hop, "rdma_cm: the next hop did not answer ARP in time");
        }
        route_resolved(&id2, ok);
    };
    if let Err(e) = std::thread::Builder::new()
        .name("stag-cm-route".into())
        .spawn_masked(resolve)
    {
        debug!(error = %e, "rdma_cm: no resolver thread");
        return Err(libc::EAGAIN);
    }
    complete(id)
}

/// Queue the outcome of route resolution, unless the id moved on (a
/// destroy, another call) meanwhile. Any thread: it writes no C struct.
fn route_resolved(id: &Arc<Id>, ok: bool) {
    let mut st = id.state();
    if st.destroyed || !st.phase.allows(Op::ResolveRoute) {
        return;
    }
    if !ok {
        st.channel.push(Pending::new(
            id.clone(),
            ffi::RDMA_CM_EVENT_ROUTE_ERROR,
            -libc::ETIMEDOUT,
        ));
        return;
    }
    st.phase = Phase::RouteResolved;
    st.channel.push(Pending::new(
        id.clone(),
        ffi::RDMA_CM_EVENT_ROUTE_RESOLVED,
        0,
    ));
}

/// `rdma_migrate_id`: move the id, and its queued events, to `channel`
/// (NULL: make it synchronous).
pub(crate) fn migrate(id: &Arc<Id>, channel: *mut ffi::rdma_event_channel) -> CmResult<()> {
    let (new, sync) = if channel.is_null() {
        if id.state().sync {
            return Err(libc::EINVAL);
        }
        let ch = Channel::new()?;
        ch.register();
        (ch, true)
    } else {
        (Channel::lookup(channel)?, false)
    };
    if id.state().sync {
        ack_held(id);
    }
    let mut st = id.state();
    let old = std::mem::replace(&mut st.channel, new.clone());
    if st.sync {
        // The private channel goes with the id's synchronous mode.
        Channel::unregister(old.raw());
    }
    st.sync = sync;
    for p in old.withdraw(&mut |p: &Pending| Arc::ptr_eq(&p.id, id)) {
        new.push(p);
    }
    drop(st);
    // SAFETY: application thread inside rdma_migrate_id.
    unsafe { id.c() }.channel = new.raw();
    Ok(())
}

/// `rdma_set_option`: the options that mean something on TCP are kept,
/// the rest refused as the kernel does.
pub(crate) fn set_option(
    id: &Arc<Id>,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: usize,
) -> CmResult<()> {
    if val.is_null() {
        return Err(libc::EINVAL);
    }
    let int = || -> CmResult<c_int> {
        if len != std::mem::size_of::<c_int>() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the application says `val` holds `len` bytes.
        Ok(unsafe { std::ptr::read_unaligned(val as *const c_int) })
    };
    let byte = || -> CmResult<u8> {
        if len != 1 {
            return Err(libc::EINVAL);
        }
        // SAFETY: as above, one byte.
        Ok(unsafe { *(val as *const u8) })
    };
    let mut st = id.state();
    match (level as u32, name as u32) {
        (ffi::RDMA_OPTION_ID, ffi::RDMA_OPTION_ID_TOS) => st.options.tos = Some(byte()?),
        (ffi::RDMA_OPTION_ID, ffi::RDMA_OPTION_ID_REUSEADDR) => st.options.reuseaddr = int()? != 0,
        (ffi::RDMA_OPTION_ID, ffi::RDMA_OPTION_ID_AFONLY) => st.options.afonly = int()? != 0,
        (ffi::RDMA_OPTION_ID, ffi::RDMA_OPTION_ID_ACK_TIMEOUT) => {
            st.options.ack_timeout = Some(byte()?)
        }
        (ffi::RDMA_OPTION_IB, ffi::RDMA_OPTION_IB_PATH) => {
            error!("rdma_cm: RDMA_OPTION_IB_PATH: stag0 is iWARP, there are no IB paths");
            return Err(libc::EINVAL);
        }
        _ => {
            error!(level, name, "rdma_cm: rdma_set_option: unknown option");
            return Err(libc::ENOSYS);
        }
    }
    Ok(())
}

/// Read an optional C address.
///
/// # Safety
/// NULL or a valid socket address.
pub(crate) unsafe fn opt_addr(sa: *const ffi::sockaddr) -> CmResult<Option<SocketAddr>> {
    if sa.is_null() {
        return Ok(None);
    }
    // SAFETY: valid (caller).
    if unsafe { (*sa).sa_family } == 0 {
        return Ok(None);
    }
    // SAFETY: valid (caller).
    unsafe { from_c(sa) }.map(Some)
}
