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
//! `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`. Rank 0 listens on
//! MASTER_ADDR only, and admits a rank through a handshake keyed by the mesh
//! secret (`SLEUTH_AUTH_TOKEN`): it sends a random challenge, the rank
//! answers with its number, its own nonce and an HMAC-SHA256 over all three,
//! and rank 0 answers with an HMAC of the rank's nonce, so each side knows
//! the other holds the secret. A connection that fails the handshake (within
//! `handshake_timeout`) is turned away and the rendezvous goes on. Frames are
//! bounded by what a step can need ([`Collective::limit_frames`]), and a
//! frame that has begun must arrive within `peer_timeout`.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use handshake::{admit, join, settle};

mod handshake;

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

    /// Bounds the frames a peer may announce, once the learner knows what a
    /// step can need (no-op where nothing crosses a wire).
    fn limit_frames(&mut self, _bytes: usize) {}
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
    /// The longest frame a peer may announce.
    max_frame: usize,
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
    /// How long a connection may take over the handshake.
    pub handshake_timeout: Duration,
    /// How long a frame that has begun may take to arrive, and a write to
    /// be taken (a stopped peer ends the collective instead of hanging it).
    pub peer_timeout: Duration,
    /// The mesh secret the handshake's MACs are keyed by (empty: no
    /// authentication, with a warning).
    pub secret: Vec<u8>,
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
        Ok(Some(Self::new(&var("MASTER_ADDR")?, master_port as u16, world_size, rank)))
    }

    /// Rank `rank` of `world_size` meeting at `master_addr:master_port`, with
    /// the default timeouts and no secret yet.
    pub fn new(master_addr: &str, master_port: u16, world_size: usize, rank: usize) -> Self {
        Self {
            master_addr: master_addr.to_owned(),
            master_port,
            world_size,
            rank,
            timeout: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(10),
            peer_timeout: Duration::from_secs(1800),
            secret: Vec::new(),
        }
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

/// Reads one frame of at most `max` bytes. `patient`: the wait for the frame
/// to begin is not bounded by the read timeout (a rank waits for rank 0's
/// next command as long as the run has no groups); once it has begun, it is.
fn read_frame_waiting(link: &mut BufReader<TcpStream>, max: usize, patient: bool) -> std::io::Result<Vec<u8>> {
    use std::io::ErrorKind;
    if patient {
        loop {
            match link.fill_buf() {
                Ok(_) => break,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
                Err(e) => return Err(e),
            }
        }
    }
    let mut len = [0u8; 8];
    link.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > max as u64 {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a frame of {len} bytes is past the limit of {max}"),
        ));
    }
    let mut payload = vec![0u8; len as usize];
    link.read_exact(&mut payload)?;
    Ok(payload)
}

fn read_frame(link: &mut BufReader<TcpStream>, max: usize) -> std::io::Result<Vec<u8>> {
    read_frame_waiting(link, max, false)
}

/// Handshakes rank 0 runs at once; more connections are dropped.
const MAX_HANDSHAKES: usize = 64;
/// Frame size allowed until the learner knows its model (see [`Collective::limit_frames`]).
const DEFAULT_MAX_FRAME: usize = 64 << 20;

