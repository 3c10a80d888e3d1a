use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Parser as _;
use lb_user::{
    cli::{Cli, Command},
    config::Config,
    control::{self, Request, Response},
    daemon, datapath,
};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cli.log_level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
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
        Command::Run { config, bpf_log } => daemon::run(daemon::Options { config_path: config, bpf_log }).await,
        Command::CheckConfig { file } => {
            let config = Config::load(&file)?;
            println!("{}: ok ({} services)", file.display(), config.services.len());
            Ok(())
        }
        Command::Status { config, json } => {
            let config = Config::load(&config)?;
            match control::call(&config.daemon.control_socket, &Request::Status).await? {
                Response::Status(status) if json => println!("{}", serde_json::to_string_pretty(&status)?),
                Response::Status(status) => print!("{}", status.table()),
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
        Command::CloseConnections { server, service, config } => {
            let config = Config::load(&config)?;
            match control::call(&config.daemon.control_socket, &Request::CloseConnections { server, service }).await? {
                Response::Closed { closed } => println!("closed {closed} connections to {server}"),
                Response::Error { error } => bail!(error),
                other => bail!("unexpected answer: {other:?}"),
            }
            Ok(())
        }
        Command::Servers { service, servers, default, config } => {
            let config = Config::load(&config)?;
            let request = Request::SetServers { service: service.clone(), servers, default };
            expect_ok(control::call(&config.daemon.control_socket, &request).await?)?;
            println!("server list of {service} set");
            Ok(())
        }
        Command::Drain { service, server, undo, config } => {
            let config = Config::load(&config)?;
            let request = Request::Drain { service: service.clone(), server, undo };
            expect_ok(control::call(&config.daemon.control_socket, &request).await?)?;
            println!("{server} of {service} {}", if undo { "no longer drained" } else { "drained" });
            Ok(())
        }
        Command::Detach { config } => {
            let config = Config::load(&config)?;
            if daemon::stop_running_daemon(&config.daemon.control_socket).await {
                println!("stopped the running daemon");
            }
            let removed = datapath::detach(&config.daemon.bpffs)
                .with_context(|| format!("detaching {}", config.daemon.bpffs.display()))?;
            if removed.is_empty() {
                println!("nothing attached under {}", config.daemon.bpffs.display());
            } else {
                println!("detached: removed {} pins under {}", removed.len(), config.daemon.bpffs.display());
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
