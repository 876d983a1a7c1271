//! What kube-proxy leaves on a node that no mode of this agent writes, removed when the agent
//! takes the node over (as `kube-proxy --cleanup` would): its canary chains in both families.
//! Its other chains, the `ip` and `ip6 kube-proxy` tables, the IPVS state and the ipsets of
//! both families have the names of the agent's own modes and go with their cleanup.
//!
//! kubelet's chains (KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT, KUBE-FIREWALL, KUBE-MARK-DROP)
//! and everything not named KUBE- (the CNI's) are never touched.

use super::{run, run_with_input, Iptables, Tools, IPTABLES_PACKAGE};
use crate::model::Family;

/// kube-proxy's canary, made in these tables to notice a flush.
const CANARY: &str = "KUBE-PROXY-CANARY";
const TABLES: [&str; 3] = ["mangle", "nat", "filter"];

/// Splits an iptables-save rule into arguments, as a shell would (comments are quoted).
pub fn split_rule(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut any = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                quoted = !quoted;
                any = true;
            }
            '\\' if quoted => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// In one table's iptables-save output: the chains `remove` selects, and the rules of other
/// chains that jump to them (as `-A CHAIN ...` argument lists, for `-D`).
pub fn plan(save: &str, remove: impl Fn(&str) -> bool) -> (Vec<String>, Vec<Vec<String>>) {
    let chains: Vec<String> = super::declared_chains(save).filter(|c| remove(c)).map(String::from).collect();
    let jumps = save
        .lines()
        .filter_map(|l| l.strip_prefix("-A "))
        .map(split_rule)
        .filter(|args| {
            let owner = args.first().map(String::as_str).unwrap_or("");
            let target = args.iter().position(|a| a == "-j" || a == "-g").and_then(|i| args.get(i + 1));
            !chains.iter().any(|c| c == owner) && target.is_some_and(|t| chains.contains(t))
        })
        .collect();
    (chains, jumps)
}

/// Removes the chains `remove` selects from every table of one family's tools, with the
/// jumps into them. Returns a line per table changed.
fn remove_chains(tools: Tools, family: &str, remove: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut done = Vec::new();
    let Ok(saved) = super::save_tables(tools) else { return done };
    for table in TABLES {
        let Some(save) = saved.get(table) else { continue };
        let (chains, jumps) = plan(save, remove);
        if chains.is_empty() {
            continue;
        }
        for mut args in jumps {
            let chain = args.remove(0);
            let mut cmd: Vec<&str> = vec!["-w", "5", "-t", table, "-D", &chain];
            cmd.extend(args.iter().map(String::as_str));
            let _ = run(tools.cmd(), IPTABLES_PACKAGE, &cmd);
        }
        let text = super::delete_chains_text(table, &chains);
        match run_with_input(tools.restore(), IPTABLES_PACKAGE, &["-w", "5", "--noflush"], &text) {
            Ok(_) => done.push(format!("{} ({family}): {} kube-proxy chains in the {table} table", tools.cmd(), chains.len())),
            Err(e) => done.push(format!("{} ({family}): could not remove kube-proxy's chains in the {table} table: {e}", tools.cmd())),
        }
    }
    done
}

/// The chains of a nat table (its `iptables-save` listing) that send a Service's packets to
/// endpoints: kube-proxy's, or this agent's iptables or IPVS mode's. While any is there, a
/// packet the eBPF maps do not hold can still be translated by what those rules last knew.
fn translating_chains(nat: &str) -> Vec<&str> {
    super::declared_chains(nat).filter(|c| translates(c)).collect()
}

/// Whether a chain of that name is one of those `translating_chains` finds.
fn translates(chain: &str) -> bool {
    matches!(chain, "KUBE-SERVICES" | "KUBE-NODEPORTS") || super::iptables::SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
}

