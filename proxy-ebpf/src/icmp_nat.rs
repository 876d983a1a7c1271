//! ICMP and ICMPv6 errors about translated flows, rewritten as nf_nat rewrites the packets
//! conntrack calls RELATED, in both directions and both families. An error quotes the packet it
//! is about, and the host it goes to must recognise that packet as one of its own: as it sent
//! it, before the translation.
//!
//! - **Towards a client** (`leaving`, on TC egress): an error about a packet the client
//!   sent to a Service (quoted client -> backend) must name the Service (quoted client ->
//!   Service, with the client's own port where the flow moved it); sent by the backend itself,
//!   it comes from the Service too. Without it a client's TCP cannot lower its path MTU, and a
//!   UDP client never hears "connection refused".
//! - **Towards a backend** (`arriving`, on TC ingress of pods and of external
//!   interfaces): an error about a reply the client received (quoted Service -> client: a
//!   router's Fragmentation Needed or Packet Too Big on the way to the client, or the client's
//!   own port unreachable) is addressed to the Service; it must go to the backend, quoting the
//!   reply as the backend sent it (backend -> client, or -> the node's SNAT address and port).
//!   Without it a backend's large replies are dropped on the way for good (routers fragment
//!   neither IPv6 nor IPv4 with DF set) and the connection stalls.
//!   An error about a packet this node forwarded to a remote backend with SNAT (quoted node
//!   address:port -> backend) is addressed to the node; it must go to the client, quoting what
//!   the client sent.
//!
//! An arriving error about a local backend's flow goes on through the stack to its new
//! destination (the kernel's conntrack saw that flow, so the error is RELATED for the node's
//! netfilter too), with its outer source kept (a router's, or the client's). One about a flow
//! SNATed to a remote backend is sent on past the stack by the FIB's route, as that flow's
//! packets are: the node's conntrack never saw them (a `ctstate INVALID` drop would take the
//! error), and its outer source becomes what nf_nat would make it, the node's SNAT address
//! towards the backend, the Service towards the client when the backend sent it (an address
//! of the node, which the stack would drop as a martian on the way in). A hairpinned flow's
//! error goes straight back to its pod, as the flow's packets do. One about a flow the node
//! itself opened (`host`), addressed to the node, goes up the stack to the process's socket.
//!
//! Checksums are updated with arithmetic. Every region a checksum covers keeps its sum (the
//! quoted headers' changes are made up in the ICMP checksum, an IPv6 outer address's in the
//! ICMPv6 one, an IPv4 one's in the header checksum), so the sum of the whole packet does not
//! change, and a CHECKSUM_COMPLETE skb's `csum` stays right without the helper.

use aya_ebpf::programs::TcContext;
use proxy_common::{csum, ct::flags, CtKey, Ip6, Reason, IPPROTO_UDP};

use crate::{
    family::Family,
    north::{self, Env},
    parse::{Parsed, IP_OFF},
    select::revnat_of,
    value::Slot,
    verdict::Verdict,
};

/// An ICMP (ICMPv6) error quoting a TCP or UDP packet whose ports are in the message: where
/// its fields are, and what they hold.
#[derive(Clone, Copy)]
pub struct Quote<A> {
    /// Offset of the ICMP checksum.
    pub icmp_csum: usize,
    /// Offset of the quoted IP header.
    pub ip: usize,
    /// Offset of the quoted TCP or UDP header, whose first 8 bytes lie within the message.
    pub l4: usize,
    pub proto: u8,
    pub saddr: A,
    pub daddr: A,
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    /// The quoted UDP checksum (TCP's is past the 8 bytes a quote must hold).
    pub udp_check: [u8; 2],
}

/// What a translated error's quote and outer addresses become.
struct Rewrite<A> {
    src: A,
    sport: [u8; 2],
    dst: A,
    dport: [u8; 2],
    outer_dst: A,
    outer_src: A,
}

/// The ICMP (ICMPv6) message at `l4_off` (from `outer_src` to `outer_dst`) about to leave (TC
/// egress), rewritten if it is an error about a translated flow that must be translated there
/// (see the module comment); anything else is passed as it is. A genuine error is addressed to the sender of
/// the packet it quotes: one addressed elsewhere is left alone, as conntrack leaves it.
#[inline(always)]
pub fn leaving<A: Family>(ctx: &TcContext, l4_off: usize, outer_src: A, outer_dst: A) -> Result<Verdict, Reason> {
    translate::<A, false>(ctx, l4_off, outer_src, outer_dst)
}

