#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![expect(internal_features, reason = "atomic_xadd: the bpf target has no AtomicU64::fetch_add")]

mod ct;
mod frag;
mod icmp;
mod lb;
mod maps;
mod nat;
mod parse;
mod revnat;
mod stats;

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use proxy_common::Reason;

#[inline(always)]
fn finish(ctx: &TcContext, verdict: Result<lb::Verdict, Reason>) -> i32 {
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
    finish(&ctx, lb::try_tc_ingress(&ctx))
}

/// TC egress on pod-facing interfaces: reverse NAT of replies, ICMP errors made recognisable.
#[classifier]
pub fn proxy_tc_egress(ctx: TcContext) -> i32 {
    finish(&ctx, revnat::try_tc_egress(&ctx))
}

/// An empty program of the same type: the floor `cargo xtask bench` measures the others
/// against (test-run and skb set-up cost). The agent never loads it.
#[classifier]
pub fn proxy_tc_floor(_ctx: TcContext) -> i32 {
    aya_ebpf::bindings::TC_ACT_OK
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
