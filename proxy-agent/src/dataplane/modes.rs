//! Choosing, building and cleaning up after proxy modes.

use std::path::Path;

use super::{
    netfilter::{self, iptables::IptablesRules, ipvs::IpvsRules, nftables::NftablesRules, RuleSet},
    ProxyMode,
};
use crate::{config::Config, model::Family};

/// Why this node cannot run the eBPF dataplane, if it cannot: tcx links need Linux 6.6, the
/// programs need kernel BTF, and loading and attaching them needs CAP_BPF, CAP_NET_ADMIN and
/// CAP_PERFMON (or CAP_SYS_ADMIN, which covers the first and the last).
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
    let missing = missing_ebpf_capabilities(effective_capabilities());
    if !missing.is_empty() {
        return Some(format!(
            "missing {} (the eBPF mode needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON; add them to the container's \
             securityContext.capabilities, as deploy/daemonset.yaml does)",
            missing.join(", ")
        ));
    }
    None
}

pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// The effective capability set of this process (CapEff of /proc/self/status).
pub fn effective_capabilities() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()))
        .unwrap_or(0)
}

/// The capabilities the eBPF mode needs that `effective` lacks, by name. CAP_SYS_ADMIN stands
/// in for CAP_BPF and CAP_PERFMON, as the kernel lets it.
pub fn missing_ebpf_capabilities(effective: u64) -> Vec<&'static str> {
    let has = |cap: u32| effective & (1 << cap) != 0;
    let admin = has(CAP_SYS_ADMIN);
    [(CAP_BPF, "CAP_BPF"), (CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_PERFMON, "CAP_PERFMON")]
        .into_iter()
        .filter(|(cap, _)| !(has(*cap) || (admin && *cap != CAP_NET_ADMIN)))
        .map(|(_, name)| name)
        .collect()
}

