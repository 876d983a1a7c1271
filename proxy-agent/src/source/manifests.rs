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
        ("ServiceCIDR", "networking.k8s.io/v1" | "networking.k8s.io/v1beta1") => Some(Kind::ServiceCidr),
        _ => None,
    }
}

fn ident_of(value: &serde_yaml::Value, kind: Kind) -> Option<Ident> {
    let meta = value.get("metadata")?;
    let name = meta.get("name")?.as_str().filter(|n| !n.is_empty())?.to_string();
    let ns = match kind {
        Kind::Node | Kind::ServiceCidr => String::new(),
        _ => meta.get("namespace").and_then(|n| n.as_str()).unwrap_or("default").to_string(),
    };
    Some((kind, ObjectKey::new(ns, name)))
}

fn decode(value: serde_yaml::Value, kind: Kind) -> Result<Object, serde_yaml::Error> {
    Ok(match kind {
        Kind::Service => Object::Service(Box::new(Service::deserialize(value)?)),
        Kind::EndpointSlice => Object::EndpointSlice(Box::new(EndpointSlice::deserialize(value)?)),
        Kind::Node => Object::Node(Box::new(Node::deserialize(value)?)),
        Kind::ServiceCidr => Object::ServiceCidr(Box::new(k8s_openapi::api::networking::v1::ServiceCIDR::deserialize(value)?)),
    })
}

/// What a YAML error means for the user: the syntax, or a number no field can hold (valid YAML,
/// but beyond 64 bits).
fn yaml_problem(e: &serde_yaml::Error) -> String {
    let text = e.to_string();
    if text.contains("invalid type: integer") {
        let at = e.location().map(|l| format!(" at line {} column {}", l.line(), l.column())).unwrap_or_default();
        let field = text.split(": invalid type").next().filter(|f| !f.starts_with("invalid")).map(|f| format!("{f}: ")).unwrap_or_default();
        format!("{field}a number out of range (no Kubernetes field holds more than 64 bits){at}")
    } else {
        format!("is not valid YAML/JSON: {text}")
    }
}

