//! The `stag` command line: `stag devices`, `stag lat …`, `stag bw …`.

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    println!("stag {}", env!("CARGO_PKG_VERSION"));
}
