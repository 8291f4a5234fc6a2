//! Weight publication: after a step, the new weights go to every policy
//! server as `UpdateWeights` streams (the run's id and version = step), in chunks of at most
//! 3 MiB so no message reaches gRPC's default 4 MiB limit. The servers swap between decode
//! steps. A server that missed a version (a failed publication, or a
//! restart that brought it back on its base weights as version 0) is found
//! by asking every server its version while the learner waits for groups,
//! and brought to the current weights ([`Publisher::behind`]); so is a
//! server that took another run's weights, whatever their number. Until then
//! its episodes carry their old version in their traces, and the learner
//! drops them as stale once they are more than `max_staleness` behind.

use std::time::{Duration, Instant};

use sleuth_discovery::Members;
use sleuth_kit::client::MeshChannel;
use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
use sleuth_proto::policy::v1::{
    DType, GetModelInfoRequest, TensorChunk, UpdateWeightsRequest, WeightsHeader, update_weights_request::Part,
};
use tch::{Device, Kind, Tensor};
use tracing::Instrument as _;

use crate::Error;
use crate::learn::Sources;
use crate::trainer::Trainer;

/// A chunk's data, below the servers' 4 MiB message limit with room for the
/// rest of the message (name, shape, framing): chunks of exactly 4 MiB were
/// refused, so every tensor over 4 MiB (any real embedding) never arrived.
const CHUNK_BYTES: usize = 3 << 20;

/// The dtype weights travel in to servers that serve `served`: the servers'
/// own 16-bit dtype when every one serves it (half the bytes of f32, and
/// exactly what they would round to), else f32 (lossless for any server).
pub fn wire_dtype(served: &[DType]) -> DType {
    match served {
        [first, rest @ ..]
            if matches!(first, DType::DtypeBf16 | DType::DtypeF16) && rest.iter().all(|d| d == first) =>
        {
            *first
        }
        _ => DType::DtypeF32,
    }
}

/// A tensor's elements in `dtype`, little-endian, row-major.
fn wire_bytes(tensor: &Tensor, dtype: DType) -> Vec<u8> {
    let flat = tensor.detach().to_device(Device::Cpu).flatten(0, -1);
    match dtype {
        DType::DtypeBf16 | DType::DtypeF16 => {
            let kind = if dtype == DType::DtypeBf16 { Kind::BFloat16 } else { Kind::Half };
            let bits = flat.to_kind(kind).contiguous().view_dtype(Kind::Int16);
            Vec::<i16>::try_from(&bits).expect("16-bit tensor").iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        _ => Vec::<f32>::try_from(&flat.to_kind(Kind::Float))
            .expect("f32 tensor")
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    }
}

/// The requests of one update to `run`'s `version`: a header, then every
/// tensor in chunks of `dtype` (see [`wire_dtype`]).
pub fn update_requests(
    run: &str,
    version: u64,
    tensors: &[(String, Tensor)],
    dtype: DType,
) -> Vec<UpdateWeightsRequest> {
    let header = WeightsHeader {
        version,
        tensor_count: tensors.len() as u32,
        checkpoint_uri: String::new(),
        run_id: run.to_owned(),
    };
    let mut requests = vec![UpdateWeightsRequest { part: Some(Part::Header(header)) }];
    for (name, tensor) in tensors {
        let shape: Vec<u64> = tensor.size().iter().map(|&d| d as u64).collect();
        let bytes = wire_bytes(tensor, dtype);
        for (i, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
            requests.push(UpdateWeightsRequest {
                part: Some(Part::Tensor(TensorChunk {
                    name: name.clone(),
                    dtype: dtype as i32,
                    shape: shape.clone(),
                    byte_offset: (i * CHUNK_BYTES) as u64,
                    data: chunk.to_vec(),
                })),
            });
        }
        if bytes.is_empty() {
            requests.push(UpdateWeightsRequest {
                part: Some(Part::Tensor(TensorChunk {
                    name: name.clone(),
                    dtype: dtype as i32,
                    shape,
                    ..Default::default()
                })),
            });
        }
    }
    requests
}

/// The policy servers a learner publishes to: fixed addresses, or the
/// ready pods of a Kubernetes Service as they come and go ([`Publisher::follow`]).
/// A pod that joins serves its base weights; the next check for servers
/// behind the learner (while it waits for groups) or the next step's
/// publication brings it to the current version.
#[derive(Clone)]
pub struct Publisher {
    servers: Members<PolicyServerClient<MeshChannel>>,
    /// Whether any server was configured: with none, no weights were ever
    /// served, even while discovery has found no pod yet.
    configured: bool,
    /// Deadline of each server's UpdateWeights: a hung server fails its
    /// publication (and is caught up later) instead of stalling the step.
    timeout: Duration,
}

/// What a policy server reports serving.
#[derive(Debug, Clone)]
struct Served {
    /// The run whose weights they are (empty: the model the server started
    /// with, or weights of no run).
    run: String,
    version: u64,
    dtype: DType,
}

impl Served {
    /// Whether these are weights `run` must replace before its turns are
    /// served: another run's, or weights of no run other than the server's
    /// own start (which a run that has published nothing samples).
    fn foreign_to(&self, run: &str) -> bool {
        self.run != run && (!self.run.is_empty() || self.version > 0)
    }
}

/// How one publication went.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// Servers that now serve the version.
    pub servers_updated: usize,
    /// `address: message` of every server that did not take it.
    pub failures: Vec<String>,
    /// Those of `failures` that refused the weights themselves (names or
    /// shapes it does not have), which no retry mends.
    pub refusals: Vec<String>,
    /// Weight bytes the servers received, summed over servers.
    pub bytes: u64,
    /// How long the publication took.
    pub elapsed: Duration,
}

