//! `stag lat` / `stag bw` end to end through the built binary, on the
//! userspace provider in loopback. Checks the JSON's shape and sanity, never
//! timing thresholds (the machine may be shared).

use std::process::Command;

use serde_json::Value;

fn stag(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(args)
        .env("STAG_DEVICE", "stag0")
        .output()
        .expect("run stag");
    assert!(
        out.status.success(),
        "stag {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stag {args:?} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

#[test]
fn lat_write_loopback_json() {
    let v = stag(&["lat", "write", "--loopback", "-n", "200", "--json"]);
    assert_eq!(v["test"], "lat");
    assert_eq!(v["op"], "write");
    assert_eq!(v["device"], "stag0");
    assert_eq!(v["backend"], "userspace");
    assert_eq!(v["latency_factor"], 2);
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 1);
    let r = &results[0];
    assert_eq!(r["bytes"], 2);
    assert_eq!(r["iterations"], 200);
    let (min, typ, max) = (
        num(r, "t_min_us"),
        num(r, "t_typical_us"),
        num(r, "t_max_us"),
    );
    assert!(min > 0.0, "{r}");
    assert!(min <= typ && typ <= max, "{r}");
    let avg = num(r, "t_avg_us");
    assert!(min <= avg && avg <= max, "{r}");
    assert!(num(r, "t_stdev_us") >= 0.0);
    let (p99, p999) = (num(r, "p99_us"), num(r, "p999_us"));
    assert!(typ <= p99 && p99 <= p999 && p999 <= max, "{r}");
}

#[test]
fn bw_write_loopback_json() {
    let v = stag(&[
        "bw",
        "write",
        "--loopback",
        "-n",
        "200",
        "-s",
        "65536",
        "--json",
    ]);
    assert_eq!(v["test"], "bw");
    assert_eq!(v["op"], "write");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 1);
    let r = &results[0];
    assert_eq!(r["bytes"], 65536);
    assert_eq!(r["iterations"], 200);
    let (peak, avg) = (num(r, "bw_peak_mb_s"), num(r, "bw_avg_mb_s"));
    assert!(avg > 0.0 && peak >= avg, "{r}");
    assert!(num(r, "msg_rate_mpps") > 0.0, "{r}");
    assert!(num(r, "bw_avg_gbit_s") > 0.0, "{r}");
}

#[test]
fn emulated_atomic_and_blocking_loopback() {
    let v = stag(&[
        "lat",
        "masked-fetch-add",
        "--loopback",
        "-n",
        "50",
        "--blocking",
        "--emulate",
        "masked-fetch-add",
        "--json",
    ]);
    assert_eq!(v["support"], "emulated");
    assert_eq!(v["completions"], "blocking");
    assert_eq!(v["results"][0]["iterations"], 50);
    assert_eq!(v["results"][0]["bytes"], 8);
}

#[test]
fn send_bw_with_credits_loopback() {
    // More messages than receives posted: exercises the credit return.
    let v = stag(&[
        "bw",
        "send",
        "--loopback",
        "-n",
        "600",
        "-s",
        "512",
        "--json",
    ]);
    assert_eq!(v["results"][0]["iterations"], 600);
}

#[test]
fn progress_mode_in_the_report() {
    let v = stag(&[
        "lat",
        "send",
        "--loopback",
        "-n",
        "50",
        "--progress",
        "blocking",
        "--json",
    ]);
    assert_eq!(v["progress"], "blocking");
    assert_eq!(v["results"][0]["iterations"], 50);
}

/// A ping-pong reposts each receive after its answer: many more messages
/// than the receive queue holds (128) must each find a receive, for every
/// operation that takes one.
#[test]
fn ping_pong_reposts_outlast_the_receive_queue() {
    for op in ["send", "imm", "write-imm"] {
        let v = stag(&["lat", op, "--loopback", "-n", "1000", "--json"]);
        assert_eq!(v["op"], op);
        assert_eq!(v["results"][0]["iterations"], 1000, "{op}");
    }
}

#[test]
fn bad_arguments_fail_cleanly() {
    let out = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(["lat", "write", "--blocking", "--loopback"])
        .env("STAG_DEVICE", "stag0")
        .output()
        .expect("run stag");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("write-imm"));
}

/// A port nothing listens on right now (the server binds it next).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

