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
//!
//! Two sockets may share a local port (SO_REUSEADDR), and one unconnected socket may send to
//! two Services; where both Services have the same backend, their translated tuples would be
//! one, and replies would reach the wrong socket or show the wrong sender. netfilter's NAT
//! moves the local port on such a clash; here there is no packet yet, so the backend moves:
//! the hooks pass over backends whose tuple is taken (`SOCK_PORTS_V1` for connected sockets on
//! a port of their own choosing, `SOCK_REVNAT_V1` for the socket's own other Services). Where
//! every backend's tuple is taken, the call goes on to the Service's address untranslated,
//! and TC egress moves the port of its packets as netfilter would (`host`); so both flows
//! keep their own replies. A holder is trusted for two minutes only: the kernel runs no
//! release hook for its own sockets (an NFS client's), whose entries would otherwise send
//! every later socket on that port to TC; past that, the call is translated as if the tuple
//! were free, and the kernel's own check refuses a TCP connect onto a tuple still in use.
//!
//! IPv6 sockets reach IPv6 Services by their addresses, and IPv4 Services through IPv4-mapped
//! addresses (`::ffff:10.96.0.10`, what a JVM or any dual-stack socket passes for an IPv4
//! peer). Their hooks (connect6, sendmsg6, recvmsg6, getpeername6) tell the two apart by the
//! address: a mapped one is served from the IPv4 maps (the last 32 bits read and written), any
//! other from the IPv6 ones (`SockFamily`). Everything above holds for both families.

use aya_ebpf::{
    bindings::{bpf_sock, BPF_ANY},
    btf_maps::LruHashMap,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    programs::{SockAddrContext, SockContext},
};
use proxy_common::{
    limits, svc_cidr, svc_flags, Backend, Ip6, Reason, RevNat, ServiceKey, ServiceValue, SockFwd, SockOwner, SockPortKey, SockRevKey,
    IPPROTO_TCP, IPPROTO_UDP,
};

use crate::{
    ct,
    family::Family,
    maps::{
        HOST_NETNS_V1, SOCK6_FWD_V1, SOCK6_HELD_V1, SOCK6_PORTS_V1, SOCK6_REVNAT_V1, SOCK_FWD_V1, SOCK_HELD_V1, SOCK_PORTS_V1,
        SOCK_REVNAT_V1,
    },
    parse::{Frag, Packet},
    pod_ingress::count_flow,
    select::{self, Choice},
    stats, value,
};

/// What a socket hook returns to let the call go on.
const PROCEED: i32 = 1;
/// What it returns to fail the call (with the error `bpf_set_retval` gave).
const REFUSE: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EPERM: i32 = 1;
/// Backends tried after a first pick whose tuple is taken.
const OTHER_BACKENDS: u32 = 8;
/// How long a holder of a tuple is trusted to be there (see the module comment).
const HOLDER_TRUSTED_NS: u64 = 120 * 1_000_000_000;

const SOCK_MAX: usize = limits::SOCK_REVNAT_MAX as usize;

/// Which hooks run: the IPv4 ones, or the IPv6 ones (which see IPv4 peers as IPv4-mapped
/// addresses).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    V4,
    V6,
}

/// A family as the socket hooks see it: its maps, and where a hook's context holds its
/// address.
trait SockFamily: Family {
    fn revnats() -> &'static LruHashMap<SockRevKey<Self>, RevNat<Self>, SOCK_MAX>;
    fn fwds() -> &'static LruHashMap<SockRevKey<Self>, SockFwd<Self>, SOCK_MAX>;
    fn ports() -> &'static LruHashMap<SockPortKey<Self>, SockOwner, SOCK_MAX>;
    fn held() -> &'static LruHashMap<u64, SockPortKey<Self>, SOCK_MAX>;
    /// Makes the call name `addr` (the port is written apart).
    fn set_addr(ctx: &SockAddrContext, hook: Hook, addr: Self);
}

