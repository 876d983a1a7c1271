//! Services for host-network processes: cgroup socket hooks. A process in the host's network
//! namespace (a hostNetwork pod, a node daemon) sends its packets out of the node, past the
//! pod-facing TC hooks, so its Service traffic is translated where the socket names its peer,
//! as kube-proxy's OUTPUT chain does for it: `connect` (TCP, and connected UDP) and `sendmsg`
//! (unconnected UDP) get a backend's address instead of the Service's, and `getpeername` and
//! `recvmsg` give the Service's back. Other namespaces are left to the TC hooks: the hooks act
//! only on sockets of the namespace in `HOST_NETNS_V1`.
//!
//! Backends are chosen as for pods (the internal scope, ClientIP affinity with the node as one
//! client, Maglev by socket), and an unconnected UDP socket keeps its backend per Service while
//! that backend is there, as conntrack keeps a UDP flow's. Without endpoints the call fails
//! with ECONNREFUSED (or EPERM where kube-proxy drops: a Local policy without a local
//! endpoint). A load-balancer IP with
//! loadBalancerSourceRanges admits the node when a range holds one of its addresses (then the
//! agent lists the load-balancer IP itself among the ranges, as kube-proxy allows); otherwise
//! the call fails with EPERM at once, where kube-proxy's firewall would drop the packets. A
//! cluster IP on a port its Service does not have is refused (ECONNREFUSED), as kube-proxy's
//! `cluster-ips-check` rejects it.

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{svc_cidr, svc_flags, Reason, RevNat, ServiceKey, SockFwd, SockRevKey, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    ct,
    lb::count_flow,
    maps::{HOST_NETNS_V1, SOCK_FWD_V1, SOCK_REVNAT_V1},
    parse::{Frag, Packet},
    select, stats,
};

/// What a socket hook returns to let the call go on.
const PROCEED: i32 = 1;
/// What it returns to fail the call (with the error `bpf_set_retval` gave).
const REFUSE: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EPERM: i32 = 1;

/// Fails the call with `errno`, counted under `reason`.
#[inline(always)]
fn refuse(reason: Reason, errno: i32) -> i32 {
    stats::count(reason, 0);
    // SAFETY: plain helper call; the hook's return value then fails the call with it.
    unsafe { bpf_set_retval(-errno) };
    REFUSE
}

/// True when the socket belongs to the host's network namespace.
#[inline(always)]
fn in_host_netns(ctx: &SockAddrContext) -> bool {
    let Some(host) = HOST_NETNS_V1.get(0) else { return false };
    // SAFETY: plain helper call on our own context.
    *host != 0 && unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) } == *host
}

/// The socket's IP protocol, if Services have it.
#[inline(always)]
fn protocol(ctx: &SockAddrContext) -> Option<u8> {
    // SAFETY: a field of our own context.
    let p = unsafe { (*ctx.sock_addr).protocol } as u8;
    (p == IPPROTO_TCP || p == IPPROTO_UDP).then_some(p)
}

/// The address the call names: (address, port), both as the packet would carry them.
#[inline(always)]
fn peer(ctx: &SockAddrContext) -> ([u8; 4], [u8; 2]) {
    // SAFETY: fields of our own context; both hold network byte order (the port in the low
    // 16 bits).
    unsafe { ((*ctx.sock_addr).user_ip4.to_ne_bytes(), ((*ctx.sock_addr).user_port as u16).to_ne_bytes()) }
}

#[inline(always)]
fn set_peer(ctx: &SockAddrContext, addr: [u8; 4], port: [u8; 2]) {
    // SAFETY: 4-byte writes to the two fields the hook may write.
    unsafe {
        (*ctx.sock_addr).user_ip4 = u32::from_ne_bytes(addr);
        (*ctx.sock_addr).user_port = u32::from(u16::from_ne_bytes(port));
    }
}

#[inline(always)]
fn rev_key(ctx: &SockAddrContext, addr: [u8; 4], port: [u8; 2]) -> SockRevKey {
    // SAFETY: plain helper call on our own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) };
    SockRevKey { cookie, addr, port, _pad: [0; 2] }
}

