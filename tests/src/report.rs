//! The report `cargo xtask bench` ends with: whatever benchmarks have written their JSON to the
//! output directory (`target/bench/`) gathered in one page, `report.html`, as tables, with two
//! plots drawn by `plotters` as SVG: new-connection latency against the number of Services, per
//! mode (`connect.svg`, from `connect.json`), and the packet rate each mode forwards against
//! the lab's floor (`north.svg`, from `north.json`). The page names the machine's CPU and
//! kernel: the figures are only comparable within one machine, and best within one run.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
};

use plotters::prelude::*;
use serde_json::Value;

/// The benchmarks in the order the page shows them, with what each measures.
const SECTIONS: [(&str, &str); 6] = [
    ("connect", "New-connection latency (microseconds p50 / p99 / p999) at 1,000, 10,000 and 30,000 Services x 4 endpoints"),
    ("north", "NodePort forwarding from a client through node A to a backend on node B: 64-byte UDP packets a second, new TCP connections a second"),
    ("datapath", "Nanoseconds a packet through the eBPF programs (BPF_PROG_TEST_RUN), by number of Services"),
    ("control", "One EndpointSlice change in the API server -> the maps"),
    ("footprint", "The agent at 30,000 Services x 4 endpoints: memory, CPU under changes, restart"),
    ("modes", "Time to program Services (x 4 endpoints unless said), and one endpoint change, in every mode"),
];

/// One colour per mode, the same in every plot.
fn colour(mode: &str) -> RGBColor {
    match mode {
        "floor" | "Floor" => RGBColor(0, 0, 0),
        "ebpf" | "Xdp" => RGBColor(31, 119, 180),
        "Tc" => RGBColor(23, 190, 207),
        "nftables" | "Nftables" => RGBColor(44, 160, 44),
        "iptables-legacy" | "Iptables" => RGBColor(214, 39, 40),
        "iptables-nft" | "IptablesNft" => RGBColor(255, 127, 14),
        _ => RGBColor(127, 127, 127),
    }
}

/// How the page names a north-south mode (as `northbench::Mode` is written in the JSON).
fn north_label(mode: &str) -> &str {
    match mode {
        "Xdp" => "eBPF, XDP",
        "Tc" => "eBPF, TC only",
        "Iptables" => "iptables (legacy)",
        "IptablesNft" => "iptables-nft",
        "Nftables" => "nftables",
        other => other,
    }
}

fn read(dir: &Path, name: &str) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).ok()?).ok()
}

fn num(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The running kernel's release (`uname -r`).
pub fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// The CPUs this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
}

/// The machine the figures come from: CPU model, cores, kernel.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cpu}, {} cores, Linux {}", cores(), kernel())
}

/// A moment as YYYY-MM-DD HH:MM UTC (as the agent's health endpoint formats its times: jiff).
fn date(t: std::time::SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t).map(|t| t.strftime("%Y-%m-%d %H:%M UTC").to_string()).unwrap_or_else(|_| "?".into())
}

/// When the benchmark's JSON was written.
fn written(dir: &Path, name: &str) -> String {
    std::fs::metadata(dir.join(format!("{name}.json"))).and_then(|m| m.modified()).map(date).unwrap_or_else(|_| "?".into())
}

/// An HTML table of `rows` under `head`.
fn table(head: &[&str], rows: &[Vec<String>]) -> String {
    let mut t = String::from("<table>\n<tr>");
    for h in head {
        let _ = write!(t, "<th>{}</th>", esc(h));
    }
    t.push_str("</tr>\n");
    for r in rows {
        t.push_str("<tr>");
        for c in r {
            let _ = write!(t, "<td>{}</td>", esc(c));
        }
        t.push_str("</tr>\n");
    }
    t.push_str("</table>\n");
    t
}

fn fmt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.decimals$}"))
}