impl SockFamily for [u8; 4] {
    #[inline(always)]
    fn revnats() -> &'static LruHashMap<SockRevKey<Self>, RevNat<Self>, SOCK_MAX> {
        &SOCK_REVNAT_V1
    }
    #[inline(always)]
    fn fwds() -> &'static LruHashMap<SockRevKey<Self>, SockFwd<Self>, SOCK_MAX> {
        &SOCK_FWD_V1
    }
    #[inline(always)]
    fn ports() -> &'static LruHashMap<SockPortKey<Self>, SockOwner, SOCK_MAX> {
        &SOCK_PORTS_V1
    }
    #[inline(always)]
    fn held() -> &'static LruHashMap<u64, SockPortKey<Self>, SOCK_MAX> {
        &SOCK_HELD_V1
    }
    /// An IPv6 hook's address is IPv4-mapped: the prefix is there already (`peer` checked it).
    #[inline(always)]
    fn set_addr(ctx: &SockAddrContext, hook: Hook, addr: Self) {
        // SAFETY: a 4-byte write to a field the hook may write.
        unsafe {
            match hook {
                Hook::V4 => (*ctx.sock_addr).user_ip4 = u32::from_ne_bytes(addr),
                Hook::V6 => (*ctx.sock_addr).user_ip6[3] = u32::from_ne_bytes(addr),
            }
        }
    }
}

impl SockFamily for Ip6 {
    #[inline(always)]
    fn revnats() -> &'static LruHashMap<SockRevKey<Self>, RevNat<Self>, SOCK_MAX> {
        &SOCK6_REVNAT_V1
    }
    #[inline(always)]
    fn fwds() -> &'static LruHashMap<SockRevKey<Self>, SockFwd<Self>, SOCK_MAX> {
        &SOCK6_FWD_V1
    }
    #[inline(always)]
    fn ports() -> &'static LruHashMap<SockPortKey<Self>, SockOwner, SOCK_MAX> {
        &SOCK6_PORTS_V1
    }
    #[inline(always)]
    fn held() -> &'static LruHashMap<u64, SockPortKey<Self>, SOCK_MAX> {
        &SOCK6_HELD_V1
    }
    /// Only IPv6 hooks see IPv6 addresses.
    #[inline(always)]
    fn set_addr(ctx: &SockAddrContext, _hook: Hook, addr: Self) {
        // SAFETY: 4-byte writes to the words the hook may write.
        unsafe {
            for (i, word) in addr.0.iter().enumerate() {
                (*ctx.sock_addr).user_ip6[i] = *word;
            }
        }
    }
}

/// Fails the call with `errno`, counted under `reason`.
#[inline(always)]
fn refuse(reason: Reason, errno: i32) -> i32 {
    stats::count(reason, 0);
    // SAFETY: plain helper call; the hook's return value then fails the call with it.
    unsafe { bpf_set_retval(-errno) };
    REFUSE
}

/// True when the socket of this context (a `bpf_sock_addr` or a `bpf_sock`) belongs to the
/// host's network namespace.
#[inline(always)]
fn in_host_netns(ctx: *mut core::ffi::c_void) -> bool {
    let Some(host) = HOST_NETNS_V1.get(0) else { return false };
    // SAFETY: plain helper call on our own context.
    *host != 0 && unsafe { bpf_get_netns_cookie(ctx) } == *host
}

/// The tuple key of a socket on local port `sport` (network byte order) at a backend.
#[inline(always)]
fn port_key<A: Family>(proto: u8, sport: [u8; 2], addr: A, port: [u8; 2]) -> SockPortKey<A> {
    SockPortKey { addr, port, sport, proto, _pad: [0; 3] }
}

/// The local port of a sock_addr context's socket in network byte order (zero: none chosen
/// yet).
#[inline(always)]
fn local_port(sk: *const bpf_sock) -> [u8; 2] {
    // SAFETY: a field a sock_addr program's socket may read, in host byte order.
    unsafe { ((*sk).src_port as u16).to_be_bytes() }
}

