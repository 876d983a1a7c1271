//! Interfaces coming and going, from rtnetlink: the current list, then every change.

use futures::{StreamExt, TryStreamExt};
use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::{
    link::{LinkAttribute, LinkMessage},
    RouteNetlinkMessage,
};
use netlink_sys::{AsyncSocket, SocketAddr};
use tokio::sync::mpsc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkChange {
    /// A link exists (new, renamed, or changed state).
    Present { index: u32, name: String },
    Gone { index: u32 },
}

fn name_of(msg: &LinkMessage) -> Option<String> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

/// Subscribes to link changes, then lists the links that exist. Subscribing first means a link
/// created during the listing is not missed (it may be reported twice, which is harmless).
pub async fn watch(tx: mpsc::Sender<LinkChange>) -> std::io::Result<Vec<(u32, String)>> {
    let (mut conn, handle, mut messages) = rtnetlink::new_connection()?;
    conn.socket_mut().socket_mut().bind(&SocketAddr::new(0, rtnetlink::constants::RTMGRP_LINK))?;
    tokio::spawn(conn);
    let mut links = Vec::new();
    let mut dump = handle.link().get().execute();
    while let Some(msg) = dump.try_next().await.map_err(std::io::Error::other)? {
        if let Some(name) = name_of(&msg) {
            links.push((msg.header.index, name));
        }
    }
    tokio::spawn(async move {
        // Keep the handle alive with the task: dropping it closes the connection.
        let _handle = handle;
        while let Some((msg, _)) = messages.next().await {
            let change = match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => {
                    name_of(&m).map(|name| LinkChange::Present { index: m.header.index, name })
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => {
                    Some(LinkChange::Gone { index: m.header.index })
                }
                _ => None,
            };
            if let Some(c) = change {
                if tx.send(c).await.is_err() {
                    return;
                }
            }
        }
        tracing::error!("the netlink link watch ended; new interfaces will not be attached");
    });
    Ok(links)
}