/// p50 / p99 / p999 of a connect row's figure.
fn percentiles(v: &Value) -> String {
    let p: Vec<Option<f64>> = (0..3).map(|i| num(&v[i])).collect();
    if p.iter().all(Option::is_none) {
        return "-".into();
    }
    p.iter().map(|x| fmt(*x, 0)).collect::<Vec<_>>().join(" / ")
}

/// Modes of connect rows in first-seen order.
fn modes(rows: &[Value]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in rows {
        let m = r["mode"].as_str().unwrap_or("?").to_string();
        if !out.contains(&m) {
            out.push(m);
        }
    }
    out
}

/// p99 against the number of Services, one line per mode, for each of the three connect
/// figures side by side (log scales: the modes differ by orders of magnitude).
fn plot_connect(rows: &[Value], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (1200, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled("New-connection p99 latency against the number of Services (log scales)", ("sans-serif", 20))?;
    let panels = root.split_evenly((1, 3));
    let figures = [
        ("cluster_tcp_us", "ClusterIP TCP connect"),
        ("cluster_udp_us", "ClusterIP UDP request"),
        ("nodeport_tcp_us", "NodePort TCP connect"),
    ];
    let p99 = |r: &Value, key: &str| num(&r[key][1]);
    let all: Vec<f64> = rows.iter().flat_map(|r| figures.iter().filter_map(move |(k, _)| p99(r, k))).filter(|v| *v > 0.0).collect();
    if all.is_empty() {
        return Err("no latency figures to plot".into());
    }
    let (lo, hi) = all.iter().fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    // Room above the lines for the legend.
    let (lo, hi) = (lo / 1.5, hi * 4.0);
    let sizes: Vec<u32> = rows.iter().filter_map(|r| r["services"].as_u64().map(|n| n as u32)).collect();
    let (smin, smax) = (sizes.iter().min().copied().unwrap_or(1000), sizes.iter().max().copied().unwrap_or(30000));
    for ((key, title), panel) in figures.iter().zip(panels.iter()) {
        let mut chart = ChartBuilder::on(panel)
            .caption(*title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d((f64::from(smin) / 1.3..f64::from(smax) * 1.3).log_scale(), (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .x_labels(4)
            .y_labels(6)
            .x_desc("Services")
            .y_desc("p99 (µs)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        for mode in modes(rows) {
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r["mode"].as_str() == Some(mode.as_str()))
                .filter_map(|r| Some((r["services"].as_f64()?, p99(r, key)?)))
                .collect();
            if pts.is_empty() {
                continue;
            }
            if mode == "floor" {
                // No Services in its path: one figure, drawn across.
                pts = vec![(f64::from(smin), pts[0].1), (f64::from(smax), pts[0].1)];
            }
            let c = colour(&mode);
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
                .label(mode.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))?;
        }
        legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    }
    root.present()?;
    Ok(())
}

/// Packets a second per mode as bars, the floor as a line across them.
fn plot_north(v: &Value, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let modes: Vec<(String, f64)> = v["modes"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| Some((m["mode"].as_str()?.to_string(), num(&m["udp_pps_delivered"])?))).collect())
        .unwrap_or_default();
    let floor = num(&v["floor_pps"]).unwrap_or(0.0);
    let top = modes.iter().map(|m| m.1).fold(floor, f64::max) * 1.15 / 1e6;
    if modes.is_empty() || top <= 0.0 {
        return Err("no packet rates to plot".into());
    }
    let root = SVGBackend::new(path, (800, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("NodePort forwarding, 64-byte UDP: packets a second by what node A runs", ("sans-serif", 18))
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..modes.len() as f64, 0f64..top)?;
    let names: Vec<String> = modes.iter().map(|m| north_label(&m.0).to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(modes.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 {
                names.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("million packets a second")
        .draw()?;
    chart.draw_series(modes.iter().enumerate().map(|(i, (mode, pps))| {
        let x = i as f64;
        Rectangle::new([(x + 0.15, 0.0), (x + 0.85, pps / 1e6)], colour(mode).filled())
    }))?;
    chart
        .draw_series(LineSeries::new([(0.0, floor / 1e6), (modes.len() as f64, floor / 1e6)], BLACK.stroke_width(2)))?
        .label(format!("floor: the lab with no processing ({:.2} Mpps)", floor / 1e6))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(2)));
    legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present()?;
    Ok(())
}

/// Both plots' legend: framed, on a light background, at `at`.
fn legend<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    at: SeriesLabelPosition,
) -> Result<(), Box<dyn std::error::Error>> {
    chart.configure_series_labels().position(at).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    Ok(())
}

/// The plot `file` on the page, or why there is none.
fn embed(html: &mut String, drawn: Result<(), Box<dyn std::error::Error>>, file: &str, alt: &str) {
    let _ = match drawn {
        Ok(()) => writeln!(html, "<img src=\"{file}\" alt=\"{alt}\">"),
        Err(e) => writeln!(html, "<p>(no plot: {})</p>", esc(&e.to_string())),
    };
}

/// The tables (and plots) of one benchmark's JSON.
fn section(dir: &Path, name: &str, v: &Value, html: &mut String) {
    let rows = |k: &str| v[k].as_array().cloned().unwrap_or_default();
    match name {
        "connect" => {
            let rows = rows("rows");
            embed(html, plot_connect(&rows, &dir.join("connect.svg")), "connect.svg", "connect p99 against Services");
            let t: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    vec![
                        r["mode"].as_str().unwrap_or("").into(),
                        r["services"].to_string(),
                        fmt(num(&r["program_s"]), 1),
                        percentiles(&r["cluster_tcp_us"]),
                        percentiles(&r["cluster_udp_us"]),
                        percentiles(&r["nodeport_tcp_us"]),
                        format!("{} {}", r["position"].as_str().unwrap_or(""), r["note"].as_str().unwrap_or("")).trim().into(),
                    ]
                })
                .collect();
            let head =
                ["mode", "Services", "programmed (s)", "ClusterIP TCP", "ClusterIP UDP", "NodePort TCP", "Service under test, notes"];
            html.push_str(&table(&head, &t));
        }
        "north" => {
            embed(html, plot_north(v, &dir.join("north.svg")), "north.svg", "packet rate per mode against the floor");
            let floor = num(&v["floor_pps"]);
            let t: Vec<Vec<String>> = rows("modes")
                .iter()
                .map(|m| {
                    let pps = num(&m["udp_pps_delivered"]);
                    vec![
                        north_label(m["mode"].as_str().unwrap_or("")).into(),
                        fmt(pps, 0),
                        fmt(num(&m["pps_vs_iptables"]), 2),
                        fmt(pps.zip(floor).map(|(p, f)| 100.0 * p / f), 0),
                        fmt(num(&m["tcp_new_conns_per_sec"]), 0),
                    ]
                })
                .collect();
            html.push_str(&table(&["node A runs", "UDP packets/s", "vs iptables", "% of the floor (this run)", "new TCP conn/s"], &t));
            let _ = writeln!(
                html,
                "<p>Floor: {} packets/s. XDP's share of it, the median of rounds measuring the two one after the other: {} % (rounds: {}).</p>",
                fmt(floor, 0),
                fmt(num(&v["xdp_share_of_floor"]).map(|r| 100.0 * r), 0),
                esc(&v["xdp_share_of_floor_rounds"].as_array().map(|a| a.iter().filter_map(num).map(|r| format!("{:.0}", 100.0 * r)).collect::<Vec<_>>().join(", ")).unwrap_or_default())
            );
        }
        "datapath" => {
            let _ = writeln!(html, "<p>Measured on Linux {}, {} CPUs.</p>", esc(v["kernel"].as_str().unwrap_or("?")), v["cpus"]);
            let cases = rows("cases");
            let mut names: Vec<String> =
                cases.first().and_then(|c| c["ns"].as_object()).map(|o| o.keys().cloned().collect()).unwrap_or_default();
            names.sort();
            let mut head = vec!["case (ns a packet)".to_string()];
            head.extend(cases.iter().map(|c| format!("{} Services", c["services"])));
            let t: Vec<Vec<String>> =
                names.iter().map(|n| std::iter::once(n.clone()).chain(cases.iter().map(|c| fmt(num(&c["ns"][n]), 1))).collect()).collect();
            html.push_str(&table(&head.iter().map(String::as_str).collect::<Vec<_>>(), &t));
            let by_size: Vec<Vec<String>> = rows("new_flow_by_ct_size")
                .iter()
                .map(|r| {
                    let floor = num(&r["floor_ns"]);
                    let x = |k: &str| fmt(num(&r[k]).zip(floor).map(|(n, f)| n / f), 1);
                    let default = if r["ct_map_max"] == v["ct_map_max_default"] { " (default)" } else { "" };
                    vec![
                        format!("{}{default}", r["ct_map_max"]),
                        fmt(num(&r["with_room_ns"]), 1),
                        x("with_room_ns"),
                        fmt(num(&r["full_ns"]), 1),
                        x("full_ns"),
                    ]
                })
                .collect();
            if !by_size.is_empty() {
                let _ = writeln!(
                    html,
                    "<p>A new IPv4 flow by the conntrack map's size (the cases above: {} entries, with room). With room: the flows of each round are removed after it, as a node's removal of expired flows does; full: every new flow evicts. Its map work lands on memory spread over the whole map.</p>",
                    v["ct_map_max"]
                );
                let head = ["conntrack entries", "with room (ns)", "x empty program", "full (ns)", "x empty program"];
                html.push_str(&table(&head, &by_size));
            }
        }
        "control" => {
            let t: Vec<Vec<String>> = rows("rows")
                .iter()
                .map(|r| vec![r["services"].to_string(), fmt(num(&r["p50_ms"]), 2), fmt(num(&r["p99_ms"]), 2), fmt(num(&r["max_ms"]), 2)])
                .collect();
            html.push_str(&table(&["Services x 4 endpoints", "p50 ms", "p99 ms", "max ms"], &t));
            let _ = writeln!(html, "<p>Agent RSS at 10,000 Services: {} MiB.</p>", fmt(num(&v["rss_mib_10k"]), 1));
        }
        "footprint" => {
            let mode_row = |label: &str, v: &Value| {
                vec![
                    label.to_string(),
                    fmt(num(&v["programmed_s"]), 1),
                    fmt(num(&v["rss_mib"]), 1),
                    fmt(num(&v["rss_mib_after_changes"]), 1),
                    fmt(num(&v["cpu_percent_at_100_changes_per_s"]), 1),
                ]
            };
            let mut t = vec![mode_row("ebpf", v)];
            if v["nftables"].is_object() {
                t.push(mode_row("nftables", &v["nftables"]));
            }
            // `changes_s`: how long the changes ran (60 s unless PROXY_BENCH_FOOTPRINT_SECONDS).
            let after =
                num(&v["changes_s"]).map_or("RSS after the changes (MiB)".into(), |s| format!("RSS after {s:.0} s of changes (MiB)"));
            let head = ["mode", "programmed after (s)", "RSS (MiB)", &after, "CPU at 100 changes/s (% of a core)"];
            html.push_str(&table(&head, &t));
            for (mode, of) in [("eBPF", v), ("nftables mode", &v["nftables"])] {
                if let Some(rss) = of["rss_mib_every_10_s_of_changes"].as_array() {
                    let series: Vec<String> = rss.iter().map(|r| fmt(num(r), 1)).collect();
                    let _ = writeln!(html, "<p>{mode} RSS every 10 s of the changes, and at their end (MiB): {}.</p>", series.join(", "));
                }
            }
            let _ = writeln!(
                html,
                "<p>eBPF restart with everything pinned: /healthz 200 after {} s, first sync after {} s ({}).</p>",
                fmt(num(&v["restart_healthz_s"]), 2),
                fmt(num(&v["restart_synced_s"]), 2),
                esc(v["restart_initial_sync"].as_str().unwrap_or(""))
            );
        }
        "modes" => {
            let t: Vec<Vec<String>> = rows("rows")
                .iter()
                .chain(rows("ipvs_guest").iter())
                .map(|r| {
                    vec![
                        r["mode"].as_str().unwrap_or("").into(),
                        r["services"].to_string(),
                        fmt(num(&r["program_s"]), 3),
                        format!("{} / {}", fmt(num(&r["change_ms_p50"]), 2), fmt(num(&r["change_ms_max"]), 2)),
                        fmt(num(&r["rewrite_s"]), 3),
                        format!("{} / {}", fmt(num(&r["rewrite_first_s"]), 2), fmt(num(&r["rewrite_later_s"]), 2)),
                        format!("{} / {}", fmt(num(&r["burst_s"]), 2), fmt(num(&r["burst_longest_s"]), 2)),
                        r["checked"].as_str().unwrap_or("").into(),
                    ]
                })
                .collect();
            html.push_str(&table(
                &[
                    "mode",
                    "Services",
                    "programmed (s)",
                    "one change p50 / max (ms)",
                    "written again by a new proxier (s)",
                    "its first sync / longest later one (s)",
                    "half the Services changed at once / its longest sync (s)",
                    "checked",
                ],
                &t,
            ));
            let _ = writeln!(html, "<p>Endpoints per Service: {}.</p>", v["endpoints_per_service"].as_u64().unwrap_or(4));
            let _ = writeln!(html, "<p>IPVS: {}</p>", esc(v["ipvs_note"].as_str().unwrap_or("")));
        }
        _ => {}
    }
}

