//! Backend selection for new flows: ClientIP affinity first, then the service's Maglev table
//! (north-south: every node picks the same backend for the same flow), else a random slot.

use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_get_prandom_u32};
use proxy_common::{svc_flags, AffinityKey, AffinityMatchKey, AffinityValue, Backend, CtEntry, Reason, RevNat, ServiceKey, ServiceValue};

use crate::{
    family::Family,
    maps::CONFIG_V3,
    parse::{Frag, Packet},
    value,
};

const NS_PER_SEC: u64 = 1_000_000_000;

/// A new flow to a Service port without endpoints: Ok to answer it with port unreachable (as
/// kube-proxy's REJECT), or the reason to drop it (a Local policy with endpoints elsewhere; a
/// later fragment, which cannot be quoted).
#[inline(always)]
pub fn without_endpoints<A: Family>(pkt: &Packet<A>, master: &ServiceValue) -> Result<(), Reason> {
    if master.flags & svc_flags::DROP_WHEN_EMPTY != 0 {
        return Err(Reason::DropNoLocalEndpoints);
    }
    if pkt.frag == Frag::Later {
        return Err(Reason::DropNoEndpoints);
    }
    Ok(())
}

/// False when a new flow from this packet's source may not reach the frontend of `master`:
/// the frontend has loadBalancerSourceRanges and none of them holds the source.
#[inline(always)]
pub fn source_allowed<A: Family>(pkt: &Packet<A>, master: &ServiceValue) -> bool {
    master.flags & svc_flags::SOURCE_RANGES == 0 || A::in_source_ranges(master.service_id, pkt.saddr)
}

/// What the family's Service CIDR map says of `daddr` (a `svc_cidr` value: an allocated
/// cluster IP, or a free address of a Service CIDR), for a packet no Service serves; `NONE`:
/// in no Service CIDR. (A plain value, not an `Option`: a `None`'s undefined payload may be
/// read by the compiled code as an unwritten register, which the verifier refuses.)
#[inline(always)]
pub fn service_cidr_of<A: Family>(daddr: A) -> u8 {
    A::service_cidr_of(daddr)
}

/// The Service address a tracked flow's replies must come from.
#[inline(always)]
pub fn revnat_of<A: Family>(entry: &CtEntry<A>) -> Option<RevNat<A>> {
    value::copy(A::revnat(), entry.service_id)
}

#[inline(always)]
pub fn service<A: Family>(key: &ServiceKey<A>) -> Option<ServiceValue> {
    value::copy(A::services(), key)
}

/// The master entry of frontend (`addr`, `port`, `proto`) as `ServiceKey::new` keys it. The
/// services map is looked up only when the frontend filter has the frontend's bit: a packet
/// for no Service, most of a node's, is told so by one array read.
#[inline(always)]
pub fn frontend<A: Family>(addr: A, port: [u8; 2], proto: u8) -> Option<ServiceValue> {
    if !A::in_filter(addr, port, proto) {
        return None;
    }
    service(&ServiceKey::new(addr, port, proto, 0))
}

/// The backend with this id, if it is set (an unset array entry is all zeroes).
#[inline(always)]
pub fn backend<A: Family>(id: u32) -> Option<Backend<A>> {
    value::copy(A::backends(), id).filter(|b| b.addr != A::UNSPECIFIED)
}

/// The backend a forward conntrack entry's flow went to, while its id still names it (ids are
/// reused eventually); None once it was removed.
#[inline(always)]
pub fn backend_of<A: Family>(entry: &CtEntry<A>) -> Option<Backend<A>> {
    backend::<A>(entry.backend_id).filter(|b| b.addr == entry.nat_addr && b.port == entry.nat_port)
}

/// The master entry pods use for `key`: the frontend's own, or for a frontend whose outside
/// clients see other backends (externalTrafficPolicy Local) the internal scope's.
#[inline(always)]
pub fn internal_master<A: Family>(key: &mut ServiceKey<A>, master: ServiceValue) -> Option<ServiceValue> {
    if master.flags & svc_flags::TWO_SCOPES == 0 {
        return Some(master);
    }
    key.scope = proxy_common::scope::INTERNAL;
    service(key)
}

pub struct Choice<A = [u8; 4]> {
    pub id: u32,
    pub backend: Backend<A>,
}

fn affinity_key<A: Family>(pkt: &Packet<A>, master: &ServiceValue, scope: u8) -> AffinityKey<A> {
    AffinityKey { service_id: master.service_id, client: pkt.saddr, scope, _pad: 0, _pad2: 0 }
}

/// The backend this client was last sent to, if that was within the timeout and the backend
/// still serves the service.
#[inline(always)]
fn affinity<A: Family>(pkt: &Packet<A>, master: &ServiceValue, scope: u8, now: u64) -> Option<Choice<A>> {
    let a = value::copy(A::affinity(), &affinity_key(pkt, master, scope))?;
    if now.saturating_sub(a.last_used_ns) > u64::from(master.affinity_timeout) * NS_PER_SEC {
        return None;
    }
    let m = AffinityMatchKey { service_id: master.service_id, backend_id: a.backend_id, scope, _pad: 0, _pad2: 0 };
    if !value::contains(A::affinity_matches(), &m) {
        return None;
    }
    backend(a.backend_id).map(|backend| Choice { id: a.backend_id, backend })
}

/// The Maglev table's pick for this flow; None when the table or the config is missing.
#[inline(always)]
fn maglev<A: Family>(pkt: &Packet<A>, table_id: u32) -> Option<u32> {
    let size = CONFIG_V3.get(0)?.maglev_size;
    if size == 0 {
        return None;
    }
    let id = A::maglev_pick(pkt, table_id, size)?;
    (id != 0).then_some(id)
}

/// Picks the backend of a new flow to the frontend `key` whose master entry is `master` (which
/// has at least one slot). `record`: remember the choice for affinity (false for a trace).
#[inline(always)]
pub fn choose<A: Family>(pkt: &Packet<A>, key: &ServiceKey<A>, master: &ServiceValue, now: u64, record: bool) -> Result<Choice<A>, Reason> {
    let sticky = master.affinity_timeout != 0;
    let choice = match if sticky { affinity(pkt, master, key.scope, now) } else { None } {
        Some(c) => c,
        None => {
            let picked = if master.flags & svc_flags::MAGLEV != 0 { maglev(pkt, master.backend_id) } else { None };
            let id = match picked {
                Some(id) => id,
                None => {
                    // SAFETY: plain helper call.
                    let slot = unsafe { bpf_get_prandom_u32() } % u32::from(master.count) + 1;
                    service(&key.with_slot(slot as u16)).map(|s| s.backend_id).ok_or(Reason::DropBackendMissing)?
                }
            };
            Choice { id, backend: backend(id).ok_or(Reason::DropBackendMissing)? }
        }
    };
    if sticky && record {
        // As kube-proxy's `recent --set`: every new connection restarts the client's timeout.
        let v = AffinityValue { last_used_ns: now, backend_id: choice.id, _pad: 0 };
        let _ = A::affinity().insert(affinity_key(pkt, master, key.scope), v, BPF_ANY as u64);
    }
    Ok(choice)
}
