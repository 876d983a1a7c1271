//! Health-check node ports of externalTrafficPolicy Local LoadBalancer Services, as kube-proxy
//! serves them: cloud load balancers probe every node and send traffic only to nodes that
//! answer 200, i.e. that have a local endpoint. Any path answers:
//! `{"service":{"namespace":..,"name":..},"localEndpoints":N,"serviceProxyHealthy":bool}` with
//! `X-Load-Balancing-Endpoint-Weight: N`; 200 when N > 0 and the proxy is healthy, else 503.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    http::{header, HeaderName, StatusCode},
    response::IntoResponse,
    Router,
};
use tokio::task::JoinHandle;

use crate::{model::ObjectKey, telemetry::Telemetry};

/// What one port reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortState {
    pub service: ObjectKey,
    pub local_endpoints: usize,
}

/// The body and status of a probe.
pub fn answer(state: &PortState, proxy_healthy: bool) -> (u16, String) {
    let body = serde_json::json!({
        "service": {"namespace": state.service.namespace, "name": state.service.name},
        "localEndpoints": state.local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    let code = if state.local_endpoints > 0 && proxy_healthy { 200 } else { 503 };
    (code, body.to_string())
}

struct Server {
    state: Arc<Mutex<PortState>>,
    task: JoinHandle<()>,
}

/// The running health-check servers, one per port.
pub struct HealthServers {
    telemetry: Arc<Telemetry>,
    servers: BTreeMap<u16, Server>,
}

impl HealthServers {
    pub fn new(telemetry: Arc<Telemetry>) -> Self {
        Self { telemetry, servers: BTreeMap::new() }
    }

    /// Serves exactly `wanted`: starts new ports, updates counts, stops ports no longer wanted.
    pub fn update(&mut self, wanted: &BTreeMap<u16, PortState>) {
        self.servers.retain(|port, s| {
            let keep = wanted.contains_key(port);
            if !keep {
                s.task.abort();
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
                    let task = spawn(*port, shared.clone(), self.telemetry.clone());
                    tracing::info!(port, service = %state.service, "health-check node port opened");
                    self.servers.insert(*port, Server { state: shared, task });
                }
            }
        }
    }
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        for s in self.servers.values() {
            s.task.abort();
        }
    }
}

fn spawn(port: u16, state: Arc<Mutex<PortState>>, telemetry: Arc<Telemetry>) -> JoinHandle<()> {
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
    let router = Router::new().fallback(handler);
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    tokio::spawn(async move {
        let mut warned = false;
        loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => {
                    if let Err(e) = axum::serve(listener, router.clone()).await {
                        tracing::error!(port, error = %e, "health-check server stopped; restarting");
                    }
                }
                Err(e) => {
                    if !warned {
                        warned = true;
                        tracing::error!(port, error = %e, "cannot listen on health-check node port; retrying every 5 s");
                    }
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_as_kube_proxy() {
        let s = PortState { service: ObjectKey::new("default", "web"), local_endpoints: 2 };
        let (code, body) = answer(&s, true);
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v, serde_json::json!({"service": {"namespace": "default", "name": "web"}, "localEndpoints": 2, "serviceProxyHealthy": true}));
        assert_eq!(answer(&PortState { local_endpoints: 0, ..s.clone() }, true).0, 503, "no local endpoint");
        assert_eq!(answer(&s, false).0, 503, "the proxy is not keeping up");
    }
}
