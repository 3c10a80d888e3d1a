//! The options of `cargo xtask bench`.

/// The options of `cargo xtask bench`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Rounds per figure, the routes taking turns; more rounds, a steadier
    /// median (the run's time limit grows with them).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Seconds per wrk run (several runs per route and round).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=30))]
    pub wrk_seconds: u64,
    /// Run only these parts (comma-separated). Default: all.
    #[arg(long, value_delimiter = ',', value_enum)]
    pub only: Vec<Part>,
}

/// A part of the benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Paths,
    Scale,
    Failover,
    Discovery,
    Owner,
    Dns,
    External,
    Election,
    LoadBalancers,
    Bgp,
}