/// Run a server (`server_args`, with `-p PORT`) in its own process and the
/// client (`client_args` + `127.0.0.1 -p PORT --json`) in another, once
/// the server says it is listening; the client's JSON.
fn two_processes(server_args: &[&str], client_args: &[&str]) -> Value {
    use std::io::{BufRead, BufReader, Read};
    let port = free_port().to_string();
    let mut server = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(server_args)
        .args(["-p", &port])
        .env("STAG_DEVICE", "stag0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the server");
    // Wait for the server's "listening" line (or its exit), keeping what
    // it printed for a failure report.
    let mut err = BufReader::new(server.stderr.take().expect("piped stderr"));
    let mut srv_err = String::new();
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).expect("server stderr") == 0 {
            break;
        }
        srv_err.push_str(&line);
        if line.contains("waiting") || line.contains("listening") {
            break;
        }
    }
    let drain = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
        rest
    });
    let mut args: Vec<&str> = client_args.to_vec();
    args.extend(["127.0.0.1", "-p", &port, "--json"]);
    let out = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(&args)
        .env("STAG_DEVICE", "stag0")
        .output()
        .expect("run the client");
    if !out.status.success() {
        let _ = server.kill();
    }
    let status = server.wait().expect("server exit");
    srv_err.push_str(&drain.join().unwrap_or_default());
    assert!(
        out.status.success() && status.success(),
        "client {args:?}: {}\nserver {server_args:?}: {srv_err}",
        String::from_utf8_lossy(&out.stderr),
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn floor_lat_two_processes_busy_and_blocking() {
    for mode in ["busy", "blocking"] {
        let v = two_processes(
            &["floor", "lat", "--mode", mode],
            &["floor", "lat", "--mode", mode, "-n", "300", "-s", "64"],
        );
        assert_eq!(v["test"], "lat");
        assert_eq!(v["mode"], mode);
        assert_eq!(v["latency_factor"], 2);
        let r = &v["results"][0];
        assert_eq!(r["bytes"], 64);
        assert_eq!(r["iterations"], 300);
        let (min, typ, max) = (
            num(r, "t_min_us"),
            num(r, "t_typical_us"),
            num(r, "t_max_us"),
        );
        assert!(min > 0.0 && min <= typ && typ <= max, "{r}");
        // The round trip is the one-way figure doubled, sample by sample.
        assert!((num(r, "rtt_typical_us") - 2.0 * typ).abs() < 1e-9, "{r}");
        assert!((num(r, "rtt_avg_us") - 2.0 * num(r, "t_avg_us")).abs() < 1e-6);
        assert!(num(r, "rtt_p99_us") >= num(r, "rtt_typical_us"));
    }
}

#[test]
fn floor_bw_streams_two_processes() {
    let v = two_processes(
        &["floor", "bw"],
        &["floor", "bw", "-s", "8", "-n", "5000", "--streams", "3"],
    );
    assert_eq!(v["test"], "bw");
    assert_eq!(v["streams"], 3);
    let r = &v["results"][0];
    assert_eq!(r["bytes"], 8);
    // Messages of all streams together.
    assert_eq!(r["iterations"], 15000);
    let (avg, rate) = (num(r, "bw_avg_mb_s"), num(r, "msg_rate_mpps"));
    assert!(avg > 0.0 && rate > 0.0, "{r}");
    // Same run, two units: MiB/s = messages/s × 8 B / 2^20.
    assert!(
        (avg - rate * 1e6 * 8.0 / 1048576.0).abs() < 1e-6 * avg,
        "{r}"
    );
    assert!(num(r, "bw_peak_mb_s") >= avg);
}

#[test]
fn floor_bw_blocking_large_messages() {
    let v = two_processes(
        &["floor", "bw", "--mode", "blocking"],
        &["floor", "bw", "--mode", "blocking", "-n", "20"],
    );
    let r = &v["results"][0];
    assert_eq!(r["bytes"], 1 << 20);
    assert_eq!(r["iterations"], 20);
    assert!(num(r, "bw_avg_mb_s") > 0.0, "{r}");
}

#[test]
fn floor_msync_json() {
    let v = stag(&["floor", "msync", "-s", "8", "-n", "20", "--json"]);
    assert_eq!(v["test"], "msync");
    let r = &v["results"][0];
    assert_eq!(
        (r["bytes"].as_u64(), r["iterations"].as_u64()),
        (Some(8), Some(20))
    );
    assert!(num(r, "t_min_us") > 0.0 && num(r, "t_typical_us") <= num(r, "t_max_us"));
}

#[test]
fn floor_refuses_a_mismatched_client() {
    // A `floor bw` client against a `floor lat` server: both fail, neither
    // hangs.
    let port = free_port().to_string();
    let server = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(["floor", "lat", "-p", &port])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the server");
    let out = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(["floor", "bw", "127.0.0.1", "-p", &port, "-n", "10"])
        .output()
        .expect("run the client");
    let srv = server.wait_with_output().expect("server exit");
    assert!(!srv.status.success());
    assert!(String::from_utf8_lossy(&srv.stderr).contains("the client runs bw"));
    assert!(!out.status.success());
}

#[test]
fn bw_multi_qp_two_processes() {
    let v = two_processes(
        &["bw", "write"],
        &["bw", "write", "-s", "64", "-n", "300", "--qps", "3"],
    );
    assert_eq!(v["qps"], 3);
    let r = &v["results"][0];
    assert_eq!(r["bytes"], 64);
    // -n is per QP; the report counts every QP's messages.
    assert_eq!(r["iterations"], 900);
    let (avg, peak, rate) = (
        num(r, "bw_avg_mb_s"),
        num(r, "bw_peak_mb_s"),
        num(r, "msg_rate_mpps"),
    );
    assert!(avg > 0.0 && peak >= avg && rate > 0.0, "{r}");
}

#[test]
fn bw_multi_qp_reads_loopback() {
    // Reads keep their ORD-limited window on each QP.
    let v = stag(&[
        "bw",
        "read",
        "--loopback",
        "-s",
        "4096",
        "-n",
        "100",
        "--qps",
        "2",
        "--json",
    ]);
    assert_eq!(v["qps"], 2);
    assert_eq!(v["tx_depth"], 16);
    assert_eq!(v["results"][0]["iterations"], 200);
}
