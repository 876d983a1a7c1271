//! Address and port rewrites. The IPv4 header and the port are written in place, and the IPv4
//! header checksum is updated with plain arithmetic (it is never offloaded).
//!
//! The TCP/UDP checksum comes in two forms. A CHECKSUM_PARTIAL skb (what a pod's own stack
//! sends through its veth with checksum offload) carries only the pseudo-header sum, which an
//! address change must update and a port change must leave alone; any other skb carries the
//! complete checksum, which both change. The skb's `ip_summed` that says which is not visible
//! to the program, but the kernel's helper knows it, so a flow's first translation (and its
//! first reply's) goes through the helper and learns the form from what the helper did to the
//! field (`rewrite_learning`). Later packets of the flow are rewritten with plain arithmetic
//! (`rewrite_known`): two helper calls are most of an established packet's cost. Each packet is
//! still checked against the learned form: its IPv4 length must be the packet's (IPv4 BIG TCP
//! packets have none, and go to the helper), and a field in the partial form equals the
//! pseudo-header sum the program computes, one in the complete form does so only by a 1 in
//! 65,536 chance. A packet that does not fit goes through the helper. So do TCP resets: the
//! kernel sends them (and TIME_WAIT acks) from its control socket with a complete checksum even
//! in an offloaded flow, and for those few packets the chance is not worth taking.
//!
//! A CHECKSUM_COMPLETE skb also carries the checksum of its whole payload in `skb->csum`,
//! which direct writes leave stale; the receiving stack then checks the packet again in
//! software and logs "hw csum failure". On TC ingress of a pod's veth packets come from the
//! pod's stack or its forwarding (which clears CHECKSUM_COMPLETE), so there the complete form
//! is rewritten with arithmetic alone. On egress, towards the pod, a packet from a NIC may
//! arrive still CHECKSUM_COMPLETE (an OVS datapath or a TC redirect delivers it without
//! clearing the state), so after an IPv4 reply's arithmetic rewrite in the complete form
//! `bpf_csum_update` moves `skb->csum` by what the written L4 bytes changed
//! (`csum::covered_change`; a no-op for other skbs). IPv6 needs nothing: its address change
//! and its L4 field's cancel in the sum. The partial form, which a NIC never produces, is all
//! arithmetic.
//!
//! The work is the same whether or not the values change, so a no-op rewrite costs what a real
//! one does.

use aya_ebpf::{bindings::BPF_F_MARK_MANGLED_0, programs::TcContext};
use proxy_common::{csum, ct::l4_csum, Reason, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    access,
    family::Family,
    parse::{ptr_at, Packet, IP_OFF},
};

const IP_CSUM: usize = 10;
pub const TCP_CSUM_OFF: usize = 16;
pub const UDP_CSUM_OFF: usize = 6;

#[derive(Clone, Copy)]
pub enum Side {
    /// Destination: DNAT towards a backend.
    Dst,
    /// Source: reverse NAT of a reply.
    Src,
}

impl Side {
    /// (network header offset of the address, L4 offset of the port, the address, the port).
    #[inline(always)]
    fn fields<A: Family>(self, pkt: &Packet<A>) -> (usize, usize, A, [u8; 2]) {
        match self {
            Side::Dst => (A::DST_OFF, 2, pkt.daddr, pkt.dport),
            Side::Src => (A::SRC_OFF, 0, pkt.saddr, pkt.sport),
        }
    }
}