/// Why nftables mode cannot run here, if it cannot.
pub fn nftables_unsupported() -> Option<String> {
    match netfilter::nftables::nft(&["list", "tables"], "") {
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// IPVS mode's options from the configuration.
pub fn ipvs_options(cfg: &Config) -> netfilter::ipvs::IpvsOptions {
    let ipvs = &cfg.netfilter.ipvs;
    netfilter::ipvs::IpvsOptions {
        scheduler: ipvs.scheduler.clone(),
        mark: cfg.netfilter.for_mode(ProxyMode::Ipvs).mark(),
        exclude_cidrs: ipvs.exclude_cidrs.clone(),
        strict_arp: ipvs.strict_arp,
        timeouts: (ipvs.tcp_timeout, ipvs.tcp_fin_timeout, ipvs.udp_timeout),
        family: Family::V4,
    }
}

/// The rules of a netfilter mode, configured as `cfg` says, written with iptables backend
/// `iptables` (iptables mode, and IPVS mode's few rules); `nfacct`: kube-proxy's nfacct
/// counters exist, and the iptables rules count into them.
pub fn rules_for(mode: ProxyMode, cfg: &Config, iptables: netfilter::Iptables, nfacct: bool) -> Result<Box<dyn RuleSet + Send>, String> {
    let settings = cfg.netfilter.for_mode(mode);
    let families = served_families(mode, iptables);
    let one = |family: Family| -> Box<dyn RuleSet + Send> {
        match mode {
            ProxyMode::Iptables => Box::new(IptablesRules::with_options(
                netfilter::iptables::IptablesOptions {
                    mark: settings.mark(),
                    localhost_nodeports: netfilter::sysctl::localhost_nodeports(cfg),
                    nfacct,
                    random_fully: true,
                    // kube-proxy leaves INVALID packets alone when conntrack is told to be liberal.
                    drop_invalid: !cfg.common.conntrack.tcp_be_liberal,
                    family,
                },
                iptables,
            )),
            ProxyMode::Nftables => {
                Box::new(NftablesRules::new(netfilter::nftables::NftablesOptions { mark: settings.mark(), family, ..Default::default() }))
            }
            _ => Box::new(IpvsRules::new(netfilter::ipvs::IpvsOptions { family, ..ipvs_options(cfg) }, iptables)),
        }
    };
    match mode {
        ProxyMode::Ebpf => Err("the eBPF mode has no netfilter rules".into()),
        _ => Ok(Box::new(netfilter::PerFamily::new(families.into_iter().map(one).collect()))),
    }
}

/// The families `mode` programs on this node, as kube-proxy decides: IPv4, and IPv6 too when
/// the kernel has IPv6 and (iptables, IPVS) its ip6tables is installed. What is left out is
/// logged once, here.
pub fn served_families(mode: ProxyMode, iptables: netfilter::Iptables) -> Vec<Family> {
    let v6 = match mode {
        ProxyMode::Iptables | ProxyMode::Nftables | ProxyMode::Ipvs if !Path::new("/proc/net/if_inet6").exists() => {
            Err("the kernel has IPv6 disabled (no /proc/net/if_inet6)".to_string())
        }
        ProxyMode::Iptables | ProxyMode::Ipvs => {
            // As kube-proxy checks ip6tables: its nat table must work, not only the tool run.
            let tools = iptables.tools(Family::V6);
            netfilter::run(tools.cmd(), netfilter::IPTABLES_PACKAGE, &["-w", "5", "-t", "nat", "-S", "POSTROUTING"])
                .map(|_| ())
                .map_err(|e| format!("{}'s nat table is not usable: {e}", tools.cmd()))
        }
        ProxyMode::Nftables => Ok(()),
        // Not a netfilter mode: it has no rules to render (its maps hold both families).
        ProxyMode::Ebpf => Err("the eBPF dataplane renders no netfilter rules".to_string()),
    };
    match v6 {
        Ok(()) => vec![Family::V4, Family::V6],
        Err(why) => {
            tracing::info!(mode = %mode, "IPv6 Services are not served: {why}");
            vec![Family::V4]
        }
    }
}

/// Removes what `mode` installs (in each of `backends`, the iptables backends the node has).
/// Returns a line per thing removed.
pub fn cleanup(mode: ProxyMode, bpffs_root: &Path, backends: &[netfilter::Iptables]) -> Vec<String> {
    match mode {
        ProxyMode::Ebpf => super::ebpf::loader::unpin_all(bpffs_root)
            .map(|removed| {
                if removed.is_empty() {
                    vec![]
                } else {
                    vec![format!("ebpf: {} pinned objects under {}", removed.len(), bpffs_root.display())]
                }
            })
            .unwrap_or_default(),
        ProxyMode::Iptables => backends.iter().flat_map(|b| netfilter::iptables::cleanup(*b)).collect(),
        ProxyMode::Nftables => netfilter::nftables::cleanup(),
        ProxyMode::Ipvs => netfilter::ipvs::cleanup(backends),
    }
}

/// Removes what every mode installed (`proxy-agent cleanup`), and so what kube-proxy installed:
/// the same chains, tables, virtual servers and sets. Returns a line per thing removed.
pub fn cleanup_all(bpffs_root: &Path) -> Vec<String> {
    let backends = netfilter::Iptables::available();
    let mut lines: Vec<String> = ProxyMode::ALL.into_iter().flat_map(|mode| cleanup(mode, bpffs_root, &backends)).collect();
    lines.extend(netfilter::takeover::cleanup(&backends));
    // The iptables mode's counters, once no rule counts into them.
    for (name, _, _) in netfilter::nfacct::COUNTERS {
        if let Ok(true) = netfilter::nfacct::delete(name) {
            lines.push(format!("nfacct: {name}"));
        }
    }
    lines
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
        tracing::info!(mode = %mode, "removed what an earlier run in another mode or iptables backend (or kube-proxy) left: {line}");
    }
    let mut kube_proxys = netfilter::takeover::cleanup(backends);
    if current == ProxyMode::Ebpf {
        // The eBPF mode writes none of the chains that translate Services: what the removals
        // above left of them (their checks of which mode ran miss a half-removed state; a jump
        // of another chain fails their restore) goes too.
        kube_proxys.extend(netfilter::takeover::remove_translating(backends));
    }
    for line in kube_proxys {
        tracing::info!("removed what kube-proxy left: {line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_missing_capabilities_are_named() {
        let caps = |list: &[u32]| list.iter().fold(0u64, |a, c| a | 1 << c);
        assert_eq!(missing_ebpf_capabilities(caps(&[CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON])), Vec::<&str>::new());
        assert_eq!(missing_ebpf_capabilities(caps(&[CAP_BPF, CAP_NET_ADMIN])), vec!["CAP_PERFMON"]);
        assert_eq!(missing_ebpf_capabilities(caps(&[CAP_SYS_ADMIN])), vec!["CAP_NET_ADMIN"]);
        assert_eq!(missing_ebpf_capabilities(0), vec!["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"]);
    }
}