/// `connect` and `sendmsg`: a Service address becomes one of its backends'.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext) -> i32 {
    if !in_host_netns(ctx) {
        return PROCEED;
    }
    let Some(proto) = protocol(ctx) else { return PROCEED };
    let (vip, vport) = peer(ctx);
    let mut key = ServiceKey::new(vip, vport, proto, 0);
    let Some(master) = select::service(&key) else {
        // A cluster IP on a port it does not serve is refused. (A free address of a Service
        // CIDR is dropped where it would leave the node, by the egress program.)
        if select::service_cidr_of(vip) == Some(svc_cidr::ALLOCATED) {
            return refuse(Reason::RejectClusterIpPort, ECONNREFUSED);
        }
        return PROCEED;
    };
    // The node passes when its ranges admit the load-balancer IP itself (see the module comment).
    if master.flags & svc_flags::SOURCE_RANGES != 0 && !select::in_source_ranges(master.service_id, vip) {
        return refuse(Reason::DropSourceRange, EPERM);
    }
    let Some(master) = select::internal_master(&mut key, master) else { return PROCEED };
    if master.count == 0 {
        if master.flags & svc_flags::DROP_WHEN_EMPTY != 0 {
            return refuse(Reason::DropNoLocalEndpoints, EPERM);
        }
        return refuse(Reason::HostReject, ECONNREFUSED);
    }
    // An unconnected UDP socket's next datagram to this Service: the backend of the last one,
    // if its id still names it (as the TC path checks a tracked flow's).
    let fwd_key = rev_key(ctx, vip, vport);
    if proto == IPPROTO_UDP {
        // SAFETY: the value is copied out at once.
        if let Some(f) = SOCK_FWD_V1.get_ptr(&fwd_key).map(|p| unsafe { *p }) {
            if select::backend(f.backend_id).is_some_and(|b| b.addr == f.addr && b.port == f.port) {
                set_peer(ctx, f.addr, f.port);
                return PROCEED;
            }
        }
    }
    // The node is one client for affinity (its source address is not chosen yet); Maglev
    // hashes the socket's cookie in the source port's place, so sockets spread.
    let cookie = fwd_key.cookie;
    let pkt = Packet {
        l4_off: 0,
        proto,
        saddr: [0; 4],
        daddr: vip,
        sport: ((cookie ^ (cookie >> 16) ^ (cookie >> 32) ^ (cookie >> 48)) as u16).to_ne_bytes(),
        dport: vport,
        tcp_flags: 0,
        ip_id: [0; 2],
        tot_len: [0; 2],
        ttl: 0,
        frag: Frag::Whole,
    };
    let Ok(choice) = select::choose(&pkt, &key, &master, ct::now(), true) else { return PROCEED };
    let be = choice.backend;
    let rn = RevNat { addr: vip, port: vport, _pad: [0; 2] };
    // A full LRU evicts; at worst getpeername shows the backend, or a UDP socket's next
    // datagram picks a backend afresh.
    let _ = SOCK_REVNAT_V1.insert(&rev_key(ctx, be.addr, be.port), &rn, BPF_ANY as u64);
    if proto == IPPROTO_UDP {
        let f = SockFwd { backend_id: choice.id, addr: be.addr, port: be.port, _pad: [0; 2] };
        let _ = SOCK_FWD_V1.insert(&fwd_key, &f, BPF_ANY as u64);
    }
    set_peer(ctx, be.addr, be.port);
    count_flow(choice.id);
    stats::count(Reason::HostConnect, 0);
    PROCEED
}

/// `getpeername` and `recvmsg`: a backend this socket was sent to shows as its Service.
#[inline(always)]
pub fn restore(ctx: &SockAddrContext) -> i32 {
    if !in_host_netns(ctx) || protocol(ctx).is_none() {
        return PROCEED;
    }
    let (addr, port) = peer(ctx);
    // SAFETY: the value is copied out at once.
    if let Some(rn) = SOCK_REVNAT_V1.get_ptr(&rev_key(ctx, addr, port)).map(|p| unsafe { *p }) {
        set_peer(ctx, rn.addr, rn.port);
    }
    PROCEED
}
