//! Reading the load-balancer maps back: used to adopt a previous run's state at start and by
//! `inspect`.

use std::{borrow::Borrow, collections::BTreeMap};

use aya::maps::{Array, HashMap, MapData, MapError};
use proxy_common::{user::MapAddr, Backend, RevNat, ServiceKey, ServiceName, ServiceValue};

/// One frontend as the maps hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendEntry<A: MapAddr = [u8; 4]> {
    pub key: ServiceKey<A>,
    pub master: ServiceValue,
    /// Backend id of slots `1..=count`; 0 where a slot is missing.
    pub slots: Vec<u32>,
    pub name: Option<String>,
    pub revnat: Option<RevNat<A>>,
}

#[derive(Debug)]
pub struct Snapshot<A: MapAddr = [u8; 4]> {
    /// Keyed by the master's key (slot 0).
    pub frontends: BTreeMap<ServiceKey<A>, FrontendEntry<A>>,
    pub backends: BTreeMap<u32, Backend<A>>,
    /// Slot entries whose master is missing, or beyond its count.
    pub stray_slots: Vec<ServiceKey<A>>,
    /// Reverse-NAT and name entries of service ids no frontend uses.
    pub stray_service_ids: Vec<u32>,
}

impl<A: MapAddr> Default for Snapshot<A> {
    fn default() -> Self {
        Self { frontends: BTreeMap::new(), backends: BTreeMap::new(), stray_slots: Vec::new(), stray_service_ids: Vec::new() }
    }
}

pub fn read<A, S, B, R, N>(
    services: &HashMap<S, ServiceKey<A>, ServiceValue>,
    backends: &Array<B, Backend<A>>,
    revnat: &HashMap<R, u32, RevNat<A>>,
    names: &HashMap<N, u32, ServiceName>,
) -> Result<Snapshot<A>, MapError>
where
    A: MapAddr,
    S: Borrow<MapData>,
    B: Borrow<MapData>,
    R: Borrow<MapData>,
    N: Borrow<MapData>,
{
    assemble(services.iter(), backends.iter(), revnat.iter(), names.iter())
}

/// The snapshot of these entries: the services map's, the backends array's in index order,
/// the reverse-NAT and name maps' (as `read` iterates the maps; unit tests pass their own).
pub fn assemble<A: MapAddr>(
    services: impl Iterator<Item = Result<(ServiceKey<A>, ServiceValue), MapError>>,
    backends: impl Iterator<Item = Result<Backend<A>, MapError>>,
    revnat: impl Iterator<Item = Result<(u32, RevNat<A>), MapError>>,
    names: impl Iterator<Item = Result<(u32, ServiceName), MapError>>,
) -> Result<Snapshot<A>, MapError> {
    let mut snap = Snapshot::default();
    let mut slots = Vec::new();
    for entry in services {
        let (k, v) = entry?;
        if k.slot == 0 {
            snap.frontends.insert(k, FrontendEntry { key: k, master: v, slots: vec![0; usize::from(v.count)], name: None, revnat: None });
        } else {
            slots.push((k, v));
        }
    }
    for (k, v) in slots {
        let master = k.with_slot(0);
        match snap.frontends.get_mut(&master) {
            Some(fe) if usize::from(k.slot) <= fe.slots.len() => fe.slots[usize::from(k.slot) - 1] = v.backend_id,
            _ => snap.stray_slots.push(k),
        }
    }
    for (id, entry) in backends.enumerate() {
        let b = entry?;
        if id != 0 && b.addr != A::default() {
            snap.backends.insert(id as u32, b);
        }
    }
    let mut by_service_id: BTreeMap<u32, ServiceKey<A>> = BTreeMap::new();
    for fe in snap.frontends.values_mut() {
        by_service_id.insert(fe.master.service_id, fe.key);
        for id in fe.slots.iter_mut() {
            if !snap.backends.contains_key(id) {
                *id = 0;
            }
        }
    }
    for entry in revnat {
        let (id, rn) = entry?;
        match by_service_id.get(&id).and_then(|k| snap.frontends.get_mut(k)) {
            Some(fe) => fe.revnat = Some(rn),
            None => snap.stray_service_ids.push(id),
        }
    }
    for entry in names {
        let (id, n) = entry?;
        match by_service_id.get(&id).and_then(|k| snap.frontends.get_mut(k)) {
            Some(fe) => fe.name = Some(n.as_str().to_string()),
            None if !snap.stray_service_ids.contains(&id) => snap.stray_service_ids.push(id),
            None => {}
        }
    }
    Ok(snap)
}
