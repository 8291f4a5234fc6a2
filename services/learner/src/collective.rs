//! Collectives between learner ranks, behind one trait.
//!
//! [`TcpCollective`] is the CPU backend: rank 0 is the hub, every other rank
//! holds one TCP connection to it, and each collective is a gather to the
//! hub followed by a scatter from it. Reductions are summed in f64 in rank
//! order on the hub, so results do not depend on timing, and gradients
//! accumulated in f64 come out the same for any world size (to f32 rounding).
//! That costs O(world) traffic on the hub, fine for CPU training and tests;
//! GPU pods would use NCCL's ring collectives behind the same trait (not
//! built yet: see docs/learner.md).
//!
//! Rendezvous follows torchrun / Kubernetes training operators:
//! `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Why a collective failed; a failed collective ends the step on every rank.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    #[error("rank {rank}: {message}")]
    Peer { rank: usize, message: String },
}

/// The operations sharded training needs.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Every rank's `payload`, in rank order, on every rank.
    fn all_gather(&mut self, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError>;
    /// Rank 0's `payload` on every rank (others pass anything, e.g. empty).
    fn broadcast(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, CollectiveError>;

    /// Element-wise sum over ranks, summed in rank order.
    fn all_reduce_sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        let all = self.all_gather(f64_bytes(values))?;
        values.iter_mut().for_each(|v| *v = 0.0);
        for bytes in &all {
            for (v, x) in values.iter_mut().zip(bytes_f64(bytes)) {
                *v += x;
            }
        }
        Ok(())
    }

    /// Waits until every rank has arrived.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.all_gather(Vec::new()).map(|_| ())
    }
}

pub fn f64_bytes(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn bytes_f64(bytes: &[u8]) -> impl Iterator<Item = f64> + '_ {
    bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
}

pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn bytes_f32(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
}

/// A single rank: every collective is the identity.
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_gather(&mut self, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        Ok(vec![payload])
    }
    fn broadcast(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        Ok(payload)
    }
}

type Link = (BufReader<TcpStream>, BufWriter<TcpStream>);

/// The TCP backend (see the module docs).
pub struct TcpCollective {
    rank: usize,
    world: usize,
    /// On rank 0: links to ranks 1..world, in rank order. Elsewhere: the hub.
    links: Vec<Link>,
}

/// Where and who: the torchrun-style environment.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    pub master_addr: String,
    pub master_port: u16,
    pub world_size: usize,
    pub rank: usize,
    /// How long to wait for the other ranks.
    pub timeout: Duration,
}

impl Rendezvous {
    /// From `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`; None when
    /// `WORLD_SIZE` is unset (a single rank).
    pub fn from_env() -> Result<Option<Self>, CollectiveError> {
        let Ok(world) = std::env::var("WORLD_SIZE") else { return Ok(None) };
        let var = |name: &str| {
            std::env::var(name).map_err(|_| CollectiveError::Rendezvous(format!("WORLD_SIZE is set but {name} is not")))
        };
        let parse = |name: &str, value: String| {
            value
                .parse::<usize>()
                .map_err(|_| CollectiveError::Rendezvous(format!("{name} must be a number, got {value:?}")))
        };
        let world_size = parse("WORLD_SIZE", world)?;
        let rank = parse("RANK", var("RANK")?)?;
        let master_port = parse("MASTER_PORT", var("MASTER_PORT")?)?;
        if world_size == 0 || rank >= world_size || master_port > usize::from(u16::MAX) {
            return Err(CollectiveError::Rendezvous(format!(
                "RANK {rank} must be below WORLD_SIZE {world_size} (>= 1) and MASTER_PORT {master_port} a port"
            )));
        }
        Ok(Some(Self {
            master_addr: var("MASTER_ADDR")?,
            master_port: master_port as u16,
            world_size,
            rank,
            timeout: Duration::from_secs(300),
        }))
    }
}

fn peer(rank: usize) -> impl Fn(std::io::Error) -> CollectiveError {
    move |e| CollectiveError::Peer { rank, message: e.to_string() }
}

fn write_frame(link: &mut BufWriter<TcpStream>, payload: &[u8]) -> std::io::Result<()> {
    link.write_all(&(payload.len() as u64).to_le_bytes())?;
    link.write_all(payload)?;
    link.flush()
}

fn read_frame(link: &mut BufReader<TcpStream>) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    link.read_exact(&mut len)?;
    let mut payload = vec![0u8; u64::from_le_bytes(len) as usize];
    link.read_exact(&mut payload)?;
    Ok(payload)
}

