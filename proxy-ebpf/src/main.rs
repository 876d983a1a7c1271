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
mod stats;

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};

/// TC ingress on pod-facing interfaces: ClusterIP DNAT for new and tracked flows, reverse NAT
/// for replies, ICMP reject for services without endpoints.
#[classifier]
pub fn proxy_tc_ingress(ctx: TcContext) -> i32 {
    let (action, reason) = match lb::try_tc_ingress(&ctx) {
        Ok(v) => (v.action, v.reason),
        Err(reason) => (TC_ACT_SHOT, reason),
    };
    stats::count(reason, ctx.len());
    action
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