impl Publisher {
    /// Publishes to the fixed entries of `addresses` at once; the
    /// `kube://` ones join through [`Publisher::follow`].
    pub fn new(
        addresses: &[String],
        token: Option<&sleuth_kit::BearerToken>,
        timeout: Duration,
    ) -> Result<Self, sleuth_kit::KitError> {
        let token = token.cloned();
        let servers = Members::new("publication target", move |address| {
            Ok(sleuth_kit::sized!(PolicyServerClient::new(sleuth_kit::client::connect_lazy(address, token.as_ref())?)))
        });
        Ok(Self {
            servers: servers.with_fixed(addresses)?,
            configured: addresses.iter().any(|a| !a.is_empty()),
            timeout,
        })
    }

    /// Keeps the servers up to date with `changes` (see [`Members::follow`]).
    pub fn follow(&self, changes: sleuth_discovery::Changes) {
        self.servers.follow(changes);
    }

    /// True when no policy server is configured at all.
    pub fn is_empty(&self) -> bool {
        !self.configured
    }

    fn snapshot(&self) -> Vec<(String, PolicyServerClient<MeshChannel>)> {
        self.servers.current().into_iter().map(|(address, client)| (address, (*client).clone())).collect()
    }

    /// What each server reports serving, in server order; `None` for a
    /// server that does not answer (it is left for the next check).
    async fn served(&self) -> Vec<(String, Option<Served>)> {
        let calls = self.snapshot().into_iter().map(|(address, client)| {
            let mut client = client.clone();
            async move {
                let served = match client.get_model_info(GetModelInfoRequest {}).await {
                    Ok(info) => {
                        let info = info.into_inner();
                        Some(Served { dtype: info.dtype(), run: info.run_id, version: info.policy_version })
                    }
                    Err(status) => {
                        tracing::debug!(server = %address, message = status.message(), "policy server did not report its version");
                        None
                    }
                };
                (address, served)
            }
        });
        futures::future::join_all(calls).await
    }

