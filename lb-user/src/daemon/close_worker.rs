//! The thread that closes VIP connections (`closing` decides which). A
//! close walks the whole socket table and dumps every TCP socket of the
//! node with netlink, each taking long with tens of thousands of sockets;
//! so the closes asked for while one runs are done together, with one walk
//! and one dump for all of them, and never on the owner loop.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::{Arc, mpsc},
};

use tokio::sync::mpsc as tokio_mpsc;
use tracing::warn;

use super::messages::{Close, Counts, Message};
use crate::{datapath::SocketTables, sock_destroy};

/// Which connections a close wants: `(vip, server) -> bool`.
pub(super) type Wanted = Box<dyn Fn(SocketAddr, SocketAddr) -> bool + Send>;

/// One close: what it wants, why (the answer goes back to the owner loop
/// as [`Message::CloseDone`]), and whether pods' namespaces are searched.
pub(super) struct Job {
    pub(super) wanted: Wanted,
    pub(super) close: Close,
    pub(super) other_namespaces: bool,
}

/// The owner loop's handle on the closing thread, which ends with it.
pub(super) struct Closer {
    jobs: mpsc::Sender<Job>,
}

impl Closer {
    /// Starts the thread; outcomes go to `done`.
    pub(super) fn start(
        tables: Arc<SocketTables>,
        done: tokio_mpsc::Sender<Message>,
    ) -> anyhow::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new().name("lb-closer".into()).spawn(move || {
            while let Ok(first) = queue.recv() {
                let batch: Vec<Job> = std::iter::once(first).chain(queue.try_iter()).collect();
                for (close, result) in close_batch(&tables, batch) {
                    let _ = done.blocking_send(Message::CloseDone { close, result });
                }
            }
        })?;
        Ok(Self { jobs })
    }

    /// Queues `job`; its outcome comes back as a message.
    pub(super) fn close(&self, job: Job) {
        if let Err(mpsc::SendError(job)) = self.jobs.send(job) {
            warn!("the closing thread is gone; connections are left to end on their own");
            drop(job);
        }
    }
}

/// Does the closes of `batch` with one walk of the table and one search
/// for the sockets: each close's outcome, counted by (VIP, server).
fn close_batch(tables: &SocketTables, batch: Vec<Job>) -> Vec<(Close, Result<Counts, String>)> {
    let mut picked: Vec<HashMap<u64, (SocketAddr, SocketAddr)>> =
        batch.iter().map(|_| HashMap::new()).collect();
    for socket in tables.vip_sockets() {
        for (job, sockets) in batch.iter().zip(&mut picked) {
            if (job.wanted)(socket.vip, socket.server) {
                sockets.insert(socket.cookie, (socket.vip, socket.server));
            }
        }
    }
    let cookies: HashSet<u64> = picked.iter().flat_map(|s| s.keys().copied()).collect();
    let other_namespaces = batch.iter().any(|job| job.other_namespaces);
    let destroyed = match sock_destroy::destroy_everywhere(&cookies, other_namespaces) {
        Ok(destroyed) => destroyed,
        Err(e) => {
            let e = format!("destroying sockets with netlink SOCK_DESTROY: {e}");
            return batch.into_iter().map(|job| (job.close, Err(e.clone()))).collect();
        }
    };
    if let Some((e, left)) = &destroyed.not_searched {
        warn!(
            left,
            "closing connections: {left} were not found in lb's network namespace, and the others could not all be searched ({e}); entering pods' namespaces needs CAP_SYS_ADMIN"
        );
    }
    let destroyed: HashSet<u64> = destroyed.cookies.into_iter().collect();
    batch
        .into_iter()
        .zip(picked)
        .map(|(job, sockets)| {
            let mut counts = Counts::new();
            for (cookie, pair) in sockets {
                if destroyed.contains(&cookie) {
                    *counts.entry(pair).or_default() += 1;
                }
            }
            (job.close, Ok(counts))
        })
        .collect()
}
