//! What a sharded step sends and holds per rank, measured: each rank is a
//! process of this binary holding a flat f32 model of P parameters (the
//! all-gather's output, as FSDP's flat parameter), its full f32 gradient and
//! 1/N of the master parameters and AdamW state. A step reduce-scatters the
//! gradient, all-reduces its norm, updates the chunk (AdamW's element-wise
//! work) and all-gathers the chunks back, through c10d's Gloo over loopback.
//! Printed per world size: median step time, bytes sent per rank (the
//! process's write syscalls, /proc/self/io: Gloo writes with writev), bytes
//! received per rank (everything loopback received during the step, over N:
//! Gloo reads with recv, which /proc/self/io does not count), peak resident
//! memory per rank during the steps (VmHWM, reset after setup), and the ratio of bytes to the FSDP bound
//! 2 x (N-1)/N x model bytes. Gloo has no reduce-scatter of its own (c10d
//! runs it as an all-reduce, 1.5x the bound); the crate's is a ring of sends
//! and receives, so expect the bound itself (NCCL's is native).
//!
//! Forward and backward passes are not part of it (they do not depend on N;
//! `cargo bench -p learner --bench grpo_step` times them).
//!
//! Run: `cargo bench -p sleuth-c10d --bench sharded_exchange` (or `make bench`);
//! `SLEUTH_BENCH_MODELS=500000000:1,2` picks models (parameters) and world sizes.

use std::process::Command;
use std::time::{Duration, Instant};

use sleuth_c10d::{Collective, ProcessGroup, Reduce, Rendezvous};
use tch::{Device, Kind, Tensor};

const STEPS: usize = 3;

/// SmolLM2-135M's parameter count (tied embeddings), and a synthetic 500M model.
const DEFAULT_MODELS: &str = "134515008:1,2,4;500000000:1,2";

/// Bytes loopback has received so far (every process's, /proc/net/dev).
fn loopback_received() -> u64 {
    let text = std::fs::read_to_string("/proc/net/dev").unwrap_or_default();
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix("lo:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn proc_field(path: &str, field: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// One rank: prints `rank seconds-per-step sent received peak-bytes`.
fn rank(params: usize, world: usize, rank: usize, port: u16) {
    tch::set_num_threads(1);
    let rendezvous =
        Rendezvous { timeout: Duration::from_secs(120), ..Rendezvous::new("127.0.0.1", port, world, rank) };
    let mut group = ProcessGroup::connect(&rendezvous, Device::Cpu).expect("rendezvous");
    let chunk = params.div_ceil(world);
    let options = (Kind::Float, Device::Cpu);
    let full = Tensor::randn([(chunk * world) as i64], options) * 0.02;
    let grads = Tensor::randn([(chunk * world) as i64], options) * 1e-3;
    let master = full.narrow(0, (rank * chunk) as i64, chunk as i64).copy();
    let (m, v) = (master.zeros_like(), master.zeros_like());
    let grad = master.zeros_like();
    // The peak from here on: the step's, not the random initialisation's.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let mut times = Vec::new();
    let (mut sent, mut received) = (0, 0);
    for step in 0..=STEPS {
        group.barrier().expect("barrier");
        let (wrote, read) = (proc_field("/proc/self/io", "wchar:"), loopback_received());
        let started = Instant::now();
        group.reduce_scatter_sum(&grad, &grads).expect("reduce_scatter");
        let norm = grad.square().sum(Kind::Double).unsqueeze(0);
        group.all_reduce(&norm, Reduce::Sum).expect("all_reduce");
        // AdamW's element-wise work, in place but for one temporary.
        tch::no_grad(|| {
            let _ = m.shallow_clone().lerp_(&grad, 0.1);
            let _ = v.shallow_clone().g_mul_scalar_(0.999).addcmul_(&grad, &grad.g_mul_scalar(0.001));
            let _ = master.shallow_clone().addcdiv_(&m, &v.sqrt().g_add_scalar_(1e-8).g_mul_scalar_(-1e6));
        });
        group.all_gather(&full, &master).expect("all_gather");
        let elapsed = started.elapsed().as_secs_f64();
        group.barrier().expect("barrier"); // every rank's bytes are in
        if step > 0 {
            times.push(elapsed);
            sent += proc_field("/proc/self/io", "wchar:") - wrote;
            received += (loopback_received() - read) / world as u64;
        }
    }
    times.sort_by(f64::total_cmp);
    let peak = proc_field("/proc/self/status", "VmHWM:") * 1024;
    println!("{rank} {} {} {} {peak}", times[STEPS / 2], sent / STEPS as u64, received / STEPS as u64);
}

fn main() {
    if let (Ok(params), Ok(world), Ok(r), Ok(port)) = (
        std::env::var("BENCH_PARAMS"),
        std::env::var("BENCH_WORLD"),
        std::env::var("BENCH_RANK"),
        std::env::var("BENCH_PORT"),
    ) {
        return rank(params.parse().unwrap(), world.parse().unwrap(), r.parse().unwrap(), port.parse().unwrap());
    }
    let models = std::env::var("SLEUTH_BENCH_MODELS").unwrap_or_else(|_| DEFAULT_MODELS.into());
    let me = std::env::current_exe().expect("this binary");
    println!("sharded step exchange through c10d Gloo (loopback, f32 on the wire), {STEPS} steps, median");
    println!(
        "{:>12} {:>5} {:>10} {:>12} {:>12} {:>10} {:>12} {:>10}",
        "parameters", "ranks", "s/step", "sent/rank", "recv/rank", "vs bound", "peak RSS", "RSS/1-rank"
    );
    for model in models.split(';') {
        let (params, worlds) = model.split_once(':').expect("PARAMS:WORLDS");
        let params: usize = params.parse().expect("a parameter count");
        let mut one_rank_peak = None;
        for world in worlds.split(',').map(|w| w.parse::<usize>().expect("a world size")) {
            let port = free_port();
            let children: Vec<_> = (0..world)
                .map(|r| {
                    Command::new(&me)
                        .env("BENCH_PARAMS", params.to_string())
                        .env("BENCH_WORLD", world.to_string())
                        .env("BENCH_RANK", r.to_string())
                        .env("BENCH_PORT", port.to_string())
                        .stdout(std::process::Stdio::piped())
                        .spawn()
                        .expect("a rank")
                })
                .collect();
            let rows: Vec<Vec<f64>> = children
                .into_iter()
                .map(|c| {
                    let out = c.wait_with_output().expect("a rank's output");
                    assert!(out.status.success(), "a rank failed: {}", out.status);
                    String::from_utf8_lossy(&out.stdout).split_whitespace().map(|x| x.parse().unwrap()).collect()
                })
                .collect();
            let max = |i: usize| rows.iter().map(|r| r[i]).fold(0.0, f64::max);
            let model_bytes = 4.0 * params as f64;
            let bound = 2.0 * (world as f64 - 1.0) / world as f64 * model_bytes;
            let peak = max(4);
            if world == 1 {
                one_rank_peak = Some(peak);
            }
            let share = one_rank_peak.map_or("-".to_owned(), |one| format!("{:.2}", peak / one));
            let versus = if world == 1 { "-".to_owned() } else { format!("{:.2}", max(2).max(max(3)) / bound) };
            println!(
                "{params:>12} {world:>5} {:>10.3} {:>10.1}MB {:>10.1}MB {versus:>10} {:>10.2}GB {share:>10}",
                max(1),
                max(2) / 1e6,
                max(3) / 1e6,
                peak / 1e9,
            );
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}
