//! The `stag` command line: `stag devices`, `stag lat …`, `stag bw …`.

use clap::{Parser, Subcommand};

mod bench;
mod rdma_core;
mod signal_forward;

use stag::verbs::{self, Backend, Capabilities, Context};

/// stag: RDMA verbs over physical RNICs, soft-RoCE/soft-iWARP and a
/// userspace iWARP provider.
#[derive(Debug, Parser)]
#[command(name = "stag", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List devices and what each can do (native, emulated or unsupported).
    Devices {
        /// Also print each operation's emulation method and cost.
        #[arg(short, long)]
        verbose: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Latency microbenchmark (perftest-style): server without HOST,
    /// client with it, or both with --loopback.
    Lat(bench::lat::LatArgs),
    /// Bandwidth microbenchmark (perftest-style): server without HOST,
    /// client with it, or both with --loopback.
    Bw(bench::bw::BwArgs),
    /// The raw-TCP (and msync) floor stag is measured against: `stag floor
    /// lat|bw [HOST]` (server without HOST), `stag floor msync`.
    Floor(bench::floor::FloorArgs),
    /// Many connected QPs at rest: connection rate, memory per idle QP, idle
    /// CPU, and that every QP still works after (server without HOST).
    Scale(bench::scale::ScaleArgs),
    /// Run an unmodified libibverbs/librdmacm program on stag0 (no root, no
    /// setup): `stag run -- ib_write_lat -R HOST`.
    Run {
        /// The program and its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Make stag0 an rdma-core device for the whole machine (root, once):
    /// plain `ibv_devices` lists it in new login sessions.
    Install {
        /// Undo a previous install.
        #[arg(long)]
        uninstall: bool,
    },
}

#[derive(Debug, serde::Serialize)]
struct DeviceReport {
    name: String,
    backend: Backend,
    transport: String,
    capabilities: Option<Capabilities>,
    error: Option<String>,
}

fn devices(verbose: bool, json: bool) -> i32 {
    let reports: Vec<DeviceReport> = verbs::devices()
        .into_iter()
        .map(|d| {
            let (capabilities, error) = match Context::open(&d.name) {
                Ok(ctx) => (Some(ctx.capabilities().clone()), None),
                Err(e) => (None, Some(e.to_string())),
            };
            DeviceReport {
                name: d.name,
                backend: d.backend,
                transport: d.transport,
                capabilities,
                error,
            }
        })
        .collect();
    if json {
        match serde_json::to_string_pretty(&reports) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("stag: {e}");
                return 1;
            }
        }
        return 0;
    }
    for r in &reports {
        println!("{} ({:?}, {})", r.name, r.backend, r.transport);
        if let Some(e) = &r.error {
            println!("  cannot open: {e}");
            continue;
        }
        let Some(caps) = &r.capabilities else {
            continue;
        };
        println!("  {:<17} {}", "(posts with)", caps.post_path);
        for (op, support) in &caps.ops {
            let short = match support {
                verbs::Support::Native => "native".to_owned(),
                verbs::Support::Emulated { .. } if !verbose => "emulated".to_owned(),
                verbs::Support::NativeExcept { .. } if !verbose => {
                    "native (some targets emulated)".to_owned()
                }
                verbs::Support::Unsupported { .. } if !verbose => "unsupported".to_owned(),
                other => other.to_string(),
            };
            println!("  {:<17} {short}", op.name());
        }
    }
    0
}

fn bench_exit(r: Result<(), bench::BenchError>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("stag: {e}");
            1
        }
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Devices { verbose, json } => devices(verbose, json),
        Command::Lat(args) => bench_exit(bench::run_lat(args)),
        Command::Bw(args) => bench_exit(bench::run_bw(args)),
        Command::Floor(args) => bench_exit(bench::floor::run_floor(args)),
        Command::Scale(args) => bench_exit(bench::scale::run_scale(args)),
        Command::Run { command } => rdma_core::run(&command).unwrap_or_else(|e| {
            eprintln!("stag run: {e}");
            127
        }),
        Command::Install { uninstall } => match rdma_core::install(uninstall) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("stag install: {e}");
                1
            }
        },
    };
    std::process::exit(code);
}
