//! Weight publication: after a step, the new weights go to every policy
//! server as `UpdateWeights` streams (version = step), in chunks of at most
//! 4 MiB so no gRPC message limit is hit. The servers swap between decode
//! steps; a failed server is reported and retried at the next step (its
//! version simply lags; the orchestrator's staleness gate sees the version
//! the learner records).

use std::time::{Duration, Instant};

use sleuth_kit::client::MeshChannel;
use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
use sleuth_proto::policy::v1::{DType, TensorChunk, UpdateWeightsRequest, WeightsHeader, update_weights_request::Part};
use tch::{Device, Kind, Tensor};

const CHUNK_BYTES: usize = 4 << 20;

/// The requests of one update: a header, then every tensor in chunks (f32, little-endian).
pub fn update_requests(version: u64, tensors: &[(String, Tensor)]) -> Vec<UpdateWeightsRequest> {
    let header = WeightsHeader { version, tensor_count: tensors.len() as u32, checkpoint_uri: String::new() };
    let mut requests = vec![UpdateWeightsRequest { part: Some(Part::Header(header)) }];
    for (name, tensor) in tensors {
        let shape: Vec<u64> = tensor.size().iter().map(|&d| d as u64).collect();
        let values = Vec::<f32>::try_from(&tensor.to_kind(Kind::Float).to_device(Device::Cpu).flatten(0, -1))
            .expect("f32 tensor");
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (i, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
            requests.push(UpdateWeightsRequest {
                part: Some(Part::Tensor(TensorChunk {
                    name: name.clone(),
                    dtype: DType::DtypeF32 as i32,
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
                    dtype: DType::DtypeF32 as i32,
                    shape,
                    ..Default::default()
                })),
            });
        }
    }
    requests
}

/// The policy servers a learner publishes to.
#[derive(Clone)]
pub struct Publisher {
    servers: Vec<(String, PolicyServerClient<MeshChannel>)>,
}

/// How one publication went.
#[derive(Debug, Clone, Default)]
pub struct Published {
    pub servers_updated: usize,
    pub failures: Vec<String>,
    pub elapsed: Duration,
}

impl Publisher {
    pub fn new(addresses: &[String], token: Option<&sleuth_kit::BearerToken>) -> Result<Self, sleuth_kit::KitError> {
        let servers = addresses
            .iter()
            .filter(|a| !a.is_empty())
            .map(|a| Ok((a.clone(), PolicyServerClient::new(sleuth_kit::client::connect_lazy(a, token)?))))
            .collect::<Result<_, sleuth_kit::KitError>>()?;
        Ok(Self { servers })
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Sends `requests` to every server concurrently.
    pub async fn publish(&self, requests: Vec<UpdateWeightsRequest>) -> Published {
        let started = Instant::now();
        let calls = self.servers.iter().map(|(address, client)| {
            let mut client = client.clone();
            let requests = requests.clone();
            async move { (address.clone(), client.update_weights(tokio_stream::iter(requests)).await) }
        });
        let mut published = Published::default();
        for (address, result) in futures::future::join_all(calls).await {
            match result {
                Ok(_) => published.servers_updated += 1,
                Err(status) => {
                    tracing::warn!(server = %address, code = ?status.code(), message = status.message(), "weight update failed");
                    published.failures.push(format!("{address}: {}", status.message()));
                }
            }
        }
        published.elapsed = started.elapsed();
        published
    }
}
