//! A corpus of malformed and hostile manifests: what a half-saved edit, a wrong tool, a copy from
//! an old cluster or a hostile user puts into the agent's manifest directory. Generated, so the
//! cases can be read here rather than in 250 files; each has a file name unique to it (with a
//! `corpus-` prefix) and says whether the agent must name it in its log.
//!
//! Objects here never reuse the cluster IPs of the lab's standard Services, except the cases
//! written against the standard Service `web` and its slice `web-1` on purpose: invalid copies
//! and invalid slices for it, which must change nothing about it.

/// One malformed file.
pub struct Case {
    /// File name within the manifest directory (may include a subdirectory).
    pub file: String,
    pub content: Vec<u8>,
    /// What the agent's log must hold for it: the file's name for a file it cannot read, the
    /// object (`Service default/x`) for an object it refuses; None for a file empty of objects.
    pub needle: Option<String>,
}

/// A file the agent must name.
fn case(file: String, content: impl Into<Vec<u8>>, reported: bool) -> Case {
    let needle = reported.then(|| file.rsplit('/').next().unwrap_or(&file).to_string());
    Case { file, content: content.into(), needle }
}

/// A file holding an object the agent must name (as `Kind namespace/name`).
fn object_case(file: String, content: String) -> Case {
    let v: serde_yaml::Value = serde_yaml::from_str(&content).expect("object cases are YAML");
    let kind = v["kind"].as_str().expect("object cases have a kind");
    let name = v["metadata"]["name"].as_str().expect("object cases have a name");
    let ns = v["metadata"]["namespace"].as_str().unwrap_or("default");
    // The log clips names longer than any valid one (253) after 253 characters.
    let name: String = name.chars().take(253).collect();
    Case { file, content: content.into(), needle: Some(format!("{kind} {ns}/{name}")) }
}

/// The same object renamed (`-list` appended) inside a `List`, as `kubectl get -o json` prints
/// it.
fn as_json_list(file: String, content: &str) -> Case {
    let mut v: serde_yaml::Value = serde_yaml::from_str(content).expect("object cases are YAML");
    let name = format!("{}-list", v["metadata"]["name"].as_str().expect("named"));
    v["metadata"]["name"] = serde_yaml::Value::String(name);
    let item: serde_json::Value = serde_yaml::from_value(v).expect("YAML as JSON");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [item]});
    let text = serde_json::to_string_pretty(&list).unwrap();
    let kind = list["items"][0]["kind"].as_str().unwrap().to_string();
    let ns = list["items"][0]["metadata"]["namespace"].as_str().unwrap_or("default").to_string();
    let name = list["items"][0]["metadata"]["name"].as_str().unwrap().to_string();
    Case { file, content: text.into(), needle: Some(format!("{kind} {ns}/{name}")) }
}

fn service(name: &str, ip: &str, spec_extra: &str, ports: &str) -> String {
    format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  clusterIP: {ip}\n{spec_extra}  ports: {ports}\n")
}

fn slice(svc: &str, name: &str, body: &str) -> String {
    format!("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {svc}\n{body}")
}

/// An object case as YAML, and renamed in a JSON `List`.
fn both(out: &mut Vec<Case>, name: String, text: String) {
    out.push(as_json_list(format!("{name}-list.json"), &text));
    out.push(object_case(format!("{name}.yaml"), text));
}