/// `leaving`'s counterpart on TC ingress, for an error just received from a pod or from
/// outside.
#[inline(always)]
pub fn arriving<A: Family>(ctx: &TcContext, l4_off: usize, outer_src: A, outer_dst: A) -> Result<Verdict, Reason> {
    translate::<A, true>(ctx, l4_off, outer_src, outer_dst)
}

/// Both, told apart at compile time (what only an arriving error needs, its route past the
/// stack, would not fit TC egress's IPv6 frame).
#[inline(always)]
fn translate<A: Family, const ARRIVING: bool>(ctx: &TcContext, l4_off: usize, outer_src: A, outer_dst: A) -> Result<Verdict, Reason> {
    let untouched = Ok(Verdict::pass(if ARRIVING { Reason::PassNotService } else { Reason::EgressPass }));
    let Some(q) = A::read_quote(ctx, l4_off) else { return untouched };
    if outer_dst != q.saddr {
        return untouched;
    }
    // The tuple the flow's packets in the other direction carry: one lookup finds the flow
    // from a quote in either of its forms.
    let key = CtKey { saddr: q.daddr, daddr: q.saddr, sport: q.dport, dport: q.sport, proto: q.proto, _pad: 0, _pad2: 0 };
    let Some(e) = Slot::of(A::ct(), &key) else { return untouched };
    // Read field by field (not copied whole: IPv6's entry would not fit beside the quote).
    let (f, nat_addr, nat_port, snat_addr, snat_port, owner) =
        e.read(|e| (e.flags, e.nat_addr, e.nat_port, e.snat_addr, e.snat_port, e.owner));
    if owner == proxy_common::ct::owner::NETFILTER {
        // A connection netfilter's entry translates: its errors are netfilter's too (RELATED).
        return untouched;
    }
    let snat = f & flags::SNAT != 0;
    // A hairpinned client is its own backend, which knows the client by the hairpin address:
    // the error goes straight back to the pod it came from, as the flow's packets do.
    let hairpin = f & flags::HAIRPIN != 0;
    let to = if f & flags::REPLY != 0 {
        // The quote is of a packet towards the backend (the key is the reply tuple): the client
        // must see the Service. A local backend's client is reached by TC egress, where the
        // error leaves; a remote one's error was addressed to this node's SNAT address, and a
        // hairpinned one's to the hairpin address, and both are met on arrival.
        if ARRIVING != (snat || hairpin) {
            return untouched;
        }
        let Some(rn) = e.read(revnat_of) else { return untouched };
        let client = if snat {
            nat_addr
        } else if hairpin {
            q.daddr
        } else {
            q.saddr
        };
        let sport = if snat {
            nat_port
        } else if f & flags::PORT_NAT != 0 {
            snat_port
        } else {
            q.sport
        };
        Rewrite {
            src: client,
            sport,
            dst: rn.addr,
            dport: rn.port,
            outer_dst: client,
            // Sent by the backend itself: it comes from the Service.
            outer_src: if outer_src == q.daddr { rn.addr } else { outer_src },
        }
    } else {
        // The quote is of a reply (the key is the forward tuple): it goes to the backend,
        // quoting the reply as the backend sent it, to the address and port it sent it to.
        if !ARRIVING {
            return untouched;
        }
        let client = if snat {
            snat_addr
        } else if hairpin {
            A::HAIRPIN
        } else {
            q.daddr
        };
        Rewrite {
            src: nat_addr,
            sport: nat_port,
            dst: client,
            dport: if f & (flags::SNAT | flags::PORT_NAT) != 0 { snat_port } else { q.dport },
            outer_dst: nat_addr,
            outer_src: if snat {
                snat_addr
            } else if hairpin && outer_src == q.daddr {
                A::HAIRPIN
            } else {
                outer_src
            },
        }
    };
    // An error about a flow the node itself opened (`host`): its client is the node, where the
    // error is addressed. It goes up the stack to the process's socket, as the flow's replies.
    let host = ARRIVING && snat && f & flags::REPLY != 0 && nat_addr == outer_dst;
    if ARRIVING && snat && !host {
        // Sent on past the stack, one hop further: an error on its last hop is left to the
        // kernel, untranslated (it sends no error about an error).
        let hops: [u8; 1] = ctx.load(IP_OFF + A::HOPS_OFF).map_err(|_| Reason::DropRewrite)?;
        if hops[0] <= 1 {
            return untouched;
        }
    }
    rewrite(ctx, &q, outer_src, outer_dst, &to)?;
    if ARRIVING && hairpin {
        return Ok(Verdict { action: crate::nat::bounce(ctx)?, reason: Reason::IcmpErrorNat });
    }
    if ARRIVING && snat && !host {
        return A::send_translated(ctx, to.outer_src, to.outer_dst);
    }
    Ok(Verdict::pass(Reason::IcmpErrorNat))
}