/// Replaces the address and port on `side` with `addr`:`port`, fixing the IPv4 header checksum
/// and, when this packet carries the L4 header, the TCP/UDP checksum.
#[inline(always)]
pub fn rewrite<A: Family>(ctx: &TcContext, pkt: &Packet<A>, side: Side, addr: A, port: [u8; 2]) -> Result<(), Reason> {
    let (addr_off, port_off, old_addr, old_port) = side.fields(pkt);
    A::store_address(ctx, addr_off, old_addr, addr)?;
    if !pkt.has_l4() {
        return Ok(());
    }
    let ports = ptr_at::<[u8; 4]>(ctx, pkt.l4()).ok_or(Reason::DropRewrite)?;
    // SAFETY: bounds checked by ptr_at.
    unsafe { access::store2(ports as usize + port_off, port) };
    let (csum_off, mangled) = l4_csum_at(pkt);
    A::l4_address_helper(ctx, csum_off, mangled, old_addr, addr)?;
    let old_p = u64::from(u16::from_ne_bytes(old_port));
    let new_p = u64::from(u16::from_ne_bytes(port));
    ctx.l4_csum_replace(csum_off, old_p, new_p, mangled | 2).map_err(|_| Reason::DropRewrite)
}

/// Where the packet's L4 checksum is, and the helper flag its protocol needs: UDP's
/// BPF_F_MARK_MANGLED_0, as a zero UDP checksum means "none" and must stay zero.
#[inline(always)]
fn l4_csum_at<A: Family>(pkt: &Packet<A>) -> (usize, u64) {
    if pkt.proto == IPPROTO_TCP {
        (pkt.l4() + TCP_CSUM_OFF, 0)
    } else {
        (pkt.l4() + UDP_CSUM_OFF, u64::from(BPF_F_MARK_MANGLED_0))
    }
}

/// The checksum field of the packet's L4 header.
#[inline(always)]
fn l4_csum_field<A: Family>(ctx: &TcContext, pkt: &Packet<A>) -> Option<[u8; 2]> {
    let (off, _) = l4_csum_at(pkt);
    // SAFETY: bounds checked by ptr_at.
    ptr_at::<[u8; 2]>(ctx, off).map(|p| unsafe { access::load2(p as usize) })
}

/// The length of the packet's L4 header and payload, as its pseudo-header counts it.
#[inline(always)]
fn l4_len<A: Family>(pkt: &Packet<A>) -> u16 {
    u16::from_be_bytes(pkt.tot_len).wrapping_sub((pkt.l4_off - IP_OFF) as u16)
}

/// The pseudo-header sum of the packet as it arrived: what its checksum field holds in the
/// partial form.
#[inline(always)]
fn pseudo_header<A: Family>(pkt: &Packet<A>) -> [u8; 2] {
    A::pseudo_header(pkt.saddr, pkt.daddr, pkt.proto, l4_len(pkt))
}

/// A flow's address sums kept in its conntrack entries (`CtEntry::addr_sum` and `addr_delta`,
/// forward and reply): with them an established packet's and a reply's arithmetic do not sum
/// the addresses again (four words each in IPv6). A zero half is summed from the addresses as
/// before.
#[derive(Clone, Copy)]
pub struct Kept {
    pair: [u8; 2],
    delta: [u8; 2],
}

impl Kept {
    /// The sums of entry `e`, for the rewrite of a packet that matched its key: a forward
    /// entry's delta is from the key's destination to its `nat_addr` (the backend's address),
    /// a reply entry's from the key's source (the backend's) to its `nat_addr` (the Service's).
    /// (A reply is given the address `revnat` holds for the entry's Service id, which is
    /// `nat_addr` while the flow lives: the reply finds its forward entry by that address
    /// (`ct::touch_reply`). Comparing the two took the IPv6 egress program past its stack.)
    #[inline(always)]
    pub fn of<A: Family>(e: &proxy_common::CtEntry<A>) -> Kept {
        Kept { pair: e.addr_sum, delta: e.addr_delta }
    }
}

