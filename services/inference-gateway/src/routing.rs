//! Which policy-server replica serves an episode.
//!
//! Episodes stick to one replica (so its prefix cache holds their earlier
//! turns) by rendezvous hashing: each replica gets a score from
//! hash(episode, replica) and the episode goes to the highest. Adding or
//! removing a replica moves only the episodes that scored it highest. When
//! that replica cannot be reached, the turn fails over to the next-highest
//! one; a turn is only retried when the policy server generated nothing
//! (its Generate is all-or-nothing), so no token is ever produced twice.
//! A replica that is up but slower than the per-request timeout is not
//! retried elsewhere: that would double the load exactly when it is highest.
//!
//! A training run's turns name the oldest weights they may be sampled with
//! (the learner's current version). A replica on older weights (restarted on
//! its base weights, or it missed a publication) refuses without generating;
//! the turn goes to the next replica, and when every replica is behind it
//! waits, within the per-request timeout, for the learner to bring one up to
//! date: tokens from weights the run has moved past would only be dropped as
//! stale by the learner.

use sleuth_kit::client::MeshChannel;
use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
use sleuth_proto::policy::v1::{GenerateRequest, GenerateResponse};
use std::time::Duration;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use tonic::Code;
use tower::discover::{Change, Discover};

use crate::error::Error;
use crate::metrics::METRICS;

/// How often a turn that every replica refused as behind tries again.
const BEHIND_POLL: Duration = Duration::from_millis(250);

/// A policy-server replica.
#[derive(Clone)]
pub struct Replica {
    pub address: String,
    client: PolicyServerClient<MeshChannel>,
}

/// The replicas of the policy, kept up to date from a tower `Discover`
/// stream of `Change::Insert(address, address)` / `Change::Remove(address)`.
/// A static list yields its inserts once ([`static_list`]); DNS or Kubernetes
/// endpoints would keep the stream open and yield changes as they happen.
#[derive(Clone)]
pub struct Replicas {
    replicas: Arc<RwLock<BTreeMap<String, Replica>>>,
    token: Option<sleuth_kit::BearerToken>,
    timeout: Duration,
}

/// A static replica list as a `Discover` stream.
pub fn static_list(
    addresses: &[String],
) -> impl Discover<Key = String, Service = String, Error = std::convert::Infallible> + Send + Unpin + 'static {
    let inserts: Vec<_> = addresses.iter().map(|a| Ok(Change::Insert(a.clone(), a.clone()))).collect();
    futures::stream::iter(inserts)
}

impl Replicas {
    /// The replicas of a static list, routable at once. `timeout` bounds each
    /// Generate call (sent to the replica as `grpc-timeout` too).
    pub fn new(
        addresses: &[String],
        token: Option<&sleuth_kit::BearerToken>,
        timeout: Duration,
    ) -> Result<Self, Error> {
        if addresses.is_empty() {
            return Err(Error::InvalidArgument("policy_servers must name at least one replica".to_owned()));
        }
        let replicas = Self::empty(token, timeout);
        for address in addresses {
            replicas.apply(Change::Insert(address.clone(), address.clone()))?;
        }
        Ok(replicas)
    }

    /// No replicas yet; [`Replicas::discover`] brings them.
    pub fn empty(token: Option<&sleuth_kit::BearerToken>, timeout: Duration) -> Self {
        Self { replicas: Arc::default(), token: token.cloned(), timeout }
    }

    /// Follows `discover` in the background: replicas join and leave as it says.
    pub fn discover<D>(self, discover: D) -> Self
    where
        D: Discover<Key = String, Service = String> + Send + Unpin + 'static,
        D::Error: std::fmt::Display,
    {
        let replicas = self.clone();
        tokio::spawn(async move {
            let mut discover = discover;
            while let Some(change) =
                futures::future::poll_fn(|cx| std::pin::Pin::new(&mut discover).poll_discover(cx)).await
            {
                match change.map_err(|e| e.to_string()).and_then(|c| replicas.apply(c).map_err(|e| e.to_string())) {
                    Ok(()) => {}
                    Err(error) => tracing::warn!(%error, "policy replica discovery"),
                }
            }
        });
        self
    }

    fn apply(&self, change: Change<String, String>) -> Result<(), Error> {
        let mut replicas = self.replicas.write().expect("replicas");
        match change {
            Change::Insert(key, address) => {
                let client = sleuth_kit::sized!(PolicyServerClient::new(sleuth_kit::client::connect_lazy(
                    &address,
                    self.token.as_ref()
                )?));
                tracing::info!(replica = %address, "policy replica joined");
                replicas.insert(key, Replica { address, client });
            }
            Change::Remove(key) => {
                tracing::info!(replica = %key, "policy replica left");
                replicas.remove(&key);
            }
        }
        Ok(())
    }

    /// Replicas in the order `episode` tries them: its own first.
    pub fn order(&self, episode: &str) -> Vec<Replica> {
        let replicas = self.replicas.read().expect("replicas");
        let mut scored: Vec<(u64, &Replica)> =
            replicas.values().map(|replica| (score(episode, &replica.address), replica)).collect();
        scored.sort_by_key(|(score, _)| std::cmp::Reverse(*score));
        scored.into_iter().map(|(_, replica)| replica.clone()).collect()
    }

