//! Health-check node ports of externalTrafficPolicy Local LoadBalancer Services, as kube-proxy
//! serves them: cloud load balancers probe every node and send traffic only to nodes that
//! answer 200, i.e. that have a local endpoint. Any path answers:
//! `{"service":{"namespace":..,"name":..},"localEndpoints":N,"serviceProxyHealthy":bool}` with
//! `X-Load-Balancing-Endpoint-Weight: N`; 200 when N > 0 and the proxy is healthy, else 503.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use axum::{
    http::{header, HeaderName, StatusCode},
    response::IntoResponse,
    Router,
};
use tokio::task::JoinHandle;

use crate::telemetry::Telemetry;

pub use crate::sync::PortState;

/// The body and status of a probe.
pub fn answer(state: &PortState, proxy_healthy: bool) -> (u16, String) {
    let body = serde_json::json!({
        "service": {"namespace": state.service.namespace(), "name": state.service.name()},
        "localEndpoints": state.local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    let code = if state.local_endpoints > 0 && proxy_healthy { 200 } else { 503 };
    (code, body.to_string())
}

struct Server {
    state: Arc<Mutex<PortState>>,
    /// One listener per address.
    tasks: Vec<JoinHandle<()>>,
}

/// The running health-check servers, one per port.
pub struct HealthServers {
    telemetry: Arc<Telemetry>,
    servers: BTreeMap<u16, Server>,
    /// Where they listen: the addresses NodePorts are served on (None: every address).
    addresses: Option<Vec<IpAddr>>,
}

impl HealthServers {
    pub fn new(telemetry: Arc<Telemetry>) -> Self {
        Self { telemetry, servers: BTreeMap::new(), addresses: None }
    }

    /// Serves exactly `wanted`, on `addresses` (the NodePort addresses, as kube-proxy binds
    /// them; None: every address): starts new ports, updates counts, stops ports no longer
    /// wanted, and moves every port when the addresses change.
    pub fn update(&mut self, wanted: &BTreeMap<u16, PortState>, addresses: Option<Vec<IpAddr>>) {
        if addresses != self.addresses {
            for s in self.servers.values() {
                s.tasks.iter().for_each(JoinHandle::abort);
            }
            self.servers.clear();
            self.addresses = addresses;
        }
        self.servers.retain(|port, s| {
            let keep = wanted.contains_key(port);
            if !keep {
                s.tasks.iter().for_each(JoinHandle::abort);
                tracing::info!(port, "health-check node port closed");
            }
            keep
        });
        for (port, state) in wanted {
            match self.servers.get(port) {
                Some(s) => {
                    let mut cur = s.state.lock().unwrap();
                    if *cur != *state {
                        *cur = state.clone();
                    }
                }
                None => {
                    let shared = Arc::new(Mutex::new(state.clone()));
                    let router = router(shared.clone(), self.telemetry.clone());
                    let addrs = self.addresses.clone().unwrap_or_else(|| vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)]);
                    let tasks = addrs
                        .iter()
                        .map(|a| {
                            crate::http::listen(
                                "health-check",
                                "a Service's healthCheckNodePort",
                                SocketAddr::from((*a, *port)),
                                router.clone(),
                            )
                        })
                        .collect();
                    tracing::info!(port, service = %state.service, addresses = ?addrs, "health-check node port opened");
                    self.servers.insert(*port, Server { state: shared, tasks });
                }
            }
        }
    }
}

#[cfg(test)]
impl HealthServers {
    /// The ports served.
    pub fn ports(&self) -> Vec<u16> {
        self.servers.keys().copied().collect()
    }
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        for s in self.servers.values() {
            s.tasks.iter().for_each(JoinHandle::abort);
        }
    }
}

fn router(state: Arc<Mutex<PortState>>, telemetry: Arc<Telemetry>) -> Router {
    let handler = move || {
        let (code, body) = answer(&state.lock().unwrap(), telemetry.proxy_healthy());
        let weight = state.lock().unwrap().local_endpoints.to_string();
        async move {
            (
                StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                [
                    (header::CONTENT_TYPE, "application/json".to_string()),
                    (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_string()),
                    (HeaderName::from_static("x-load-balancing-endpoint-weight"), weight),
                ],
                body,
            )
                .into_response()
        }
    };
    Router::new().fallback(handler)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ObjectKey;

    #[test]
    fn answers_as_kube_proxy() {
        let s = PortState { service: ObjectKey::new("default", "web"), local_endpoints: 2 };
        let (code, body) = answer(&s, true);
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"service": {"namespace": "default", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": true})
        );
        assert_eq!(answer(&PortState { local_endpoints: 0, ..s.clone() }, true).0, 503, "no local endpoint");
        assert_eq!(answer(&s, false).0, 503, "the proxy is not keeping up");
    }
}
