//! North-south decisions, shared by TC and XDP on external interfaces: NodePort, load-balancer
//! and external IPs. A flow to a backend on this node is only DNATed (the client's address is
//! kept, and the reply leaves through TC egress); a flow to a backend on another node is DNATed
//! and SNATed to this node's address with a tracked port mapping, and sent on past the stack
//! (its source is one of our addresses, which the stack would drop as martian on ingress), so
//! its reply comes back here and is translated back the same way.
//!
//! XDP handles what it can finish on its own (remote backends with a resolved neighbour, their
//! replies) and leaves the rest to TC, which makes the same choice: Maglev and affinity are
//! deterministic for a flow.
//!
//! Both families take the same decisions (`Family`), in XDP and in TC. TC's external IPv6
//! program decides a new flow in a program of its own (`decide_tracked`): its whole decision
//! beside the rest of that program does not fit one stack frame.

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS},
    cty::c_void,
    helpers::bpf_fib_lookup,
};
use proxy_common::{
    ct::{flags, owner, ROUTE_XDP_KNOWN},
    limits, svc_flags, xdp_dev, Backend, CtEntry, Reason, ServiceKey,
};

use crate::{
    ct,
    family::Family,
    flowcache,
    maps::{CONFIG_V3, XDP_DEVS_V1},
    parse::Packet,
    pod_ingress::count_flow,
    select::{self, backend_of, revnat_of},
    value::{self, Slot},
};

/// Where the FIB sends a packet.
#[derive(Clone, Copy)]
pub struct Route<A = [u8; 4]> {
    pub ifindex: u32,
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
    /// The next hop has no neighbour entry yet: `dmac` is unknown.
    pub no_neigh: bool,
    /// The next hop (gateway, or the destination itself).
    pub nexthop: A,
}

pub struct Env {
    /// `xdp_md` or `__sk_buff`, for the FIB helper.
    pub ctx: *mut c_void,
    pub ifindex: u32,
    /// Running in XDP: anything that needs the stack is passed on untouched.
    pub xdp: bool,
    /// A trace: decide, but write nothing.
    pub dry: bool,
    /// XDP: the packet's step is to be cached (its flow missed the flow cache, `flowcache`),
    /// under this generation, read before the packet's lookups.
    pub cache_under: Option<u32>,
}

pub enum Step<A = [u8; 4]> {
    /// Not ours to change.
    Pass(Reason),
    /// DNAT only, and on through the stack (a backend on this node).
    /// `sport`: the client's source port moved to keep the translated tuple unique.
    Dnat {
        backend: Backend<A>,
        backend_id: u32,
        service_id: u32,
        reason: Reason,
        sport: Option<[u8; 2]>,
    },
    /// Rewrite both addresses and send by `route`.
    Forward {
        dst: (A, [u8; 2]),
        src: (A, [u8; 2]),
        route: Route<A>,
        backend_id: u32,
        service_id: u32,
        reason: Reason,
    },
    /// A reply of a flow the node itself opened (`host`): the source becomes `src` and the
    /// destination port `dport` (the process's own), and it goes up the stack to its socket.
    Deliver {
        src: (A, [u8; 2]),
        dport: [u8; 2],
        backend_id: u32,
        service_id: u32,
    },
    /// A new flow, left for `new_flow` (`decide_tracked`).
    NewFlow,
    /// No endpoints: ICMP (ICMPv6) port unreachable.
    Reject {
        service_id: u32,
    },
    Drop(Reason),
}

#[inline(always)]
pub fn fib<A: Family>(env: &Env, pkt: &Packet<A>, src: A, dst: A) -> Result<Route<A>, Reason> {
    fib_proto(env, pkt.proto, src, dst)
}

