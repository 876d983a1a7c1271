//! `proxy-agent rules`: what a mode would program for a manifest directory, printed in the
//! mode's own format, without touching the kernel.

use std::{fmt::Write as _, path::Path};

use crate::{
    config::Config,
    dataplane::{
        modes,
        netfilter::{NodeContext, Services},
        ProxyMode,
    },
    model::store::{Kind, NodePortAddresses, Store},
    source::manifests::ManifestDir,
};

/// Every Service's ports as the manifest directory describes them for node `node`, NodePorts on
/// `context`'s addresses (as the golden tests give them).
pub fn services_of(
    dir: &Path,
    node: &str,
    context: &NodeContext,
    rules: crate::model::validate::Rules,
) -> anyhow::Result<(Store, Services)> {
    let nodeport = if context.nodeport_all {
        NodePortAddresses::All
    } else {
        NodePortAddresses::Cidrs(context.nodeport_ips.iter().map(|a| crate::model::Cidr::host(*a)).collect())
    };
    load(dir, node, rules, nodeport, context.nodeport_ips.clone(), context.node_ips.first().copied())
}

/// The store and every Service's ports for the manifests in `dir`, on node `node` with local
/// addresses `local`, NodePorts on the addresses `nodeport` selects of them, and the node IP
/// `node_ip` over the Node manifest's InternalIP (kube-proxy's rule).
fn load(
    dir: &Path,
    node: &str,
    rules: crate::model::validate::Rules,
    nodeport: NodePortAddresses,
    local: Vec<std::net::IpAddr>,
    node_ip: Option<std::net::IpAddr>,
) -> anyhow::Result<(Store, Services)> {
    let mut manifests = ManifestDir::new(dir).map_err(anyhow::Error::msg)?;
    let (events, problems) = manifests.scan();
    for p in problems {
        eprintln!("skipped: {p}");
    }
    let mut store = Store::new(node);
    store.set_rules(rules);
    store.set_nodeport_config(nodeport);
    store.set_local_addresses(local);
    if node_ip.is_some() {
        store.set_node_ip_override(node_ip);
    }
    for e in events {
        for r in store.apply(e) {
            eprintln!("{}: {}", r.object, r.message);
        }
    }
    // Kinds the directory has none of are simply empty.
    for kind in [Kind::Service, Kind::EndpointSlice, Kind::Node, Kind::ServiceCidr] {
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

/// What `mode` would program for the manifests in `dir`, configured as `run` would be with the
/// same settings (`cfg`), on a node with addresses `node_ips`: NodePorts on those of them
/// `--nodeport-addresses` selects, the node IP from `--bind-address` or the directory's Node.
pub fn print(mode: ProxyMode, dir: &Path, cfg: &Config, node_ips: &[std::net::IpAddr]) -> anyhow::Result<String> {
    let settings = cfg.netfilter.for_mode(mode);
    let rules = crate::model::validate::Rules { node_port_range: cfg.common.node_port_range };
    let (mut store, services) =
        load(dir, &cfg.common.hostname, rules, cfg.common.nodeport_addresses.clone(), node_ips.to_vec(), cfg.common.node_ip)?;
    let info = store.node_info();
    let mut context = NodeContext {
        nodeport_ips: info.nodeport_addresses,
        nodeport_all: cfg.common.nodeport_addresses == NodePortAddresses::All,
        local: Default::default(),
        masquerade_all: settings.masquerade_all,
        node_ips: info.node_ips,
        nodeport_all_families: crate::model::Family::ALL.into_iter().filter(|f| cfg.common.nodeport_addresses.all_of(*f)).collect(),
    };
    let masquerading = crate::dataplane::netfilter::proxier::Masquerading {
        masquerade_all: settings.masquerade_all,
        detect_local: Some(cfg.netfilter.detect_local.clone()),
        cluster_cidrs: cfg.common.cluster_cidrs.clone(),
    };
    context.local = masquerading.local_traffic(&store);
    if mode == ProxyMode::Ebpf {
        // The frontends the map writer would program.
        let mut out = String::new();
        let node = store.node_info();
        for ports in services.values() {
            for (key, fe) in crate::dataplane::ebpf::frontends::render(ports, &node) {
                let backends: Vec<String> = fe.backends.iter().map(|b| b.to_string()).collect();
                let _ = writeln!(out, "{key} {:?} {} -> [{}]", fe.kind, fe.name, backends.join(", "));
            }
        }
        return Ok(out);
    }
    // What is printed does not depend on the backend.
    // With the counters where the node has them (a running agent or kube-proxy made them);
    // `rules` itself creates nothing.
    let nfacct =
        crate::dataplane::netfilter::nfacct::COUNTERS.iter().all(|(n, _, _)| crate::dataplane::netfilter::nfacct::packets(n).is_ok());
    let mut rules = modes::rules_for(mode, cfg, cfg.netfilter.iptables_backend.unwrap_or_default(), nfacct).map_err(anyhow::Error::msg)?;
    store.set_service_cidr_flag(cfg.common.service_cidrs.clone());
    rules.set_service_cidrs(store.cluster_ip_ranges().0);
    Ok(rules.render(&services, &context))
}
