#![no_std]
#![no_main]
#![feature(core_intrinsics, asm_experimental_arch)]
#![expect(internal_features, reason = "atomic_xadd, atomic_or: the bpf target has no AtomicU64::fetch_add nor fetch_or")]

mod access;
mod ct;
mod egress;
mod ext;
mod family;
mod flowcache;
mod frag;
mod host;
mod icmp;
mod icmp6;
mod icmp_nat;
mod maps;
mod nat;
mod north;
mod parse;
mod parse6;
mod pod_ingress;
mod select;
mod sock;
mod stats;
mod value;
mod verdict;
mod xdp;

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    macros::{cgroup_sock, cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, SockContext, TcContext, XdpContext},
};
use proxy_common::Reason;

#[inline(always)]
fn finish(ctx: &TcContext, verdict: Result<verdict::Verdict, Reason>) -> i32 {
    let (action, reason) = match verdict {
        Ok(v) => (v.action, v.reason),
        Err(reason) => (TC_ACT_SHOT, reason),
    };
    stats::count(reason, ctx.len());
    action
}

/// TC ingress on pod-facing interfaces: ClusterIP DNAT for new and tracked flows, ICMP reject
/// for services without endpoints.
#[classifier]
pub fn proxy_tc_ingress(ctx: TcContext) -> i32 {
    if parse::is_ipv6(&ctx) {
        from_pod6(&ctx)
    } else {
        from_pod(&ctx)
    }
}

/// The IPv4 (and other) half of `proxy_tc_ingress`, and its IPv6 half: two BPF functions side
/// by side, so that the program's stack is the entry point's (empty) frame and the larger of
/// theirs rather than their sum, and IPv6's tracked flows are served without a tail call.
/// (Each may tail-call on: the frames before it, the entry point's, are below the verifier's
/// 256 bytes for that. A BPF function that tail-calls needs the JIT: x86-64 from Linux 5.10,
/// arm64 from 6.0.)
#[inline(never)]
fn from_pod(ctx: &TcContext) -> i32 {
    finish(ctx, pod_ingress::try_tc_ingress(ctx))
}

#[inline(never)]
fn from_pod6(ctx: &TcContext) -> i32 {
    finish(ctx, pod_ingress::try_tc_ingress6(ctx))
}

/// TC egress on every attached interface: reverse NAT of replies, ICMP errors made
/// recognisable, the Service CIDR checks of what leaves the node, and host flows the socket
/// hooks left to TC (`host`, tail-called).
#[classifier]
pub fn proxy_tc_egress(ctx: TcContext) -> i32 {
    finish(&ctx, egress::try_tc_egress(&ctx))
}

/// The IPv6 flow from pods, as `proxy_tc_ingress` serves it (`from_pod6`): an older build's
/// `proxy_tc_ingress` tail-calls this program until an upgrade replaces it. The new flows of
/// both go on to `proxy_tc_ingress6_new`.
#[classifier]
pub fn proxy_tc_ingress6(ctx: TcContext) -> i32 {
    finish(&ctx, pod_ingress::try_tc_ingress6(&ctx))
}

#[classifier]
pub fn proxy_tc_ingress6_new(ctx: TcContext) -> i32 {
    finish(&ctx, pod_ingress::try_tc_ingress6_new(&ctx))
}

/// IPv6 packets leaving, and IPv4 host flows' (`host`), tail-called by `proxy_tc_egress`: one
/// tail call site there for both (a second one made IPv6's every reply slower by 7 %).
#[classifier]
#[inline(always)]
pub fn proxy_tc_egress6(ctx: TcContext) -> i32 {
    // Inlined into the program: the compiler made it a BPF function of its own, a call on every
    // IPv6 reply's way.
    let verdict = if parse::is_ipv6(&ctx) { egress::try_tc_egress6(&ctx) } else { host::try_host4(&ctx) };
    finish(&ctx, verdict)
}

/// TC ingress on external interfaces: NodePort, load-balancer and external IPs (north-south),
/// replies of flows SNATed to remote backends, and `proxy-agent trace` packets.
#[classifier]
pub fn proxy_tc_ext_ingress(ctx: TcContext) -> i32 {
    outcome(&ctx, ext::try_tc_ext_ingress(&ctx))
}