/// `fib` for a packet of protocol `proto` from `src` to `dst`.
#[inline(always)]
pub fn fib_proto<A: Family>(env: &Env, proto: u8, src: A, dst: A) -> Result<Route<A>, Reason> {
    // SAFETY: a plain-data struct of integers and arrays; all-zero is a valid value.
    let mut p: FibParams = unsafe { core::mem::zeroed() };
    p.l4_protocol = proto;
    p.ifindex = env.ifindex;
    // tot_len stays 0: no MTU check (translation does not change the size).
    A::set_fib_addresses(&mut p, src, dst);
    // SAFETY: `p` is a valid, fully initialised parameter block of the size passed.
    let rc = unsafe { bpf_fib_lookup(env.ctx, &mut p, size_of::<FibParams>() as i32, 0) };
    let no_neigh = rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64;
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 && !no_neigh {
        return Err(Reason::DropNoRoute);
    }
    Ok(Route { ifindex: p.ifindex, smac: p.smac, dmac: p.dmac, no_neigh, nexthop: A::fib_nexthop(&p) })
}

/// The route of a tracked flow: the one cached in its entry while it is fresh, else a FIB lookup
/// whose answer is cached (not for a neighbour that is not resolved yet, nor in a trace), with
/// what native XDP may send out of its device (`xdp_dev` flags): an established packet in XDP
/// then needs no lookup of its device. The flags are as fresh as the route (an epoch); the
/// agent itself notices a change of what a device takes only at its next housekeeping.
#[inline(always)]
fn route_of<A: Family>(
    env: &Env,
    pkt: &Packet<A>,
    e: &mut Slot<CtEntry<A>>,
    entry: &CtEntry<A>,
    src: A,
    dst: A,
    now: u64,
) -> Result<Route<A>, Reason> {
    if route_fresh(entry, now) {
        return Ok(Route { ifindex: entry.route_ifindex, smac: entry.route_smac, dmac: entry.route_dmac, no_neigh: false, nexthop: dst });
    }
    let r = fib(env, pkt, src, dst)?;
    if !r.no_neigh && !env.dry {
        // Only XDP uses them (TC caches none: its packets would pay the lookup for nothing).
        // The flags are 3 bits (`xdp_dev`); anything wider is not cached.
        let flags = if env.xdp { device_flags(r.ifindex) } else { u32::MAX };
        let xdp = if flags < u32::from(ROUTE_XDP_KNOWN) { ROUTE_XDP_KNOWN | flags as u8 } else { 0 };
        let epoch = proxy_common::ct::route_epoch(now);
        // Racing writers store the same kind of data, and a torn route (or one route's device
        // flags beside another's index) is at worst used until the epoch moves on.
        e.update(move |e| {
            e.route_ifindex = r.ifindex;
            e.route_dmac = r.dmac;
            e.route_smac = r.smac;
            // Before the epoch that makes them current.
            e.route_xdp = xdp;
            e.route_epoch = epoch;
        });
    }
    Ok(r)
}

/// Whether the entry's cached route is set and of the current epoch (`route_of` uses it).
#[inline(always)]
fn route_fresh<A: Family>(entry: &CtEntry<A>, now: u64) -> bool {
    entry.route_ifindex != 0 && entry.route_epoch == proxy_common::ct::route_epoch(now)
}

/// The `xdp_dev` flags cached with a tracked flow's route (`CtEntry::route_xdp`), while that
/// route is the one `route_of` gives; else 0 (not known).
#[inline(always)]
fn cached_device<A: Family>(entry: &CtEntry<A>, now: u64) -> u8 {
    if route_fresh(entry, now) {
        entry.route_xdp
    } else {
        0
    }
}

/// A route XDP can use, or the step to take instead: XDP passes what needs a neighbour resolved
/// or leaves by a device that cannot take its frames (and everything else it cannot finish);
/// TC drops what has no route. `device`: the route device's flags if known (`cached_device`).
#[inline(always)]
fn usable<A: Family>(env: &Env, route: Result<Route<A>, Reason>, device: u8) -> Result<Route<A>, Step<A>> {
    match route {
        Ok(r) if !env.xdp || (!r.no_neigh && xdp_can_send(env.ifindex, r.ifindex, device)) => Ok(r),
        Ok(_) => Err(Step::Pass(Reason::XdpPass)),
        Err(r) => Err(xdp_pass(env).unwrap_or(Step::Drop(r))),
    }
}

