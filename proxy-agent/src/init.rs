//! `proxy-agent run --init-only`: what needs full privileges, done once by a short privileged
//! init container so that the long-running agent needs only its mode's capabilities (kube-proxy
//! has the same flag for the same split). Mounts made here reach the host through the
//! DaemonSet's Bidirectional hostPath volumes, so they outlive every container.

use std::{io, os::fd::AsRawFd as _, path::Path};

use crate::{
    bpffs,
    config::Config,
    dataplane::{ebpf::hostsock, modes, netfilter, ProxyMode},
};

/// The mode the agent will run in: the configured one, or what auto would pick on this
/// node's kernel (the checks that need no privileges beyond ours).
fn expected_mode(cfg: &Config) -> ProxyMode {
    cfg.common.proxy_mode.unwrap_or_else(|| match modes::ebpf_unsupported() {
        None => ProxyMode::Ebpf,
        Some(_) if modes::nftables_unsupported().is_none() => ProxyMode::Nftables,
        Some(_) => ProxyMode::Iptables,
    })
}

/// Mounts the cgroup v2 hierarchy at `dir` as the host sees it: from inside the host's cgroup
/// namespace (that of `host_proc`/1) when the container has one of its own (containerd's
/// default on cgroup v2 hosts), since one mounted from a container's own namespace shows only
/// the container's cgroup.
fn mount_host_cgroup2(dir: &Path, host_proc: Option<&Path>) -> io::Result<()> {
    if hostsock::in_host_cgroup_namespace() {
        return hostsock::mount_cgroup2(dir);
    }
    let Some(proc) = host_proc else {
        return Err(io::Error::other(
            "this container has a cgroup namespace of its own: pass --host-proc (the host's /proc as a hostPath volume) to mount the host's hierarchy",
        ));
    };
    {
        let ns = std::fs::File::open(proc.join("1/ns/cgroup"))?;
        // SAFETY: setns on a namespace fd; this process is single-threaded here.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWCGROUP) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    hostsock::mount_cgroup2(dir)
}

/// The kernel modules a netfilter mode needs (conntrack; IPVS and its scheduler), each once.
fn modules_needed(mode: ProxyMode, ipvs_scheduler: &str) -> Vec<String> {
    let mut modules: Vec<String> = vec!["nf_conntrack".into()];
    if mode == ProxyMode::Ipvs {
        modules.extend(["ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh"].map(String::from));
        let scheduler = format!("ip_vs_{ipvs_scheduler}");
        if !modules.contains(&scheduler) {
            modules.push(scheduler);
        }
    }
    modules
}

/// Whether `modules.builtin` (its text) lists module `name` (a path ending in `/name.ko`).
fn is_builtin(list: &str, name: &str) -> bool {
    let file = format!("/{name}.ko");
    list.lines().any(|l| l.trim_end().ends_with(&file))
}

/// Loads the kernel modules a netfilter mode needs; what failed, said for people.
fn load_modules(mode: ProxyMode, cfg: &Config) -> Vec<String> {
    let modules = modules_needed(mode, &cfg.netfilter.ipvs.scheduler.0);
    let mut failures = Vec::new();
    // Loaded, or built into the kernel: a loaded module, and a built-in one with parameters,
    // is under /sys/module; the modules directory (which may not exist at all) lists the
    // built-in ones.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let builtin = std::fs::read_to_string(format!("/lib/modules/{}/modules.builtin", release.trim())).unwrap_or_default();
    let present = |m: &str| Path::new("/sys/module").join(m).exists() || is_builtin(&builtin, m);
    for m in modules.iter().filter(|m| !present(m)) {
        // Watched as the netfilter tools are: a modprobe waiting for ever (on another load of
        // the module, or a helper that never answers) is killed and reported, not waited on.
        if let Err(e) = netfilter::run_with_input("modprobe", "kmod", &[m.as_str()], "") {
            failures.push(e.to_string());
        }
    }
    failures
}

/// Does what `--init-only` promises. Fails on what the agent cannot do without; what it can
/// do without is reported.
pub fn run(cfg: &Config, host_proc: Option<&Path>) -> anyhow::Result<()> {
    let mode = expected_mode(cfg);
    tracing::info!(mode = %mode, "preparing the node");
    if mode == ProxyMode::Ebpf {
        let root = &cfg.common.bpffs_root;
        let prepared = bpffs::prepare(root)?;
        match (&prepared.mounted, prepared.outlives_agent) {
            (None, _) => tracing::info!(bpffs = %root.display(), "a BPF filesystem is there already"),
            (Some(m), true) => tracing::info!(bpffs = %m.display(), "mounted a BPF filesystem the host shares"),
            (Some(m), false) => anyhow::bail!(
                "mounted a BPF filesystem at {} but it does not reach the host (the volume needs mountPropagation: \
                 Bidirectional and a privileged container): the agent's pins would die with each container",
                m.display()
            ),
        }
        match &cfg.ebpf.cgroup_root {
            Some(Some(dir)) if !hostsock::is_cgroup2(dir) => {
                mount_host_cgroup2(dir, host_proc)
                    .map_err(|e| anyhow::anyhow!("mounting the cgroup v2 hierarchy at {}: {e}", dir.display()))?;
                tracing::info!(cgroup = %dir.display(), "mounted the host's cgroup v2 hierarchy for the socket hooks");
            }
            Some(Some(dir)) => tracing::info!(cgroup = %dir.display(), "a cgroup v2 hierarchy is there already"),
            _ => {}
        }
        // What kube-proxy, or this agent in another mode, left: the eBPF mode's agent removes
        // it itself after its first whole write (reading iptables-legacy with the CAP_NET_RAW
        // the DaemonSet gives it), so that those rules serve new connections until then.
        tracing::info!("what kube-proxy or another mode left stays until the agent's first whole write");
    } else {
        // The modules first: the conntrack and IPVS sysctls exist only once they are loaded.
        for failure in load_modules(mode, cfg) {
            tracing::warn!("{failure}");
        }
        for failure in netfilter::sysctl::apply(&netfilter::sysctl::settings(mode, cfg)) {
            tracing::warn!("{failure}");
        }
        // What kube-proxy, or this agent in another mode, left (both iptables backends).
        let backends = netfilter::Iptables::available();
        let ipt = matches!(mode, ProxyMode::Iptables | ProxyMode::Ipvs)
            .then(|| cfg.netfilter.iptables_backend.unwrap_or_else(|| netfilter::Iptables::detect(&backends).0));
        modes::cleanup_other_modes(mode, ipt, &backends, &cfg.common.bpffs_root);
    }
    tracing::info!(mode = %mode, "node prepared");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_module_is_loaded_once_and_the_scheduler_last() {
        assert_eq!(modules_needed(ProxyMode::Nftables, "rr"), ["nf_conntrack"]);
        assert_eq!(modules_needed(ProxyMode::Iptables, "rr"), ["nf_conntrack"]);
        // The default scheduler is among the ones always loaded: not asked for twice.
        assert_eq!(modules_needed(ProxyMode::Ipvs, "rr"), ["nf_conntrack", "ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh"]);
        assert_eq!(modules_needed(ProxyMode::Ipvs, "lc"), ["nf_conntrack", "ip_vs", "ip_vs_rr", "ip_vs_wrr", "ip_vs_sh", "ip_vs_lc"]);
    }

    #[test]
    fn built_in_modules_are_read_from_the_kernels_list() {
        let list = "kernel/net/netfilter/nf_conntrack.ko\nkernel/net/netfilter/ipvs/ip_vs_rr.ko\n";
        assert!(is_builtin(list, "ip_vs_rr") && is_builtin(list, "nf_conntrack"));
        assert!(!is_builtin(list, "ip_vs") && !is_builtin(list, "rr"), "whole names only");
        assert!(!is_builtin("", "nf_conntrack"));
    }
}