/// IPv6 on external interfaces (tail-called by `proxy_tc_ext_ingress`).
#[classifier]
pub fn proxy_tc_ext_ingress6(ctx: TcContext) -> i32 {
    outcome(&ctx, ext::try_tc_ext_ingress6(&ctx))
}

#[classifier]
pub fn proxy_tc_ext_ingress6_new(ctx: TcContext) -> i32 {
    finish(&ctx, ext::try_tc_ext_ingress6_new(&ctx))
}

#[classifier]
pub fn proxy_tc_ext_ingress6_trace(ctx: TcContext) -> i32 {
    outcome(&ctx, ext::try_tc_ext_ingress6_trace(&ctx))
}

/// ICMPv6 errors arriving from pods and from outside (tail-called by the IPv6 pod ingress and
/// `proxy_tc_ext_ingress6`).
#[classifier]
pub fn proxy_tc_icmp6(ctx: TcContext) -> i32 {
    finish(&ctx, icmp_nat::try_arriving6(&ctx))
}

/// An ICMPv6 error `proxy_tc_icmp6` translated, sent on by the FIB's route.
#[classifier]
pub fn proxy_tc_icmp6_send(ctx: TcContext) -> i32 {
    finish(&ctx, icmp_nat::try_send6(&ctx))
}

/// An IPv6 host flow's packet leaving (tail-called by `proxy_tc_egress6`, see `host`).
#[classifier]
pub fn proxy_tc_host6(ctx: TcContext) -> i32 {
    finish(&ctx, host::try_host6(&ctx))
}
/// An IPv6 host flow's first packet (tail-called by `proxy_tc_host6`).
#[classifier]
pub fn proxy_tc_host6_new(ctx: TcContext) -> i32 {
    finish(&ctx, host::try_host6_new(&ctx))
}
/// An external program's outcome: counted, or a trace packet's (which counts nothing).
#[inline(always)]
fn outcome(ctx: &TcContext, o: ext::Outcome) -> i32 {
    match o {
        ext::Outcome::Counted(v) => finish(ctx, v),
        ext::Outcome::Traced => ext::TRACE_ACTION,
    }
}

/// XDP on external interfaces: the fast path for north-south flows to remote backends.
#[xdp]
pub fn proxy_xdp_ext(ctx: XdpContext) -> u32 {
    xdp::finish(&ctx, xdp::try_xdp(&ctx))
}

/// IPv6 in XDP on external interfaces (tail-called by `proxy_xdp_ext`).
#[xdp]
pub fn proxy_xdp_ext6(ctx: XdpContext) -> u32 {
    xdp::finish(&ctx, xdp::try_xdp6(&ctx))
}

/// connect() of host-network sockets: Services to backends (see `sock`).
#[cgroup_sock_addr(connect4)]
pub fn proxy_sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::Hook::V4, true)
}

/// sendmsg() of unconnected host-network UDP sockets.
#[cgroup_sock_addr(sendmsg4)]
pub fn proxy_sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::Hook::V4, false)
}

/// recvmsg() of unconnected host-network UDP sockets: answers show the Service as sender.
#[cgroup_sock_addr(recvmsg4)]
pub fn proxy_sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::restore(&ctx, sock::Hook::V4)
}

/// getpeername() of host-network sockets connected to a Service.
#[cgroup_sock_addr(getpeername4)]
pub fn proxy_sock_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::restore(&ctx, sock::Hook::V4)
}

/// The same four for IPv6 sockets, whose IPv4 peers are IPv4-mapped addresses.
#[cgroup_sock_addr(connect6)]
pub fn proxy_sock_connect6(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::Hook::V6, true)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn proxy_sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::Hook::V6, false)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn proxy_sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::restore(&ctx, sock::Hook::V6)
}

#[cgroup_sock_addr(getpeername6)]
pub fn proxy_sock_getpeername6(ctx: SockAddrContext) -> i32 {
    sock::restore(&ctx, sock::Hook::V6)
}

/// close() of host-network sockets: a connected socket's tuple is free again.
#[cgroup_sock(sock_release)]
pub fn proxy_sock_release(ctx: SockContext) -> i32 {
    sock::release(&ctx);
    1
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