    /// The dtype to send weights in ([`wire_dtype`] of what the answering servers serve).
    pub async fn wire_dtype(&self) -> DType {
        let served: Vec<DType> = self.served().await.into_iter().filter_map(|(_, s)| s.map(|s| s.dtype)).collect();
        wire_dtype(&served)
    }

    /// The servers not serving `run`'s weights at `version` or newer: an
    /// older version of it, or any other weights.
    pub async fn behind(&self, run: &str, version: u64) -> Vec<String> {
        let mut behind = Vec::new();
        for (address, served) in self.served().await {
            let Some(served) = served else { continue };
            if served.run != run || served.version < version {
                tracing::warn!(server = %address, serves = served.version, serves_run = served.run, current = version, "policy server behind the learner; publishing the current weights to it");
                behind.push(address);
            }
        }
        behind
    }

    /// The newest version of `run` any server reports serving (0 when none
    /// does), and whether any serves weights `run` must replace ([`Served::foreign_to`]).
    pub async fn newest_served(&self, run: &str) -> (u64, bool) {
        let served: Vec<Served> = self.served().await.into_iter().filter_map(|(_, served)| served).collect();
        let newest = served.iter().filter(|s| s.run == run).map(|s| s.version).max().unwrap_or(0);
        (newest, served.iter().any(|s| s.foreign_to(run)))
    }

    /// Sends `requests` to every server concurrently.
    pub async fn publish(&self, requests: Vec<UpdateWeightsRequest>) -> Published {
        let all: Vec<String> = self.snapshot().into_iter().map(|(address, _)| address).collect();
        self.publish_to(&all, requests).await
    }

    /// Sends `requests` to the servers at `addresses` (those still known) concurrently.
    pub async fn publish_to(&self, addresses: &[String], requests: Vec<UpdateWeightsRequest>) -> Published {
        let started = Instant::now();
        let version = requests.iter().find_map(|r| match &r.part {
            Some(Part::Header(header)) => Some(header.version),
            _ => None,
        });
        // One trace per publication, whichever step or republication sent it.
        let span = tracing::info_span!(parent: None, "publish_weights", version, servers = addresses.len());
        let servers = self.snapshot();
        let targets = servers.iter().filter(|(address, _)| addresses.contains(address));
        let calls = targets.map(|(address, client)| {
            let mut client = client.clone();
            let requests = requests.clone();
            let stream = tokio_stream::iter(requests);
            async move {
                let sent = sleuth_kit::client::within(self.timeout, stream, async |r| client.update_weights(r).await);
                (address.clone(), sent.await)
            }
        });
        let mut published = Published::default();
        for (address, result) in futures::future::join_all(calls).instrument(span).await {
            match result {
                Ok(response) => {
                    published.servers_updated += 1;
                    published.bytes += response.get_ref().bytes_received;
                }
                Err(status) => {
                    tracing::warn!(server = %address, code = ?status.code(), message = status.message(), "weight update failed");
                    let failure = format!("{address}: {}", status.message());
                    if status.code() == tonic::Code::InvalidArgument {
                        published.refusals.push(failure.clone());
                    }
                    published.failures.push(failure);
                }
            }
        }
        published.elapsed = started.elapsed();
        published
    }
}

/// Brings every policy server that does not serve `run`'s `step` (a failed
/// publication, a restarted server on its base weights, a server another
/// run published to) to the current weights.
pub(crate) async fn reconcile(trainer: Trainer, sources: &Sources, run: &str, step: u64) -> Result<Trainer, Error> {
    if step == 0 || sources.publisher.is_empty() {
        return Ok(trainer);
    }
    let behind = sources.publisher.behind(run, step).await;
    if behind.is_empty() {
        return Ok(trainer);
    }
    let wire = sources.publisher.wire_dtype().await;
    let run = run.to_owned();
    let (trainer, requests) =
        crate::learn::blocking(trainer, move |t| update_requests(&run, step, &t.named_tensors(), wire)).await?;
    let published = sources.publisher.publish_to(&behind, requests).await;
    tracing::info!(
        version = step,
        servers = published.servers_updated,
        failures = published.failures.len(),
        "weights republished"
    );
    Ok(trainer)
}