fn collect(file: &Path, doc: usize, value: serde_yaml::Value, out: &mut Parsed) {
    if value.is_null() {
        return; // an empty document, e.g. a trailing `---`
    }
    let problem =
        |out: &mut Parsed, message: String| out.problems.push(Problem { file: file.into(), document: Some(doc), object: None, message });
    if !value.is_mapping() {
        let what = match value {
            serde_yaml::Value::Sequence(_) => "a list",
            serde_yaml::Value::Tagged(_) => "a tagged value",
            _ => "a scalar",
        };
        return problem(out, format!("is {what}, not a Kubernetes object (a mapping with apiVersion and kind)"));
    }
    let Some(kind) = value.get("kind").and_then(|k| k.as_str()).map(str::to_string) else {
        return problem(out, "has no kind: not a Kubernetes object".into());
    };
    let api_version = value.get("apiVersion").and_then(|k| k.as_str()).unwrap_or_default().to_string();
    if kind == "List" || kind.ends_with("List") {
        match value.get("items").and_then(|i| i.as_sequence()) {
            Some(items) => {
                for (i, item) in items.iter().enumerate() {
                    if item.is_null() || !item.is_mapping() {
                        problem(out, format!("{kind} items[{i}] is not a Kubernetes object"));
                        continue;
                    }
                    collect(file, doc, item.clone(), out);
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
            // Nothing can refer to an object without a name: say where it is, and skip it.
            None => out.problems.push(Problem {
                file: file.into(),
                document: Some(doc),
                object: Some(format!("a {} without a name", k.as_str())),
                message: "metadata.name is missing; skipped".into(),
            }),
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
            message: yaml_problem(&e),
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
    /// What its last read found wrong (reported while it lasts, see `spawn`).
    problems: Vec<Problem>,
}

/// How far the walk goes: a manifest directory is a ConfigMap or a checkout, not a file system.
pub const MAX_DEPTH: usize = 16;
pub const MAX_FILES: usize = 10_000;
/// The largest manifest read: `kubectl get services,endpointslices -A -o yaml` of 30,000
/// Services is about 90 MB; a larger file is refused, not read.
pub const MAX_FILE_BYTES: u64 = 256 << 20;

/// The directory and what each file held at its last good parse.
pub struct ManifestDir {
    dir: PathBuf,
    files: HashMap<PathBuf, FileState>,
}

fn is_manifest(path: &Path) -> bool {
    matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json"))
}

/// Files below `dir`, skipping hidden entries (editor swap files, ConfigMap `..data` links).
/// Symbolic links to files are followed (a ConfigMap volume's files are links into a hidden
/// directory); links to directories are not, so a link loop cannot make the walk endless; and
/// the walk stops at `MAX_DEPTH` levels and `MAX_FILES` files. An entry that cannot be read (a
/// dangling symlink, a temporary file deleted meanwhile) is reported and skipped; `complete`
/// turns false, so the caller keeps what it knew instead of deleting the objects of files it
/// could not see.
fn list_files(dir: &Path, depth: usize, out: &mut Vec<PathBuf>, problems: &mut Vec<Problem>, complete: &mut bool) {
    let problem = |file: &Path, message: String| Problem { file: file.into(), document: None, object: None, message };
    if depth > MAX_DEPTH {
        problems.push(problem(dir, format!("is more than {MAX_DEPTH} directories deep; not read further")));
        *complete = false;
        return;
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            problems.push(problem(dir, format!("cannot be read: {e}")));
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
        if out.len() >= MAX_FILES {
            problems.push(problem(dir, format!("holds more than {MAX_FILES} files below it; the rest are not read")));
            *complete = false;
            return;
        }
        let path = entry.path();
        let link = entry.file_type().is_ok_and(|t| t.is_symlink());
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_dir() && link => {
                problems.push(problem(&path, "is a link to a directory; links to directories are not followed".into()));
            }
            Ok(meta) if meta.is_dir() => list_files(&path, depth + 1, out, problems, complete),
            Ok(meta) => {
                if is_manifest(&path) {
                    if meta.is_file() {
                        out.push(path);
                    } else {
                        // A pipe or a device (or a link to one) would block or never end.
                        problems.push(problem(&path, "is not a regular file; not read".into()));
                    }
                }
            }
            Err(e) => {
                if is_manifest(&path) {
                    problems.push(problem(&path, format!("cannot be read: {e}")));
                    *complete = false;
                }
            }
        }
    }
}

/// A file's text, refused past `MAX_FILE_BYTES` (before reading) and when it is not UTF-8 (with
/// where).
fn read_text(path: &Path, len: u64) -> Result<String, String> {
    use std::{io::Read as _, os::unix::fs::OpenOptionsExt as _};
    let too_large = |len: u64| format!("is {len} bytes; manifests larger than {} MiB are not read", MAX_FILE_BYTES >> 20);
    if len > MAX_FILE_BYTES {
        return Err(too_large(len));
    }
    // What was listed as a regular file may have been replaced since: never block on a pipe,
    // and never read past the limit of a file that grew.
    let file =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(|e| format!("cannot be read: {e}"))?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Err("is not a regular file; not read".into());
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot be read: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("grew past {} MiB while it was read; not read", MAX_FILE_BYTES >> 20));
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let text = &e.as_bytes()[..at];
        let line = text.iter().filter(|b| **b == b'\n').count() + 1;
        let column = at - text.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1) + 1;
        format!("is not UTF-8 text: invalid byte at line {line}, column {column} (offset {at})")
    })
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
        list_files(&self.dir, 0, &mut paths, &mut problems, &mut complete);
        // Only a complete listing says a file is gone; otherwise keep what it held.
        if complete {
            let present: std::collections::HashSet<&PathBuf> = paths.iter().collect();
            self.files.retain(|p, _| present.contains(p));
        }
        for path in &paths {
            let meta = std::fs::metadata(path);
            let stamp =
                Stamp { modified: meta.as_ref().ok().and_then(|m| m.modified().ok()), len: meta.as_ref().map(|m| m.len()).unwrap_or(0) };
            if self.files.get(path).is_some_and(|f| f.stamp == stamp) {
                continue;
            }
            let previous = self.files.remove(path).map(|f| f.objects).unwrap_or_default();
            let kept = if previous.is_empty() { "" } else { "; keeping what it held before" };
            let mut file_problems = Vec::new();
            let objects = match read_text(path, stamp.len)
                .map_err(|message| Problem { file: path.clone(), document: None, object: None, message })
                .and_then(|text| parse_file(path, &text))
            {
                Ok(parsed) => {
                    let mut objects: BTreeMap<Ident, Object> = parsed.objects.into_iter().collect();
                    for id in parsed.broken {
                        if let Some(old) = previous.get(&id) {
                            objects.entry(id).or_insert_with(|| old.clone());
                        }
                    }
                    file_problems.extend(parsed.problems);
                    objects
                }
                Err(p) => {
                    file_problems.push(Problem { message: format!("{}{kept}", p.message), ..p });
                    previous
                }
            };
            self.files.insert(path.clone(), FileState { stamp, objects, problems: file_problems });
        }
        // Every file's standing problems, not only those of the files read now.
        let mut files: Vec<(&PathBuf, &FileState)> = self.files.iter().collect();
        files.sort_by_key(|(p, _)| *p);
        problems.extend(files.into_iter().flat_map(|(_, f)| f.problems.iter().cloned()));
        let events = self.events(&mut problems);
        (events, problems)
    }

    /// The object set per kind. An object defined in more than one file is a problem of the
    /// files whose copy is not used.
    fn events(&self, problems: &mut Vec<Problem>) -> Vec<Event> {
        let mut by_kind: BTreeMap<Kind, BTreeMap<Ident, Object>> = BTreeMap::new();
        for kind in [Kind::Service, Kind::EndpointSlice, Kind::Node, Kind::ServiceCidr] {
            by_kind.insert(kind, BTreeMap::new());
        }
        // Files in name order; a later file's copy of an object wins, as `kubectl apply -f dir`.
        let mut paths: Vec<&PathBuf> = self.files.keys().collect();
        paths.sort();
        let mut defined_in: HashMap<&Ident, &PathBuf> = HashMap::new();
        for p in paths {
            for (id, obj) in &self.files[p].objects {
                if let Some(earlier) = defined_in.insert(id, p) {
                    problems.push(Problem {
                        file: earlier.clone(),
                        document: None,
                        object: Some(format!("{} {}", id.0.as_str(), id.1)),
                        message: format!("is defined again in {}, whose copy is used", p.display()),
                    });
                }
                by_kind.entry(id.0).or_default().insert(id.clone(), obj.clone());
            }
        }
        by_kind.into_iter().map(|(kind, objs)| Event::Replace { kind, objects: objs.into_values().collect() }).collect()
    }
}

