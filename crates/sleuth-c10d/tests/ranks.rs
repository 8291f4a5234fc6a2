//! Ranks of one process group (threads of this process, Gloo on loopback):
//! every collective gives what one rank would compute; a missing or gone
//! rank is named.

use std::time::Duration;

use sleuth_c10d::{Collective, CollectiveError, ProcessGroup, Reduce, Rendezvous};
use tch::{Device, Kind, Tensor};

fn rendezvous(port: u16, world: usize, rank: usize) -> Rendezvous {
    Rendezvous {
        timeout: Duration::from_secs(30),
        peer_timeout: Duration::from_secs(30),
        ..Rendezvous::new("127.0.0.1", port, world, rank)
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap()
}

/// Runs `body` on every rank of a fresh group of `world` threads.
fn ranks<T: Send + 'static>(world: usize, body: impl Fn(ProcessGroup) -> T + Send + Sync + Clone + 'static) -> Vec<T> {
    let port = free_port();
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let body = body.clone();
            std::thread::spawn(move || {
                body(ProcessGroup::connect(&rendezvous(port, world, rank), Device::Cpu).unwrap())
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t).unwrap()
}

#[test]
fn three_ranks_gather_scatter_reduce_broadcast_and_message() {
    ranks(3, |mut group| {
        let rank = group.rank();
        let r = rank as f32;
        // all_gather: every rank's [r, r + 0.5].
        let input = Tensor::from_slice(&[r, r + 0.5]);
        let output = Tensor::zeros([6], (Kind::Float, Device::Cpu));
        group.all_gather(&output, &input).unwrap();
        assert_eq!(values(&output), [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        // reduce_scatter: rank k receives the sum over ranks of chunk k.
        let input = Tensor::arange(6, (Kind::Float, Device::Cpu)) + f64::from(r) * 10.0;
        let output = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        group.reduce_scatter_sum(&output, &input).unwrap();
        let k = 2.0 * r;
        assert_eq!(values(&output), [3.0 * k + 30.0, 3.0 * (k + 1.0) + 30.0]);
        // all_reduce: sum and max.
        let t = Tensor::from_slice(&[r, -r]);
        group.all_reduce(&t, Reduce::Sum).unwrap();
        assert_eq!(values(&t), [3.0, -3.0]);
        let t = Tensor::from_slice(&[r, -r]);
        group.all_reduce(&t, Reduce::Max).unwrap();
        assert_eq!(values(&t), [2.0, 0.0]);
        // broadcast from rank 1.
        let t = Tensor::from_slice(&[r; 3]);
        group.broadcast(&t, 1).unwrap();
        assert_eq!(values(&t), [1.0; 3]);
        // Messages through the store, twice (the keys of a round are deleted, the next round's are new).
        for round in 0..2u8 {
            let all = group.all_gather_bytes(vec![rank as u8 + round; rank + 1]).unwrap();
            assert_eq!(all, vec![vec![round], vec![1 + round; 2], vec![2 + round; 3]]);
            let said = group.broadcast_bytes(if rank == 0 { vec![b's', round] } else { Vec::new() }).unwrap();
            assert_eq!(said, [b's', round]);
        }
        group.barrier().unwrap();
    });
}

#[test]
fn tensors_of_the_wrong_shape_or_device_are_refused_by_name() {
    ranks(2, |mut group| {
        let error = group.all_gather(
            &Tensor::zeros([3], (Kind::Float, Device::Cpu)),
            &Tensor::zeros([2], (Kind::Float, Device::Cpu)),
        );
        assert!(matches!(&error, Err(CollectiveError::Usage { op: "all_gather", .. })), "{error:?}");
        let strided = Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)).transpose(0, 1);
        let error = group.all_reduce(&strided, Reduce::Sum).unwrap_err().to_string();
        assert!(error.contains("contiguous"), "{error}");
        group.barrier().unwrap();
    });
}

#[test]
fn a_rank_that_never_joins_is_named() {
    let port = free_port();
    let alone = Rendezvous { timeout: Duration::from_millis(1500), ..rendezvous(port, 3, 0) };
    let error = ProcessGroup::connect(&alone, Device::Cpu).err().unwrap().to_string();
    assert!(error.contains("ranks [1, 2] did not join"), "{error}");
}

/// Through Gloo the reduce-scatter is a ring of sends and receives (the
/// shim's), so it gets its own check on more ranks and chunks of odd length:
/// each rank's chunk is the sum one rank computes, within f32 rounding (the
/// ring adds the ranks in another order).
#[test]
fn four_ranks_reduce_scatter_to_what_one_rank_sums() {
    const WORLD: usize = 4;
    const CHUNK: i64 = 1001;
    let input =
        |rank: usize| (Tensor::arange(CHUNK * WORLD as i64, (Kind::Float, Device::Cpu)) * (rank as f64 + 1.0)).sin();
    let sum = (0..WORLD).map(input).reduce(|a, b| a + b).unwrap();
    let chunks = ranks(WORLD, move |mut group| {
        let output = Tensor::zeros([CHUNK], (Kind::Float, Device::Cpu));
        let mine = input(group.rank());
        group.reduce_scatter_sum(&output, &mine).unwrap();
        assert_eq!(values(&mine), values(&input(group.rank())), "the input is only read");
        group.barrier().unwrap();
        output
    });
    for (rank, chunk) in chunks.iter().enumerate() {
        let expected = sum.narrow(0, rank as i64 * CHUNK, CHUNK);
        let error = (chunk - &expected).abs().max().double_value(&[]);
        assert!(error < 1e-6, "rank {rank}: off by {error}");
    }
}

/// A rank that leaves (its group dropped, its connections closed) fails the
/// next collective on every other rank, and each names it: an all-reduce
/// (Gloo's own) and a reduce-scatter (the shim's ring). It leaves at once,
/// or once the others are inside the collective: then a survivor may be
/// blocked on the other survivor (in the ring, rank 1 waits for rank 0's
/// next step, which never comes), and only the failing rank's abort frees
/// it in time for the roll call; without it rank 1 was named gone too.
#[test]
fn a_rank_gone_mid_run_is_named_by_every_other_rank() {
    fn all_reduce(group: &mut ProcessGroup) -> Result<(), CollectiveError> {
        group.all_reduce(&Tensor::ones([4], (Kind::Float, Device::Cpu)), Reduce::Sum)
    }
    fn reduce_scatter(group: &mut ProcessGroup) -> Result<(), CollectiveError> {
        let input = Tensor::ones([6], (Kind::Float, Device::Cpu));
        group.reduce_scatter_sum(&Tensor::zeros([2], (Kind::Float, Device::Cpu)), &input)
    }
    let ops = [("all_reduce", all_reduce as fn(&mut ProcessGroup) -> _), ("reduce_scatter", reduce_scatter)];
    for ((name, op), delay) in ops.into_iter().flat_map(|op| [(op, 0), (op, 300)]) {
        let errors = ranks(3, move |mut group| {
            op(&mut group).unwrap();
            if group.rank() == 2 {
                std::thread::sleep(Duration::from_millis(delay));
                drop(group);
                return None;
            }
            let error = op(&mut group).unwrap_err();
            // The group takes nothing more, and says why.
            let after = op(&mut group).unwrap_err().to_string();
            assert!(after.contains("aborted when an earlier collective failed"), "{name}: {after}");
            Some(error)
        });
        for (rank, error) in errors.into_iter().enumerate().take(2) {
            let error = error.unwrap();
            assert!(
                matches!(&error, CollectiveError::Failed { gone, .. } if gone == &[2]),
                "{name}, rank 2 leaving after {delay} ms, rank {rank}: {error}"
            );
            assert!(error.to_string().contains("rank 2 is gone"), "{name}: {error}");
        }
    }
}
