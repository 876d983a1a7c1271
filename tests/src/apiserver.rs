//! An in-process Kubernetes API server for the kube-rs code path. It speaks the real list/watch
//! protocol over HTTP: JSON lists with a resourceVersion (paged with continue tokens when the
//! client sets `limit`, as kube-rs does), chunked watch streams of JSON events
//! from a resourceVersion, BOOKMARK events, `410 Gone` (an ERROR event with an Expired Status)
//! for a compacted resourceVersion, label and field selectors, and streams that the test can
//! cut mid-way. Objects that stop matching a watch's selector are DELETED on that watch, as the
//! real server does.
//!
//! It serves Services, EndpointSlices, Nodes and ServiceCIDRs, cluster-wide, which is what the
//! agent watches.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::{Query, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::netns::{enter, Netns};

pub use proxy_agent::model::store::Kind;

fn kind_of(obj: &Value) -> Kind {
    match obj["kind"].as_str() {
        Some("Service") => Kind::Service,
        Some("EndpointSlice") => Kind::EndpointSlice,
        Some("Node") => Kind::Node,
        Some("ServiceCIDR") => Kind::ServiceCidr,
        other => panic!("the test API server serves Services, EndpointSlices, Nodes and ServiceCIDRs, not {other:?}"),
    }
}

fn api_version(kind: Kind) -> &'static str {
    match kind {
        Kind::EndpointSlice => "discovery.k8s.io/v1",
        Kind::ServiceCidr => "networking.k8s.io/v1",
        _ => "v1",
    }
}

/// Kinds that are not namespaced.
fn cluster_scoped(kind: Kind) -> bool {
    matches!(kind, Kind::Node | Kind::ServiceCidr)
}

type Key = (Kind, String, String);

struct Watch {
    id: u64,
    kind: Kind,
    labels: String,
    fields: String,
    tx: mpsc::UnboundedSender<Bytes>,
}

/// What a misbehaving API server sends on a watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hostile {
    /// One byte every half second, never a whole line.
    Trickle,
    /// One line that never ends, a megabyte at a time.
    EndlessLine,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// Events by resourceVersion, for watches that resume.
    history: Vec<(u64, Kind, &'static str, Value, Option<Value>)>,
    /// A watch from a resourceVersion below this gets 410 Gone.
    compacted_below: u64,
    watches: Vec<Watch>,
    /// Requests seen: (path, query), for assertions.
    requests: Vec<(String, String)>,
    /// Authorization headers seen.
    authorizations: std::collections::BTreeSet<String>,
    /// Watches of a kind answered with hostile bodies instead of events.
    hostile: BTreeMap<Kind, Hostile>,
    bookmark_every: Option<Duration>,
    next_watch: u64,
    /// Answer 404 for ServiceCIDRs, as API servers before 1.33 do.
    no_service_cidrs: bool,
    /// Lists being paged (`limit`/`continue`): what is left of each, and the list's
    /// resourceVersion, by continue token.
    pages: BTreeMap<String, (Vec<Value>, u64)>,
    next_page: u64,
}

/// Matches a label selector of the forms kube-proxy uses: `key`, `!key`, `key=value`,
/// `key==value`, `key!=value`, comma-separated.
pub fn labels_match(selector: &str, labels: &Value) -> bool {
    selector.split(',').map(str::trim).filter(|s| !s.is_empty()).all(|term| {
        let get = |k: &str| labels.get(k).and_then(|v| v.as_str());
        if let Some(k) = term.strip_prefix('!') {
            get(k).is_none()
        } else if let Some((k, v)) = term.split_once("!=") {
            get(k) != Some(v)
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            get(k) == Some(v)
        } else {
            get(term).is_some()
        }
    })
}

fn fields_match(selector: &str, obj: &Value) -> bool {
    selector.split(',').map(str::trim).filter(|s| !s.is_empty()).all(|term| match term.split_once('=') {
        Some(("metadata.name", v)) => obj["metadata"]["name"].as_str() == Some(v),
        Some(("metadata.namespace", v)) => obj["metadata"]["namespace"].as_str() == Some(v),
        _ => panic!("the test API server does not know field selector {term:?}"),
    })
}

