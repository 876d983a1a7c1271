//! The manifest-directory source: the YAML or JSON that `kubectl get -o yaml` prints, including
//! multi-document files and `List` kinds, for Services, EndpointSlices and Nodes. Every change
//! in the directory leads to a rescan that replaces the full set of objects, exactly like a
//! relist of the API server would.
//!
//! A file that does not parse, or an object that does not decode, is reported and the last good
//! version of what it held is kept: a half-saved edit never takes Services down.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde::Deserialize;
use tokio::sync::mpsc;

use crate::model::{
    store::{Event, Kind, Object},
    ObjectKey,
};

/// A problem with one file or one object in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    /// 1-based document number within the file, when the problem is with one document.
    pub document: Option<usize>,
    pub object: Option<String>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(d) = self.document {
            write!(f, " (document {d})")?;
        }
        if let Some(o) = &self.object {
            write!(f, ": {o}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Identity of an object within a file: kind, namespace, name.
type Ident = (Kind, ObjectKey);

#[derive(Default)]
struct Parsed {
    objects: Vec<(Ident, Object)>,
    /// Objects that failed to decode but whose identity is known.
    broken: Vec<Ident>,
    problems: Vec<Problem>,
}

fn kind_of(kind: &str, api_version: &str) -> Option<Kind> {
    match (kind, api_version) {
        ("Service", "v1") => Some(Kind::Service),
        ("EndpointSlice", "discovery.k8s.io/v1") => Some(Kind::EndpointSlice),
        ("Node", "v1") => Some(Kind::Node),
        _ => None,
    }
}

fn ident_of(value: &serde_yaml::Value, kind: Kind) -> Option<Ident> {
    let meta = value.get("metadata")?;
    let name = meta.get("name")?.as_str()?.to_string();
    let ns = match kind {
        Kind::Node => String::new(),
        _ => meta.get("namespace").and_then(|n| n.as_str()).unwrap_or("default").to_string(),
    };
    Some((kind, ObjectKey::new(ns, name)))
}

fn decode(value: serde_yaml::Value, kind: Kind) -> Result<Object, serde_yaml::Error> {
    Ok(match kind {
        Kind::Service => Object::Service(Box::new(Service::deserialize(value)?)),
        Kind::EndpointSlice => Object::EndpointSlice(Box::new(EndpointSlice::deserialize(value)?)),
        Kind::Node => Object::Node(Box::new(Node::deserialize(value)?)),
    })
}

fn collect(file: &Path, doc: usize, value: serde_yaml::Value, out: &mut Parsed) {
    if value.is_null() {
        return; // an empty document, e.g. a trailing `---`
    }
    let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or_default().to_string();
    let api_version = value.get("apiVersion").and_then(|k| k.as_str()).unwrap_or_default().to_string();
    if kind == "List" || kind.ends_with("List") {
        match value.get("items").and_then(|i| i.as_sequence()) {
            Some(items) => {
                for item in items.clone() {
                    collect(file, doc, item, out);
                }
            }
            None => out.problems.push(Problem {
                file: file.into(),
                document: Some(doc),
                object: None,
                message: format!("{kind} without an items list"),
            }),
        }
        return;
    }
    let Some(k) = kind_of(&kind, &api_version) else {
        // Deployments, ConfigMaps and the like live in the same directories; they are not ours.
        tracing::debug!(file = %file.display(), kind, api_version, "skipping object of a kind the proxy does not use");
        return;
    };
    let ident = ident_of(&value, k);
    match decode(value, k) {
        Ok(obj) => match ident {
            Some(id) => out.objects.push((id, obj)),
            // Without a name the store reports it; give it an identity nobody else has.
            None => out.objects.push(((k, ObjectKey::new("", format!("#{}:{doc}", file.display()))), obj)),
        },
        Err(e) => {
            out.problems.push(Problem {
                file: file.into(),
                document: Some(doc),
                object: ident.as_ref().map(|(k, key)| format!("{} {key}", k.as_str())),
                message: format!("cannot be decoded: {e}"),
            });
            if let Some(id) = ident {
                out.broken.push(id);
            }
        }
    }
}

/// Parses one file. `Err` is a problem with the file as a whole (it is not YAML at all).
fn parse_file(file: &Path, text: &str) -> Result<Parsed, Problem> {
    let mut out = Parsed::default();
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(de).map_err(|e| Problem {
            file: file.into(),
            document: Some(i + 1),
            object: None,
            message: format!("is not valid YAML/JSON: {e}"),
        })?;
        collect(file, i + 1, value, &mut out);
    }
    Ok(out)
}

#[derive(Clone, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
}

struct FileState {
    stamp: Stamp,
    objects: BTreeMap<Ident, Object>,
}

/// The directory and what each file held at its last good parse.
pub struct ManifestDir {
    dir: PathBuf,
    files: HashMap<PathBuf, FileState>,
}