/// Removes the chains `translates` names, in every table of each of `backends` and family, with
/// every jump into them, another chain's too (without the chain it leads nowhere): for the eBPF
/// mode, which writes none of them, once the modes' own removals have left some (their checks
/// of which mode ran did not match a half-removed state, or a jump of another chain made their
/// restore fail). Returns a line per table changed.
pub fn remove_translating(backends: &[Iptables]) -> Vec<String> {
    let mut removed = Vec::new();
    for &b in backends {
        for family in Family::ALL {
            removed.extend(remove_chains(b.tools(family), family.api_name(), &translates));
        }
    }
    removed
}

/// What still translates Services in netfilter, a line per backend and family, and per
/// nftables table: empty once the removal at takeover has done its work. A backend that cannot
/// be read counts as clean here (the removal has said why it could not read it).
pub fn translating_leftovers(backends: &[Iptables]) -> Vec<String> {
    let mut left = Vec::new();
    for &b in backends {
        for family in Family::ALL {
            let tools = b.tools(family);
            let Ok(saved) = super::save_tables(tools) else { continue };
            let chains = saved.get("nat").map(|nat| translating_chains(nat)).unwrap_or_default();
            match chains[..] {
                [] => {}
                [only] => left.push(format!("{} ({}): {only} in the nat table", tools.cmd(), family.api_name())),
                [first, ..] => {
                    left.push(format!("{} ({}): {} chains in the nat table ({first}, ...)", tools.cmd(), family.api_name(), chains.len()))
                }
            }
        }
    }
    if let Ok(families) = super::nftables::families_with_table() {
        left.extend(families.into_iter().map(|f| format!("nftables: table {} kube-proxy", super::nft_family(f))));
    }
    left
}

/// Removes what kube-proxy left that no mode of the agent writes (see the module notes), in
/// each of `backends`. Returns a line per thing removed.
pub fn cleanup(backends: &[Iptables]) -> Vec<String> {
    let mut removed = Vec::new();
    for &b in backends {
        for family in Family::ALL {
            removed.extend(remove_chains(b.tools(family), family.api_name(), &|c| c == CANARY));
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chains_that_translate_are_the_services_and_their_endpoints() {
        let chains = translating_chains(SAVE);
        assert_eq!(chains, ["KUBE-SERVICES", "KUBE-SVC-XYZ"], "kubelet's canary and the CNI's chains do not count");
        let ipvs = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\nCOMMIT\n";
        assert_eq!(translating_chains(ipvs), ["KUBE-SERVICES"], "IPVS mode's jump to its sets translates too");
        let cleaned = "*nat\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:CNI-HOSTPORT-DNAT - [0:0]\nCOMMIT\n";
        assert!(translating_chains(cleaned).is_empty(), "what the removal leaves (masquerade marks, kubelet's) translates nothing");
    }

    /// Chains kubelet makes (or made), which stay.
    const KUBELET_CHAINS: [&str; 4] = ["KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-FIREWALL", "KUBE-MARK-DROP"];

    fn kube_proxy_chain(c: &str) -> bool {
        c.starts_with("KUBE-") && !KUBELET_CHAINS.contains(&c)
    }

    const SAVE: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-XYZ - [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d fd00::10/128 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-XYZ
COMMIT
"#;

    #[test]
    fn kube_proxy_chains_and_the_jumps_into_them_are_planned_for_removal() {
        let (chains, jumps) = plan(SAVE, kube_proxy_chain);
        assert_eq!(chains, ["KUBE-SERVICES", "KUBE-SVC-XYZ"], "kubelet's canary and the CNI's chain stay");
        assert_eq!(jumps.len(), 2, "the jumps from PREROUTING and OUTPUT, not the one between removed chains: {jumps:?}");
        assert_eq!(jumps[0], ["PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"]);
    }

    #[test]
    fn rules_split_as_a_shell_splits_them() {
        assert_eq!(split_rule(r#"A -m comment --comment "a \"b\" c" -j X"#), ["A", "-m", "comment", "--comment", "a \"b\" c", "-j", "X"]);
        assert_eq!(split_rule("  -j   X  "), ["-j", "X"]);
        assert_eq!(split_rule(r#"--comment """#), ["--comment", ""]);
    }
}
