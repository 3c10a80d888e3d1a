//! `lb`: the daemon (`lb run`) and its command-line client.

use std::process::ExitCode;

use clap::Parser as _;
use lb_user::{
    cli::{Cli, Command, LogFormat},
    client, daemon, detach,
};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cli.log_level));
    // Colours only on a terminal: logs in files and journald stay plain.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    // BIRD's supervisor: no async runtime, no threads.
    if let Command::BgpSpeaker { dir, speaker } = &cli.command {
        return match lb_user::bgp::supervisor::run(dir, speaker) {
            Ok(status) if status.success() => ExitCode::SUCCESS,
            Ok(status) => {
                ExitCode::from(status.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1))
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime =
        match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("error: cannot start the async runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run { config, bpf_log, detach_on_exit } => {
                daemon::run(daemon::Options { config_path: config, bpf_log, detach_on_exit }).await
            }
            command => client::run(command).await.map(|()| daemon::Ended::Stopped),
        }
    });
    match result {
        Ok(daemon::Ended::Stopped) => ExitCode::SUCCESS,
        Ok(daemon::Ended::Detached) => ExitCode::from(detach::EXIT_DETACHED),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