/// The rewrite of a flow's first packet (or first reply), through the helper (`rewrite`);
/// returns the checksum form it found (`l4_csum`), told by what the helper did to the field:
/// the partial form moves by the address change alone, the complete one by the address and
/// port change the other way. When both give the same value (nothing changed, or a fragment)
/// the form stays unknown.
#[inline(always)]
pub fn rewrite_learning<A: Family>(ctx: &TcContext, pkt: &Packet<A>, side: Side, addr: A, port: [u8; 2]) -> Result<u8, Reason> {
    let before = if pkt.frag == crate::parse::Frag::Whole { l4_csum_field(ctx, pkt) } else { None };
    rewrite(ctx, pkt, side, addr, port)?;
    let (Some(before), Some(after)) = (before, l4_csum_field(ctx, pkt)) else {
        return Ok(l4_csum::UNKNOWN);
    };
    let (_, _, old_addr, old_port) = side.fields(pkt);
    let partial = A::partial_update(before, old_addr, addr);
    let complete = A::complete_update(before, old_addr, addr, old_port, port, pkt.proto == IPPROTO_UDP);
    Ok(if partial == complete {
        l4_csum::UNKNOWN
    } else if after == partial && before == pseudo_header(pkt) {
        l4_csum::PARTIAL
    } else if after == complete {
        l4_csum::COMPLETE
    } else {
        l4_csum::UNKNOWN
    })
}

/// The rewrite of a later packet of a flow whose checksum form is `form`: plain arithmetic
/// when the packet fits that form (see the module comment), else the helper (`rewrite`).
#[inline(always)]
pub fn rewrite_known<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    side: Side,
    addr: A,
    port: [u8; 2],
    form: u8,
    kept: Kept,
) -> Result<(), Reason> {
    let usable = form == l4_csum::PARTIAL || form == l4_csum::COMPLETE;
    let whole = pkt.frag == crate::parse::Frag::Whole && u32::from(u16::from_be_bytes(pkt.tot_len)) + IP_OFF as u32 == ctx.len();
    if !usable || !whole || pkt.tcp_flags & crate::parse::TCP_RST != 0 {
        return rewrite(ctx, pkt, side, addr, port);
    }
    let (addr_off, port_off, old_addr, _) = side.fields(pkt);
    let fit = Fit { pkt, side, addr, port, form, kept };
    let written = if pkt.proto == IPPROTO_TCP {
        l4_arithmetic::<A, { TCP_CSUM_OFF + 2 }>(ctx, pkt.l4(), port_off, &fit)
    } else {
        l4_arithmetic::<A, { UDP_CSUM_OFF + 2 }>(ctx, pkt.l4(), port_off, &fit)
    };
    let Some(l4_change) = written else {
        return rewrite(ctx, pkt, side, addr, port);
    };
    if fit.moves_skb_csum() {
        // SAFETY: plain helper call on our own skb; for a skb that is not CHECKSUM_COMPLETE it
        // does nothing (and says so, which is no failure here).
        unsafe { aya_ebpf::helpers::bpf_csum_update(ctx.skb.skb, u32::from(l4_change)) };
    }
    A::store_address(ctx, addr_off, old_addr, addr)
}

/// An arithmetic rewrite of a packet of a flow whose checksum form is `form`.
struct Fit<'a, A: Family> {
    pkt: &'a Packet<A>,
    side: Side,
    addr: A,
    port: [u8; 2],
    form: u8,
    kept: Kept,
}

