//! The API-server source: kube-rs watchers on Services, EndpointSlices and this node's Node,
//! with the label selectors kube-proxy uses. Each watcher's initial list (and every relist,
//! after a 410 Gone or a lost watch) becomes one `Replace` event, so objects that vanished
//! while the watch was down are removed; changes after that are `Apply` and `Delete`. Errors
//! are retried with backoff forever: an unreachable API server delays programming but stops
//! nothing, and what is pinned keeps serving.

use std::fmt::Debug;

use futures::StreamExt;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    runtime::{watcher, WatchStreamExt},
    Api, Client, Resource,
};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::model::{
    store::{Event, Kind, Object},
    validate::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME},
    ObjectKey,
};

/// Builds a client from `--kubeconfig`, else $KUBECONFIG, in-cluster config, ~/.kube/config.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!(
                "no Kubernetes API configuration found ({e}); pass --kubeconfig, set KUBECONFIG, \
                 run in a pod, or pass --manifests DIR to read objects from files"
            )
        })?,
    };
    Ok(Client::try_from(config)?)
}

fn key_of<K: Resource>(obj: &K, namespaced: bool) -> ObjectKey {
    let meta = obj.meta();
    let ns = if namespaced { meta.namespace.clone().unwrap_or_else(|| "default".into()) } else { String::new() };
    ObjectKey::new(ns, meta.name.clone().unwrap_or_default())
}

fn watch<K>(api: Api<K>, config: watcher::Config, kind: Kind, wrap: fn(K) -> Object, namespaced: bool, tx: mpsc::Sender<Event>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = watcher(api, config).default_backoff().boxed();
        let mut listing: Option<Vec<Object>> = None;
        let mut failing = false;
        while let Some(item) = stream.next().await {
            let event = match item {
                Ok(e) => {
                    if failing {
                        tracing::info!(kind = kind.as_str(), "watch re-established");
                        failing = false;
                    }
                    e
                }
                Err(e) => {
                    // The stream retries with exponential backoff on its own; say it once.
                    if !failing {
                        tracing::warn!(kind = kind.as_str(), error = %e, "watch failed; retrying with backoff");
                    }
                    failing = true;
                    continue;
                }
            };
            let out = match event {
                watcher::Event::Init => {
                    listing = Some(Vec::new());
                    None
                }
                watcher::Event::InitApply(obj) => {
                    listing.get_or_insert_with(Vec::new).push(wrap(obj));
                    None
                }
                watcher::Event::InitDone => Some(Event::Replace { kind, objects: listing.take().unwrap_or_default() }),
                watcher::Event::Apply(obj) => Some(Event::Apply(wrap(obj))),
                watcher::Event::Delete(obj) => Some(Event::Delete { kind, key: key_of(&obj, namespaced) }),
            };
            if let Some(ev) = out {
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
        }
    });
}

/// Starts the three watchers.
pub fn spawn(client: Client, node_name: &str, tx: mpsc::Sender<Event>) {
    // kube-proxy's selectors: Services another proxy claims are not ours (KEP-2447), and slices
    // of headless Services are never needed.
    watch(
        Api::<Service>::all(client.clone()),
        watcher::Config::default().labels(&format!("!{LABEL_SERVICE_PROXY_NAME}")),
        Kind::Service,
        |s| Object::Service(Box::new(s)),
        true,
        tx.clone(),
    );
    watch(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(&format!("!{LABEL_HEADLESS}")),
        Kind::EndpointSlice,
        |s| Object::EndpointSlice(Box::new(s)),
        true,
        tx.clone(),
    );
    watch(
        Api::<Node>::all(client),
        watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        Kind::Node,
        |n| Object::Node(Box::new(n)),
        false,
        tx,
    );
}
