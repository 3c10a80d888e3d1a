use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Parser as _;
use lb_user::{
    cli::{Cli, Command, LogFormat},
    config::{ClientPaths, Config},
    control::{self, Request, Response},
    daemon, datapath,
};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cli.log_level));
    // Colours only on a terminal: logs in files and journald stay plain.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run { config, bpf_log, detach_on_exit } => daemon::run(daemon::Options { config_path: config, bpf_log, detach_on_exit }).await,
        Command::CheckConfig { file } => {
            let config = Config::load(&file)?;
            println!("{}: ok ({} services)", file.display(), config.services.len());
            Ok(())
        }
        Command::Status { config, json, watch } => {
            let paths = ClientPaths::load(&config)?;
            loop {
                let status = match control::call(&paths.control_socket, &Request::Status).await? {
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
                    print!("{}", status.table());
                }
                if !watch {
                    return Ok(());
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
        Command::Reload { config } => {
            let paths = ClientPaths::load(&config)?;
            expect_ok(control::call(&paths.control_socket, &Request::Reload).await?)?;
            println!("config reloaded");
            Ok(())
        }
        Command::CloseConnections { server, service, config } => {
            let paths = ClientPaths::load(&config)?;
            match control::call(&paths.control_socket, &Request::CloseConnections { server, service }).await? {
                Response::Closed { closed } => println!("closed {closed} connections to {server}"),
                Response::Error { error } => bail!(error),
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
        Command::Servers { service, servers, default, config } => {
            let paths = ClientPaths::load(&config)?;
            let request = Request::SetServers { service: service.clone(), servers, default };
            expect_ok(control::call(&paths.control_socket, &request).await?)?;
            println!("server list of {service} set");
            Ok(())
        }
        Command::Drain { service, server, undo, config } => {
            let paths = ClientPaths::load(&config)?;
            let request = Request::Drain { service: service.clone(), server, undo };
            expect_ok(control::call(&paths.control_socket, &request).await?)?;
            println!("{server} of {service} {}", if undo { "no longer drained" } else { "drained" });
            Ok(())
        }
        Command::Detach { config } => {
            let paths = ClientPaths::load(&config)?;
            if daemon::stop_running_daemon(&paths.control_socket).await {
                println!("stopped the running daemon");
            }
            let removed = datapath::detach(&paths.bpffs).with_context(|| format!("detaching {}", paths.bpffs.display()))?;
            if removed.is_empty() {
                println!("nothing attached under {}", paths.bpffs.display());
            } else {
                println!("detached: removed {} pins under {}", removed.len(), paths.bpffs.display());
            }
            Ok(())
        }
    }
}

fn expect_ok(response: Response) -> anyhow::Result<()> {
    match response {
        Response::Ok => Ok(()),
        Response::Error { error } => bail!(error),
        other => bail!("unexpected answer: {other:?}"),
    }
}
