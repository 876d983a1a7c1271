//! Choosing, building and cleaning up after proxy modes.

use std::path::Path;

use super::{
    netfilter::{self, iptables::IptablesRules, ipvs::IpvsRules, nftables::NftablesRules, RuleSet},
    ProxyMode,
};

/// Why this node cannot run the eBPF dataplane, if it cannot: tcx links need Linux 6.6, the
/// programs need kernel BTF, and loading them needs root (CAP_BPF, CAP_NET_ADMIN,
/// CAP_SYS_ADMIN).
pub fn ebpf_unsupported() -> Option<String> {
    // SAFETY: uname fills the struct.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::uname(&mut u) } == 0 {
        // SAFETY: NUL-terminated by the kernel.
        let release = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().into_owned();
        let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty()).map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        if (major, minor) < (6, 6) {
            return Some(format!("kernel {release} is older than 6.6 (tcx links)"));
        }
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Some("the kernel has no BTF (/sys/kernel/btf/vmlinux; CONFIG_DEBUG_INFO_BTF)".into());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not running as root (CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN are needed)".into());
    }
    None
}

/// Why nftables mode cannot run here, if it cannot.
pub fn nftables_unsupported() -> Option<String> {
    match netfilter::run("nft", "nftables", &["list", "tables"]) {
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// How the netfilter modes are configured beyond the node view.
#[derive(Clone, Debug, Default)]
pub struct RuleOptions {
    /// `--ipvs-scheduler` (IPVS mode).
    pub scheduler: netfilter::ipvs::Scheduler,
    /// The iptables backend (iptables mode, and IPVS mode's few rules).
    pub iptables: netfilter::Iptables,
}

/// The rules of a netfilter mode.
pub fn rules_for(mode: ProxyMode, opts: RuleOptions) -> Result<Box<dyn RuleSet + Send>, String> {
    match mode {
        ProxyMode::Iptables => Ok(Box::new(IptablesRules::new(opts.iptables))),
        ProxyMode::Nftables => Ok(Box::new(NftablesRules::new())),
        ProxyMode::Ipvs => Ok(Box::new(IpvsRules::new(opts.scheduler, opts.iptables))),
        ProxyMode::Ebpf => Err("the eBPF mode has no netfilter rules".into()),
    }
}

/// Removes what `mode` installs (in each of `backends`, the iptables backends the node has).
/// Returns a line per thing removed.
pub fn cleanup(mode: ProxyMode, bpffs_root: &Path, backends: &[netfilter::Iptables]) -> Vec<String> {
    match mode {
        ProxyMode::Ebpf => crate::inspect::cleanup(bpffs_root)
            .map(|removed| if removed.is_empty() { vec![] } else { vec![format!("ebpf: {} pinned objects under {}", removed.len(), bpffs_root.display())] })
            .unwrap_or_default(),
        ProxyMode::Iptables => backends.iter().flat_map(|b| netfilter::iptables::cleanup(*b)).collect(),
        ProxyMode::Nftables => netfilter::nftables::cleanup(),
        ProxyMode::Ipvs => netfilter::ipvs::cleanup(backends),
    }
}

/// Switching mode, or iptables backend, leaves nothing of the others behind (as kube-proxy
/// cleans up at start). `ipt` is the backend `current` uses, if it uses iptables; `backends`
/// are the ones the node has.
pub fn cleanup_other_modes(current: ProxyMode, ipt: Option<netfilter::Iptables>, backends: &[netfilter::Iptables], bpffs_root: &Path) {
    let mut lines: Vec<(ProxyMode, String)> = Vec::new();
    for mode in ProxyMode::ALL.into_iter().filter(|m| *m != current) {
        // IPVS mode keeps a few iptables chains of its own; the iptables mode's service chains
        // are still removed.
        lines.extend(cleanup(mode, bpffs_root, backends).into_iter().map(|l| (mode, l)));
    }
    for &b in backends.iter().filter(|b| Some(**b) != ipt) {
        match current {
            ProxyMode::Iptables => lines.extend(netfilter::iptables::cleanup(b).into_iter().map(|l| (current, l))),
            ProxyMode::Ipvs => lines.extend(netfilter::ipvs::cleanup_iptables(b).into_iter().map(|l| (current, l))),
            _ => {}
        }
    }
    for (mode, line) in lines {
        tracing::info!(mode = %mode, "removed what an earlier run in another mode or iptables backend left: {line}");
    }
}
