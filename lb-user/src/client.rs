//! The subcommands that talk to a running daemon through its control socket
//! (`lb status`, `reload`, `servers`, `drain`, `close-connections`,
//! `detach`), and `lb check-config`, which needs no daemon.

use std::{path::Path, time::Duration};

use anyhow::{Context as _, bail};

use crate::{
    cli::Command,
    config::{ClientPaths, Config},
    control::{self, Request, Response},
    datapath, status,
};

/// Runs a client subcommand. `lb run` is not one: the caller starts the
/// daemon for it.
pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run { .. } => bail!("`lb run` starts the daemon; it is not a client command"),
        Command::BgpSpeaker { .. } => {
            bail!("`lb bgp-speaker` is started by the daemon; it is not a client command")
        }
        Command::CheckConfig { file } => {
            let config = Config::load(&file)?;
            println!("{}: ok ({} services)", file.display(), config.services.len());
        }
        Command::Status { config, json, watch } => {
            let socket = ClientPaths::load(&config)?.control_socket;
            loop {
                let status = match control::call(&socket, &Request::Status).await? {
                    Response::Status(status) => status,
                    other => bail!("unexpected answer: {other:?}"),
                };
                if watch {
                    // Clear the screen and go home, like `watch`.
                    print!("\x1b[2J\x1b[H");
                }
                if json {
                    println!("{}", serde_json::to_string_pretty(&status)?);
                } else {
                    print!("{}", status::table(&status));
                }
                if !watch {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        Command::Reload { config } => {
            expect_ok(&config, &Request::Reload).await?;
            println!("config reloaded");
        }
        Command::CloseConnections { server, service, config } => {
            let socket = ClientPaths::load(&config)?.control_socket;
            match control::call(&socket, &Request::CloseConnections { server, service }).await? {
                Response::Closed { closed } => println!("closed {closed} connections to {server}"),
                Response::Error { error } => bail!(error),
                other => bail!("unexpected answer: {other:?}"),
            }
        }
        Command::Servers { service, servers, default, config } => {
            expect_ok(&config, &Request::SetServers { service: service.clone(), servers, default })
                .await?;
            println!("server list of {service} set");
        }
        Command::Drain { service, server, undo, config } => {
            expect_ok(&config, &Request::Drain { service: service.clone(), server, undo }).await?;
            println!(
                "{server} of {service} {}",
                if undo { "no longer drained" } else { "drained" }
            );
        }
        Command::Detach { config } => {
            let paths = ClientPaths::load(&config)?;
            // Stop a running daemon first so it does not keep working on a
            // datapath that is going away; it exits so that it is not
            // restarted. An lb from before `Detach` is asked to shut down.
            let socket = &paths.control_socket;
            let stopped = match control::call(socket, &Request::Detach).await {
                Ok(Response::Ok) => true,
                Ok(_) => {
                    matches!(control::call(socket, &Request::Shutdown).await, Ok(Response::Ok))
                }
                Err(_) => false,
            };
            if stopped {
                println!("stopped the running daemon");
            }
            // The BGP speaker the daemon ran, if it answers (a daemon that
            // was killed left it announcing): its routes are withdrawn.
            if crate::bgp::stop_speaker(&paths.state_dir) {
                println!("stopped BIRD: its routes are withdrawn");
            }
            let removed = datapath::detach(&paths.bpffs)
                .with_context(|| format!("detaching {}", paths.bpffs.display()))?;
            if removed.is_empty() {
                println!("nothing attached under {}", paths.bpffs.display());
            } else {
                println!(
                    "detached: removed {} pins under {}",
                    removed.len(),
                    paths.bpffs.display()
                );
            }
        }
    }
    Ok(())
}

/// Sends `request` to the daemon of the config at `config`; its answer
/// must be `Ok`.
async fn expect_ok(config: &Path, request: &Request) -> anyhow::Result<()> {
    let socket = ClientPaths::load(config)?.control_socket;
    match control::call(&socket, request).await? {
        Response::Ok => Ok(()),
        Response::Error { error } => bail!(error),
        other => bail!("unexpected answer: {other:?}"),
    }
}