fn is_manifest(path: &Path) -> bool {
    matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json"))
}

/// Files below `dir`, skipping hidden entries (editor swap files, ConfigMap `..data` links).
/// An entry that cannot be read (a dangling symlink, a temporary file deleted meanwhile) is
/// reported and skipped; `complete` turns false, so the caller keeps what it knew instead of
/// deleting the objects of files it could not see.
fn list_files(dir: &Path, out: &mut Vec<PathBuf>, problems: &mut Vec<Problem>, complete: &mut bool) {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            problems.push(Problem { file: dir.into(), document: None, object: None, message: format!("cannot be read: {e}") });
            *complete = false;
            return;
        }
    };
    for entry in entries {
        let Ok(entry) = entry else {
            *complete = false;
            continue;
        };
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Follows symlinks: ConfigMap volumes are links into a hidden directory.
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_dir() => list_files(&path, out, problems, complete),
            Ok(meta) => {
                if meta.is_file() && is_manifest(&path) {
                    out.push(path);
                }
            }
            Err(e) => {
                if is_manifest(&path) {
                    problems.push(Problem { file: path, document: None, object: None, message: format!("cannot be read: {e}") });
                    *complete = false;
                }
            }
        }
    }
}

impl ManifestDir {
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self, String> {
        let dir = dir.into();
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => Ok(Self { dir, files: HashMap::new() }),
            Ok(_) => Err(format!("--manifests {}: not a directory", dir.display())),
            Err(e) => Err(format!("--manifests {}: {e}", dir.display())),
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Reads what changed and returns the full object set per kind, plus the problems found.
    pub fn scan(&mut self) -> (Vec<Event>, Vec<Problem>) {
        let mut problems = Vec::new();
        let mut paths = Vec::new();
        let mut complete = true;
        list_files(&self.dir, &mut paths, &mut problems, &mut complete);
        // Only a complete listing says a file is gone; otherwise keep what it held.
        if complete {
            let present: std::collections::HashSet<&PathBuf> = paths.iter().collect();
            self.files.retain(|p, _| present.contains(p));
        }
        for path in &paths {
            let meta = std::fs::metadata(path);
            let stamp = Stamp {
                modified: meta.as_ref().ok().and_then(|m| m.modified().ok()),
                len: meta.as_ref().map(|m| m.len()).unwrap_or(0),
            };
            if self.files.get(path).is_some_and(|f| f.stamp == stamp) {
                continue;
            }
            let text = match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) => {
                    problems.push(Problem { file: path.clone(), document: None, object: None, message: format!("cannot be read: {e}") });
                    continue;
                }
            };
            let previous = self.files.remove(path).map(|f| f.objects).unwrap_or_default();
            let objects = match parse_file(path, &text) {
                Ok(parsed) => {
                    let mut objects: BTreeMap<Ident, Object> = parsed.objects.into_iter().collect();
                    for id in parsed.broken {
                        if let Some(old) = previous.get(&id) {
                            objects.entry(id).or_insert_with(|| old.clone());
                        }
                    }
                    problems.extend(parsed.problems);
                    objects
                }
                Err(p) => {
                    let kept = if previous.is_empty() { "" } else { "; keeping what it held before" };
                    problems.push(Problem { message: format!("{}{kept}", p.message), ..p });
                    previous
                }
            };
            self.files.insert(path.clone(), FileState { stamp, objects });
        }
        (self.events(), problems)
    }

    fn events(&self) -> Vec<Event> {
        let mut by_kind: BTreeMap<Kind, BTreeMap<Ident, Object>> = BTreeMap::new();
        for kind in [Kind::Service, Kind::EndpointSlice, Kind::Node] {
            by_kind.insert(kind, BTreeMap::new());
        }
        // Files in name order; a later file's copy of an object wins, as `kubectl apply -f dir`.
        let mut paths: Vec<&PathBuf> = self.files.keys().collect();
        paths.sort();
        for p in paths {
            for (id, obj) in &self.files[p].objects {
                by_kind.entry(id.0).or_default().insert(id.clone(), obj.clone());
            }
        }
        by_kind
            .into_iter()
            .map(|(kind, objs)| Event::Replace { kind, objects: objs.into_values().collect() })
            .collect()
    }
}