/// The socket's IP protocol, if Services have it.
#[inline(always)]
fn protocol(ctx: &SockAddrContext) -> Option<u8> {
    // SAFETY: a field of our own context.
    let p = unsafe { (*ctx.sock_addr).protocol } as u8;
    (p == IPPROTO_TCP || p == IPPROTO_UDP).then_some(p)
}

/// `::ffff:0:0/96`, the IPv4-mapped prefix, as the three leading words of `user_ip6`.
const V4_MAPPED: [u32; 3] = [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff])];

/// The address a call names, as the packet would carry it.
enum Peer {
    V4([u8; 4]),
    V6(Ip6),
}

/// The address the call names and its port (network byte order).
#[inline(always)]
fn peer(ctx: &SockAddrContext, hook: Hook) -> (Peer, [u8; 2]) {
    // SAFETY: fields of our own context, read as the 4-byte words the kernel allows; they hold
    // network byte order (the port in the low 16 bits).
    unsafe {
        let sa = ctx.sock_addr;
        let addr = match hook {
            Hook::V4 => Peer::V4((*sa).user_ip4.to_ne_bytes()),
            Hook::V6 => {
                // One 4-byte load per word: the verifier refuses the 8-byte load the compiler
                // could otherwise merge two of them into.
                let word = |i: usize| core::ptr::read_volatile(core::ptr::addr_of!((*sa).user_ip6[i]));
                let words = [word(0), word(1), word(2), word(3)];
                if [words[0], words[1], words[2]] == V4_MAPPED {
                    Peer::V4(words[3].to_ne_bytes())
                } else {
                    Peer::V6(Ip6(words))
                }
            }
        };
        (addr, ((*sa).user_port as u16).to_ne_bytes())
    }
}

/// Makes the call name `addr`:`port`.
#[inline(always)]
fn set_peer<A: SockFamily>(ctx: &SockAddrContext, hook: Hook, addr: A, port: [u8; 2]) {
    A::set_addr(ctx, hook, addr);
    // SAFETY: a 4-byte write to the field the hook may write.
    unsafe { (*ctx.sock_addr).user_port = u32::from(u16::from_ne_bytes(port)) };
}

#[inline(always)]
fn rev_key<A: Family>(ctx: &SockAddrContext, addr: A, port: [u8; 2]) -> SockRevKey<A> {
    // SAFETY: plain helper call on our own context.
    SockRevKey::new(unsafe { bpf_get_socket_cookie(ctx.sock_addr.cast()) }, addr, port)
}

/// `connect` and `sendmsg`: a Service address becomes one of its backends'.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, hook: Hook, connect: bool) -> i32 {
    if !in_host_netns(ctx.sock_addr.cast()) {
        return PROCEED;
    }
    let Some(proto) = protocol(ctx) else { return PROCEED };
    match peer(ctx, hook) {
        (Peer::V4(vip), vport) => translate_to(ctx, hook, connect, proto, vip, vport),
        (Peer::V6(vip), vport) => translate_to(ctx, hook, connect, proto, vip, vport),
    }
}