impl<A: Family> Fit<'_, A> {
    /// On egress a complete-form skb may be CHECKSUM_COMPLETE (see the module comment), whose
    /// `skb->csum` covers the network header and the L4 bytes. An IPv4 header's change sums to
    /// zero with its checksum's, but the L4 checksum field moves by the address change, which
    /// nothing in the packet cancels: `skb->csum` must move by what the L4 bytes did
    /// (`bpf_csum_update`, one call that only adds, where the L4 helper took two checks, a
    /// writability check and the field's rewrite again). In IPv6 the address bytes' change
    /// and the field's cancel, and `skb->csum` stays.
    #[inline(always)]
    fn moves_skb_csum(&self) -> bool {
        A::HEADER_CSUM && self.form == l4_csum::COMPLETE && matches!(self.side, Side::Src)
    }

    /// The new checksum field, if the packet's `field` fits the learned form. (A function
    /// rather than a closure: the closure was compiled as a BPF subprogram, a call per packet.)
    #[inline(always)]
    fn new_field(&self, field: [u8; 2]) -> Option<[u8; 2]> {
        let (_, _, old_addr, old_port) = self.side.fields(self.pkt);
        let (pair, delta) = (self.kept.pair, self.kept.delta);
        let pseudo =
            if pair != [0, 0] { csum::pseudo_header_with(pair, self.pkt.proto, l4_len(self.pkt)) } else { pseudo_header(self.pkt) };
        let is_partial = field == pseudo;
        if self.form == l4_csum::PARTIAL && is_partial {
            Some(if delta != [0, 0] { csum::partial_update_with(field, delta) } else { A::partial_update(field, old_addr, self.addr) })
        } else if self.form == l4_csum::COMPLETE && !is_partial {
            let udp = self.pkt.proto == IPPROTO_UDP;
            Some(if delta != [0, 0] {
                csum::l4_update_with(field, delta, old_port, self.port, udp)
            } else {
                A::complete_update(field, old_addr, self.addr, old_port, self.port, udp)
            })
        } else {
            None
        }
    }
}

/// Writes the port at `port_off` of the L4 header and the checksum `fit` makes of the one at
/// its end (`LEN` is the checksum's offset + 2). Returns the change of the sum of the bytes it
/// wrote (`csum::covered_change`); None, with nothing written, when the header is out of
/// bounds or the packet does not fit.
#[inline(always)]
fn l4_arithmetic<A: Family, const LEN: usize>(ctx: &TcContext, l4_off: usize, port_off: usize, fit: &Fit<A>) -> Option<u16> {
    let l4 = ptr_at::<[u8; LEN]>(ctx, l4_off)? as usize;
    // SAFETY: bounds checked by ptr_at, for these accesses too.
    let field = unsafe { access::load2(l4 + LEN - 2) };
    let new = fit.new_field(field)?;
    let (_, _, _, old_port) = fit.side.fields(fit.pkt);
    // SAFETY: as above.
    unsafe {
        access::store2(l4 + port_off, fit.port);
        access::store2(l4 + LEN - 2, new);
    }
    Some(csum::covered_change(old_port, fit.port, field, new))
}

/// Replaces the address at `addr_off` of the IPv4 header, `old` with `new`, and updates the
/// header checksum.
#[inline(always)]
pub fn rewrite_ipv4(ctx: &TcContext, addr_off: usize, old: [u8; 4], new: [u8; 4]) -> Result<(), Reason> {
    let ip = ptr_at::<[u8; 20]>(ctx, IP_OFF).ok_or(Reason::DropRewrite)? as usize;
    // SAFETY: bounds checked by ptr_at; the program owns the (unshared) packet data.
    unsafe {
        let check = csum::update4(access::load2(ip + IP_CSUM), old, new);
        access::store4(ip + addr_off, new);
        access::store2(ip + IP_CSUM, check);
    }
    Ok(())
}

/// Sends the packet back out the interface it came in on, to the host it came from: hairpinned
/// flows go straight back to their pod, past routing (whose reverse-path filter would drop a
/// source no route leads to) and netfilter.
#[inline(always)]
pub fn bounce(ctx: &TcContext) -> Result<i32, Reason> {
    let macs = crate::parse::ptr_at::<[u8; 12]>(ctx, 0).ok_or(Reason::DropRewrite)?;
    // SAFETY: bounds checked by ptr_at.
    let macs = unsafe { &mut *macs };
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    *macs = swapped;
    // SAFETY: reads the ifindex field of our own context; plain helper call.
    let action = unsafe { aya_ebpf::helpers::bpf_redirect((*ctx.skb.skb).ifindex, 0) } as i32;
    if action != aya_ebpf::bindings::TC_ACT_REDIRECT {
        return Err(Reason::DropRewrite);
    }
    Ok(action)
}
