//! The lab's and the benchmarks' programs, in an object of their own (`proxy-lab`) so that the
//! agent's object holds only what the agent loads. The tests and `cargo xtask bench` load it;
//! the agent never does. It compiles the dataplane's modules again (the benchmark's generator
//! runs the external XDP logic), so those it does not call are dead code here.
#![no_std]
#![no_main]
#![feature(core_intrinsics, asm_experimental_arch)]
#![expect(internal_features, reason = "atomic_xadd: the bpf target has no AtomicU64::fetch_add")]
#![expect(dead_code, reason = "the dataplane's modules are compiled whole; the lab calls the XDP path only")]

#[path = "../access.rs"]
mod access;
#[path = "../bench.rs"]
mod bench;
#[path = "../ct.rs"]
mod ct;
#[path = "../ext.rs"]
mod ext;
#[path = "../family.rs"]
mod family;
#[path = "../flowcache.rs"]
mod flowcache;
#[path = "../frag.rs"]
mod frag;
#[path = "../host.rs"]
mod host;
#[path = "../icmp.rs"]
mod icmp;
#[path = "../icmp6.rs"]
mod icmp6;
#[path = "../icmp_nat.rs"]
mod icmp_nat;
#[path = "../maps.rs"]
mod maps;
#[path = "../nat.rs"]
mod nat;
#[path = "../north.rs"]
mod north;
#[path = "../parse.rs"]
mod parse;
#[path = "../parse6.rs"]
mod parse6;
#[path = "../pod_ingress.rs"]
mod pod_ingress;
#[path = "../select.rs"]
mod select;
#[path = "../stats.rs"]
mod stats;
#[path = "../value.rs"]
mod value;
#[path = "../verdict.rs"]
mod verdict;
#[path = "../xdp.rs"]
mod xdp;

use aya_ebpf::{
    bindings::{xdp_action, TC_ACT_OK},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

/// Passes every frame. The lab attaches it to the far end of veths that XDP_TX and
/// XDP_REDIRECT send into, because veth delivers XDP frames promptly only to a peer that runs
/// XDP itself.
#[xdp]
pub fn proxy_xdp_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Drops every frame: the benchmark's sink on the far side of the forwarding node.
#[xdp]
pub fn proxy_xdp_drop(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

/// Restores the frame from `BENCH_FRAME_V1`, then runs the external XDP logic on it. XDP
/// live-frame test runs recycle frames with whatever the program wrote into them; the restore
/// makes every run see the same arriving frame.
#[xdp]
pub fn proxy_xdp_bench_ext(ctx: XdpContext) -> u32 {
    if !bench::restore(&ctx) {
        return xdp_action::XDP_ABORTED;
    }
    xdp::finish(&ctx, xdp::try_xdp(&ctx))
}

/// Restores the frame and sends it straight back out (the floor: generator, transmit and sink
/// with no processing at all).
#[xdp]
pub fn proxy_xdp_bench_tx(ctx: XdpContext) -> u32 {
    if !bench::restore(&ctx) {
        return xdp_action::XDP_ABORTED;
    }
    xdp_action::XDP_TX
}

/// Restores the frame, then hands it to the stack.
#[xdp]
pub fn proxy_xdp_bench_pass(ctx: XdpContext) -> u32 {
    if !bench::restore(&ctx) {
        return xdp_action::XDP_ABORTED;
    }
    xdp_action::XDP_PASS
}

/// An empty classifier: the floor `cargo xtask bench` measures the agent's programs against
/// (test-run and skb set-up cost).
#[classifier]
pub fn proxy_tc_floor(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
