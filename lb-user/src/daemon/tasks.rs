//! The owner loop's helpers that run as tasks of their own: one health
//! check loop per server, the reader of the kernel's event ring buffer and
//! the reader of the kernel programs' log. Each sends what it learns to the
//! owner loop and decides nothing.

use std::{net::SocketAddr, sync::Arc, time::Instant};

use aya::maps::{MapData, RingBuf};
use lb_common::Event;
use tokio::{
    io::unix::AsyncFd,
    sync::{Notify, mpsc},
};
use tracing::error;

use super::messages::Message;
use crate::{
    config, datapath,
    health::{Checker, Tls},
};

/// Checks `server` every interval, and at once when `now` is notified.
/// The checker is built here, on a blocking thread, not by the owner loop:
/// an https client may load the system's CA store, which takes a while.
pub(super) async fn check_loop(
    service: String,
    server: SocketAddr,
    health: config::HealthConfig,
    tls: Tls,
    now: Arc<Notify>,
    tx: mpsc::Sender<Message>,
) {
    let interval = health.interval;
    let checker =
        match tokio::task::spawn_blocking(move || Checker::new(&health, &tls, server)).await {
            Ok(Ok(Some(checker))) => checker,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => return error!(service, %server, "cannot check this server: {e:#}"),
            Err(e) => return error!(service, %server, "building the checker failed: {e}"),
        };
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = now.notified() => ticker.reset(),
        }
        let started = Instant::now();
        let result = checker.check(server).await;
        let took = started.elapsed();
        if tx
            .send(Message::Health { service: service.clone(), server, result, took })
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Reads the kernel's connection events and hands them to the owner task.
pub(super) async fn forward_events(events: RingBuf<MapData>, tx: mpsc::Sender<Message>) {
    // SAFETY: the ring buffer owns its fd and keeps it open while registered.
    let mut events = match unsafe { AsyncFd::register(events) } {
        Ok(fd) => fd,
        Err(e) => {
            error!("cannot poll the event ring buffer: {e}");
            return;
        }
    };
    loop {
        let Ok(mut guard) = events.readable_mut().await else { return };
        let ring = guard.get_inner_mut();
        while let Some(item) = ring.next() {
            let Some(event) = Event::from_bytes(&item) else { continue };
            if tx.send(Message::Kernel(event)).await.is_err() {
                return;
            }
        }
        guard.clear_ready();
    }
}

/// `--bpf-log`: drains the kernel programs' log ring buffer as it fills.
pub(super) async fn forward_kernel_logs(logger: datapath::KernelLogger) {
    // SAFETY: the logger owns its ring buffer fd and keeps it open.
    let mut logger = match unsafe { AsyncFd::register(logger) } {
        Ok(fd) => fd,
        Err(e) => {
            error!("cannot poll the kernel log buffer: {e}");
            return;
        }
    };
    loop {
        let Ok(mut guard) = logger.readable_mut().await else { return };
        guard.get_inner_mut().flush();
        guard.clear_ready();
    }
}