/// Whether XDP running on `ingress` may send a frame out of `egress` (XDP_TX when they are the
/// same device, XDP_REDIRECT otherwise), whose flags `device` gives if it has `ROUTE_XDP_KNOWN`.
/// A frame native XDP sends into a device that cannot take it is dropped by the kernel, a veth
/// whose peer runs no XDP program being the common case; the agent records what each device
/// takes (`xdp_dev`), and what it has not recorded goes to TC.
#[inline(always)]
fn xdp_can_send(ingress: u32, egress: u32, device: u8) -> bool {
    let flags = if device & ROUTE_XDP_KNOWN != 0 { u32::from(device & !ROUTE_XDP_KNOWN) } else { device_flags(egress) };
    let need = if ingress == egress { xdp_dev::TX } else { xdp_dev::XMIT };
    flags & need != 0 || device_flags(ingress) & xdp_dev::GENERIC != 0
}

/// The `xdp_dev` flags the agent recorded for a device (0: none, or not recorded).
#[inline(always)]
fn device_flags(ifindex: u32) -> u32 {
    value::copy(&XDP_DEVS_V1, &ifindex).unwrap_or(0)
}

/// XDP: caches the step of a tracked flow's packet (`flowcache`), sent on by `route` with the
/// addresses `dst` and `src`, for as long as the conntrack path would take it again without
/// writing the flow's entry `e` (`lifetime`: the entry's, `u64::MAX` for one never checked).
#[inline(always)]
fn remember<A: Family>(
    env: &Env,
    pkt: &Packet<A>,
    e: &Slot<CtEntry<A>>,
    lifetime: u64,
    now: u64,
    dst: (A, [u8; 2]),
    src: (A, [u8; 2]),
    route: &Route<A>,
    reason: Reason,
) {
    let Some(generation) = env.cache_under else { return };
    // As the packet left it (a packet the cache takes adds no flags).
    let (last_seen, flags) = e.read(|e| (e.last_seen_ns, e.flags));
    if !flowcache::caches(flags) {
        return;
    }
    let until = flowcache::window_end(last_seen, lifetime, now);
    flowcache::fill_xdp(&ct::key(pkt), env.ifindex, generation, now, until, dst, src, route, reason);
}

/// XDP gives up on anything it cannot finish itself; TC decides it again.
#[inline(always)]
fn xdp_pass<A: Family>(env: &Env) -> Option<Step<A>> {
    env.xdp.then_some(Step::Pass(Reason::XdpPass))
}

#[inline(always)]
pub fn decide<A: Family>(env: &Env, pkt: &Packet<A>, clock: impl Fn() -> u64 + Copy) -> Step<A> {
    decide_tracked(env, pkt, clock, false)
}

/// `decide`; with `stage_new`, a packet that opens a flow gets `Step::NewFlow` instead of its
/// step, for a program of its own to decide (IPv6's whole decision does not fit one 512-byte
/// stack frame).
#[inline(always)]
pub fn decide_tracked<A: Family>(env: &Env, pkt: &Packet<A>, clock: impl Fn() -> u64 + Copy, stage_new: bool) -> Step<A> {
    decide_found(env, pkt, clock, stage_new, ct::lookup(ct::key(pkt)))
}

