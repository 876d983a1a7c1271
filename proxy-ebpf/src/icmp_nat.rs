//! ICMP and ICMPv6 errors about translated flows, rewritten as nf_nat rewrites the packets
//! conntrack calls RELATED, in both directions and both families. An error quotes the packet it
//! is about, and the host it goes to must recognise that packet as one of its own: as it sent
//! it, before the translation.
//!
//! - **Towards a client** (`Direction::Leaving`, on TC egress): an error about a packet the client
//!   sent to a Service (quoted client -> backend) must name the Service (quoted client ->
//!   Service, with the client's own port where the flow moved it); sent by the backend itself,
//!   it comes from the Service too. Without it a client's TCP cannot lower its path MTU, and a
//!   UDP client never hears "connection refused".
//! - **Towards a backend** (`Direction::Arriving`, on TC ingress of pods and of external
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
//! An arriving error goes on through the stack to its new destination. Its outer source is
//! kept (a router's, or the sender's): an address of the node there would be dropped as a
//! martian on the way in, and the receiver matches an error by its quote.
//!
//! Checksums are updated with arithmetic. Every region a checksum covers keeps its sum (the
//! quoted headers' changes are made up in the ICMP checksum, an IPv6 outer address's in the
//! ICMPv6 one, an IPv4 one's in the header checksum), so the sum of the whole packet does not
//! change, and a CHECKSUM_COMPLETE skb's `csum` stays right without the helper.

use aya_ebpf::programs::TcContext;
use proxy_common::{csum, ct::flags, CtKey, Reason, IPPROTO_UDP};

use crate::{family::Family, select::revnat_of, value::Slot, verdict::Verdict};

/// Where an error is met.
#[derive(Clone, Copy, PartialEq)]
pub enum Direction {
    /// TC egress: about to leave towards its destination.
    Leaving,
    /// TC ingress: just received from a pod or from outside.
    Arriving,
}

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

/// The ICMP (ICMPv6) message at `l4_off` (from `outer_src` to `outer_dst`), rewritten if it is
/// an error about a translated flow that must be translated where it is met (see the module
/// comment); anything else is passed as it is.
#[inline(always)]
pub fn translate<A: Family>(ctx: &TcContext, l4_off: usize, outer_src: A, outer_dst: A, at: Direction) -> Result<Verdict, Reason> {
    let untouched = Ok(Verdict::pass(if at == Direction::Leaving { Reason::EgressPass } else { Reason::PassNotService }));
    let Some(q) = A::read_quote(ctx, l4_off) else { return untouched };
    // The tuple the flow's packets in the other direction carry: one lookup finds the flow
    // from a quote in either of its forms.
    let key = CtKey { saddr: q.daddr, daddr: q.saddr, sport: q.dport, dport: q.sport, proto: q.proto, _pad: 0, _pad2: 0 };
    let Some(e) = Slot::of(A::ct(), &key) else { return untouched };
    // Read field by field (not copied whole: IPv6's entry would not fit beside the quote).
    let (f, nat_addr, nat_port, snat_addr, snat_port) = e.read(|e| (e.flags, e.nat_addr, e.nat_port, e.snat_addr, e.snat_port));
    let snat = f & flags::SNAT != 0;
    let to = if f & flags::REPLY != 0 {
        // The quote is of a packet towards the backend (the key is the reply tuple): the client
        // must see the Service. A local backend's client is reached by TC egress, where the
        // error leaves; a remote one's error was addressed to this node's SNAT address.
        if at == Direction::Arriving && !snat {
            return untouched;
        }
        let Some(rn) = e.read(revnat_of) else { return untouched };
        let sport = if snat {
            nat_port
        } else if f & flags::PORT_NAT != 0 {
            snat_port
        } else {
            q.sport
        };
        Rewrite {
            src: if snat { nat_addr } else { q.saddr },
            sport,
            dst: rn.addr,
            dport: rn.port,
            outer_dst: if snat && outer_dst == q.saddr { nat_addr } else { outer_dst },
            // Sent by the backend itself: it comes from the Service (not on arrival: see the
            // module comment).
            outer_src: if !snat && outer_src == q.daddr { rn.addr } else { outer_src },
        }
    } else {
        // The quote is of a reply (the key is the forward tuple): it goes to the backend,
        // quoting the reply as the backend sent it, to the address and port it sent it to.
        if at == Direction::Leaving || outer_dst != q.saddr {
            return untouched;
        }
        let hairpin = f & flags::HAIRPIN != 0;
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
            // A hairpinned client is its own backend, known to itself by the hairpin address.
            outer_src: if hairpin && outer_src == q.daddr { A::HAIRPIN } else { outer_src },
        }
    };
    rewrite(ctx, &q, outer_src, outer_dst, &to)?;
    Ok(Verdict::pass(Reason::IcmpErrorNat))
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
