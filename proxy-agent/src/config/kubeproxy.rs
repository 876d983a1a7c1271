//! kube-proxy's configuration file, `kubeproxy.config.k8s.io/v1alpha1` `KubeProxyConfiguration`
//! (YAML or JSON), as `kube-proxy --config` reads it: a kubeadm cluster's `kube-proxy`
//! ConfigMap works unchanged. Every field of the schema is known here. A field of the wrong
//! type or value is an error naming it; a field the schema does not have is named in a
//! warning and otherwise ignored, as kube-proxy's lenient decoding does.

use std::{collections::BTreeMap, path::Path, time::Duration};

use serde::{Deserialize, Deserializer};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";
/// A configuration file is a few kilobytes; anything much larger is not one.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// A Go duration (`30s`, `1m0s`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GoDuration(pub Duration);

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        super::duration::parse(&s).map(GoDuration).map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub feature_gates: Option<BTreeMap<String, bool>>,
    pub client_connection: Option<ClientConnection>,
    pub logging: Option<Logging>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub bind_address_hard_fail: Option<bool>,
    pub enable_profiling: Option<bool>,
    pub show_hidden_metrics_for_version: Option<String>,
    pub mode: Option<String>,
    pub iptables: Option<Iptables>,
    pub ipvs: Option<Ipvs>,
    pub nftables: Option<Nftables>,
    pub winkernel: Option<Winkernel>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    pub conntrack: Option<Conntrack>,
    pub config_sync_period: Option<GoDuration>,
    pub port_range: Option<String>,
    pub windows_run_as_service: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
    pub accept_content_types: Option<String>,
    pub content_type: Option<String>,
    pub qps: Option<f32>,
    pub burst: Option<i32>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Logging {
    pub format: Option<String>,
    pub flush_frequency: Option<serde_yaml::Value>,
    pub verbosity: Option<u32>,
    pub vmodule: Option<serde_yaml::Value>,
    pub options: Option<serde_yaml::Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Iptables {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub localhost_node_ports: Option<bool>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ipvs {
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    pub strict_arp: Option<bool>,
    pub tcp_timeout: Option<GoDuration>,
    pub tcp_fin_timeout: Option<GoDuration>,
    pub udp_timeout: Option<GoDuration>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Nftables {
    pub masquerade_bit: Option<i32>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<GoDuration>,
    pub min_sync_period: Option<GoDuration>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Winkernel {
    pub network_name: Option<String>,
    pub source_vip: Option<String>,
    #[serde(rename = "enableDSR")]
    pub enable_dsr: Option<bool>,
    pub root_hns_endpoint_name: Option<String>,
    pub forward_health_check_vip: Option<bool>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocal {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Conntrack {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    pub tcp_established_timeout: Option<GoDuration>,
    pub tcp_close_wait_timeout: Option<GoDuration>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<GoDuration>,
    pub udp_stream_timeout: Option<GoDuration>,
}

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("reading the configuration file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error(
        "the configuration file {path} is {size} bytes; a KubeProxyConfiguration is a few kilobytes (at most {MAX_FILE_BYTES} are read)"
    )]
    TooLarge { path: String, size: u64 },
    #[error("the configuration file {path} is not YAML or JSON: {detail}")]
    Syntax { path: String, detail: String },
    #[error("the configuration file {path}: field {field}: {detail}")]
    Field { path: String, field: String, detail: String },
}

/// A configuration file read: its content, and the paths of fields the schema does not have.
#[derive(Debug, Default)]
pub struct Loaded {
    pub config: KubeProxyConfiguration,
    pub unknown_fields: Vec<String>,
}

/// Reads and decodes `path`.
pub fn load(path: &Path) -> Result<Loaded, FileError> {
    let shown = path.display().to_string();
    let size = std::fs::metadata(path).map_err(|source| FileError::Read { path: shown.clone(), source })?.len();
    if size > MAX_FILE_BYTES {
        return Err(FileError::TooLarge { path: shown, size });
    }
    let text = std::fs::read(path).map_err(|source| FileError::Read { path: shown.clone(), source })?;
    let text = String::from_utf8(text).map_err(|e| FileError::Syntax {
        path: shown.clone(),
        detail: format!("not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
    })?;
    parse(&text).map_err(|e| e.at(&shown))
}

/// Decodes a configuration file's text (`path` is filled in by the caller).
pub fn parse(text: &str) -> Result<Loaded, FileError> {
    let value: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|e| FileError::Syntax { path: String::new(), detail: e.to_string() })?;
    if !matches!(value, serde_yaml::Value::Mapping(_)) {
        return Err(FileError::Syntax { path: String::new(), detail: "expected a mapping of fields at the top".into() });
    }
    let mut unknown = Vec::new();
    let mut record = |p: serde_ignored::Path<'_>| unknown.push(dotted(&p));
    let ignoring = serde_ignored::Deserializer::new(value, &mut record);
    let config: KubeProxyConfiguration = serde_path_to_error::deserialize(ignoring).map_err(|e| FileError::Field {
        path: String::new(),
        field: e.path().to_string(),
        detail: e.inner().to_string(),
    })?;
    let field = |field: &str, detail: String| FileError::Field { path: String::new(), field: field.into(), detail };
    match config.api_version.as_deref() {
        Some(API_VERSION) => {}
        Some(other) => return Err(field("apiVersion", format!("{other:?}: only {API_VERSION} is read"))),
        None => return Err(field("apiVersion", format!("missing: it must be {API_VERSION}"))),
    }
    match config.kind.as_deref() {
        Some(KIND) => {}
        other => return Err(field("kind", format!("{other:?}: it must be {KIND}"))),
    }
    Ok(Loaded { config, unknown_fields: unknown })
}

/// A field's path as the schema writes it (`ipvs.scheduler`, `nodePortAddresses[1]`).
fn dotted(p: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match p {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", dotted(parent)),
        Path::Map { parent, key } => match dotted(parent) {
            s if s.is_empty() => key.clone(),
            s => format!("{s}.{key}"),
        },
        Path::Some { parent } | Path::NewtypeStruct { parent } | Path::NewtypeVariant { parent } => dotted(parent),
    }
}

impl FileError {
    fn at(self, path: &str) -> Self {
        match self {
            Self::Syntax { detail, .. } => Self::Syntax { path: path.into(), detail },
            Self::Field { field, detail, .. } => Self::Field { path: path.into(), field, detail },
            other => other,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    /// What kubeadm writes into the `kube-proxy` ConfigMap's config.conf (v1.33).
    pub const KUBEADM: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;
}

#[cfg(test)]
mod tests {
    use super::{tests_support::KUBEADM, *};

    #[test]
    fn a_kubeadm_config_map_reads_without_unknown_fields() {
        let l = parse(KUBEADM).unwrap();
        assert!(l.unknown_fields.is_empty(), "{:?}", l.unknown_fields);
        assert_eq!(l.config.cluster_cidr.as_deref(), Some("10.244.0.0/16"));
        assert_eq!(l.config.client_connection.unwrap().kubeconfig.as_deref(), Some("/var/lib/kube-proxy/kubeconfig.conf"));
        assert_eq!(l.config.ipvs.unwrap().tcp_timeout, Some(GoDuration(Duration::ZERO)));
    }

    #[test]
    fn json_reads_as_well() {
        let l = parse(r#"{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration", "mode": "nftables", "iptables": {"syncPeriod": "45s"}}"#).unwrap();
        assert_eq!(l.config.mode.as_deref(), Some("nftables"));
        assert_eq!(l.config.iptables.unwrap().sync_period, Some(GoDuration(Duration::from_secs(45))));
    }

    #[test]
    fn a_bad_field_is_named_and_an_unknown_one_reported() {
        let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let err = parse(&format!("{head}iptables:\n  syncPeriod: fast\n")).unwrap_err().to_string();
        assert!(err.contains("iptables.syncPeriod") && err.contains("not a duration"), "{err}");
        let err = parse(&format!("{head}conntrack:\n  maxPerCore: many\n")).unwrap_err().to_string();
        assert!(err.contains("conntrack.maxPerCore"), "{err}");
        let err = parse(&format!("{head}iptables:\n  masqueradeBit: 99999999999\n")).unwrap_err().to_string();
        assert!(err.contains("iptables.masqueradeBit"), "{err}");
        let l = parse(&format!("{head}ipvs:\n  schedular: rr\nfancyFeature: true\n")).unwrap();
        assert_eq!(l.unknown_fields, ["ipvs.schedular", "fancyFeature"]);
        let err = parse("apiVersion: v1\nkind: ConfigMap\n").unwrap_err().to_string();
        assert!(err.contains("apiVersion") && err.contains(API_VERSION), "{err}");
        assert!(parse("just a string").unwrap_err().to_string().contains("mapping"));
        assert!(parse("a: [").unwrap_err().to_string().contains("not YAML or JSON"));
    }
}