/// The corpus. `node_ip` is the lab node's address (cases that put a Service on it).
pub fn malformed(node_ip: &str) -> Vec<Case> {
    let mut out = Vec::new();
    let mut n = 0;
    let mut name = |what: &str| {
        n += 1;
        format!("corpus-{n:03}-{what}")
    };

    // Files that are not YAML, not text, or not what a reader can finish.
    let syntax: [&str; 16] = [
        "kind: [unclosed",
        "{apiVersion: v1, kind: Service",
        "apiVersion: v1\nkind: Service\nmetadata:\n\tname: tabbed\n",
        "apiVersion: v1\n  kind: Service\n bad: indent\n",
        "\"unterminated string\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nmetadata: {name: b}\n",
        "key: value: another\n",
        "- [a, b\n- c\n",
        "apiVersion: v1\nkind: Service\n---\n{{{{\n",
        "? complex\n: [\n",
        "%YAML 9.9\n---\nkind: Service\n",
        "!!binary notbase64 ===\n",
        "a: *undefined_alias\n",
        "[]\n",
        "{}\n",
        "just a string\n",
    ];
    for (i, text) in syntax.iter().enumerate() {
        out.push(case(format!("{}.yaml", name(&format!("syntax{i}"))), *text, true));
    }
    for (i, text) in [
        r#"{"apiVersion": "v1", "kind": "Service","#,
        r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "j"}, "spec": {"ports": [}}"#,
        "[1, 2,, 3]",
        r#"{"a": "\ud800"}"#,
    ]
    .iter()
    .enumerate()
    {
        out.push(case(format!("{}.json", name(&format!("json{i}"))), *text, true));
    }
    // Not UTF-8: a Latin-1 name, a lone continuation byte, a truncated sequence, a NUL byte
    // (valid UTF-8 that YAML refuses), a UTF-16 file.
    let binary: [&[u8]; 5] = [
        b"apiVersion: v1\nkind: Service\nmetadata: {name: caf\xe9}\n",
        b"\x80\x81\x82",
        b"kind: Service\nmetadata: {name: \xe2\x82}\n",
        b"kind: Service\x00\nmetadata: {name: nul}\n",
        b"\xff\xfek\x00i\x00n\x00d\x00:\x00 \x00S\x00",
    ];
    for (i, bytes) in binary.iter().enumerate() {
        out.push(case(format!("{}.yaml", name(&format!("bytes{i}"))), *bytes, true));
    }
    // Expansion and nesting bombs: aliases that double ten times over, and nesting beyond any
    // parser's recursion limit.
    let mut laughs = String::from("a0: &a0 [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n");
    for i in 1..10 {
        let p = i - 1;
        laughs += &format!("a{i}: &a{i} [*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p}]\n");
    }
    out.push(case(format!("{}.yaml", name("billion-laughs")), laughs.clone(), true));
    out.push(case(format!("{}.yaml", name("laughs-in-a-service")), format!("{laughs}apiVersion: v1\nkind: Service\nmetadata: {{name: laughs}}\nspec: {{clusterIP: 10.96.7.1, ports: [{{port: 80}}], externalIPs: *a9}}\n"), true));
    out.push(case(format!("{}.yaml", name("deep-flow")), format!("{}{}", "[".repeat(20_000), "]".repeat(20_000)), true));
    out.push(case(
        format!("{}.yaml", name("deep-block")),
        (0..2_000).map(|i| format!("{}k{i}:\n", " ".repeat(i))).collect::<String>(),
        true,
    ));
    // One enormous line (4 MiB) inside an otherwise plausible Service.
    out.push(Case {
        file: format!("{}.yaml", name("long-line")),
        content: format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {}}}\nspec: {{clusterIP: 10.96.7.2, ports: [{{port: 80}}]}}\n",
            "x".repeat(4 << 20)
        )
        .into(),
        // Named, clipped: the log quotes the first characters and the length.
        needle: Some(format!("Service default/{}... ({} bytes in all)", "x".repeat(253), 4 << 20)),
    });

    // Empty of objects: not an error, nothing to name.
    for (i, text) in
        ["", "\n\n", "---\n", "---\n---\n", "# only a comment\n", "null\n", "~\n", "&anchor\n", "--- # nothing\n"].iter().enumerate()
    {
        out.push(case(format!("{}.yaml", name(&format!("empty{i}"))), *text, false));
    }

    // Documents that parse but do not decode as the object they claim to be.
    let decode = [
        "apiVersion: v1\nkind: Service\nmetadata: {name: d1}\nspec: {clusterIP: 10.96.7.10, ports: [{port: \"80\"}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d2}\nspec: {clusterIP: 10.96.7.11, ports: {port: 80}}\n",
        "apiVersion: v1\nkind: Service\nmetadata: [d3]\nspec: {clusterIP: 10.96.7.12, ports: [{port: 80}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d4}\nspec: 5\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d5}\nspec: {clusterIP: 12, ports: [{port: 80}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d6}\nspec: {clusterIP: 10.96.7.15, ports: [{port: 80.5}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d7}\nspec: {clusterIP: 10.96.7.16, ports: [{port: 99999999999999999999}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d8}\nspec: {clusterIP: 10.96.7.17, ports: [{port: true}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d9, labels: [a]}\nspec: {clusterIP: 10.96.7.18, ports: [{port: 80}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d10}\nspec: {clusterIP: 10.96.7.19, ports: [{port: 80}], sessionAffinityConfig: {clientIP: {timeoutSeconds: abc}}}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d11}\nspec: {clusterIP: 10.96.7.20, ports: [80]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d12}\nspec: {clusterIP: 10.96.7.21, externalIPs: 192.0.2.1, ports: [{port: 80}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: d13}\nspec: {clusterIP: 10.96.7.22, ports: [{port: 80}]}\nstatus: {loadBalancer: {ingress: 5}}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: 42}\nspec: {clusterIP: 10.96.7.23, ports: [{port: 80}]}\n",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: d15}\naddressType: IPv4\nendpoints: {addresses: [10.0.0.1]}\n",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: d16}\naddressType: IPv4\nendpoints: [{addresses: 10.0.0.1}]\n",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: d17}\naddressType: 4\nendpoints: []\n",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: d19}\naddressType: IPv4\nports: [{port: -1.5}]\n",
        "apiVersion: v1\nkind: Node\nmetadata: {name: lab-node}\nstatus: {addresses: 5}\n",
        "apiVersion: v1\nkind: List\nitems: 5\n",
        "apiVersion: v1\nkind: List\nitems: [5, \"x\", [1]]\n",
        "apiVersion: v1\nkind: List\nitems: [{apiVersion: v1, kind: Service, metadata: {name: d23}, spec: {ports: 7}}]\n",
        "apiVersion: v1\nkind: Service\nspec: {clusterIP: 10.96.7.30, ports: [{port: 80}]}\n",
        "apiVersion: v1\nkind: Service\nmetadata: {name: ''}\nspec: {clusterIP: 10.96.7.31, ports: [{port: 80}]}\n",
    ];
    for (i, text) in decode.iter().enumerate() {
        out.push(case(format!("{}.yaml", name(&format!("decode{i}"))), *text, true));
    }
    // Decodes, but the API server would refuse it: named as the object.
    out.push(object_case(
        format!("{}.yaml", name("no-address-type")),
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: d18}\nendpoints: []\n".into(),
    ));

    // Services the API server would refuse. Each is wrong in one way and otherwise valid.
    let mut ip = 0u32;
    let mut next_ip = || {
        ip += 1;
        format!("10.96.8.{ip}")
    };
    let port80 = "[{port: 80}]";
    let bad_cluster_ips = [
        "0.0.0.0",
        "127.0.0.1",
        "127.0.0.53",
        "224.0.0.1",
        "239.255.255.250",
        "255.255.255.255",
        "169.254.169.254",
        "10.96.0.300",
        "abc",
        "1.2.3",
        "10.96.0.1/32",
        "0x0a.0.0.1",
        "1.2.3.4.5",
        node_ip,
    ];
    for (i, bad) in bad_cluster_ips.iter().enumerate() {
        both(&mut out, name(&format!("cluster-ip{i}")), service(&format!("bad-ip-{i}"), bad, "", port80));
    }
    for (i, p) in ["0", "-1", "65536", "70000", "2147483648"].iter().enumerate() {
        both(&mut out, name(&format!("port{i}")), service(&format!("bad-port-{i}"), &next_ip(), "", &format!("[{{port: {p}}}]")));
    }
    for (i, p) in ["0", "-1", "65536", "100000"].iter().enumerate() {
        both(
            &mut out,
            name(&format!("target-port{i}")),
            service(&format!("bad-target-{i}"), &next_ip(), "", &format!("[{{port: 80, targetPort: {p}}}]")),
        );
    }
    for (i, p) in ["ICMP", "tcp", "\"\"", "SCTPX", "GRE"].iter().enumerate() {
        both(
            &mut out,
            name(&format!("protocol{i}")),
            service(&format!("bad-proto-{i}"), &next_ip(), "", &format!("[{{port: 80, protocol: {p}}}]")),
        );
    }
    // NodePorts outside the default range land on the node's SSH, kubelet or health port.
    for (i, np) in ["22", "10250", "10256", "80", "29999", "32768", "65535", "65536", "-30000"].iter().enumerate() {
        both(
            &mut out,
            name(&format!("node-port{i}")),
            service(&format!("bad-np-{i}"), &next_ip(), "  type: NodePort\n", &format!("[{{port: 80, nodePort: {np}}}]")),
        );
    }
    for (i, hc) in ["22", "10256", "70000"].iter().enumerate() {
        both(
            &mut out,
            name(&format!("health-port{i}")),
            service(
                &format!("bad-hc-{i}"),
                &next_ip(),
                &format!("  type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: {hc}\n"),
                &format!("[{{port: 80, nodePort: {}}}]", 30990 + i),
            ),
        );
    }
    let port_sets = [
        "[{name: a, port: 80}, {name: a, port: 81}]",
        "[{name: a, port: 80}, {port: 81}]",
        "[{name: Upper, port: 80}]",
        "[{name: under_score, port: 80}]",
        "[{name: -lead, port: 80}]",
        "[{name: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa, port: 80}]",
        "[{name: a, port: 80}, {name: b, port: 80}]",
        "[]",
    ];
    for (i, ports) in port_sets.iter().enumerate() {
        both(&mut out, name(&format!("ports{i}")), service(&format!("bad-ports-{i}"), &next_ip(), "", ports));
    }
    let names =
        ["Upper", "under_score", "-lead", "trail-", "dots.in.name", &"n".repeat(64), "1starts-with-digit", "spa ce", "uni\u{e7}ode"];
    for (i, bad) in names.iter().enumerate() {
        // YAML only: a suffix could make a name valid.
        out.push(object_case(format!("{}.yaml", name(&format!("name{i}"))), service(&format!("\"{bad}\""), &next_ip(), "", port80)));
    }
    for (i, ns) in ["Default", "kube_system", &"n".repeat(64), "a.b", "-x"].iter().enumerate() {
        let text = format!("apiVersion: v1\nkind: Service\nmetadata: {{name: bad-ns-{i}, namespace: \"{ns}\"}}\nspec: {{clusterIP: {}, ports: [{{port: 80}}]}}\n", next_ip());
        both(&mut out, name(&format!("namespace{i}")), text);
    }
    let specs = [
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}\n",
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: -5}}\n",
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 86401}}\n",
        "  sessionAffinity: Sometimes\n",
        "  type: NodePort\n  externalTrafficPolicy: Sometimes\n",
        "  internalTrafficPolicy: Nowhere\n",
        "  type: Bogus\n",
        "  externalIPs: [192.0.2.300]\n",
        "  externalIPs: [127.0.0.1]\n",
        "  externalIPs: [0.0.0.0]\n",
        "  externalIPs: [224.0.0.251]\n",
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [10.0.0.0/33]\n",
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [not-a-cidr]\n",
        "  type: LoadBalancer\n  loadBalancerSourceRanges: [10.0.0.1]\n",
        "  clusterIPs: [10.96.9.1]\n",
        "  ipFamilies: [IPv5]\n",
        "  ipFamilyPolicy: Sometimes\n",
        "  type: ExternalName\n",
    ];
    for (i, extra) in specs.iter().enumerate() {
        let ports = if extra.contains("NodePort") || extra.contains("LoadBalancer") {
            format!("[{{port: 80, nodePort: {}}}]", 31000 + i)
        } else {
            port80.to_string()
        };
        both(&mut out, name(&format!("spec{i}")), service(&format!("bad-spec-{i}"), &next_ip(), extra, &ports));
    }

    // Hostile slices for the standard Service `web`: each must add nothing to it.
    let web_slices = [
        "addressType: IPv4\nports: [{name: http, port: 8080, protocol: TCP}, {name: http, port: 9999, protocol: TCP}]\nendpoints: [{addresses: [10.99.99.1]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [127.0.0.1]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [224.0.0.251]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [0.0.0.0]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [169.254.169.254]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [255.255.255.255]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.99.99.300]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.99.99.2, nonsense]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: []}]\n",
        "addressType: IPv4\nports: [{name: http, port: 0}]\nendpoints: [{addresses: [10.99.99.3]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 65536}]\nendpoints: [{addresses: [10.99.99.4]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080, protocol: ICMP}]\nendpoints: [{addresses: [10.99.99.5]}]\n",
        "addressType: IPv4\nports: [{name: HTTP_, port: 8080}]\nendpoints: [{addresses: [10.99.99.6]}]\n",
        "addressType: IPv5\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.99.99.7]}]\n",
        "addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [\"fd00::1\"]}]\n",
    ];
    for (i, body) in web_slices.iter().enumerate() {
        out.push(object_case(format!("{}.yaml", name(&format!("web-slice{i}"))), slice("web", &format!("web-bad-{i}"), body)));
    }
    // Invalid later copies of `web` and of its slice `web-1` (a later file's copy wins, as with
    // `kubectl apply -f dir`): the last good version must stay.
    out.push(object_case(
        format!("{}.yaml", name("web-copy")),
        service("web", "10.96.0.300", "", "[{name: http, port: 80, targetPort: 8080}]"),
    ));
    out.push(object_case(
        format!("{}.yaml", name("web-1-copy")),
        slice(
            "web",
            "web-1",
            "addressType: IPv4\nports: [{name: http, port: 8080}, {name: http, port: 8081}]\nendpoints: [{addresses: [10.99.99.9]}]\n",
        ),
    ));
    // Invalid slices by name and labels.
    for (i, nm) in ["Web-Bad", "web_bad", &"w".repeat(254)].iter().enumerate() {
        out.push(object_case(
            format!("{}.yaml", name(&format!("slice-name{i}"))),
            slice("web", &format!("\"{nm}\""), "addressType: IPv4\nendpoints: []\n"),
        ));
    }

    // Several documents in one file, one of them broken: the file is reported, nothing of it
    // is taken.
    out.push(case(
        format!("{}.yaml", name("multi-doc")),
        format!(
            "{}---\nkind: [broken\n---\n{}",
            service("multi-a", "10.96.7.40", "", port80),
            service("multi-b", "10.96.7.41", "", port80)
        ),
        true,
    ));

    // Nested directories, deeper than the walk goes.
    let deep: String = (0..20).map(|i| format!("d{i}/")).collect();
    out.push(Case {
        file: format!("corpus-deep/{deep}{}.yaml", name("too-deep")),
        content: service("deep", "10.96.7.50", "", port80).into(),
        needle: Some("is more than 16 directories deep".into()),
    });
    out
}