fn matches(labels: &str, fields: &str, obj: &Value) -> bool {
    labels_match(labels, &obj["metadata"]["labels"]) && fields_match(fields, obj)
}

fn line(kind: &str, obj: &Value) -> Bytes {
    let mut s = serde_json::to_string(&json!({"type": kind, "object": obj})).unwrap();
    s.push('\n');
    Bytes::from(s)
}

/// The event a watch with this selector sees when `old` becomes `new` (None: not there).
fn event_for(w: &Watch, typ: &'static str, new: &Value, old: Option<&Value>) -> Option<Bytes> {
    let was = old.is_some_and(|o| matches(&w.labels, &w.fields, o));
    let is = typ != "DELETED" && matches(&w.labels, &w.fields, new);
    match (was, is) {
        (false, true) => Some(line("ADDED", new)),
        (true, true) => Some(line("MODIFIED", new)),
        (true, false) => Some(line("DELETED", new)),
        (false, false) => None,
    }
}

#[derive(Clone)]
pub struct ApiServer {
    inner: Arc<Mutex<Inner>>,
    pub addr: SocketAddr,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Params {
    watch: Option<String>,
    resource_version: Option<String>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    timeout_seconds: Option<u64>,
    limit: Option<usize>,
    #[serde(rename = "continue")]
    continue_token: Option<String>,
}

impl ApiServer {
    /// Starts a server listening on 127.0.0.1 inside `ns` (the agent runs there), on its own
    /// thread and runtime. `port` 0 picks a free one.
    pub fn start(ns: &Netns, port: u16) -> Self {
        let inner = Arc::new(Mutex::new(Inner { rv: 100, bookmark_every: Some(Duration::from_millis(300)), ..Default::default() }));
        let file = ns.file();
        let (tx, rx) = std::sync::mpsc::channel();
        let state = inner.clone();
        std::thread::spawn(move || {
            enter(&file).expect("enter the node namespace");
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind the API server");
                tx.send(listener.local_addr().unwrap()).unwrap();
                let app = Router::new()
                    .route("/api/v1/services", get(|s, h, q| serve(s, h, q, Kind::Service)))
                    .route("/apis/discovery.k8s.io/v1/endpointslices", get(|s, h, q| serve(s, h, q, Kind::EndpointSlice)))
                    .route("/api/v1/nodes", get(|s, h, q| serve(s, h, q, Kind::Node)))
                    .route("/apis/networking.k8s.io/v1/servicecidrs", get(|s, h, q| serve(s, h, q, Kind::ServiceCidr)))
                    .with_state(state);
                // Go's net/http (the real API server) sets TCP_NODELAY; without it, watch events
                // written one by one can wait ~40 ms for a delayed ACK.
                let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                let _ = axum::serve(listener, app).await;
            });
        });
        let addr = rx.recv_timeout(Duration::from_secs(10)).expect("API server started");
        Self { inner, addr }
    }

    /// A kubeconfig pointing at this server.
    pub fn write_kubeconfig(&self, path: &Path) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: http://{}\nusers:\n- name: lab\n  user: {{}}\ncontexts:\n- name: lab\n  context: {{cluster: lab, user: lab}}\ncurrent-context: lab\n",
            self.addr
        );
        std::fs::write(path, text).expect("write kubeconfig");
    }

    /// Creates or updates an object (a Kubernetes manifest, YAML or JSON).
    pub fn apply(&self, manifest: &str) {
        let mut obj: Value = serde_yaml::from_str(manifest).expect("manifest parses");
        let kind = kind_of(&obj);
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        let rv = inner.rv;
        let meta = obj["metadata"].as_object_mut().expect("metadata");
        if !cluster_scoped(kind) && !meta.contains_key("namespace") {
            meta.insert("namespace".into(), json!("default"));
        }
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        let name = meta["name"].as_str().expect("name").to_string();
        let ns = meta.get("namespace").and_then(|v| v.as_str()).unwrap_or_default().to_string();
        meta.entry("uid").or_insert_with(|| json!(format!("uid-{name}-{ns}")));
        let old = inner.objects.insert((kind, ns, name), obj.clone());
        let typ = if old.is_some() { "MODIFIED" } else { "ADDED" };
        Self::publish(&mut inner, rv, kind, typ, obj, old);
    }

    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        let Some(mut obj) = inner.objects.remove(&(kind, namespace.into(), name.into())) else {
            panic!("deleting {name}: no such object");
        };
        inner.rv += 1;
        let rv = inner.rv;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let old = Some(obj.clone());
        Self::publish(&mut inner, rv, kind, "DELETED", obj, old);
    }

    fn publish(inner: &mut Inner, rv: u64, kind: Kind, typ: &'static str, obj: Value, old: Option<Value>) {
        inner.watches.retain(|w| {
            if w.kind != kind {
                return true;
            }
            match event_for(w, typ, &obj, old.as_ref()) {
                Some(bytes) => w.tx.send(bytes).is_ok(),
                None => !w.tx.is_closed(),
            }
        });
        inner.history.push((rv, kind, typ, obj, old));
    }

    /// Ends every watch stream. `abrupt`: in the middle of an event, as a dropped connection
    /// would; otherwise cleanly, as the server's watch timeout does.
    pub fn cut_watches(&self, abrupt: bool) {
        let mut inner = self.inner.lock().unwrap();
        for w in inner.watches.drain(..) {
            if abrupt {
                let _ = w.tx.send(Bytes::from_static(b"{\"type\":\"MODIFIED\",\"object\":{\"kind\":"));
            }
        }
    }

    /// Forgets history, as etcd compaction does: watches resuming from before now get 410 Gone.
    /// Also cuts the open watches so they have to resume.
    pub fn compact(&self) {
        {
            let mut inner = self.inner.lock().unwrap();
            inner.compacted_below = inner.rv + 1;
            inner.history.clear();
            // Continue tokens expire with the history they stand on.
            inner.pages.clear();
        }
        self.cut_watches(false);
    }

    pub fn open_watches(&self) -> usize {
        let mut inner = self.inner.lock().unwrap();
        inner.watches.retain(|w| !w.tx.is_closed());
        inner.watches.len()
    }

    /// Requests so far: (path, query string).
    /// Answers new watches of `kind` with `hostile` bodies (None: as a real server again). The
    /// watches open now are cut, so the agent comes back for a new one.
    pub fn set_hostile(&self, kind: Kind, hostile: Option<Hostile>) {
        let mut g = self.inner.lock().unwrap();
        match hostile {
            Some(h) => g.hostile.insert(kind, h),
            None => g.hostile.remove(&kind),
        };
        g.watches.retain(|w| w.kind != kind);
    }

    /// The Authorization headers requests came with (the service account token, say).
    pub fn authorizations(&self) -> Vec<String> {
        self.inner.lock().unwrap().authorizations.iter().cloned().collect()
    }

    /// From now on, answer as an API server before 1.33: no ServiceCIDRs (404).
    pub fn without_service_cidrs(&self) {
        self.inner.lock().unwrap().no_service_cidrs = true;
    }

    pub fn requests(&self) -> Vec<(String, String)> {
        self.inner.lock().unwrap().requests.clone()
    }
}