/// Scans `dir` now, then on every change below it (and every `resync` as a safety net for
/// filesystems without inotify), sending the resulting events into `tx`.
pub fn spawn(mut dir: ManifestDir, tx: mpsc::Sender<Event>, resync: Duration) -> notify::Result<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let (wake_tx, mut wake_rx) = mpsc::unbounded_channel::<()>();
    // Links are not followed by the watch either: a link loop would make it endless.
    let mut watcher = notify::RecommendedWatcher::new(
        move |res: notify::Result<notify::Event>| {
            // Opening and reading (our own scans' included) change nothing: waking on them
            // would make every scan start the next. A file closed after writing did change.
            use notify::event::{AccessKind, AccessMode, EventKind};
            if res.is_ok_and(|e| !matches!(e.kind, EventKind::Access(a) if a != AccessKind::Close(AccessMode::Write))) {
                let _ = wake_tx.send(());
            }
        },
        notify::Config::default().with_follow_symlinks(false),
    )?;
    watcher.watch(dir.path(), notify::RecursiveMode::Recursive)?;
    tokio::spawn(async move {
        // Each problem is said once when it appears and once when it clears, however often
        // the directory is scanned.
        let mut reported: std::collections::BTreeSet<String> = Default::default();
        loop {
            // A scan reads and parses files: off the runtime's worker threads, which serve
            // /healthz and the metrics meanwhile. A scan that panics (a bug) sends nothing, so
            // the objects read before stay, and the next change scans again.
            let scanned = tokio::task::spawn_blocking(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dir.scan()));
                (dir, result)
            })
            .await;
            let result;
            (dir, result) = match scanned {
                Ok(s) => s,
                // The runtime is shutting down.
                Err(_) => return,
            };
            match result {
                Ok((events, problems)) => {
                    let now: std::collections::BTreeSet<String> = problems.iter().map(|p| p.to_string()).collect();
                    for p in now.difference(&reported) {
                        tracing::warn!("manifest {}", crate::model::clip(p, 1024));
                    }
                    for p in reported.difference(&now) {
                        tracing::info!("manifest problem cleared: {}", crate::model::clip(p, 1024));
                    }
                    reported = now;
                    for ev in events {
                        if tx.send(ev).await.is_err() {
                            return;
                        }
                    }
                }
                Err(_) => tracing::error!("the scan of the manifest directory failed; its objects stay as last read"),
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

    /// A directory of the test's own (the guard removes it when it drops, also when the test
    /// fails), and its path.
    fn tempdir(name: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::Builder::new().prefix(&format!("proxy-manifests-{name}-")).tempdir().unwrap();
        let path = d.path().to_path_buf();
        (d, path)
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
                Object::ServiceCidr(c) => c.metadata.name.clone().unwrap_or_default(),
            })
            .collect()
    }

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n";

    #[test]
    fn reads_multi_document_files_lists_and_json() {
        let (_guard, d) = tempdir("multi");
        write(&d, "a.yaml", &format!("{SVC}---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: ignored}}\n"));
        write(&d, "b.yaml", "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: db}\n  spec: {clusterIP: 10.96.0.11, ports: [{port: 5432}]}\n");
        write(
            &d,
            "c.json",
            r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"cache"},"spec":{"clusterIP":"10.96.0.12","ports":[{"port":6379}]}}"#,
        );
        write(&d, "notes.txt", "not a manifest");
        let mut m = ManifestDir::new(&d).unwrap();
        let (events, problems) = m.scan();
        assert!(problems.is_empty(), "{problems:?}");
        let mut svcs = names(&events, Kind::Service);
        svcs.sort();
        assert_eq!(svcs, ["cache", "db", "web"]);
        assert_eq!(names(&events, Kind::EndpointSlice), ["web-1"]);
    }

    #[test]
    fn a_broken_file_keeps_its_previous_objects_and_is_reported() {
        let (_guard, d) = tempdir("broken");
        write(&d, "a.yaml", SVC);
        let mut m = ManifestDir::new(&d).unwrap();
        assert_eq!(names(&m.scan().0, Kind::Service), ["web"]);
        write(&d, "a.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: web\n  spec: [");
        let (events, problems) = m.scan();
        assert_eq!(names(&events, Kind::Service), ["web"], "the last good version stays");
        assert_eq!(problems.len(), 1);
        let text = problems[0].to_string();
        assert!(text.contains("a.yaml") && text.contains("not valid YAML") && text.contains("keeping what it held before"), "{text}");
    }

    #[test]
    fn an_undecodable_object_keeps_its_previous_version_and_others_still_change() {
        let (_guard, d) = tempdir("undecodable");
        write(&d, "a.yaml", &format!("{SVC}---\napiVersion: v1\nkind: Service\nmetadata: {{name: db}}\nspec: {{clusterIP: 10.96.0.11, ports: [{{port: 5432}}]}}\n"));
        let mut m = ManifestDir::new(&d).unwrap();
        m.scan();
        // web gets a port that is not a number; db is deleted from the file.
        write(
            &d,
            "a.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: eighty}]}\n",
        );
        let (events, problems) = m.scan();
        assert_eq!(names(&events, Kind::Service), ["web"], "web kept, db removed");
        assert_eq!(problems.len(), 1);
        let text = problems[0].to_string();
        assert!(text.contains("document 1") && text.contains("Service default/web") && text.contains("cannot be decoded"), "{text}");
    }

    #[test]
    fn deleting_a_file_deletes_its_objects() {
        let (_guard, d) = tempdir("delete");
        write(&d, "a.yaml", SVC);
        let mut m = ManifestDir::new(&d).unwrap();
        m.scan();
        std::fs::remove_file(d.join("a.yaml")).unwrap();
        assert!(names(&m.scan().0, Kind::Service).is_empty());
    }

    #[test]
    fn an_unreadable_entry_is_reported_and_deletes_nothing() {
        let (_guard, d) = tempdir("unreadable");
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
    }

    #[test]
    fn a_missing_directory_is_a_clear_error() {
        let err = ManifestDir::new("/nonexistent/manifests").err().unwrap();
        assert!(err.contains("--manifests /nonexistent/manifests"), "{err}");
    }

    #[test]
    fn link_loops_end_the_walk_and_are_named() {
        let (_guard, d) = tempdir("loops");
        write(&d, "a.yaml", SVC);
        std::fs::create_dir(d.join("sub")).unwrap();
        for (link, to) in [("x", "."), ("y", "."), ("sub/up", "..")] {
            std::os::unix::fs::symlink(to, d.join(link)).unwrap();
        }
        let mut m = ManifestDir::new(&d).unwrap();
        let (events, problems) = m.scan();
        assert_eq!(names(&events, Kind::Service), ["web"]);
        let linked: Vec<String> = problems
            .iter()
            .filter(|p| p.message.contains("links to directories are not followed"))
            .map(|p| p.file.display().to_string())
            .collect();
        assert_eq!(linked.len(), 3, "{problems:?}");
        // A file link is followed, as a ConfigMap volume's are.
        std::fs::create_dir(d.join(".data")).unwrap();
        write(
            &d.join(".data"),
            "db.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: db}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 5432}]}\n",
        );
        std::os::unix::fs::symlink(".data/db.yaml", d.join("db.yaml")).unwrap();
        assert_eq!(names(&m.scan().0, Kind::Service), ["db", "web"]);
    }

    #[test]
    fn a_file_too_large_is_refused_unread_and_problems_stand_while_they_last() {
        let (_guard, d) = tempdir("large");
        write(&d, "a.yaml", SVC);
        let big = std::fs::File::create(d.join("big.yaml")).unwrap();
        // Sparse: the size is what the agent looks at before reading.
        big.set_len(MAX_FILE_BYTES + 1).unwrap();
        let mut m = ManifestDir::new(&d).unwrap();
        let (events, problems) = m.scan();
        assert_eq!(names(&events, Kind::Service), ["web"]);
        let big_problem = problems.iter().find(|p| p.file.ends_with("big.yaml")).expect("the large file is named");
        assert!(big_problem.message.contains("not read"), "{big_problem}");
        // Scanned again, unchanged: the problem is still there (so it is not reported as cleared).
        assert_eq!(m.scan().1, problems);
        std::fs::remove_file(d.join("big.yaml")).unwrap();
        assert!(m.scan().1.is_empty(), "cleared once the file is gone");
    }

    #[test]
    fn a_file_that_is_not_utf8_is_named_with_the_position() {
        let (_guard, d) = tempdir("utf8");
        std::fs::write(d.join("a.yaml"), b"apiVersion: v1\nkind: Service\nmetadata: {name: w\xffb}\n").unwrap();
        let (_, problems) = ManifestDir::new(&d).unwrap().scan();
        assert_eq!(problems.len(), 1);
        assert!(problems[0].message.contains("line 3, column 19"), "{}", problems[0]);
    }

    #[test]
    fn a_number_too_large_and_a_nameless_object_are_named_with_their_file() {
        let (_guard, d) = tempdir("messages");
        write(
            &d,
            "a.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 99999999999999999999999}]}\n",
        );
        write(&d, "b.yaml", "apiVersion: v1\nkind: Service\nmetadata: {namespace: x}\nspec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}\n");
        let (_, problems) = ManifestDir::new(&d).unwrap().scan();
        let shown: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        assert!(
            shown[0].contains("a.yaml (document 1): spec.ports[0].port: a number out of range") && !shown[0].contains("not valid YAML"),
            "{shown:?}"
        );
        assert!(shown[1].contains("b.yaml (document 1): a Service without a name: metadata.name is missing"), "{shown:?}");
    }

    /// The directory's own scans open it and its files; those events must not start another
    /// scan (they did: the agent rescanned in a loop, about 50 times a second, forever).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_scan_does_not_wake_the_next() {
        let (_guard, dir) = tempdir("no-wake");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        write(&dir, "a.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n");
        write(
            &dir.join("sub"),
            "b.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}\n",
        );
        let (tx, mut rx) = mpsc::channel(1024);
        let _watcher = spawn(ManifestDir::new(&dir).unwrap(), tx, Duration::from_secs(3600)).unwrap();
        let count = |rx: &mut mpsc::Receiver<Event>| std::iter::from_fn(|| rx.try_recv().ok()).count();
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(count(&mut rx), 4, "one scan: one Replace per kind");
        // A change is one more scan.
        write(&dir, "a.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}\n");
        tokio::time::sleep(Duration::from_millis(600)).await;
        let after = count(&mut rx);
        assert!((4..=8).contains(&after), "a write (modify, close) is one or two scans, got {after} events");
    }

    #[test]
    fn documents_that_are_not_objects_and_objects_defined_twice_are_named() {
        let (_guard, dir) = tempdir("not-objects");
        write(&dir, "a.yaml", "just text\n---\n[1, 2]\n---\n{}\n---\napiVersion: v1\nkind: List\nitems: [5]\n---\nnull\n");
        let svc = |ip: &str| {
            format!("apiVersion: v1\nkind: Service\nmetadata: {{name: web}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n")
        };
        write(&dir, "b.yaml", &svc("10.96.0.1"));
        write(&dir, "c.yaml", &svc("10.96.0.2"));
        let (events, problems) = ManifestDir::new(&dir).unwrap().scan();
        let text: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        let has = |s: &str| text.iter().any(|t| t.contains(s));
        assert!(has("a.yaml (document 1): is a scalar, not a Kubernetes object"), "{text:#?}");
        assert!(has("a.yaml (document 2): is a list, not a Kubernetes object"), "{text:#?}");
        assert!(has("a.yaml (document 3): has no kind"), "{text:#?}");
        assert!(has("a.yaml (document 4): List items[0] is not a Kubernetes object"), "{text:#?}");
        assert!(has("b.yaml: Service default/web: is defined again in"), "{text:#?}");
        assert_eq!(text.len(), 5, "an empty document is no problem: {text:#?}");
        // The later file's copy is the one used.
        let Some(Event::Replace { objects, .. }) = events.iter().find(|e| matches!(e, Event::Replace { kind: Kind::Service, .. })) else {
            panic!()
        };
        let Object::Service(s) = &objects[0] else { panic!() };
        assert_eq!(s.spec.as_ref().unwrap().cluster_ip.as_deref(), Some("10.96.0.2"));
    }
}
