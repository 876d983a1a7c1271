//! What native XDP may send out of each interface (`XDP_DEVS_V1`).
//!
//! A frame native XDP sends (XDP_TX, or XDP_REDIRECT into another device) is handed to the
//! egress driver's XDP transmit path. A driver without one drops it, and so does a veth whose
//! peer has no NAPI context: the peer must run an XDP program itself or have GRO on
//! (`veth_xdp_xmit`, "veth: allow enabling NAPI even without XDP"). A veth uplink with nothing
//! on its far end, as kind nodes and many VM and container setups have, is exactly that. The
//! kernel says which devices take XDP frames in each device's `xdp_features`
//! (NETDEV_XDP_ACT_NDO_XMIT), over the `netdev` generic netlink family; the datapath hands a
//! flow whose egress device lacks it to TC. For a veth the bit follows its peer, and is set by
//! GRO on the peer as by an XDP program there; frames sent into a veth whose peer only has GRO
//! on were seen to vanish on Linux 6.18 (counted as received by the peer's XDP ring, never
//! reaching its stack), so a veth counts only when its peer runs a native XDP program, which
//! rtnetlink tells (the peer's IFLA_XDP, asked for in the peer's namespace by its netnsid).

use std::{collections::BTreeMap, io};

use futures::TryStreamExt as _;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkXdp, XdpAttached};
use netlink_sys::{protocols::NETLINK_GENERIC, Socket, SocketAddr};

use crate::netlink::{attr, attrs, request, NLM_F_DUMP, NLM_F_REQUEST};
use proxy_common::xdp_dev;

/// NETDEV_XDP_ACT_* bits of `xdp_features` (include/uapi/linux/netdev.h).
pub const XDP_ACT_BASIC: u64 = 1 << 0;
pub const XDP_ACT_NDO_XMIT: u64 = 1 << 2;

/// One interface as XDP sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XdpDevice {
    pub name: String,
    pub veth: bool,
    /// An XDP program runs on it in generic (skb) mode.
    pub generic: bool,
    /// NETDEV_XDP_ACT_* bits; None when the kernel did not say.
    pub features: Option<u64>,
    /// A veth's peer runs an XDP program in native mode (None: not a veth, or not known).
    pub peer_native_xdp: Option<bool>,
}

impl XdpDevice {
    /// Its `xdp_dev` flags.
    pub fn flags(&self) -> u32 {
        let features = self.features.unwrap_or(0);
        let xmit = features & XDP_ACT_NDO_XMIT != 0 && (!self.veth || self.peer_native_xdp == Some(true));
        // A veth's XDP_TX goes to its peer the way a redirect into it does; other drivers
        // transmit from their own XDP_TX ring (part of the basic set).
        let tx = xmit || (!self.veth && features & XDP_ACT_BASIC != 0);
        let mut flags = 0;
        if tx {
            flags |= xdp_dev::TX;
        }
        if xmit {
            flags |= xdp_dev::XMIT;
        }
        if self.generic {
            flags |= xdp_dev::GENERIC;
        }
        flags
    }

    /// Why native XDP cannot send frames out of this device, if it cannot.
    pub fn why_not_native(&self) -> Option<&'static str> {
        if self.flags() & xdp_dev::TX != 0 || self.generic {
            return None;
        }
        Some(match (self.features, self.veth) {
            (None, _) => "the kernel does not report this device's XDP features",
            (Some(_), true) => "a veth whose peer runs no native XDP program drops (or loses) frames sent from native XDP",
            (Some(_), false) => "its driver has no XDP transmit path",
        })
    }
}

/// Every interface of this network namespace: name, kind and XDP mode from rtnetlink, features
/// from the `netdev` generic netlink family.
pub async fn read() -> io::Result<BTreeMap<u32, XdpDevice>> {
    // A few hundred bytes each way on a netlink socket: quick enough not to leave the task.
    let features = xdp_features();
    let (conn, handle, _) = rtnetlink::new_connection()?;
    let conn = tokio::spawn(conn);
    let mut out = BTreeMap::new();
    // veth -> (peer index, peer's namespace id when it is in another namespace)
    let mut peers = BTreeMap::new();
    let mut dump = handle.link().get().execute();
    while let Some(msg) = dump.try_next().await.map_err(io::Error::other)? {
        let mut dev = XdpDevice::default();
        let (mut peer, mut nsid) = (None, None);
        for a in &msg.attributes {
            match a {
                LinkAttribute::IfName(n) => dev.name = n.clone(),
                LinkAttribute::LinkInfo(info) => dev.veth = info.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))),
                LinkAttribute::Xdp(xdp) => dev.generic = attached(xdp) == Some(XdpAttached::SocketBuffer),
                LinkAttribute::Link(i) => peer = Some(*i),
                LinkAttribute::LinkNetNsId(id) => nsid = Some(*id),
                _ => {}
            }
        }
        dev.features = features.as_ref().ok().and_then(|f| f.get(&msg.header.index).copied());
        if let (true, Some(p)) = (dev.veth, peer) {
            peers.insert(msg.header.index, (p, nsid));
        }
        out.insert(msg.header.index, dev);
    }
    for (index, (peer, nsid)) in peers {
        let native = peer_native_xdp(&handle, peer, nsid).await;
        if let Some(d) = out.get_mut(&index) {
            d.peer_native_xdp = native;
        }
    }
    conn.abort();
    if let Err(e) = features {
        tracing::debug!("reading xdp_features: {e}");
    }
    Ok(out)
}