/// `decide_tracked`, with the packet's conntrack entry looked up by the caller (XDP, which
/// reads the conntrack filter before its flow cache).
#[inline(always)]
pub fn decide_found<A: Family>(
    env: &Env,
    pkt: &Packet<A>,
    clock: impl Fn() -> u64 + Copy,
    stage_new: bool,
    found: Option<Slot<CtEntry<A>>>,
) -> Step<A> {
    if let Some(mut e) = found {
        let now = clock();
        let entry = e.get();
        if entry.flags & flags::REPLY != 0 {
            if entry.flags & flags::SNAT == 0 {
                // A local backend's flow (TC egress translates its replies), or a pod's reply
                // coming back from another node; at its handover too (`owner::HANDOVER`): no
                // masquerade of pods' traffic takes such a reply, tracked as new or not.
                return xdp_pass(env).unwrap_or(Step::Pass(Reason::ReplyIngress));
            }
            let Some(rn) = revnat_of(&entry) else {
                return xdp_pass(env).unwrap_or(Step::Pass(Reason::PassNotService));
            };
            if !env.xdp && entry.nat_addr == pkt.daddr {
                // The client is the node itself (`host`): delivered here, by TC. (XDP passes
                // it all the same: the FIB has no route to forward to a local address.)
                if !env.dry && !ct::touch_reply(pkt, &mut e, &entry, &ct::snat_forward_key(&entry, rn.addr, rn.port, pkt.proto), now) {
                    return Step::Pass(Reason::PassNotService);
                }
                return Step::Deliver {
                    src: (rn.addr, rn.port),
                    dport: entry.nat_port,
                    backend_id: entry.backend_id,
                    service_id: entry.service_id,
                };
            }
            let route = match usable(env, route_of(env, pkt, &mut e, &entry, rn.addr, entry.nat_addr, now), cached_device(&entry, now)) {
                Ok(r) => r,
                Err(step) => return step,
            };
            if !env.dry && !ct::touch_reply(pkt, &mut e, &entry, &ct::snat_forward_key(&entry, rn.addr, rn.port, pkt.proto), now) {
                return xdp_pass(env).unwrap_or(Step::Pass(Reason::PassNotService));
            }
            let (dst, src) = ((entry.nat_addr, entry.nat_port), (rn.addr, rn.port));
            // A reply entry's own age is never checked: its flow's forward entry is, when due.
            remember(env, pkt, &e, u64::MAX, now, dst, src, &route, Reason::XdpReply);
            return Step::Forward {
                dst,
                src,
                route,
                backend_id: entry.backend_id,
                service_id: entry.service_id,
                reason: if env.xdp { Reason::XdpReply } else { Reason::ExtReply },
            };
        }
        let live = !ct::forward_stale(pkt, &entry, now);
        if live && entry.owner == owner::NETFILTER && (pkt.proto != proxy_common::IPPROTO_UDP || backend_of(&entry).is_some()) {
            // A connection netfilter's entry translates (either of its tuples): TC keeps it
            // alive, and leaves it to the stack. (A UDP flow whose endpoint went is tracked
            // afresh below, as kube-proxy clears such a flow's netfilter entry; TCP stays with
            // it, as there.)
            if let Some(s) = xdp_pass(env) {
                return s;
            }
            if !env.dry {
                ct::touch_forward(pkt, &mut e, now);
            }
            return Step::Pass(Reason::PassNetfilter);
        }
        if live && entry.owner == owner::HANDOVER && (env.dry || !ct::handed_over(&mut e, &entry, now)) {
            return Step::Drop(Reason::DropHandover);
        }
        let be = backend_of(&entry);
        if let (true, Some(be)) = (live, be) {
            if entry.flags & flags::SNAT == 0 {
                if let Some(s) = xdp_pass(env) {
                    return s;
                }
                if !env.dry {
                    ct::touch_forward(pkt, &mut e, now);
                }
                let sport = (entry.flags & flags::PORT_NAT != 0).then_some(entry.snat_port);
                return Step::Dnat {
                    backend: be,
                    backend_id: entry.backend_id,
                    service_id: entry.service_id,
                    reason: Reason::Established,
                    sport,
                };
            }
            let route = match usable(env, route_of(env, pkt, &mut e, &entry, pkt.saddr, be.addr, now), cached_device(&entry, now)) {
                Ok(r) => r,
                Err(step) => return step,
            };
            if !env.dry {
                ct::touch_forward(pkt, &mut e, now);
            }
            let (dst, src) = ((be.addr, be.port), (entry.snat_addr, entry.snat_port));
            remember(env, pkt, &e, ct::lifetime(pkt.proto, entry.flags), now, dst, src, &route, Reason::XdpForward);
            return Step::Forward {
                dst,
                src,
                route,
                backend_id: entry.backend_id,
                service_id: entry.service_id,
                reason: if env.xdp { Reason::XdpForward } else { Reason::ExtEstablished },
            };
        }
        // Expired, or its backend is gone: TC tracks it afresh.
        if let Some(s) = xdp_pass(env) {
            return s;
        }
        if !env.dry {
            ct::drop_reply(pkt, &entry);
            // A SYN reusing a closing connection's ports, or a flow whose backend went: the
            // flow caches may hold the old step, on any CPU.
            flowcache::retracked_unless_ended(entry.last_seen_ns, now);
        }
    }
    if stage_new {
        return Step::NewFlow;
    }
    new_flow(env, pkt, clock)
}