/// Scans `dir` now, then on every change below it (and every `resync` as a safety net for
/// filesystems without inotify), sending the resulting events into `tx`.
pub fn spawn(mut dir: ManifestDir, tx: mpsc::Sender<Event>, resync: Duration) -> notify::Result<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let (wake_tx, mut wake_rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok() {
            let _ = wake_tx.send(());
        }
    })?;
    watcher.watch(dir.path(), notify::RecursiveMode::Recursive)?;
    tokio::spawn(async move {
        loop {
            let (events, problems) = dir.scan();
            for p in problems {
                tracing::warn!("manifest {p}");
            }
            for ev in events {
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                woke = wake_rx.recv() => {
                    if woke.is_none() {
                        return;
                    }
                    // Editors write a file in several steps; let them finish.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    while wake_rx.try_recv().is_ok() {}
                }
                _ = tokio::time::sleep(resync) => {}
            }
        }
    });
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
        // Make the stamp change even within one mtime tick.
        let f = std::fs::OpenOptions::new().append(true).open(dir.join(name)).unwrap();
        f.set_modified(SystemTime::now() + Duration::from_secs(rand_secs())).unwrap();
    }

    fn rand_secs() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(1);
        N.fetch_add(1, Ordering::Relaxed)
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("proxy-manifests-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn names(events: &[Event], kind: Kind) -> Vec<String> {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Replace { kind: k, objects } if *k == kind => Some(objects),
                _ => None,
            })
            .flatten()
            .map(|o| match o {
                Object::Service(s) => s.metadata.name.clone().unwrap_or_default(),
                Object::EndpointSlice(s) => s.metadata.name.clone().unwrap_or_default(),
                Object::Node(n) => n.metadata.name.clone().unwrap_or_default(),
            })
            .collect()
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n";

    #[test]
    fn reads_multi_document_files_lists_and_json() {
        let d = tempdir("multi");
        write(&d, "a.yaml", &format!("{SVC}---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: ignored}}\n"));
        write(&d, "b.yaml", "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: db}\n  spec: {clusterIP: 10.96.0.11, ports: [{port: 5432}]}\n");
        write(&d, "c.json", r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"cache"},"spec":{"clusterIP":"10.96.0.12","ports":[{"port":6379}]}}"#);
        write(&d, "notes.txt", "not a manifest");
        let mut m = ManifestDir::new(&d).unwrap();
        let (events, problems) = m.scan();
        assert!(problems.is_empty(), "{problems:?}");
        let mut svcs = names(&events, Kind::Service);
        svcs.sort();
        assert_eq!(svcs, ["cache", "db", "web"]);
        assert_eq!(names(&events, Kind::EndpointSlice), ["web-1"]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_broken_file_keeps_its_previous_objects_and_is_reported() {
        let d = tempdir("broken");
        write(&d, "a.yaml", SVC);
        let mut m = ManifestDir::new(&d).unwrap();
        assert_eq!(names(&m.scan().0, Kind::Service), ["web"]);
        write(&d, "a.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: web\n  spec: [");
        let (events, problems) = m.scan();
        assert_eq!(names(&events, Kind::Service), ["web"], "the last good version stays");
        assert_eq!(problems.len(), 1);
        let text = problems[0].to_string();
        assert!(text.contains("a.yaml") && text.contains("not valid YAML") && text.contains("keeping what it held before"), "{text}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_undecodable_object_keeps_its_previous_version_and_others_still_change() {
        let d = tempdir("undecodable");
        write(&d, "a.yaml", &format!("{SVC}---\napiVersion: v1\nkind: Service\nmetadata: {{name: db}}\nspec: {{clusterIP: 10.96.0.11, ports: [{{port: 5432}}]}}\n"));
        let mut m = ManifestDir::new(&d).unwrap();
        m.scan();
        // web gets a port that is not a number; db is deleted from the file.
        write(&d, "a.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: eighty}]}\n");
        let (events, problems) = m.scan();
        assert_eq!(names(&events, Kind::Service), ["web"], "web kept, db removed");
        assert_eq!(problems.len(), 1);
        let text = problems[0].to_string();
        assert!(text.contains("document 1") && text.contains("Service default/web") && text.contains("cannot be decoded"), "{text}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn deleting_a_file_deletes_its_objects() {
        let d = tempdir("delete");
        write(&d, "a.yaml", SVC);
        let mut m = ManifestDir::new(&d).unwrap();
        m.scan();
        std::fs::remove_file(d.join("a.yaml")).unwrap();
        assert!(names(&m.scan().0, Kind::Service).is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_unreadable_entry_is_reported_and_deletes_nothing() {
        let d = tempdir("unreadable");
        write(&d, "a.yaml", SVC);
        let mut m = ManifestDir::new(&d).unwrap();
        m.scan();
        std::os::unix::fs::symlink("/nonexistent/target.yaml", d.join("b.yaml")).unwrap();
        let (events, problems) = m.scan();
        assert_eq!(names(&events, Kind::Service), ["web"], "web stays programmed");
        assert!(problems.iter().any(|p| p.file.ends_with("b.yaml")), "{problems:?}");
        std::fs::remove_file(d.join("b.yaml")).unwrap();
        std::fs::remove_file(d.join("a.yaml")).unwrap();
        assert!(names(&m.scan().0, Kind::Service).is_empty(), "a complete listing still deletes");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_missing_directory_is_a_clear_error() {
        let err = ManifestDir::new("/nonexistent/manifests").err().unwrap();
        assert!(err.contains("--manifests /nonexistent/manifests"), "{err}");
    }
}