#[inline(always)]
fn translate_to<A: SockFamily>(ctx: &SockAddrContext, hook: Hook, connect: bool, proto: u8, vip: A, vport: [u8; 2]) -> i32 {
    let Some(master) = select::frontend(vip, vport, proto) else {
        // A cluster IP on a port it does not serve is refused. (A free address of a Service
        // CIDR is dropped where it would leave the node, by the egress program.)
        if select::service_cidr_of(vip) == svc_cidr::ALLOCATED {
            return refuse(Reason::RejectClusterIpPort, ECONNREFUSED);
        }
        return PROCEED;
    };
    let mut key = ServiceKey::new(vip, vport, proto, 0);
    // The node passes when its ranges admit the load-balancer IP itself (see the module comment).
    if master.flags & svc_flags::SOURCE_RANGES != 0 && !A::in_source_ranges(master.service_id, vip) {
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
    if proto == IPPROTO_UDP && !connect {
        if let Some(f) = value::copy(A::fwds(), &fwd_key) {
            if select::backend::<A>(f.backend_id).is_some_and(|b| b.addr == f.addr && b.port == f.port) {
                set_peer(ctx, hook, f.addr, f.port);
                return PROCEED;
            }
        }
    }
    // The node is one client for affinity (its source address is not chosen yet); Maglev
    // hashes the socket's cookie in the source port's place, so sockets spread.
    let cookie = u64::from_ne_bytes(fwd_key.cookie);
    let pkt = Packet {
        l4_off: 0,
        proto,
        saddr: A::UNSPECIFIED,
        daddr: vip,
        sport: ((cookie ^ (cookie >> 16) ^ (cookie >> 32) ^ (cookie >> 48)) as u16).to_ne_bytes(),
        dport: vport,
        tcp_flags: 0,
        ip_id: Default::default(),
        tot_len: [0; 2],
        ttl: 0,
        frag: Frag::Whole,
    };
    let now = ct::now();
    let Ok(first) = select::choose(&pkt, &key, &master, now, true) else { return PROCEED };
    // SAFETY: the socket of a sock_addr context is always there.
    let sport = local_port(unsafe { (*ctx.sock_addr).__bindgen_anon_1.sk });
    let taken = |b: &Backend<A>| holder(cookie, proto, sport, b).is_some() || (!connect && other_service(ctx, b, vip, vport));
    let choice = if !taken(&first.backend) {
        first
    } else if let Some(other) = untaken_backend(&key, &master, &taken) {
        stats::count(Reason::HostBackendMoved, 0);
        other
    } else if (connect || !other_service(ctx, &first.backend, vip, vport)) && !tuple_held(cookie, proto, sport, &first.backend, now) {
        // Taken only by a holder that may be gone (see the module comment): sent on as if the
        // tuple were free; a live TCP one is refused by the kernel's own check.
        first
    } else {
        // Every backend's tuple is taken from this port: the call goes on to the Service, and
        // TC egress moves the port of its packets (`host`). A socket connecting again leaves
        // its old tuple.
        if connect {
            release_tuples(cookie);
        }
        stats::count(Reason::HostSharedBackend, 0);
        return PROCEED;
    };
    let be = choice.backend;
    let rn = RevNat { addr: vip, port: vport, _pad: [0; 2] };
    // A full LRU evicts; at worst getpeername shows the backend, or a UDP socket's next
    // datagram picks a backend afresh.
    let _ = A::revnats().insert(&rev_key(ctx, be.addr, be.port), &rn, BPF_ANY as u64);
    if proto == IPPROTO_UDP {
        let f = SockFwd { backend_id: choice.id, addr: be.addr, port: be.port, _pad: [0; 2] };
        let _ = A::fwds().insert(&fwd_key, &f, BPF_ANY as u64);
    }
    if connect {
        // A UDP socket connecting again leaves its old tuple.
        release_tuples(cookie);
        if sport != [0; 2] {
            let key = port_key(proto, sport, be.addr, be.port);
            if A::ports().insert(&key, &SockOwner { cookie, since_ns: now }, BPF_ANY as u64).is_ok() {
                let _ = A::held().insert(&cookie, &key, BPF_ANY as u64);
            }
        }
    }
    set_peer(ctx, hook, be.addr, be.port);
    count_flow::<A>(choice.id);
    stats::count(Reason::HostConnect, 0);
    PROCEED
}

/// True when this socket reaches backend `b` for a Service other than `vip:vport`.
#[inline(always)]
fn other_service<A: SockFamily>(ctx: &SockAddrContext, b: &Backend<A>, vip: A, vport: [u8; 2]) -> bool {
    value::copy(A::revnats(), &rev_key(ctx, b.addr, b.port)).is_some_and(|r| r.addr != vip || r.port != vport)
}

/// The other connected socket on local port `sport` that reaches backend `b`, if any (a socket
/// without a local port yet gets one the kernel keeps apart).
#[inline(always)]
fn holder<A: SockFamily>(cookie: u64, proto: u8, sport: [u8; 2], b: &Backend<A>) -> Option<(SockPortKey<A>, SockOwner)> {
    if sport == [0; 2] {
        return None;
    }
    let key = port_key(proto, sport, b.addr, b.port);
    value::copy(A::ports(), &key).filter(|o| o.cookie != cookie).map(|o| (key, o))
}

/// True when that holder can be trusted to be there: it took the tuple less than
/// HOLDER_TRUSTED_NS ago, and its own record still names the tuple (the two LRU maps may lose
/// entries independently).
#[inline(always)]
fn tuple_held<A: SockFamily>(cookie: u64, proto: u8, sport: [u8; 2], b: &Backend<A>, now: u64) -> bool {
    holder(cookie, proto, sport, b).is_some_and(|(key, owner)| {
        now.saturating_sub(owner.since_ns) < HOLDER_TRUSTED_NS && value::copy(A::held(), &owner.cookie) == Some(key)
    })
}

/// Another backend of the Service whose tuple is not `taken`, from a random slot on (at most
/// `OTHER_BACKENDS` tried).
#[inline(always)]
fn untaken_backend<A: Family>(key: &ServiceKey<A>, master: &ServiceValue, taken: &impl Fn(&Backend<A>) -> bool) -> Option<Choice<A>> {
    let count = u32::from(master.count);
    // SAFETY: plain helper call.
    let start = unsafe { bpf_get_prandom_u32() } % count;
    for i in 0..OTHER_BACKENDS {
        if i >= count {
            break;
        }
        let slot = (start + i) % count + 1;
        let Some(id) = select::service(&key.with_slot(slot as u16)).map(|s| s.backend_id) else { continue };
        let Some(backend) = select::backend(id) else { continue };
        if !taken(&backend) {
            return Some(Choice { id, backend });
        }
    }
    None
}

/// Forgets the tuple the socket `cookie` held at a backend of family `A`, if it still holds it.
#[inline(always)]
fn release_tuple<A: SockFamily>(cookie: u64) {
    let Some(key) = value::copy(A::held(), &cookie) else { return };
    let _ = A::held().remove(&cookie);
    if value::copy(A::ports(), &key).is_some_and(|o| o.cookie == cookie) {
        let _ = A::ports().remove(&key);
    }
}

/// Forgets the tuple the socket `cookie` held, of either family (an IPv6 socket may have
/// connected to an IPv4-mapped address before).
#[inline(always)]
fn release_tuples(cookie: u64) {
    release_tuple::<[u8; 4]>(cookie);
    release_tuple::<Ip6>(cookie);
}

/// A host-network socket closed: the tuple it held is free for the next socket on its port.
#[inline(always)]
pub fn release(ctx: &SockContext) {
    if !in_host_netns(ctx.sock.cast()) {
        return;
    }
    // SAFETY: plain helper call on our own context.
    release_tuples(unsafe { bpf_get_socket_cookie(ctx.sock.cast()) });
}

/// `getpeername` and `recvmsg`: a backend this socket was sent to shows as its Service.
#[inline(always)]
pub fn restore(ctx: &SockAddrContext, hook: Hook) -> i32 {
    if !in_host_netns(ctx.sock_addr.cast()) || protocol(ctx).is_none() {
        return PROCEED;
    }
    match peer(ctx, hook) {
        (Peer::V4(addr), port) => restore_from(ctx, hook, addr, port),
        (Peer::V6(addr), port) => restore_from(ctx, hook, addr, port),
    }
    PROCEED
}

#[inline(always)]
fn restore_from<A: SockFamily>(ctx: &SockAddrContext, hook: Hook, addr: A, port: [u8; 2]) {
    if let Some(rn) = value::copy(A::revnats(), &rev_key(ctx, addr, port)) {
        set_peer(ctx, hook, rn.addr, rn.port);
    }
}