/// Sends a translated error from `src` to `dst` on past the stack by the FIB's route, one hop
/// less (the caller has checked it has one to spare), as `Step::Forward` sends a flow's packets.
#[inline(always)]
pub fn send_on<A: Family>(ctx: &TcContext, src: A, dst: A) -> Result<Verdict, Reason> {
    // SAFETY: reads a field of our own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let env = Env { ctx: ctx.skb.skb as *mut _, ifindex, xdp: false, dry: false, cache_under: None };
    let route = north::fib_proto(&env, A::ICMP_PROTO, src, dst)?;
    A::decrement_hops(ctx)?;
    Ok(Verdict { action: crate::ext::send(ctx, &route)?, reason: Reason::IcmpErrorNat })
}

/// The IPv6 stage of `send_on` (`prog_names::TC_ICMP6_SEND`): the addresses are the packet's,
/// already translated.
#[inline(always)]
pub fn try_send6(ctx: &TcContext) -> Result<Verdict, Reason> {
    let src: [u8; 16] = ctx.load(IP_OFF + Ip6::SRC_OFF).map_err(|_| Reason::DropRewrite)?;
    let dst: [u8; 16] = ctx.load(IP_OFF + Ip6::DST_OFF).map_err(|_| Reason::DropRewrite)?;
    send_on(ctx, Ip6::from_bytes(src), Ip6::from_bytes(dst))
}

/// An ICMPv6 error arriving from a pod or from outside (a program of its own: see
/// `prog_names::TC_ICMP6`).
#[inline(always)]
pub fn try_arriving6(ctx: &TcContext) -> Result<Verdict, Reason> {
    match crate::parse6::ipv6(ctx) {
        Parsed::Icmp { l4_off, saddr, daddr, .. } => arriving::<Ip6>(ctx, l4_off, saddr, daddr),
        _ => Ok(Verdict::pass(Reason::PassNotService)),
    }
}

/// Writes the rewrite, every checksum following (see the module comment).
#[inline(always)]
fn rewrite<A: Family>(ctx: &TcContext, q: &Quote<A>, outer_src: A, outer_dst: A, to: &Rewrite<A>) -> Result<(), Reason> {
    let fail = |_| Reason::DropRewrite;
    let mut icmp: [u8; 2] = ctx.load(q.icmp_csum).map_err(fail)?;
    ctx.store(q.ip + A::SRC_OFF, &to.src, 0).map_err(fail)?;
    ctx.store(q.ip + A::DST_OFF, &to.dst, 0).map_err(fail)?;
    ctx.store(q.l4, &to.sport, 0).map_err(fail)?;
    ctx.store(q.l4 + 2, &to.dport, 0).map_err(fail)?;
    icmp = csum::l4_update(icmp, q.saddr, to.src, q.sport, to.sport, false);
    icmp = csum::l4_update(icmp, q.daddr, to.dst, q.dport, to.dport, false);
    if A::HEADER_CSUM {
        // The quoted IPv4 header's checksum follows its addresses.
        let old: [u8; 2] = ctx.load(q.ip + 10).map_err(fail)?;
        let new = csum::update_address(csum::update_address(old, q.saddr, to.src), q.daddr, to.dst);
        ctx.store(q.ip + 10, &new, 0).map_err(fail)?;
        icmp = csum::update2(icmp, old, new);
    }
    if q.proto == IPPROTO_UDP && q.udp_check != [0; 2] {
        // The quoted UDP checksum follows the quoted datagram, as nf_nat keeps it.
        let udp = csum::l4_update(q.udp_check, q.saddr, to.src, q.sport, to.sport, true);
        let udp = csum::l4_update(udp, q.daddr, to.dst, q.dport, to.dport, true);
        ctx.store(q.l4 + 6, &udp, 0).map_err(fail)?;
        icmp = csum::update2(icmp, q.udp_check, udp);
    }
    // The outer addresses: IPv4's header checksum is `store_address`'s; ICMPv6's checksum
    // covers them in its pseudo-header.
    if to.outer_src != outer_src {
        A::store_address(ctx, A::SRC_OFF, outer_src, to.outer_src)?;
        if !A::HEADER_CSUM {
            icmp = csum::update_address(icmp, outer_src, to.outer_src);
        }
    }
    if to.outer_dst != outer_dst {
        A::store_address(ctx, A::DST_OFF, outer_dst, to.outer_dst)?;
        if !A::HEADER_CSUM {
            icmp = csum::update_address(icmp, outer_dst, to.outer_dst);
        }
    }
    ctx.store(q.icmp_csum, &icmp, 0).map_err(fail)
}
