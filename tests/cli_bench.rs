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
fn bad_arguments_fail_cleanly() {
    let out = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(["lat", "write", "--blocking", "--loopback"])
        .env("STAG_DEVICE", "stag0")
        .output()
        .expect("run stag");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("write-imm"));
}
