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
        }
    };
}

suite!(ebpf, ProxyMode::Ebpf);
suite!(iptables, ProxyMode::Iptables);
suite!(nftables, ProxyMode::Nftables);

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
    assert_eq!(conformance::SCENARIOS.len(), 12);
}