/// The XDP attach mode a link reports.
fn attached(xdp: &[LinkXdp]) -> Option<XdpAttached> {
    xdp.iter().find_map(|x| match x {
        LinkXdp::Attached(a) => Some(*a),
        _ => None,
    })
}

/// Whether link `index` (in the namespace `nsid` names, or ours) runs a native XDP program.
async fn peer_native_xdp(handle: &rtnetlink::Handle, index: u32, nsid: Option<i32>) -> Option<bool> {
    let mut req = handle.link().get().match_index(index);
    if let Some(id) = nsid {
        req.message_mut().attributes.push(LinkAttribute::IfNetnsId(id));
    }
    let msg = req.execute().try_next().await.ok().flatten()?;
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::Xdp(xdp) => Some(matches!(attached(xdp), Some(XdpAttached::Driver | XdpAttached::Multiple))),
        _ => None,
    })
}

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
/// A generic netlink message's header: the command, version 1.
fn genl(cmd: u8) -> [u8; 4] {
    [cmd, 1, 0, 0]
}

/// `xdp_features` of every device, by index (Linux 6.3+).
pub fn xdp_features() -> io::Result<BTreeMap<u32, u64>> {
    let mut socket = Socket::new(NETLINK_GENERIC)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let name = attr(CTRL_ATTR_FAMILY_NAME, b"netdev\0");
    let family = request(&mut socket, GENL_ID_CTRL, NLM_F_REQUEST, genl(CTRL_CMD_GETFAMILY), &name)
        .map_err(|e| io::Error::new(e.kind(), format!("the netdev generic netlink family (Linux 6.3+): {e}")))?
        .iter()
        .find_map(|m| attrs(m.get(4..).unwrap_or(&[])).find(|(t, _)| *t == CTRL_ATTR_FAMILY_ID).and_then(|(_, v)| v.get(..2)))
        .map(|v| u16::from_ne_bytes([v[0], v[1]]))
        .ok_or_else(|| io::Error::other("no id for the netdev generic netlink family"))?;
    let mut devices = BTreeMap::new();
    for m in request(&mut socket, family, NLM_F_REQUEST | NLM_F_DUMP, genl(NETDEV_CMD_DEV_GET), &[])? {
        let (mut index, mut features) = (None, None);
        for (t, v) in attrs(m.get(4..).unwrap_or(&[])) {
            match (t, v.len()) {
                (NETDEV_A_DEV_IFINDEX, 4) => index = Some(u32::from_ne_bytes(v.try_into().expect("4 bytes"))),
                (NETDEV_A_DEV_XDP_FEATURES, 8) => features = Some(u64::from_ne_bytes(v.try_into().expect("8 bytes"))),
                _ => {}
            }
        }
        if let (Some(i), Some(f)) = (index, features) {
            devices.insert(i, f);
        }
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_veth_takes_xdp_frames_only_when_the_kernel_says_its_peer_can() {
        let veth = |features, peer| XdpDevice {
            name: "uplink0".into(),
            veth: true,
            generic: false,
            features: Some(features),
            peer_native_xdp: Some(peer),
        };
        // What this kernel reports for a veth whose peer has neither XDP nor GRO (0x23), and
        // once the peer runs XDP or turns GRO on (0x67).
        assert_eq!(veth(0x23, false).flags(), 0);
        assert!(veth(0x23, false).why_not_native().unwrap().contains("peer"));
        assert_eq!(veth(0x67, true).flags(), xdp_dev::TX | xdp_dev::XMIT);
        assert_eq!(veth(0x67, true).why_not_native(), None);
        // GRO alone on the peer sets the bit, but frames sent into it were seen to vanish.
        assert_eq!(veth(0x67, false).flags(), 0);
        let nic = XdpDevice { name: "eth0".into(), veth: false, generic: false, features: Some(XDP_ACT_BASIC), peer_native_xdp: None };
        assert_eq!(nic.flags(), xdp_dev::TX, "XDP_TX, but nothing may be redirected into it");
        let unknown = XdpDevice { features: None, ..nic.clone() };
        assert_eq!(unknown.flags(), 0);
        let generic = XdpDevice { generic: true, ..veth(0x23, false) };
        assert_eq!(generic.flags(), xdp_dev::GENERIC);
        assert_eq!(generic.why_not_native(), None);
    }

    #[test]
    fn attributes_are_walked_with_their_padding() {
        let mut payload = attr(CTRL_ATTR_FAMILY_NAME, b"netdev\0");
        payload.extend(attr(CTRL_ATTR_FAMILY_ID, &33u16.to_ne_bytes()));
        let got: Vec<(u16, Vec<u8>)> = attrs(&payload).map(|(t, v)| (t, v.to_vec())).collect();
        assert_eq!(got, vec![(CTRL_ATTR_FAMILY_NAME, b"netdev\0".to_vec()), (CTRL_ATTR_FAMILY_ID, 33u16.to_ne_bytes().to_vec())]);
    }
}