impl TcpCollective {
    /// Joins the group: rank 0 listens on MASTER_ADDR:MASTER_PORT and admits
    /// each other rank through the handshake (see the module docs); the
    /// others connect, retrying until `timeout`.
    pub fn connect(rendezvous: &Rendezvous) -> Result<Self, CollectiveError> {
        let Rendezvous {
            ref master_addr,
            master_port,
            world_size,
            rank,
            timeout,
            handshake_timeout,
            peer_timeout,
            ref secret,
        } = *rendezvous;
        let failed = |message: String| CollectiveError::Rendezvous(message);
        let address = resolve_master(master_addr, master_port, rank, Instant::now() + timeout)?;
        if secret.is_empty() {
            tracing::warn!("no mesh secret (SLEUTH_AUTH_TOKEN): learner ranks do not authenticate each other");
        }
        if rank == 0 {
            // Only where the other ranks reach it (MASTER_ADDR names rank 0 itself), not every interface.
            let listener = TcpListener::bind(address).map_err(|e| {
                failed(format!(
                    "rank 0 cannot listen on MASTER_ADDR {master_addr}:{master_port} ({address}): {e}; on rank 0, MASTER_ADDR must name this host"
                ))
            })?;
            let mut links: Vec<Option<Link>> = (1..world_size).map(|_| None).collect();
            listener.set_nonblocking(true).map_err(|e| failed(e.to_string()))?;
            let deadline = Instant::now() + timeout;
            // Handshakes run on their own threads, so a silent connection
            // delays no other rank; beyond MAX_HANDSHAKES at once, connections are dropped.
            let (admitted, verdicts) = std::sync::mpsc::channel();
            let in_progress = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            while links.iter().any(Option::is_none) {
                while let Ok((from, verdict)) = verdicts.try_recv() {
                    match verdict {
                        Ok((joined, link)) => match links.get_mut(joined - 1) {
                            Some(slot @ None) => {
                                *slot = Some(settle(link, peer_timeout).map_err(|e| failed(e.to_string()))?)
                            }
                            _ => return Err(failed(format!("rank {joined} joined twice"))),
                        },
                        // A stranger (or a rank with another secret) is turned away; the rendezvous goes on.
                        Err(why) => tracing::warn!(%from, %why, "refused a connection to the learner's rendezvous"),
                    }
                }
                match listener.accept() {
                    Ok((stream, from)) => {
                        use std::sync::atomic::Ordering;
                        if in_progress.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
                            in_progress.fetch_sub(1, Ordering::SeqCst);
                            tracing::warn!(%from, "too many handshakes at once; dropped a connection");
                            continue;
                        }
                        let (admitted, in_progress, secret) = (admitted.clone(), in_progress.clone(), secret.clone());
                        std::thread::spawn(move || {
                            let verdict = admit(stream, &secret, handshake_timeout, world_size);
                            in_progress.fetch_sub(1, Ordering::SeqCst);
                            let _ = admitted.send((from, verdict));
                        });
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
            let links = links.into_iter().map(|l| l.expect("all joined")).collect();
            Ok(Self { rank, world: world_size, links, max_frame: DEFAULT_MAX_FRAME })
        } else {
            // Until the deadline, a refused or broken handshake is tried
            // again (rank 0 may be starting, or busy with other ranks).
            let deadline = Instant::now() + timeout;
            let link = loop {
                let why = match TcpStream::connect_timeout(&address, Duration::from_secs(5)) {
                    Ok(stream) => match join(stream, secret, handshake_timeout, rank) {
                        Ok(link) => break link,
                        Err(why) => format!("was not admitted: {why}"),
                    },
                    Err(e) => format!("cannot reach it: {e}"),
                };
                if Instant::now() > deadline {
                    return Err(failed(format!("rank {rank}, rank 0 at {master_addr}:{master_port}: {why}")));
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let link = settle(link, peer_timeout).map_err(|e| failed(e.to_string()))?;
            Ok(Self { rank, world: world_size, links: vec![link], max_frame: DEFAULT_MAX_FRAME })
        }
    }
}

/// Rank 0's address. On Kubernetes, MASTER_ADDR names rank 0's pod, which
/// has no DNS record until the pod is scheduled and has an IP: the other
/// ranks (and rank 0 itself) may start first. So the name is looked up again
/// until `deadline`, and the error names who waited for what.
pub fn resolve_master(
    master_addr: &str,
    master_port: u16,
    rank: usize,
    deadline: Instant,
) -> Result<std::net::SocketAddr, CollectiveError> {
    let mut reported = Instant::now();
    loop {
        let why = match (master_addr, master_port).to_socket_addrs() {
            Ok(mut addresses) => match addresses.next() {
                Some(address) => return Ok(address),
                None => "it has no address".to_owned(),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(CollectiveError::Rendezvous(format!(
                "rank {rank}: MASTER_ADDR {master_addr:?} (rank 0) did not resolve before the rendezvous timeout: {why}"
            )));
        }
        if reported.elapsed() >= Duration::from_secs(10) {
            tracing::warn!(rank, master_addr, %why, "rank 0's name does not resolve yet (is its pod scheduled?)");
            reported = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(200));
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
                all.push(read_frame(reader, self.max_frame).map_err(peer(i + 1))?);
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
            (0..self.world).map(|_| read_frame(reader, self.max_frame).map_err(peer(0))).collect()
        }
    }

    fn limit_frames(&mut self, bytes: usize) {
        self.max_frame = bytes;
    }

    fn broadcast(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        if self.rank == 0 {
            for (i, (_, writer)) in self.links.iter_mut().enumerate() {
                write_frame(writer, &payload).map_err(peer(i + 1))?;
            }
            Ok(payload)
        } else {
            read_frame_waiting(&mut self.links[0].0, self.max_frame, true).map_err(peer(0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::handshake::HANDSHAKE_FRAME;
    use super::*;

    #[test]
    fn three_ranks_gather_reduce_and_broadcast() {
        let port = sleuth_testkit::free_port().unwrap();
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let rendezvous = Rendezvous {
                        timeout: Duration::from_secs(20),
                        secret: b"mesh".to_vec(),
                        ..Rendezvous::new("127.0.0.1", port, 3, rank)
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
        let rendezvous = Rendezvous { timeout: Duration::from_millis(300), ..Rendezvous::new("127.0.0.1", port, 3, 0) };
        let error = TcpCollective::connect(&rendezvous).err().unwrap().to_string();
        assert!(error.contains("ranks [1, 2] did not join"), "{error}");
    }

    /// A rank whose MASTER_ADDR does not resolve (rank 0's pod not yet
    /// scheduled) keeps looking it up until the rendezvous timeout, then
    /// names itself and the name; a name that resolves is taken at once.
    #[test]
    fn an_unresolvable_master_is_retried_until_the_timeout_and_named() {
        let started = Instant::now();
        let rendezvous = Rendezvous {
            timeout: Duration::from_millis(700),
            ..Rendezvous::new("learner-0.learner-ranks.sleuth.svc.invalid", 29500, 2, 1)
        };
        let error = TcpCollective::connect(&rendezvous).err().unwrap().to_string();
        assert!(started.elapsed() >= Duration::from_millis(700), "gave up after {:?}", started.elapsed());
        assert!(
            error.contains("rank 1")
                && error.contains("learner-0.learner-ranks.sleuth.svc.invalid")
                && error.contains("did not resolve"),
            "{error}"
        );
        let address = resolve_master("localhost", 29500, 1, Instant::now()).unwrap();
        assert!(address.ip().is_loopback());
    }

    /// Connections that announce a huge frame, send a hello without the
    /// secret, or say nothing are turned away; a rank with another secret is
    /// refused and says why; the real ranks still meet. A frame past the
    /// limit ends the collective instead of allocating it.
    #[test]
    fn strangers_are_turned_away_and_the_ranks_still_meet() {
        let port = sleuth_testkit::free_port().unwrap();
        let rendezvous = move |rank: usize, secret: &[u8]| Rendezvous {
            timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(1),
            secret: secret.to_vec(),
            ..Rendezvous::new("127.0.0.1", port, 2, rank)
        };
        let root = std::thread::spawn(move || TcpCollective::connect(&rendezvous(0, b"mesh")));
        let reach = || loop {
            if let Ok(stream) = TcpStream::connect(("127.0.0.1", port)) {
                break stream;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // A frame header announcing 2^62 bytes.
        let mut huge = reach();
        huge.write_all(&(1u64 << 62).to_le_bytes()).unwrap();
        // A hello for rank 1 with a made-up MAC.
        let mut forged = BufReader::new(reach());
        let challenge = read_frame(&mut forged, HANDSHAKE_FRAME).unwrap();
        assert_eq!(challenge.len(), 32);
        let hello = [&1u64.to_le_bytes()[..], &[7u8; 32], &[9u8; 32]].concat();
        write_frame(&mut BufWriter::new(forged.get_ref().try_clone().unwrap()), &hello).unwrap();
        // Silence.
        let _silent = reach();
        // A rank with another secret.
        let other = Rendezvous { timeout: Duration::from_secs(2), ..rendezvous(1, b"other") };
        let error = TcpCollective::connect(&other).err().unwrap().to_string();
        assert!(error.contains("not admitted") && error.contains("another mesh secret"), "{error}");

        let mut one = TcpCollective::connect(&rendezvous(1, b"mesh")).unwrap();
        let mut zero = root.join().unwrap().unwrap();
        let gathered = std::thread::spawn(move || one.all_gather(vec![1]).map(|all| (all, one)));
        assert_eq!(zero.all_gather(vec![0]).unwrap(), [vec![0], vec![1]]);
        let (all, mut one) = gathered.join().unwrap().unwrap();
        assert_eq!(all, [vec![0], vec![1]]);

        zero.limit_frames(16);
        let sent = std::thread::spawn(move || one.all_gather(vec![0; 64]));
        let error = zero.all_gather(Vec::new()).unwrap_err().to_string();
        assert!(error.contains("past the limit of 16"), "{error}");
        drop(zero);
        assert!(sent.join().unwrap().is_err(), "the collective ends on both sides");
    }
}
