//! Builds the eBPF programs (proxy-ebpf, bpf target, nightly + bpf-linker) into OUT_DIR and
//! takes their DWARF out (`strip_dwarf`); the agent embeds its object (`proxy`) with
//! `include_bytes_aligned!`. The lab's object
//! (`proxy-lab`, test and benchmark programs) is built beside it and only named to the crates
//! that depend on this one (proxy-tests), never embedded in the agent.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _};
use object::build::elf::SectionData;

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
    for object in ["proxy", "proxy-lab"] {
        let path = out_dir.join(object);
        strip_dwarf(&path).with_context(|| format!("taking the DWARF out of {}", path.display()))?;
    }
    println!("cargo:lab_object={}", out_dir.join("proxy-lab").display());
    Ok(())
}

/// Takes the DWARF sections (`.debug_*`) and their relocations out of a linked eBPF object.
/// bpf-linker made the object's BTF from them, line info included (what verifier logs and
/// `bpftool prog dump ... linum` show), and nothing reads them after that: the loader uses the
/// BTF. They were 5 MB of the agent's 6.5 MB object, embedded in its binary, and parsing the
/// object at every start paged about 2 MB of them in for good.
fn strip_dwarf(path: &Path) -> anyhow::Result<()> {
    if std::env::var_os("AYA_BUILD_SKIP").is_some() && !path.exists() {
        // Nothing was built (the object then fails to embed, with its own error).
        return Ok(());
    }
    let data = std::fs::read(path)?;
    let mut elf = object::build::elf::Builder::read(data.as_slice()).map_err(|e| anyhow::anyhow!("reading it: {e}"))?;
    // The sections and their relocations (`.rel.debug_*`), then the symbols naming them.
    for section in elf.sections.iter_mut() {
        let name = section.name.as_slice();
        if [&b".debug"[..], b".rel.debug", b".rela.debug"].iter().any(|p| name.starts_with(p)) {
            section.delete = true;
        }
    }
    // The relocations of what stays: deleting the symbols of the deleted sections drops the
    // relocations that name them, which must all be DWARF's.
    let kept = |elf: &object::build::elf::Builder| -> usize {
        elf.sections.iter().filter(|s| !s.delete).map(|s| if let SectionData::Relocation(r) = &s.data { r.len() } else { 0 }).sum()
    };
    let before = kept(&elf);
    elf.delete_orphans();
    let after = kept(&elf);
    if after != before {
        bail!("{} relocations outside DWARF name its sections", before - after);
    }
    // LLVM names the sections in the symbols' string table; the writer wants a table of its
    // own for them (as `objcopy` writes).
    if !elf.sections.iter().any(|s| matches!(s.data, SectionData::SectionString)) {
        let names = elf.sections.add();
        names.name = b".shstrtab"[..].into();
        names.sh_type = object::elf::SHT_STRTAB;
        names.sh_addralign = 1;
        names.data = SectionData::SectionString;
    }
    let mut out = Vec::new();
    elf.write(&mut out).map_err(|e| anyhow::anyhow!("writing it: {e}"))?;
    let tmp = path.with_extension("stripped");
    std::fs::write(&tmp, &out)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
