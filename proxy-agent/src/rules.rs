//! `proxy-agent rules`: what a mode would program for a manifest directory, printed in the
//! mode's own format, without touching the kernel.

use std::{fmt::Write as _, path::Path};

use crate::{
    dataplane::{
        modes,
        netfilter::{NodeContext, Services},
        ProxyMode,
    },
    model::store::{Kind, NodePortAddresses, Store},
    source::manifests::ManifestDir,
};

/// Every Service's ports as the manifest directory describes them for node `node`.
pub fn services_of(dir: &Path, node: &str, context: &NodeContext) -> anyhow::Result<(Store, Services)> {
    let mut manifests = ManifestDir::new(dir).map_err(anyhow::Error::msg)?;
    let (events, problems) = manifests.scan();
    for p in problems {
        eprintln!("skipped: {p}");
    }
    let mut store = Store::new(node);
    store.set_nodeport_config(if context.nodeport_all {
        NodePortAddresses::All
    } else {
        NodePortAddresses::Cidrs(context.nodeport_ips.iter().map(|a| crate::model::store::Cidr { addr: *a, prefix: 32 }).collect())
    });
    store.set_local_addresses(context.nodeport_ips.clone());
    for e in events {
        for r in store.apply(e) {
            eprintln!("{}: {}", r.object, r.message);
        }
    }
    // Kinds the directory has none of are simply empty.
    for kind in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
        if !store.synced(&[kind]) {
            store.apply(crate::model::store::Event::Replace { kind, objects: vec![] });
        }
    }
    let mut services = Services::new();
    for svc in store.take_dirty().services {
        let t = store.translate(&svc);
        if !t.ports.is_empty() {
            services.insert(svc, t.ports);
        }
    }
    Ok((store, services))
}

pub fn print(mode: ProxyMode, dir: &Path, node: &str, context: NodeContext, opts: modes::RuleOptions) -> anyhow::Result<String> {
    let (store, services) = services_of(dir, node, &context)?;
    if mode == ProxyMode::Ebpf {
        // The frontends the map writer would program.
        let mut out = String::new();
        for svc in services.keys() {
            for (key, fe) in store.translate(svc).frontends {
                let backends: Vec<String> = fe.backends.iter().map(|b| b.to_string()).collect();
                let _ = writeln!(out, "{key} {:?} {} -> [{}]", fe.kind, fe.name, backends.join(", "));
            }
        }
        return Ok(out);
    }
    let rules = modes::rules_for(mode, opts).map_err(anyhow::Error::msg)?;
    Ok(rules.render(&services, &context))
}
