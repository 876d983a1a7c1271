//! Builds the eBPF programs (proxy-ebpf, bpf target, nightly + bpf-linker) into OUT_DIR; the
//! agent embeds its object (`proxy`) with `include_bytes_aligned!`. The lab's object
//! (`proxy-lab`, test and benchmark programs) is built beside it and only named to the crates
//! that depend on this one (proxy-tests), never embedded in the agent.

use std::{path::PathBuf, process::Command};

use anyhow::{bail, Context as _};

fn main() -> anyhow::Result<()> {
    if Command::new("bpf-linker").arg("--version").output().is_err() {
        bail!(
            "bpf-linker is not installed or not on PATH; it links the eBPF programs. \
             Run `cargo xtask setup`, which installs it against the nightly toolchain's LLVM."
        );
    }
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let ebpf_dir = manifest_dir.join("../proxy-ebpf").canonicalize().context("proxy-ebpf directory")?;
    let ebpf_dir = ebpf_dir.to_str().context("proxy-ebpf path is not UTF-8")?;
    println!("cargo:rerun-if-changed={}", manifest_dir.join("../proxy-common/src").display());
    let package = aya_build::Package { name: "proxy-ebpf", root_dir: ebpf_dir, ..Default::default() };
    aya_build::build_ebpf([package], aya_build::Toolchain::default())?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    println!("cargo:lab_object={}", out_dir.join("proxy-lab").display());
    Ok(())
}
