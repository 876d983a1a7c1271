//! The test lab shared by the integration tests, the demo (`cargo xtask run`) and the
//! benchmarks (`cargo xtask bench`).

pub mod apiserver;
pub mod cluster;
pub mod conformance;
pub mod connectbench;
pub mod container;
pub mod corpus;
pub mod fuzz;
pub mod interrupt;
pub mod lab;
pub mod modesbench;
pub mod netns;
pub mod newernft;
pub mod northbench;
pub mod packet;
pub mod packet6;
pub mod perfwhere;
pub mod report;
pub mod require;
pub mod servers;
pub mod synack_delay;
pub mod testrun;

/// The lab's eBPF object: programs the tests and benchmarks load and the agent never does
/// (XDP pass and drop for the far ends of links, the benchmarks' frame generators, the empty
/// floor classifier). Its maps are the dataplane's, by name, so a program of it can share an
/// agent's pinned maps.
pub static LAB_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("PROXY_LAB_OBJECT"));

/// Loads the lab object with every dataplane map at its smallest, for a program that uses none
/// of them (or owns the benchmark's).
pub fn load_lab_object() -> aya::Ebpf {
    let mut loader = aya::EbpfLoader::new();
    for name in proxy_common::map_names::ALL {
        loader.map_max_entries(name, 1);
    }
    loader.load(LAB_OBJECT).expect("load the lab's eBPF object")
}

/// Loads the lab object on the maps an agent (or a dataplane loaded with pins) pinned under
/// `root`: its programs then work on that agent's maps.
pub fn load_lab_object_on(root: &std::path::Path) -> aya::Ebpf {
    let mut loader = aya::EbpfLoader::new();
    for name in proxy_common::map_names::ALL {
        loader.map_pin_path(name, proxy_agent::dataplane::ebpf::loader::maps_dir(root).join(name));
    }
    loader.load(LAB_OBJECT).expect("load the lab's eBPF object on the pinned maps")
}

#[cfg(test)]
mod tests {
    use proxy_common::prog_names;

    /// The agent's object carries only what the agent loads; the lab's programs and the
    /// benchmark's maps are in the lab object.
    #[test]
    fn the_agents_object_carries_no_lab_programs_or_benchmark_maps() {
        let agent = aya_obj::Object::parse(proxy_agent::dataplane::ebpf::loader::OBJECT).expect("parse the agent's object");
        let lab = aya_obj::Object::parse(super::LAB_OBJECT).expect("parse the lab object");
        for name in prog_names::LAB {
            assert!(!agent.programs.contains_key(name), "the agent's object carries the lab program {name}");
            assert!(lab.programs.contains_key(name), "the lab object lacks {name}");
        }
        for name in [prog_names::TC_INGRESS, prog_names::XDP_EXT, prog_names::SOCK_RELEASE] {
            assert!(agent.programs.contains_key(name), "the agent's object lacks {name}");
        }
        let bench_maps: Vec<&String> = agent.maps.keys().filter(|m| m.starts_with("BENCH_")).collect();
        assert!(bench_maps.is_empty(), "benchmark maps in the agent's object: {bench_maps:?}");
        assert!(lab.maps.contains_key("BENCH_FRAME_V1"), "the lab object lacks the benchmark's frame map");
        // The lab's benchmark program shares the agent's maps by name: every map it has that the
        // agent's object has too is defined alike.
        for (name, map) in &lab.maps {
            if let Some(theirs) = agent.maps.get(name) {
                assert_eq!(
                    (map.map_type(), map.key_size(), map.value_size(), map.max_entries()),
                    (theirs.map_type(), theirs.key_size(), theirs.value_size(), theirs.max_entries()),
                    "map {name} differs between the objects"
                );
            }
        }
    }
}