    /// Generates on the episode's replica, failing over while replicas are
    /// unreachable or behind `request.min_policy_version`, and waiting while
    /// every replica is behind.
    pub async fn generate(&self, episode: &str, request: GenerateRequest) -> Result<(String, GenerateResponse), Error> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut waited = false;
        loop {
            match self.try_replicas(episode, &request).await {
                Err(Error::Policy(status))
                    if status.code() == Code::FailedPrecondition && tokio::time::Instant::now() < deadline =>
                {
                    if !waited {
                        tracing::warn!(
                            episode,
                            needed = request.min_policy_version,
                            message = status.message(),
                            "every policy replica is behind the run's weights; waiting for the learner to update one"
                        );
                        waited = true;
                    }
                    METRICS.behind_waits.inc();
                    tokio::time::sleep(BEHIND_POLL).await;
                }
                result => return result,
            }
        }
    }

    /// One pass over the episode's replicas in its order.
    async fn try_replicas(
        &self,
        episode: &str,
        request: &GenerateRequest,
    ) -> Result<(String, GenerateResponse), Error> {
        let (mut last, mut behind) = (None, None);
        for replica in self.order(episode) {
            let in_flight = METRICS.replica_in_flight.with_label_values(&[replica.address.as_str()]);
            in_flight.inc();
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(self.timeout);
            let result = tokio::time::timeout(self.timeout, replica.client.clone().generate(call)).await;
            in_flight.dec();
            match result {
                Ok(Ok(response)) => return Ok((replica.address.clone(), response.into_inner())),
                // Nothing was generated: the replica is down or overloaded; try the next.
                Ok(Err(status))
                    if matches!(status.code(), Code::Unavailable | Code::ResourceExhausted | Code::Unknown) =>
                {
                    tracing::warn!(episode, replica = %replica.address, code = ?status.code(), "policy replica failed, trying the next");
                    METRICS.replica_failures.with_label_values(&[replica.address.as_str()]).inc();
                    last = Some(status);
                }
                // Behind the run's weights: nothing generated; another replica may be current.
                Ok(Err(status)) if status.code() == Code::FailedPrecondition => behind = Some(status),
                Ok(Err(status)) => return Err(Error::Policy(status)),
                Err(_) => {
                    return Err(Error::Policy(tonic::Status::deadline_exceeded(format!(
                        "policy replica {} did not answer within policy_timeout {}",
                        replica.address,
                        humantime::format_duration(self.timeout)
                    ))));
                }
            }
        }
        // A replica behind the run's weights will be brought up to date: worth waiting for.
        Err(Error::Policy(behind.or(last).unwrap_or_else(|| tonic::Status::unavailable("no policy replica"))))
    }
}

/// FNV-1a over episode and replica: stable across builds and processes, so
/// every gateway pod, whatever its version, routes an episode the same way.
fn score(episode: &str, replica: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in episode.bytes().chain([0xff]).chain(replica.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // FNV's low bits mix poorly for short keys; finish with a SplitMix64 round.
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replicas(addresses: &[&str]) -> Replicas {
        let addresses: Vec<String> = addresses.iter().map(|a| a.to_string()).collect();
        Replicas::new(&addresses, None, Duration::from_secs(1)).unwrap()
    }

    #[tokio::test]
    async fn replicas_join_and_leave_as_discovery_says() {
        let (changes, stream) =
            tokio::sync::mpsc::unbounded_channel::<Result<Change<String, String>, std::convert::Infallible>>();
        let replicas = Replicas::empty(None, Duration::from_secs(1))
            .discover(tokio_stream::wrappers::UnboundedReceiverStream::new(stream));
        let addresses = |r: &Replicas| {
            let mut a: Vec<String> = r.order("ep").into_iter().map(|r| r.address).collect();
            a.sort();
            a
        };
        let settled = |r: &Replicas, want: &[&str]| {
            let (r, want) = (r.clone(), want.iter().map(|s| s.to_string()).collect::<Vec<_>>());
            async move {
                for _ in 0..100 {
                    if addresses(&r) == want {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                false
            }
        };
        changes.send(Ok(Change::Insert("a:1".into(), "a:1".into()))).unwrap();
        changes.send(Ok(Change::Insert("b:1".into(), "b:1".into()))).unwrap();
        assert!(settled(&replicas, &["a:1", "b:1"]).await);
        changes.send(Ok(Change::Remove("a:1".into()))).unwrap();
        assert!(settled(&replicas, &["b:1"]).await);
    }

    #[tokio::test]
    async fn episodes_stick_and_spread() {
        let three = replicas(&["a:1", "b:1", "c:1"]);
        let first = |r: &Replicas, e: &str| r.order(e)[0].address.clone();
        let mut counts = std::collections::HashMap::new();
        for i in 0..300 {
            let episode = format!("ep-{i}");
            assert_eq!(first(&three, &episode), first(&three, &episode), "sticky");
            *counts.entry(first(&three, &episode)).or_insert(0) += 1;
        }
        assert!(counts.values().all(|&n| n > 60), "spread over replicas: {counts:?}");
        // Removing a replica moves only the episodes that were on it.
        let two = replicas(&["a:1", "b:1"]);
        for i in 0..300 {
            let episode = format!("ep-{i}");
            let before = first(&three, &episode);
            if before != "c:1" {
                assert_eq!(first(&two, &episode), before);
            }
        }
    }
}