/// The step for a packet opening a flow (or of none the hooks serve).
#[inline(always)]
pub fn new_flow<A: Family>(env: &Env, pkt: &Packet<A>, clock: impl Fn() -> u64 + Copy) -> Step<A> {
    let master = match select::frontend(pkt.daddr, pkt.dport, pkt.proto) {
        Some(m) if m.flags & svc_flags::EXTERNAL != 0 => m,
        _ => return xdp_pass(env).unwrap_or(Step::Pass(Reason::PassNotService)),
    };
    if !select::source_allowed(pkt, &master) {
        // Dropped here, already in XDP: the ranges are a firewall.
        return Step::Drop(Reason::DropSourceRange);
    }
    if master.count == 0 {
        if let Some(s) = xdp_pass(env) {
            return s;
        }
        return match select::without_endpoints(pkt, &master) {
            Ok(()) => Step::Reject { service_id: master.service_id },
            Err(r) => Step::Drop(r),
        };
    }
    let now = clock();
    if ct::adopt_pending(pkt, now) {
        return Step::Drop(Reason::DropAdoptPending);
    }
    let key = ServiceKey::new(pkt.daddr, pkt.dport, pkt.proto, 0);
    let choice = match select::choose(pkt, &key, &master, now, !env.dry) {
        Ok(c) => c,
        Err(r) => return xdp_pass(env).unwrap_or(Step::Drop(r)),
    };
    let be = choice.backend;
    if be.flags & proxy_common::backend_flags::LOCAL != 0 {
        if let Some(s) = xdp_pass(env) {
            return s;
        }
        let mut sport = None;
        if !env.dry {
            match ct::create(pkt, master.service_id, choice.id, &be, now, false, proxy_common::ct::l4_csum::UNKNOWN) {
                Ok(moved) => sport = moved,
                Err(r) => return Step::Drop(r),
            }
            count_flow::<A>(choice.id);
        }
        return Step::Dnat { backend: be, backend_id: choice.id, service_id: master.service_id, reason: Reason::ExtNewLocal, sport };
    }
    let route = match usable(env, fib(env, pkt, pkt.saddr, be.addr), 0) {
        Ok(r) => r,
        Err(step) => return step,
    };
    let Some(snat_addr) = A::node_address(route.ifindex) else {
        return xdp_pass(env).unwrap_or(Step::Drop(Reason::DropNoRoute));
    };
    let (min, max) = snat_ports();
    let port = if env.dry {
        [0; 2]
    } else {
        match ct::create_snat::<A, false>(pkt, master.service_id, choice.id, &be, snat_addr, min, max, now) {
            Ok(p) => p,
            Err(r) => return Step::Drop(r),
        }
    };
    if !env.dry {
        count_flow::<A>(choice.id);
    }
    Step::Forward {
        dst: (be.addr, be.port),
        src: (snat_addr, port),
        route,
        backend_id: choice.id,
        service_id: master.service_id,
        reason: if env.xdp { Reason::XdpForward } else { Reason::ExtNewRemote },
    }
}

/// The ports SNAT gives flows (`--snat-port-range`), network byte order aside.
#[inline(always)]
pub fn snat_ports() -> (u16, u16) {
    match CONFIG_V3.get(0) {
        Some(c) if c.snat_port_min != 0 && c.snat_port_min <= c.snat_port_max => (c.snat_port_min, c.snat_port_max),
        _ => (limits::SNAT_PORT_MIN, limits::SNAT_PORT_MAX),
    }
}