/// Writes `report.html` (and the plots) into `dir` from the JSON there; returns its path and
/// the benchmarks it found.
pub fn write(dir: &Path) -> std::io::Result<(PathBuf, Vec<&'static str>)> {
    let mut html = String::from(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>proxy benchmarks</title>\n<style>body{font-family:sans-serif;max-width:1250px;margin:auto}table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}img{max-width:100%}</style></head><body>\n",
    );
    let _ =
        writeln!(html, "<h1>proxy benchmarks</h1>\n<p>{} &middot; report of {}</p>", esc(&machine()), date(std::time::SystemTime::now()));
    html.push_str("<p>Each figure compares best with the others of its own run on this machine: absolute figures move by half between runs of a shared VM. Reproduce with <code>cargo xtask bench</code> (or one benchmark: <code>cargo xtask bench connect</code>); this page is <code>target/bench/report.html</code>.</p>\n");
    let mut found = Vec::new();
    for (name, what) in SECTIONS {
        let Some(v) = read(dir, name) else { continue };
        found.push(name);
        let _ = writeln!(html, "<h2>{name}</h2>\n<p>{} (figures written {})</p>", esc(what), written(dir, name));
        section(dir, name, &v, &mut html);
    }
    if found.is_empty() {
        html.push_str("<p>No benchmark has written its figures here yet.</p>\n");
    }
    html.push_str("</body></html>\n");
    let path = dir.join("report.html");
    std::fs::write(&path, html)?;
    Ok((path, found))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_holds_each_benchmarks_figures_and_draws_its_plots() {
        let guard = tempfile::Builder::new().prefix("proxy-report-").tempdir().unwrap();
        let dir = guard.path();
        let connect = serde_json::json!({"benchmark": "connect", "rows": [
            {"mode": "floor", "services": 1000, "program_s": null, "position": "no proxy", "cluster_tcp_us": [20.0, 61.0, 90.0], "cluster_udp_us": [150.0, 400.0, 500.0], "nodeport_tcp_us": [null, null, null], "note": ""},
            {"mode": "ebpf", "services": 1000, "program_s": 1.4, "position": "a hash map", "cluster_tcp_us": [24.0, 75.0, 99.0], "cluster_udp_us": [142.0, 358.0, 420.0], "nodeport_tcp_us": [34.0, 72.0, 80.0], "note": ""},
            {"mode": "ebpf", "services": 30000, "program_s": 6.0, "position": "a hash map", "cluster_tcp_us": [31.0, 61.0, 70.0], "cluster_udp_us": [166.0, 391.0, 450.0], "nodeport_tcp_us": [26.0, 62.0, 70.0], "note": "<ok>"},
        ]});
        let north = serde_json::json!({"benchmark": "north", "floor_pps": 6.7e6, "xdp_share_of_floor": 0.74, "xdp_share_of_floor_rounds": [0.72, 0.74, 0.8],
            "modes": [{"mode": "Xdp", "udp_pps_delivered": 5.0e6, "pps_vs_iptables": 8.0, "tcp_new_conns_per_sec": 25000.0},
                      {"mode": "Iptables", "udp_pps_delivered": 6.2e5, "pps_vs_iptables": 1.0, "tcp_new_conns_per_sec": 20000.0}]});
        std::fs::write(dir.join("connect.json"), connect.to_string()).unwrap();
        std::fs::write(dir.join("north.json"), north.to_string()).unwrap();
        let (path, found) = write(dir).unwrap();
        assert_eq!(found, ["connect", "north"], "only what was measured");
        let html = std::fs::read_to_string(&path).unwrap();
        assert!(html.contains("<img src=\"connect.svg\"") && html.contains("<img src=\"north.svg\""), "both plots on the page");
        assert!(html.contains("24 / 75 / 99") && html.contains("5000000") && html.contains("74 %"), "the figures in the tables");
        assert!(html.contains("&lt;ok&gt;") && !html.contains("<ok>"), "text from the JSON is escaped");
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        assert!(html.contains(&format!("Linux {}", kernel.trim())), "the kernel is named");
        assert!(html.contains("figures written 20"), "each section says when its figures were written");
        for (plot, mode) in [("connect.svg", "ebpf"), ("north.svg", "eBPF, XDP")] {
            let svg = std::fs::read_to_string(dir.join(plot)).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains(mode), "{plot} drawn with its modes");
        }
        let connect_svg = std::fs::read_to_string(dir.join("connect.svg")).unwrap();
        assert!(connect_svg.contains("ClusterIP TCP connect") && connect_svg.contains("floor"), "three panels, every mode in the legend");
    }

    #[test]
    fn the_footprint_section_says_how_long_the_changes_ran_and_the_rss_over_them() {
        let guard = tempfile::Builder::new().prefix("proxy-report-footprint-").tempdir().unwrap();
        let dir = guard.path();
        let footprint = serde_json::json!({"benchmark": "footprint", "services": 30000, "programmed_s": 8.2, "rss_mib": 62.7,
            "rss_mib_after_changes": 68.0, "rss_mib_every_10_s_of_changes": [62.7, 63.04, 67.9], "changes_s": 600.2,
            "cpu_percent_at_100_changes_per_s": 3.8, "restart_healthz_s": 4.5, "restart_synced_s": 8.27,
            "restart_initial_sync": "initial sync done unchanged=30000",
            "nftables": {"rss_mib": 160.0, "rss_mib_after_changes": 250.0, "rss_mib_every_10_s_of_changes": [160.0, 251.5]}});
        std::fs::write(dir.join("footprint.json"), footprint.to_string()).unwrap();
        let (path, found) = write(dir).unwrap();
        assert_eq!(found, ["footprint"]);
        let html = std::fs::read_to_string(&path).unwrap();
        assert!(
            html.contains("RSS after 600 s of changes") && html.contains("68.0"),
            "the RSS after the changes, and how long they ran: {html}"
        );
        assert!(
            html.contains("eBPF RSS every 10 s of the changes, and at their end (MiB): 62.7, 63.0, 67.9"),
            "the RSS over the changes: {html}"
        );
        assert!(html.contains("nftables mode RSS every 10 s of the changes, and at their end (MiB): 160.0, 251.5"), "{html}");
        // A file from before `changes_s` (a minute of changes, no series) still reads.
        let older = serde_json::json!({"benchmark": "footprint", "rss_mib": 62.0, "rss_mib_after_changes": 63.3, "nftables": null});
        std::fs::write(dir.join("footprint.json"), older.to_string()).unwrap();
        let html = std::fs::read_to_string(write(dir).unwrap().0).unwrap();
        assert!(html.contains("RSS after the changes (MiB)") && html.contains("63.3") && !html.contains("every 10 s"), "{html}");
    }

    #[test]
    fn the_datapath_section_holds_a_new_flow_by_conntrack_size_with_room_and_full() {
        let guard = tempfile::Builder::new().prefix("proxy-report-datapath-").tempdir().unwrap();
        let dir = guard.path();
        let datapath = serde_json::json!({"benchmark": "datapath", "kernel": "6.18", "cpus": 2, "ct_map_max": 2097152, "ct_map_max_default": 262144,
            "cases": [{"services": 1, "ns": {"floor/calls": 56.0, "new_flow/calls": 1047.0}}],
            "new_flow_by_ct_size": [
                {"ct_map_max": 32768, "with_room_ns": 672.0, "full_ns": 842.0, "floor_ns": 56.0},
                {"ct_map_max": 262144, "with_room_ns": 1069.0, "full_ns": 1614.0, "floor_ns": 57.0}]});
        std::fs::write(dir.join("datapath.json"), datapath.to_string()).unwrap();
        let html = std::fs::read_to_string(write(dir).unwrap().0).unwrap();
        assert!(html.contains("the cases above: 2097152 entries, with room"), "the cases' map size: {html}");
        let row = |cells: [&str; 5]| cells.iter().map(|c| format!("<td>{c}</td>")).collect::<String>();
        assert!(html.contains(&row(["32768", "672.0", "12.0", "842.0", "15.0"])), "{html}");
        assert!(html.contains(&row(["262144 (default)", "1069.0", "18.8", "1614.0", "28.3"])), "the default named: {html}");
        // A file from before the table: the section has no such paragraph.
        let older = serde_json::json!({"benchmark": "datapath", "kernel": "6.18", "cpus": 2, "cases": []});
        std::fs::write(dir.join("datapath.json"), older.to_string()).unwrap();
        let html = std::fs::read_to_string(write(dir).unwrap().0).unwrap();
        assert!(!html.contains("conntrack map's size"), "{html}");
    }

    #[test]
    fn dates_are_civil_dates_in_utc() {
        let at = |s: u64| date(std::time::UNIX_EPOCH + std::time::Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01 00:00 UTC");
        // 2000-02-29 (a leap day of a century divisible by 400), 13:45.
        assert_eq!(at(951_831_900), "2000-02-29 13:45 UTC");
        assert_eq!(at(1_795_046_400), "2026-11-19 00:00 UTC");
    }

    #[test]
    fn nothing_to_draw_is_said_instead_of_a_broken_plot() {
        let guard = tempfile::Builder::new().prefix("proxy-report-empty-").tempdir().unwrap();
        let dir = guard.path();
        std::fs::write(dir.join("connect.json"), r#"{"benchmark": "connect", "rows": []}"#).unwrap();
        std::fs::write(dir.join("north.json"), r#"{"benchmark": "north", "modes": []}"#).unwrap();
        let (path, _) = write(dir).unwrap();
        let html = std::fs::read_to_string(&path).unwrap();
        assert!(html.contains("no latency figures to plot") && html.contains("no packet rates to plot"), "{html}");
        assert!(!html.contains("<img"), "no image of nothing");
    }
}
