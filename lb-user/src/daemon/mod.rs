//! `lb run`: the daemon's owner loop. One task owns every service's
//! balancer and the datapath, and is the only writer of the maps; kernel
//! reports, health results, control requests, timers and signals reach it
//! as messages, and it carries out what the pure code decides.
//!
//! Rooms: this file is the select loop and the dispatch of messages;
//! - `owner`: the owner loop's state (`Daemon`), which the rooms that act
//!   on it use;
//! - `messages`: what reaches the owner loop (`Message`, `Close`), plain
//!   data that every room may use;
//! - `startup`: the config to keep, the saved lists, adoption of a running
//!   datapath, memory tuning;
//! - `service`: one service's parts (config, balancer, tasks), and
//!   `service_table` every service, by name and by VIP;
//! - `inputs`: kernel reports, health results and deadlines to balancers,
//!   and the tick's look at the datapath;
//! - `apply`: a balancer's effects carried out (one write per change);
//! - `discovered`: discovered lists to server lists;
//! - `external_sync`: the external path (XDP) kept in step with the
//!   services; `external_state`: what it keeps between two syncs;
//! - `elections`: the leased VIPs' elections (`crate::election`) kept in
//!   step with the services, and turned into announcements;
//! - `membership`: the same for the elections by membership (`elect`);
//! - `load_balancers`: LoadBalancer Services' services beside the file's,
//!   and the allocating node's election; `load_balancer_task`: the task
//!   and what it said, which the loop holds;
//! - `closing`: VIP connections closed in the background, by the
//!   `close_worker` thread;
//! - `requests`: control requests and metrics scrapes;
//! - `reload`: a reload's plan (`crate::reload_plan::plan`) executed;
//! - `tasks`: the check loops and the kernel's event and log readers;
//! - `timers`: when each balancer next needs its clock;
//! - `watch`: when a full socket table is worth a log line.
//!
//! What it decides with lives below: the state machine in `balancer`,
//! what a reload changes in `reload`, the status view in `status`, the
//! socket protocol in `control`.

mod apply;
mod census;
mod close_worker;
mod closing;
mod discovered;
mod elections;
mod external_state;
mod external_sync;
mod inputs;
mod load_balancer_task;
mod load_balancers;
mod membership;
mod messages;
mod owner;
mod reload;
mod requests;
mod saver;
mod service;
mod service_table;
mod startup;
mod tasks;
mod timers;
mod watch;

use std::time::{Duration, Instant};

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::oneshot,
};
use tracing::info;

pub use self::owner::Options;
use self::{messages::Message, startup::Started};
use crate::{
    control::{Request, Response},
    datapath,
};

/// Why the owner loop ended.
enum Exit {
    Signal(&'static str),
    /// A control client asked; answered once the daemon has done what
    /// exiting means.
    Requested(oneshot::Sender<Response>),
    /// `lb detach` asked; answered once the daemon has let go of the pins.
    Detach(oneshot::Sender<Response>),
}

/// How the daemon ended, for its exit status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Stopped (a signal, a shutdown request): exit 0.
    Stopped,
    /// Stopped for `lb detach`: [`crate::detach::EXIT_DETACHED`].
    Detached,
}