/// Publishes the learner's current weights as a new version before any step,
/// when the versions the servers know would otherwise mislabel tokens:
///
/// - after a crash, the versions published after the checkpoint the learner
///   resumed from are lost: their weights died with the process, yet episodes
///   sampled by them carry their numbers. Reusing a number would label those
///   tokens as sampled by other weights, so the resumed run skips past every
///   version of its own that its announcements or any policy server has seen
///   and publishes the checkpoint's weights as the next one. Groups
///   sampled by the lost weights are then at least one version old and
///   dropped as stale beyond `max_staleness`;
/// - a fresh run with a start model of its own (`policy.model_uri`), or one
///   whose servers serve another run's weights, publishes its start weights
///   as its first version, 1: the orchestrator starts no episode of a run
///   with a start model before it (version 0 is the model the servers started
///   with, not the run's), and the servers refuse the turns of a run without
///   one while they hold another run's weights (its versions count that
///   run's steps, not this one's).
///
/// Neither trains: the run's own steps (`Meta::steps_trained`, what its
/// schedule and `max_steps` count) stay as they were.
///
/// The new version is sealed as a checkpoint and recorded as a step without
/// groups whose metrics say why (`republished`).
pub(crate) async fn republish(
    trainer: Trainer,
    sources: &Sources,
    plan: &crate::learn::Plan,
    meta: &mut crate::checkpoint::Meta,
) -> Result<Trainer, Error> {
    let run_id = plan.run_id.as_str();
    // Without policy servers no weights were ever served: no version can be lost.
    let (announced, (served, foreign)) = if sources.publisher.is_empty() {
        (0, (0, false))
    } else {
        let announced = sleuth_store::patiently("reading the announced version", sources.patience, || {
            sleuth_store::trajectories::learner_version(&sources.redis, run_id)
        })
        .await?;
        (announced, sources.publisher.newest_served(run_id).await)
    };
    let (newest, checkpoint) = (announced.max(served), meta.step);
    // A run that has published nothing yet starts from its own weights: its
    // start model, or the learner's model when servers hold other weights.
    let fresh = checkpoint == 0 && announced == 0;
    let why = if fresh && (plan.start_model_uri.is_some() || foreign) {
        let uri = plan.start_model_uri.clone().unwrap_or_else(|| sources.model_dir.display().to_string());
        tracing::info!(uri, foreign, "publishing the run's start weights as its first version");
        serde_json::json!({ "republished": "start model", "model_uri": uri })
    } else if newest > checkpoint {
        tracing::warn!(
            checkpoint,
            lost = ?(checkpoint + 1..=newest),
            "versions published after the checkpoint were lost; publishing the checkpoint's weights as a new version"
        );
        serde_json::json!({ "republished": "lost versions", "rolled_back_to": checkpoint, "lost_versions": [checkpoint + 1, newest] })
    } else {
        return Ok(trainer);
    };
    let version = newest.max(checkpoint) + 1;
    meta.renumber(version);
    let trainer = crate::learn::save_checkpoint(trainer, sources, meta).await?;
    let stats = crate::trainer::StepStats { step: version, ..Default::default() };
    let mut metrics = why;
    metrics["groups"] = 0.into();
    sleuth_store::patiently("recording the republished version", sources.patience, || {
        crate::records::record(&sources.database, run_id, &stats, &metrics)
    })
    .await?;
    if sources.publisher.is_empty() {
        return Ok(trainer);
    }
    let wire = sources.publisher.wire_dtype().await;
    let run = run_id.to_owned();
    let (trainer, requests) =
        crate::learn::blocking(trainer, move |t| update_requests(&run, version, &t.named_tensors(), wire)).await?;
    let published = sources.publisher.publish(requests).await;
    if let Some(refusal) = published.refusals.first() {
        // A server that cannot take these weights (another architecture) would hold the run's turns for good.
        return Err(Error::InvalidArgument(format!(
            "policy server {refusal}: the run's weights must have the served model's architecture (spec.policy.model_uri)"
        )));
    }
    tracing::info!(version, servers = published.servers_updated, "weights republished");
    Ok(trainer)
}

