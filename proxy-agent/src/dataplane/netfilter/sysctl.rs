//! The kernel settings the netfilter modes need, set as kube-proxy sets them: its conntrack
//! settings, route_localnet for localhost NodePorts, IPVS's. A value already right is not
//! written, so an agent without write access (a container's read-only /proc/sys) works when
//! `--init-only` in a privileged init container has set them.

use std::{io, path::Path};

use crate::{
    config::{Config, Conntrack},
    dataplane::ProxyMode,
};

/// Sets `/proc/sys/<key>` to `value` unless it already is. True when it wrote.
pub fn ensure(key: &str, value: &str) -> io::Result<bool> {
    let path = Path::new("/proc/sys").join(key);
    let current = std::fs::read_to_string(&path)?;
    if current.split_whitespace().eq(value.split_whitespace()) {
        return Ok(false);
    }
    std::fs::write(&path, value).map(|()| true)
}

/// A setting the mode wants: `/proc/sys` key or, for the conntrack hash size, a /sys path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub key: String,
    pub value: String,
    /// Raise only: a larger value already there is kept (table sizes).
    pub at_least: bool,
    pub why: &'static str,
}

fn setting(key: &str, value: impl ToString, why: &'static str) -> Setting {
    Setting { key: key.into(), value: value.to_string(), at_least: false, why }
}

/// What kube-proxy's `conntrack` settings ask of the kernel's conntrack table.
pub fn conntrack_settings(c: &Conntrack, cpus: u32) -> Vec<Setting> {
    let mut out = Vec::new();
    if let Some(per_core) = c.max_per_core.filter(|p| *p > 0) {
        let max = per_core.saturating_mul(cpus).max(c.min.unwrap_or(0));
        out.push(Setting {
            key: "net/netfilter/nf_conntrack_max".into(),
            value: max.to_string(),
            at_least: true,
            why: "conntrack.maxPerCore",
        });
    }
    let secs = |d: std::time::Duration| d.as_secs().max(1);
    if let Some(d) = c.tcp_established_timeout {
        out.push(setting("net/netfilter/nf_conntrack_tcp_timeout_established", secs(d), "conntrack.tcpEstablishedTimeout"));
    }
    if let Some(d) = c.tcp_close_wait_timeout {
        out.push(setting("net/netfilter/nf_conntrack_tcp_timeout_close_wait", secs(d), "conntrack.tcpCloseWaitTimeout"));
    }
    if c.tcp_be_liberal {
        out.push(setting("net/netfilter/nf_conntrack_tcp_be_liberal", 1, "conntrack.tcpBeLiberal"));
    }
    if let Some(d) = c.udp_timeout {
        out.push(setting("net/netfilter/nf_conntrack_udp_timeout", secs(d), "conntrack.udpTimeout"));
    }
    if let Some(d) = c.udp_stream_timeout {
        out.push(setting("net/netfilter/nf_conntrack_udp_timeout_stream", secs(d), "conntrack.udpStreamTimeout"));
    }
    out
}

/// Whether iptables mode serves NodePorts on 127.0.0.1 with this configuration: asked for, and
/// NodePorts served on every address or on loopback ones (kube-proxy's rule).
pub fn localhost_nodeports(cfg: &Config) -> bool {
    use crate::model::store::NodePortAddresses;
    cfg.netfilter.localhost_nodeports
        && match &cfg.common.nodeport_addresses {
            NodePortAddresses::All => true,
            NodePortAddresses::Primary => false,
            NodePortAddresses::Cidrs(c) => c.iter().any(|c| c.contains(std::net::Ipv4Addr::LOCALHOST.into())),
        }
}

/// Every setting `mode` wants.
pub fn settings(mode: ProxyMode, cfg: &Config) -> Vec<Setting> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let mut out = conntrack_settings(&cfg.common.conntrack.with_kube_proxy_defaults(), cpus);
    match mode {
        ProxyMode::Iptables if localhost_nodeports(cfg) => {
            out.push(setting("net/ipv4/conf/all/route_localnet", 1, "iptables.localhostNodePorts (NodePorts on 127.0.0.1)"));
        }
        ProxyMode::Ipvs => {
            let opts = crate::dataplane::modes::ipvs_options(cfg);
            out.extend(opts.sysctls().into_iter().map(|(k, v)| setting(k, v, "IPVS mode")));
        }
        _ => {}
    }
    out
}

/// Applies `settings`. Returns a line per failure, naming the setting, why it is wanted and
/// what to do.
pub fn apply(settings: &[Setting]) -> Vec<String> {
    let mut failures = Vec::new();
    for s in settings {
        let result = (|| -> io::Result<bool> {
            if s.at_least {
                let current: u64 = std::fs::read_to_string(Path::new("/proc/sys").join(&s.key))?.trim().parse().unwrap_or(0);
                if current >= s.value.parse().unwrap_or(0) {
                    return Ok(false);
                }
            }
            ensure(&s.key, &s.value)
        })();
        match result {
            Ok(true) => tracing::info!(sysctl = %s.key.replace('/', "."), value = %s.value, "set for {}", s.why),
            Ok(false) => {}
            Err(e) => failures.push(format!(
                "sysctl {}={} ({}) could not be set: {e}{}",
                s.key.replace('/', "."),
                s.value,
                s.why,
                match e.raw_os_error() {
                    Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) => {
                        "; /proc/sys is read-only in an unprivileged container: let `proxy-agent run --init-only` set it in a \
                         privileged init container (deploy/daemonset.yaml does)"
                    }
                    Some(libc::ENOENT) => "; the kernel module is not loaded (nf_conntrack, ip_vs)",
                    _ => "",
                }
            )),
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn conntrack_settings_follow_kube_proxy() {
        let c = Conntrack {
            max_per_core: Some(32768),
            min: Some(131072),
            tcp_established_timeout: Some(Duration::from_secs(86400)),
            tcp_close_wait_timeout: Some(Duration::from_secs(3600)),
            tcp_be_liberal: true,
            udp_timeout: None,
            udp_stream_timeout: Some(Duration::from_secs(120)),
        };
        let s = conntrack_settings(&c, 2);
        assert_eq!(
            s[0],
            Setting { key: "net/netfilter/nf_conntrack_max".into(), value: "131072".into(), at_least: true, why: "conntrack.maxPerCore" }
        );
        assert_eq!(conntrack_settings(&c, 8)[0].value, "262144", "per core wins over the minimum on larger nodes");
        let keys: Vec<(&str, &str)> = s[1..].iter().map(|s| (s.key.as_str(), s.value.as_str())).collect();
        assert_eq!(
            keys,
            [
                ("net/netfilter/nf_conntrack_tcp_timeout_established", "86400"),
                ("net/netfilter/nf_conntrack_tcp_timeout_close_wait", "3600"),
                ("net/netfilter/nf_conntrack_tcp_be_liberal", "1"),
                ("net/netfilter/nf_conntrack_udp_timeout_stream", "120"),
            ]
        );
        assert!(conntrack_settings(&Conntrack::default(), 4).is_empty(), "nothing set, nothing written");
    }
}
