//! What a node's newer nft (1.1.2 or later: Debian 13's, a CNI plugin's, a firewall's) leaves
//! in the kernel that older nft versions cannot read, made here over netlink so that no newer
//! nft is needed: a table with one set declared by `type`, stored as nft 1.1.3 stores it.
//! nft before 1.1.2 (Debian 12's 1.0.6 among them) crashes on it in any command that loads
//! sets (kubernetes#136786).

use proxy_agent::dataplane::netfilter::nfnetlink::{self, NFNL_SUBSYS_NFTABLES};

const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_NEWSET: u16 = 9;

/// The set's user data as nft 1.1.3 writes it for `type ipv4_addr`, read off `nft --debug=mnl`:
/// records of a type byte, a length byte and the value. The key's byte order (type 0, a u32:
/// 2, big-endian), then a key "typeof" record (type 3, 8 bytes) that nests an expression kind
/// (type 0, a u32: 4) with empty expression data (type 1, no bytes): older nft versions build
/// the key's expression from such a record and find none.
const NEWER_SET_USERDATA: [u8; 16] = [0, 4, 2, 0, 0, 0, 3, 8, 0, 4, 4, 0, 0, 0, 1, 0];

/// Adds table `ip <table>` holding set `newer { type ipv4_addr ; }` as nft 1.1.3 writes it, in
/// the calling thread's network namespace.
pub fn add_table_with_newer_set(table: &str) -> std::io::Result<()> {
    let (flags, ip) = (libc::NLM_F_CREATE as u16, libc::NFPROTO_IPV4 as u8);
    let name = [table.as_bytes(), &[0]].concat();
    let (zero, ipv4_addr, four, id) = (0u32.to_be_bytes(), 7u32.to_be_bytes(), 4u32.to_be_bytes(), 1u32.to_be_bytes());
    // (NFTA_TABLE_NAME, NFTA_TABLE_FLAGS.)
    let new_table = nfnetlink::message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE, flags, ip, 0, &[(1, &name), (2, &zero)]);
    // (NFTA_SET_TABLE, _NAME, _FLAGS, _KEY_TYPE, _KEY_LEN, _ID, _USERDATA.)
    let set: [(u16, &[u8]); 7] =
        [(1, &name), (2, b"newer\0"), (3, &zero), (4, &ipv4_addr), (5, &four), (10, &id), (13, &NEWER_SET_USERDATA)];
    let new_set = nfnetlink::message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSET, flags, ip, 0, &set);
    nfnetlink::nftables_batch(&[new_table, new_set])
}

/// Whether this machine's nft crashes (SIGSEGV) listing the tables of the calling thread's
/// network namespace, where `add_table_with_newer_set` made one. Panics where it does not on
/// Debian 12's nftables package (this image's), which was seen to crash on the set nft 1.1.3
/// itself wrote and on this one: the set made here would not be that.
pub fn this_nft_crashes() -> bool {
    let out = std::process::Command::new("nft").args(["list", "tables"]).output().expect("run nft");
    let crashes = std::os::unix::process::ExitStatusExt::signal(&out.status) == Some(libc::SIGSEGV);
    let package = std::process::Command::new("dpkg-query").args(["-W", "-f", "${Version}", "nftables"]).output();
    let known = package.is_ok_and(|p| p.stdout == b"1.0.6-2+deb12u2");
    assert!(crashes || !known, "Debian 12's nft 1.0.6 crashes on the set as nft 1.1.3 writes it: the set made here is not that");
    crashes
}