/// Runs the daemon until SIGTERM/SIGINT or a shutdown request. The datapath
/// stays pinned and working after it returns (fail-static) unless
/// `detach_on_exit`.
pub async fn run(options: Options) -> anyhow::Result<Ended> {
    let detach_on_exit = options.detach_on_exit;
    let Started {
        mut daemon,
        mut messages,
        mut calls,
        mut discoveries,
        mut elections,
        mut memberships,
        mut served,
        mut scrapes,
    } = startup::start(options).await?;
    let socket_path = daemon.config.settings.control_socket.clone();
    let bpffs = daemon.config.settings.bpffs.clone();

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut hangup = signal(SignalKind::hangup())?;
    // Housekeeping (metrics of departed servers, a full socket table, the
    // watchdog); balancers
    // get their clock from `timers`, only when one needs it.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // systemd's WatchdogSec: pinged from the owner loop's tick, so a loop
    // that stops turning (not only a dead process) gets the daemon restarted.
    let watchdog = sd_notify::watchdog_enabled();
    if let Some(every) = watchdog {
        info!(?every, "systemd watchdog enabled; pinging every second");
    }
    // Before the first request: adopted XDP programs serve on with what
    // their maps hold until here.
    daemon.sync_external(true);
    let exit = loop {
        let deadline = daemon.timers.next().map(tokio::time::Instant::from_std);
        tokio::select! {
            _ = terminate.recv() => break Exit::Signal("SIGTERM"),
            _ = interrupt.recv() => break Exit::Signal("SIGINT"),
            _ = hangup.recv() => { let _ = daemon.reload(); }
            Some(scrape) = scrapes.recv() => { let _ = scrape.send(daemon.scrape()); }
            () = sleep_until(deadline) => daemon.on_deadlines(Instant::now()),
            _ = tick.tick() => {
                daemon.metrics.expire(Instant::now());
                daemon.sync_external(false);
                daemon.watch_socket_table(Instant::now());
                if watchdog.is_some() {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                }
            }
            Some((request, reply)) = calls.recv() => match request {
                Request::Shutdown => break Exit::Requested(reply),
                Request::Detach => break Exit::Detach(reply),
                Request::CloseConnections { server, service } => {
                    daemon.close_on_request(server, service.as_deref(), reply);
                }
                Request::Status => daemon.answer_status(reply),
                Request::SetServers { service, servers, default } => {
                    daemon.set_servers(&service, &servers, default, reply);
                }
                Request::Drain { service, server, undo } => {
                    answer(reply, daemon.drain(&service, server, undo));
                }
                Request::Reload => answer(reply, daemon.reload()),
            },
            Some(update) = discoveries.recv() => {
                // A burst (1,000 services changed at once) is applied in
                // one go, then saved and cleaned up once.
                daemon.on_discovered(update);
                while let Ok(update) = discoveries.try_recv() {
                    daemon.on_discovered(update);
                }
                daemon.after_discovered();
            }
            Some(update) = elections.recv() => daemon.on_election(update),
            Some(answering) = memberships.recv() => daemon.on_membership(answering),
            Ok(()) = served.changed() => {
                let now = served.borrow_and_update().clone();
                daemon.on_served(now);
            }
            Some(message) = messages.recv() => match message {
                Message::Kernel(event) => daemon.on_kernel_event(&event),
                Message::Health { service, server, result, took } => {
                    daemon.on_health(&service, server, result, took);
                }
                Message::CloseDone { close, result } => daemon.close_done(close, result),
            },
        }
    };
    // The same way out for a signal and a request: tell systemd, free the
    // socket path, detach if asked, and only then answer the requester.
    match &exit {
        Exit::Signal(name) => info!("{name}: exiting"),
        Exit::Requested(_) => info!("shutdown requested: exiting"),
        Exit::Detach(_) => info!("lb detach: exiting, and not to be restarted"),
    }
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let _ = std::fs::remove_file(&socket_path);
    // Detached for good, another node takes the leased VIPs over at once,
    // not when the leases run out; stopped to start again, the node keeps
    // them (a rollout moves no VIP).
    if matches!(exit, Exit::Detach(_)) || detach_on_exit {
        if let Some(speaker) = &mut daemon.bgp {
            speaker.stop();
        }
        daemon.resign().await;
    } else {
        daemon.keep_leases();
    }
    drop(daemon);
    if detach_on_exit {
        let removed = datapath::detach(&bpffs)?;
        info!(pins = removed.len(), "--detach-on-exit: detached everything");
    } else {
        info!("the datapath stays attached and keeps serving the last selections");
    }
    let (reply, ended) = match exit {
        Exit::Signal(_) => return Ok(Ended::Stopped),
        Exit::Requested(reply) => (reply, Ended::Stopped),
        Exit::Detach(reply) => (reply, Ended::Detached),
    };
    let _ = reply.send(Response::Ok);
    // The answer is written by the client's own task (`control::serve`):
    // give it the moment it needs before the process ends, or the client
    // sees the connection close without it.
    tokio::time::sleep(REPLY_GRACE).await;
    Ok(ended)
}

/// How long an exiting daemon waits for its last answer to be written.
const REPLY_GRACE: Duration = Duration::from_millis(200);

/// Sleeps until `deadline`, or for ever without one.
async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Answers a control request that succeeds with `Ok` or fails with an error.
fn answer(reply: oneshot::Sender<Response>, result: anyhow::Result<()>) {
    let response = match result {
        Ok(()) => Response::Ok,
        Err(e) => Response::Error { error: format!("{e:#}") },
    };
    let _ = reply.send(response);
}