async fn serve(State(inner): State<Arc<Mutex<Inner>>>, headers: axum::http::HeaderMap, Query(p): Query<Params>, kind: Kind) -> Response {
    let labels = p.label_selector.clone().unwrap_or_default();
    let fields = p.field_selector.clone().unwrap_or_default();
    let mut g = inner.lock().unwrap();
    let query = format!(
        "watch={} resourceVersion={} labelSelector={labels} fieldSelector={fields} limit={} continue={}",
        p.watch.clone().unwrap_or_default(),
        p.resource_version.clone().unwrap_or_default(),
        p.limit.map(|l| l.to_string()).unwrap_or_default(),
        p.continue_token.clone().unwrap_or_default(),
    );
    g.requests.push((kind.as_str().into(), query));
    if kind == Kind::ServiceCidr && g.no_service_cidrs {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "the server could not find the requested resource", "reason": "NotFound", "code": 404});
        return (StatusCode::NOT_FOUND, [("content-type", "application/json")], status.to_string()).into_response();
    }
    if let Some(auth) = headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        g.authorizations.insert(auth.to_string());
    }
    if p.watch.as_deref() != Some("true") && p.watch.as_deref() != Some("1") {
        // A list is paged when the client sets `limit`, as the real server pages one: each
        // page a part of one snapshot, taken at the first page, whose resourceVersion every
        // page carries. (Simpler than the real one: a token serves once, is not tied to its
        // kind or selectors, and `remainingItemCount` is given with selectors too.)
        let (mut items, rv) = match p.continue_token.as_deref().filter(|t| !t.is_empty()) {
            Some(token) => match g.pages.remove(token) {
                Some(rest) => rest,
                None => {
                    let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": "the provided continue parameter is too old", "reason": "Expired", "code": 410});
                    return (StatusCode::GONE, [("content-type", "application/json")], status.to_string()).into_response();
                }
            },
            None => (
                g.objects.iter().filter(|((k, _, _), o)| *k == kind && matches(&labels, &fields, o)).map(|(_, o)| o.clone()).collect(),
                g.rv,
            ),
        };
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if let Some(limit) = p.limit.filter(|l| *l > 0 && items.len() > *l) {
            let rest = items.split_off(limit);
            let token = format!("page-{}", g.next_page);
            g.next_page += 1;
            metadata["continue"] = json!(token);
            metadata["remainingItemCount"] = json!(rest.len());
            g.pages.insert(token, (rest, rv));
        }
        let body = json!({
            "apiVersion": api_version(kind),
            "kind": format!("{}List", kind.as_str()),
            "metadata": metadata,
            "items": items,
        });
        return (StatusCode::OK, [("content-type", "application/json")], body.to_string()).into_response();
    }

    if let Some(h) = g.hostile.get(&kind).copied() {
        drop(g);
        let stream = futures::stream::unfold(0u64, move |n| async move {
            let chunk = match h {
                Hostile::Trickle => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    Bytes::from_static(b" ")
                }
                Hostile::EndlessLine => {
                    // Paced a little, so the test measures the agent, not the loop.
                    if n % 16 == 0 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Bytes::from(vec![b'x'; 1 << 20])
                }
            };
            Some((Ok::<_, std::io::Error>(chunk), n + 1))
        });
        return (StatusCode::OK, [("content-type", "application/json")], Body::from_stream(stream)).into_response();
    }
    let from: u64 = p.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(g.rv);
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    if from < g.compacted_below {
        let status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {from} ({})", g.compacted_below),
            "reason": "Expired", "code": 410,
        });
        let _ = tx.send(line("ERROR", &status));
        drop(tx);
    } else {
        g.next_watch += 1;
        let id = g.next_watch;
        let probe = Watch { id, kind, labels: labels.clone(), fields: fields.clone(), tx: tx.clone() };
        for (rv, k, typ, obj, old) in &g.history {
            if *rv > from && *k == kind {
                if let Some(b) = event_for(&probe, typ, obj, old.as_ref()) {
                    let _ = tx.send(b);
                }
            }
        }
        g.watches.push(probe);
        if let Some(every) = g.bookmark_every {
            let (tx, inner) = (tx.clone(), inner.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let g = inner.lock().unwrap();
                    // A cut or timed-out watch is no longer registered: end its stream.
                    if !g.watches.iter().any(|w| w.id == id) {
                        return;
                    }
                    let rv = g.rv;
                    drop(g);
                    let mark =
                        json!({"kind": kind.as_str(), "apiVersion": api_version(kind), "metadata": {"resourceVersion": rv.to_string()}});
                    if tx.send(line("BOOKMARK", &mark)).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        if let Some(secs) = p.timeout_seconds {
            // Only the id is held, so a cut stream is not kept open until its timeout.
            let inner = inner.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(secs)).await;
                inner.lock().unwrap().watches.retain(|w| w.id != id);
            });
        }
    }
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx)) });
    (StatusCode::OK, [("content-type", "application/json")], Body::from_stream(stream)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selectors() {
        let l = json!({"a": "1", "b": "2"});
        assert!(labels_match("", &l));
        assert!(labels_match("a", &l));
        assert!(labels_match("!c", &l));
        assert!(!labels_match("!a", &l));
        assert!(labels_match("a=1,b!=3", &l));
        assert!(!labels_match("a=2", &l));
        assert!(labels_match("!service.kubernetes.io/headless", &Value::Null));
    }
}
