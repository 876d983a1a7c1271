//! Names the lab's eBPF object (test and benchmark programs) to this crate: proxy-agent's build
//! script builds it beside the agent's and passes its path on (see proxy-agent's `links`).

fn main() {
    let object = std::env::var("DEP_PROXY_EBPF_LAB_OBJECT").expect("proxy-agent's build script names the lab object");
    println!("cargo:rustc-env=PROXY_LAB_OBJECT={object}");
    println!("cargo:rerun-if-env-changed=DEP_PROXY_EBPF_LAB_OBJECT");
}