impl TcpCollective {
    /// Joins the group: rank 0 listens on MASTER_PORT and accepts the others
    /// (each announces its rank); the others connect, retrying until `timeout`.
    pub fn connect(rendezvous: &Rendezvous) -> Result<Self, CollectiveError> {
        let Rendezvous { master_addr, master_port, world_size, rank, timeout } = rendezvous.clone();
        let failed = |message: String| CollectiveError::Rendezvous(message);
        let split = |stream: TcpStream| -> Result<Link, CollectiveError> {
            stream.set_nodelay(true).map_err(|e| failed(e.to_string()))?;
            let reader = stream.try_clone().map_err(|e| failed(e.to_string()))?;
            Ok((BufReader::new(reader), BufWriter::new(stream)))
        };
        if rank == 0 {
            let listener = TcpListener::bind(("0.0.0.0", master_port))
                .map_err(|e| failed(format!("rank 0 cannot listen on MASTER_PORT {master_port}: {e}")))?;
            let mut links: Vec<Option<Link>> = (1..world_size).map(|_| None).collect();
            listener.set_nonblocking(true).map_err(|e| failed(e.to_string()))?;
            let deadline = Instant::now() + timeout;
            while links.iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).map_err(|e| failed(e.to_string()))?;
                        let (mut reader, writer) = split(stream)?;
                        let hello = read_frame(&mut reader).map_err(|e| failed(e.to_string()))?;
                        let joined = u64::from_le_bytes(hello.try_into().map_err(|_| failed("bad hello".into()))?);
                        match links.get_mut((joined as usize).wrapping_sub(1)) {
                            Some(slot @ None) => *slot = Some((reader, writer)),
                            _ => {
                                return Err(failed(format!(
                                    "rank {joined} joined twice or is outside WORLD_SIZE {world_size}"
                                )));
                            }
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let missing: Vec<usize> =
                                links.iter().enumerate().filter(|(_, l)| l.is_none()).map(|(i, _)| i + 1).collect();
                            return Err(failed(format!("ranks {missing:?} did not join within {timeout:?}")));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(failed(e.to_string())),
                }
            }
            Ok(Self { rank, world: world_size, links: links.into_iter().map(|l| l.expect("all joined")).collect() })
        } else {
            let deadline = Instant::now() + timeout;
            let address = (master_addr.as_str(), master_port);
            let stream = loop {
                let attempt = address.to_socket_addrs().map_err(|e| e.to_string()).and_then(|mut addrs| {
                    let addr = addrs.next().ok_or("no address")?;
                    TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())
                });
                match attempt {
                    Ok(stream) => break stream,
                    Err(e) if Instant::now() > deadline => {
                        return Err(failed(format!("rank {rank} cannot reach {master_addr}:{master_port}: {e}")));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            let (reader, mut writer) = split(stream)?;
            write_frame(&mut writer, &(rank as u64).to_le_bytes()).map_err(|e| failed(e.to_string()))?;
            Ok(Self { rank, world: world_size, links: vec![(reader, writer)] })
        }
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&mut self, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        if self.rank == 0 {
            let mut all = vec![payload];
            for (i, (reader, _)) in self.links.iter_mut().enumerate() {
                all.push(read_frame(reader).map_err(peer(i + 1))?);
            }
            // One frame per rank payload, so nothing needs re-encoding.
            for (i, (_, writer)) in self.links.iter_mut().enumerate() {
                for part in &all {
                    write_frame(writer, part).map_err(peer(i + 1))?;
                }
            }
            Ok(all)
        } else {
            let (reader, writer) = &mut self.links[0];
            write_frame(writer, &payload).map_err(peer(0))?;
            (0..self.world).map(|_| read_frame(reader).map_err(peer(0))).collect()
        }
    }

    fn broadcast(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        if self.rank == 0 {
            for (i, (_, writer)) in self.links.iter_mut().enumerate() {
                write_frame(writer, &payload).map_err(peer(i + 1))?;
            }
            Ok(payload)
        } else {
            read_frame(&mut self.links[0].0).map_err(peer(0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_ranks_gather_reduce_and_broadcast() {
        let port = sleuth_testkit::free_port().unwrap();
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let rendezvous = Rendezvous {
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        world_size: 3,
                        rank,
                        timeout: Duration::from_secs(20),
                    };
                    let mut c = TcpCollective::connect(&rendezvous).unwrap();
                    let gathered = c.all_gather(vec![rank as u8; rank + 1]).unwrap();
                    assert_eq!(gathered, vec![vec![0], vec![1, 1], vec![2, 2, 2]]);
                    let mut values = [rank as f64, 1.0];
                    c.all_reduce_sum(&mut values).unwrap();
                    assert_eq!(values, [3.0, 3.0]);
                    let from_root = c.broadcast(if rank == 0 { b"step".to_vec() } else { Vec::new() }).unwrap();
                    assert_eq!(from_root, b"step");
                    c.barrier().unwrap();
                })
            })
            .collect();
        for rank in ranks {
            rank.join().unwrap();
        }
    }

    #[test]
    fn a_missing_rank_is_named() {
        let port = sleuth_testkit::free_port().unwrap();
        let rendezvous = Rendezvous {
            master_addr: "127.0.0.1".into(),
            master_port: port,
            world_size: 3,
            rank: 0,
            timeout: Duration::from_millis(300),
        };
        let error = TcpCollective::connect(&rendezvous).err().unwrap().to_string();
        assert!(error.contains("ranks [1, 2] did not join"), "{error}");
    }
}
