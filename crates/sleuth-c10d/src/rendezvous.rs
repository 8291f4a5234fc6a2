//! Where and who: torchrun's environment, as Kubernetes training operators
//! and the chart's StatefulSet set it.

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use crate::CollectiveError;
use crate::group::Bind;

/// Rank `rank` of `world_size`, meeting at rank 0's store.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    pub master_addr: String,
    pub master_port: u16,
    pub world_size: usize,
    pub rank: usize,
    /// How long to wait for the other ranks to join.
    pub timeout: Duration,
    /// How long one collective may take once every rank has joined it (a
    /// rank that stopped answering ends it instead of hanging it).
    pub peer_timeout: Duration,
    /// Where this rank's Gloo connections listen.
    pub bind: Bind,
}

impl Rendezvous {
    /// From `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK` (and Gloo's
    /// own `GLOO_SOCKET_IFNAME`); None when `WORLD_SIZE` is unset (a single
    /// rank).
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
        let mut rendezvous = Self::new(&var("MASTER_ADDR")?, master_port as u16, world_size, rank);
        if let Ok(interface) = std::env::var("GLOO_SOCKET_IFNAME")
            && !interface.is_empty()
        {
            rendezvous.bind = Bind::Interface(interface);
        }
        Ok(Some(rendezvous))
    }

    /// Rank `rank` of `world_size` meeting at `master_addr:master_port`, with
    /// the default timeouts; Gloo listens on loopback when rank 0 is there,
    /// else where this host's name resolves.
    pub fn new(master_addr: &str, master_port: u16, world_size: usize, rank: usize) -> Self {
        let local = matches!(master_addr, "127.0.0.1" | "localhost" | "::1");
        Self {
            master_addr: master_addr.to_owned(),
            master_port,
            world_size,
            rank,
            timeout: Duration::from_secs(300),
            peer_timeout: Duration::from_secs(1800),
            bind: if local { Bind::Host("127.0.0.1".into()) } else { Bind::Default },
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank whose MASTER_ADDR does not resolve (rank 0's pod not yet
    /// scheduled) keeps looking it up until the rendezvous timeout, then
    /// names itself and the name; a name that resolves is taken at once.
    #[test]
    fn an_unresolvable_master_is_retried_until_the_timeout_and_named() {
        let started = Instant::now();
        let deadline = started + Duration::from_millis(700);
        let error =
            resolve_master("learner-0.learner-ranks.sleuth.svc.invalid", 29500, 1, deadline).unwrap_err().to_string();
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
}
