//! The conformance suite (tests/src/conformance.rs) in every mode this kernel runs: ebpf,
//! iptables and nftables. IPVS needs a kernel with IPVS: its run is `ipvs_in_a_guest`
//! (tests/tests/ipvs_guest.rs), which boots Debian's kernel in qemu and runs the same
//! scenarios there.

use std::path::PathBuf;

use proxy_agent::dataplane::ProxyMode;
use proxy_tests::{conformance, require};

fn agent() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_proxy-lab-agent"))
}

fn run(mode: ProxyMode, scenario: &str) {
    if !require::root(&format!("conformance {scenario} ({mode})")) {
        return;
    }
    let (_, f) = conformance::SCENARIOS.iter().find(|(n, _)| *n == scenario).expect("known scenario");
    f(&agent(), mode);
}

macro_rules! suite {
    ($mode:ident, $m:expr) => {
        mod $mode {
            use super::*;
            #[test]
            fn clusterip_tcp_and_udp_reach_every_backend() {
                run($m, "clusterip_tcp_and_udp_reach_every_backend")
            }
            #[test]
            fn a_service_without_endpoints_refuses() {
                run($m, "a_service_without_endpoints_refuses")
            }
            #[test]
            fn endpoint_changes_are_followed() {
                run($m, "endpoint_changes_are_followed")
            }
            #[test]
            fn a_pod_reaching_its_own_service_gets_through() {
                run($m, "a_pod_reaching_its_own_service_gets_through")
            }
            #[test]
            fn a_connection_tried_before_its_service_existed_gets_through() {
                run($m, "a_connection_tried_before_its_service_existed_gets_through")
            }
            #[test]
            fn node_port_from_outside() {
                run($m, "node_port_from_outside")
            }
            #[test]
            fn external_traffic_policy_local() {
                run($m, "external_traffic_policy_local")
            }
            #[test]
            fn internal_traffic_policy_local() {
                run($m, "internal_traffic_policy_local")
            }
            #[test]
            fn load_balancer_and_external_ips() {
                run($m, "load_balancer_and_external_ips")
            }
            #[test]
            fn client_ip_affinity() {
                run($m, "client_ip_affinity")
            }
            #[test]
            fn a_node_port_without_endpoints_refuses() {
                run($m, "a_node_port_without_endpoints_refuses")
            }
            #[test]
            fn xdp_forwards_north_south() {
                run($m, "xdp_forwards_north_south")
            }
            #[test]
            fn maglev_agreement() {
                run($m, "maglev_agreement")
            }
            #[test]
            fn service_cidrs_drop_free_addresses_and_reject_unserved_ports() {
                run($m, "service_cidrs_drop_free_addresses_and_reject_unserved_ports")
            }
            #[test]
            fn path_mtu_discovery_through_a_service() {
                run($m, "path_mtu_discovery_through_a_service")
            }
            #[test]
            fn path_mtu_discovery_through_a_node_port() {
                run($m, "path_mtu_discovery_through_a_node_port")
            }
            #[test]
            fn ipv6_services() {
                run($m, "ipv6_services")
            }
        }
    };
}

suite!(ebpf, ProxyMode::Ebpf);
suite!(iptables, ProxyMode::Iptables);
suite!(nftables, ProxyMode::Nftables);

/// Not a scenario of every mode (IPVS state cannot be loaded on this kernel): taking a node
/// over from kube-proxy, and going back.
mod takeover {
    use super::*;

    fn takeover(mode: ProxyMode) {
        if require::root(&format!("taking over from kube-proxy ({mode})")) {
            conformance::taking_over_from_kube_proxy(&agent(), mode);
        }
    }

    #[test]
    fn ebpf() {
        takeover(ProxyMode::Ebpf)
    }
    #[test]
    fn iptables() {
        takeover(ProxyMode::Iptables)
    }
    #[test]
    fn nftables() {
        takeover(ProxyMode::Nftables)
    }
}

/// Not a scenario of every mode: localhost NodePorts are served by the iptables mode (as
/// kube-proxy's) and by the eBPF mode's socket hooks, not by nftables (as kube-proxy's).
mod localhost_node_ports {
    use super::*;

    fn check(mode: ProxyMode, enabled: bool) {
        if require::root(&format!("localhost NodePorts ({mode})")) {
            conformance::localhost_node_ports(&agent(), mode, enabled);
        }
    }

    #[test]
    fn iptables_serves_them_by_default() {
        check(ProxyMode::Iptables, true)
    }
    #[test]
    fn iptables_does_not_when_told_not_to() {
        check(ProxyMode::Iptables, false)
    }
    #[test]
    fn ebpf_serves_them_by_default() {
        check(ProxyMode::Ebpf, true)
    }
    #[test]
    fn ebpf_does_not_when_told_not_to() {
        check(ProxyMode::Ebpf, false)
    }
    #[test]
    fn nftables_does_not_as_kube_proxy() {
        check(ProxyMode::Nftables, true)
    }
}

/// Not a scenario of every mode: which iptables the iptables mode writes to.
#[test]
fn iptables_backend_auto_and_switching() {
    if !require::root("iptables backends") {
        return;
    }
    conformance::iptables_backends(&agent());
}

#[test]
fn every_scenario_is_in_the_suite() {
    // The macro lists scenarios by hand; keep it in step with the library.
    assert_eq!(conformance::SCENARIOS.len(), 17);
}

/// IPVS mode's cleanup, which runs whenever another mode starts, leaves the iptables mode's
/// nat jumps alone where IPVS mode never ran: they are the same rules, and a starting iptables
/// mode would otherwise translate no new connection until its first sync.
#[test]
fn ipvs_cleanup_leaves_the_iptables_modes_jumps() {
    if !require::root("ipvs cleanup beside the iptables mode") {
        return;
    }
    use proxy_agent::dataplane::netfilter::{ipvs, Iptables};
    use proxy_tests::{
        lab::{sock, WEB_VIP},
        servers::tcp_ask,
    };
    let mut lab = conformance::lab(&agent(), ProxyMode::Iptables);
    // The agent's own syncs must not put back what the cleanup takes.
    lab.kill_agent();
    let removed: Vec<String> = lab.node.run(|| [Iptables::Nft, Iptables::Legacy].into_iter().flat_map(ipvs::cleanup_iptables).collect());
    assert!(removed.is_empty(), "IPVS mode never ran here, yet its cleanup removed {removed:?}");
    let answer = tcp_ask(&lab.client.ns, sock(WEB_VIP)).expect("a new connection to the Service is still translated");
    assert!(answer.backend.starts_with("backend-"), "{answer:?}");
}
