//! Endpoint categorisation with kube-proxy's semantics (`CategorizeEndpoints` and
//! `topologyModeFromHints` in kubernetes `pkg/proxy/topology.go`): ready endpoints first,
//! serving+terminating ones only when no endpoint is ready (KEP-1669), topology hints honoured
//! only when every ready endpoint carries one and one matches this node or its zone, and the
//! Cluster and Local sets computed independently.

use std::{collections::BTreeSet, net::IpAddr};

/// One endpoint of one service port, after validation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// The endpoint runs on this node.
    pub local: bool,
    pub zone_hints: BTreeSet<String>,
    pub node_hints: BTreeSet<String>,
}

impl Endpoint {
    fn serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }
}

/// Which traffic policy sets a service port needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policies {
    /// Some traffic uses the Cluster policy (internal with iTP=Cluster, or external with
    /// eTP=Cluster).
    pub uses_cluster: bool,
    /// Some traffic uses the Local policy.
    pub uses_local: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologyMode {
    None,
    PreferSameZone,
    PreferSameNode,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Categorized {
    /// Usable endpoints for Cluster traffic policy (topology applied).
    pub cluster: Vec<Endpoint>,
    /// Usable endpoints for Local traffic policy.
    pub local: Vec<Endpoint>,
    /// There is a usable endpoint somewhere in the cluster (even if none is reachable here).
    pub has_any: bool,
}

pub fn categorize(endpoints: &[Endpoint], policies: Policies, node_name: &str, zone: Option<&str>) -> Categorized {
    let mut out = Categorized::default();
    if endpoints.is_empty() {
        return out;
    }
    if policies.uses_cluster {
        let mode = topology_mode(endpoints, node_name, zone);
        out.cluster = endpoints.iter().filter(|ep| ep.ready && available_for_topology(ep, mode, node_name, zone)).cloned().collect();
        // The topology mode is only chosen when a ready endpoint matches it, so an empty set
        // here means nothing is ready anywhere: fall back to serving+terminating endpoints.
        if out.cluster.is_empty() {
            out.cluster = endpoints.iter().filter(|ep| ep.serving_terminating()).cloned().collect();
        }
        out.has_any = !out.cluster.is_empty();
    }
    if policies.uses_local {
        let mut local_ready = false;
        let mut local_serving_terminating = false;
        for ep in endpoints {
            if ep.ready {
                out.has_any = true;
                local_ready |= ep.local;
            } else if ep.serving_terminating() {
                out.has_any = true;
                local_serving_terminating |= ep.local;
            }
        }
        if local_ready {
            out.local = endpoints.iter().filter(|ep| ep.local && ep.ready).cloned().collect();
        } else if local_serving_terminating {
            out.local = endpoints.iter().filter(|ep| ep.local && ep.serving_terminating()).cloned().collect();
        }
    }
    out
}

/// The topology mode the hints allow: same node when every ready endpoint has a node hint and
/// one names this node; else same zone when every ready endpoint has a zone hint and one names
/// this zone; else none.
pub fn topology_mode(endpoints: &[Endpoint], node_name: &str, zone: Option<&str>) -> TopologyMode {
    let mut any_ready = false;
    let mut all_node_hints = true;
    let mut for_node = false;
    let mut all_zone_hints = true;
    let mut for_zone = false;
    for ep in endpoints.iter().filter(|ep| ep.ready) {
        any_ready = true;
        if ep.node_hints.is_empty() {
            all_node_hints = false;
        } else if ep.node_hints.contains(node_name) {
            for_node = true;
        }
        if ep.zone_hints.is_empty() {
            all_zone_hints = false;
        } else if zone.is_some_and(|z| ep.zone_hints.contains(z)) {
            for_zone = true;
        }
    }
    if !any_ready {
        TopologyMode::None
    } else if all_node_hints && for_node {
        TopologyMode::PreferSameNode
    } else if all_zone_hints && for_zone {
        TopologyMode::PreferSameZone
    } else {
        TopologyMode::None
    }
}

fn available_for_topology(ep: &Endpoint, mode: TopologyMode, node_name: &str, zone: Option<&str>) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::PreferSameNode => ep.node_hints.contains(node_name),
        TopologyMode::PreferSameZone => zone.is_some_and(|z| ep.zone_hints.contains(z)),
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const NODE: &str = "node-a";

    fn ep(last: u8) -> Endpoint {
        Endpoint {
            addr: IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            local: false,
            zone_hints: BTreeSet::new(),
            node_hints: BTreeSet::new(),
        }
    }

    fn terminating(mut e: Endpoint, serving: bool) -> Endpoint {
        e.ready = false;
        e.serving = serving;
        e.terminating = true;
        e
    }

    fn local(mut e: Endpoint) -> Endpoint {
        e.local = true;
        e
    }

    fn zones(mut e: Endpoint, z: &[&str]) -> Endpoint {
        e.zone_hints = z.iter().map(|s| s.to_string()).collect();
        e
    }

    fn nodes(mut e: Endpoint, n: &[&str]) -> Endpoint {
        e.node_hints = n.iter().map(|s| s.to_string()).collect();
        e
    }

    fn addrs(eps: &[Endpoint]) -> Vec<u8> {
        eps.iter().map(|e| if let IpAddr::V4(a) = e.addr { a.octets()[3] } else { 0 }).collect()
    }

    const CLUSTER: Policies = Policies { uses_cluster: true, uses_local: false };
    const LOCAL: Policies = Policies { uses_cluster: false, uses_local: true };
    const BOTH: Policies = Policies { uses_cluster: true, uses_local: true };

    struct Case {
        name: &'static str,
        endpoints: Vec<Endpoint>,
        policies: Policies,
        zone: Option<&'static str>,
        cluster: Vec<u8>,
        local: Vec<u8>,
        has_any: bool,
    }

    #[test]
    fn categorize_table() {
        let cases = vec![
            Case { name: "no endpoints", endpoints: vec![], policies: BOTH, zone: None, cluster: vec![], local: vec![], has_any: false },
            Case {
                name: "ready endpoints only are used while any is ready",
                endpoints: vec![ep(1), terminating(ep(2), true), {
                    let mut e = ep(3);
                    e.ready = false;
                    e.serving = false;
                    e
                }],
                policies: CLUSTER,
                zone: None,
                cluster: vec![1],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "no ready endpoint: fall back to serving+terminating (KEP-1669)",
                endpoints: vec![terminating(ep(1), true), terminating(ep(2), false)],
                policies: CLUSTER,
                zone: None,
                cluster: vec![1],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "terminating but not serving is never used",
                endpoints: vec![terminating(ep(1), false)],
                policies: BOTH,
                zone: None,
                cluster: vec![],
                local: vec![],
                has_any: false,
            },
            Case {
                name: "local policy uses local ready endpoints",
                endpoints: vec![ep(1), local(ep(2)), local(terminating(ep(3), true))],
                policies: LOCAL,
                zone: None,
                cluster: vec![],
                local: vec![2],
                has_any: true,
            },
            Case {
                name: "local fallback is independent of remote ready endpoints",
                endpoints: vec![ep(1), local(terminating(ep(2), true))],
                policies: BOTH,
                zone: None,
                cluster: vec![1],
                local: vec![2],
                has_any: true,
            },
            Case {
                name: "no local endpoint: local set empty, but has_any",
                endpoints: vec![ep(1)],
                policies: LOCAL,
                zone: None,
                cluster: vec![],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "zone hints: only endpoints hinted for our zone",
                endpoints: vec![zones(ep(1), &["a"]), zones(ep(2), &["b"]), zones(ep(3), &["a"])],
                policies: CLUSTER,
                zone: Some("a"),
                cluster: vec![1, 3],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "zone hints ignored when one ready endpoint lacks a hint",
                endpoints: vec![zones(ep(1), &["a"]), ep(2)],
                policies: CLUSTER,
                zone: Some("a"),
                cluster: vec![1, 2],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "zone hints ignored when none is for our zone",
                endpoints: vec![zones(ep(1), &["b"]), zones(ep(2), &["c"])],
                policies: CLUSTER,
                zone: Some("a"),
                cluster: vec![1, 2],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "zone hints ignored when the node has no zone label",
                endpoints: vec![zones(ep(1), &["a"]), zones(ep(2), &["b"])],
                policies: CLUSTER,
                zone: None,
                cluster: vec![1, 2],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "unready endpoints' missing hints do not disable topology",
                endpoints: vec![zones(ep(1), &["a"]), zones(ep(2), &["b"]), terminating(ep(3), true)],
                policies: CLUSTER,
                zone: Some("a"),
                cluster: vec![1],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "node hints win over zone hints (PreferSameNode)",
                endpoints: vec![nodes(zones(ep(1), &["a"]), &[NODE]), nodes(zones(ep(2), &["a"]), &["node-b"])],
                policies: CLUSTER,
                zone: Some("a"),
                cluster: vec![1],
                local: vec![],
                has_any: true,
            },
            Case {
                name: "node hints not for us: fall through to zone hints",
                endpoints: vec![nodes(zones(ep(1), &["a"]), &["node-b"]), nodes(zones(ep(2), &["b"]), &["node-c"])],
                policies: CLUSTER,
                zone: Some("a"),
                cluster: vec![1],
                local: vec![],
                has_any: true,
            },
        ];
        for c in cases {
            let got = categorize(&c.endpoints, c.policies, NODE, c.zone);
            assert_eq!(addrs(&got.cluster), c.cluster, "{}: cluster set", c.name);
            assert_eq!(addrs(&got.local), c.local, "{}: local set", c.name);
            assert_eq!(got.has_any, c.has_any, "{}: has_any", c.name);
        }
    }
}