/// Sends the new weights to the policy servers; says how it went.
pub(crate) async fn publish_step(
    requests: Option<Vec<UpdateWeightsRequest>>,
    sources: &Sources,
    version: u64,
) -> Published {
    let Some(requests) = requests else { return Published::default() };
    let published = sources.publisher.publish(requests).await;
    tracing::info!(
        version,
        servers = published.servers_updated,
        failures = published.failures.len(),
        bytes = published.bytes,
        seconds = published.elapsed.as_secs_f64(),
        "weights published"
    );
    published
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use sleuth_proto::policy::v1::DType;
    use sleuth_proto::policy::v1::update_weights_request::Part;
    use tch::{Device, Kind, Tensor};

    /// Every message of an update fits the servers' default 4 MiB limit, for
    /// a tensor as large as a real embedding.
    #[test]
    fn update_messages_fit_the_grpc_limit() {
        let embedding = Tensor::zeros([49_152, 64], (Kind::Float, Device::Cpu));
        let requests =
            super::update_requests("run", 3, &[("model.embed_tokens.weight".into(), embedding)], DType::DtypeF32);
        assert_eq!(requests.len(), 1 + (49_152 * 64 * 4usize).div_ceil(super::CHUNK_BYTES));
        for request in &requests {
            assert!(request.encoded_len() < 4 << 20, "{} bytes", request.encoded_len());
        }
    }

    /// Servers that all serve bf16 get bf16 (half the bytes) holding exactly
    /// the values they would round f32 to; any f32 server, or a mix, gets f32.
    #[test]
    fn weights_travel_in_the_served_dtype_when_every_server_serves_it() {
        use super::wire_dtype;
        assert_eq!(wire_dtype(&[DType::DtypeBf16, DType::DtypeBf16]), DType::DtypeBf16);
        assert_eq!(wire_dtype(&[DType::DtypeF16]), DType::DtypeF16);
        assert_eq!(wire_dtype(&[DType::DtypeBf16, DType::DtypeF32]), DType::DtypeF32);
        assert_eq!(wire_dtype(&[DType::DtypeBf16, DType::DtypeF16]), DType::DtypeF32);
        assert_eq!(wire_dtype(&[]), DType::DtypeF32);

        let weights = Tensor::randn([300, 7], (Kind::Float, Device::Cpu));
        let bytes = |dtype| -> Vec<u8> {
            super::update_requests("run", 1, &[("w".into(), weights.shallow_clone())], dtype)
                .into_iter()
                .filter_map(|r| match r.part {
                    Some(Part::Tensor(chunk)) => {
                        assert_eq!(chunk.dtype, dtype as i32);
                        Some(chunk.data)
                    }
                    _ => None,
                })
                .flatten()
                .collect()
        };
        let (f32_bytes, bf16_bytes) = (bytes(DType::DtypeF32), bytes(DType::DtypeBf16));
        assert_eq!((f32_bytes.len(), bf16_bytes.len()), (300 * 7 * 4, 300 * 7 * 2));
        let bits: Vec<i16> = bf16_bytes.chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]])).collect();
        let received = Tensor::from_slice(&bits).view_dtype(Kind::BFloat16).view([300, 7]);
        assert!(received.equal(&weights.to_kind(Kind::BFloat16)), "bf16 on the wire is the served rounding");
    }
}
