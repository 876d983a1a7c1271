//! Support for the forwarding benchmark's frame generator (see `proxy_xdp_bench_ext`).

use aya_ebpf::{
    btf_maps::{Array, PerCpuArray},
    macros::btf_map,
    programs::XdpContext,
};

use crate::parse::ptr_at;

/// Length of the benchmark's frames (the classic minimum Ethernet frame, without FCS).
pub const FRAME_LEN: usize = 64;
// `restore` copies it a u64 at a time.
const _: () = assert!(FRAME_LEN % 8 == 0);
/// Offset of the UDP source port in the frame (Ethernet + a 20-byte IPv4 header).
const SPORT_OFF: usize = 34;
/// Flows the generator cycles through (consecutive source ports), unless `BENCH_FLOWS_V1`
/// says otherwise.
const FLOWS: u32 = 16;

/// The frame every benchmark run starts from (a UDP datagram without checksum, so the source
/// port can change without one). Not pinned; only the benchmark writes it.
#[btf_map]
pub static BENCH_FRAME_V1: Array<[u8; FRAME_LEN], 1> = Array::new();

/// How many flows the generator cycles through (0: `FLOWS`).
#[btf_map]
pub static BENCH_FLOWS_V1: Array<u32, 1> = Array::new();

/// Frames generated on this CPU, to pick the next flow.
#[btf_map]
pub static BENCH_SEQ_V1: PerCpuArray<u32, 1> = PerCpuArray::new();

/// Copies the template over the frame and gives it the next flow's source port. False when
/// either is missing or the frame is too short. The port is an IPv4 frame's: an IPv6 template
/// takes one flow, whose port (bytes of its source address here) is written back unchanged.
#[inline(always)]
pub fn restore(ctx: &XdpContext) -> bool {
    let Some(t) = BENCH_FRAME_V1.get(0) else { return false };
    // SAFETY: taken once here; only this generator uses the slot.
    let Some(seq) = (unsafe { crate::value::per_cpu(&BENCH_SEQ_V1, 0) }) else { return false };
    let Some(p) = ptr_at::<[u8; FRAME_LEN]>(ctx, 0) else { return false };
    let n = *seq;
    *seq = n.wrapping_add(1);
    // SAFETY: bounds checked by ptr_at; the template is a map value (8-byte aligned).
    unsafe {
        // A word at a time: as one assignment it was a call to a byte-at-a-time `memmove`,
        // which made the floor look slower than the lab is.
        let (to, from) = (p as usize, (t as *const [u8; FRAME_LEN]).cast::<u64>());
        for i in 0..FRAME_LEN / 8 {
            crate::access::store8(to + 8 * i, from.add(i).read());
        }
        let base = u16::from_be_bytes([(*p)[SPORT_OFF], (*p)[SPORT_OFF + 1]]);
        let flows = match BENCH_FLOWS_V1.get(0) {
            Some(&f) if f != 0 => f,
            _ => FLOWS,
        };
        let port = base.wrapping_add((n % flows) as u16).to_be_bytes();
        (*p)[SPORT_OFF] = port[0];
        (*p)[SPORT_OFF + 1] = port[1];
    }
    true
}
