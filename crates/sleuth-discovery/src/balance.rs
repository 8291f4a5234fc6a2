//! One channel to every replica of a stateless upstream (the tool and
//! inference gateways an agent calls): each call goes to the less loaded of
//! two ready replicas (tower's power of two choices), and replicas join and
//! leave as discovery reports them. A single HTTP/2 channel to a Service's
//! ClusterIP would instead pin every call of a caller to the one pod its
//! connection reached, so pods a scale-out adds would get no traffic until
//! callers restarted.

use std::time::Duration;

use futures::StreamExt;
use sleuth_kit::BearerToken;
use sleuth_kit::client::{MeshChannel, connect_lazy, endpoint, with_token};
use tonic::transport::Channel;
use tonic::transport::channel::Change as Balanced;
use tower::discover::Change;

use crate::{DiscoveryError, discover};

/// Changes queued for the balancer before discovery waits for it.
const PENDING_CHANGES: usize = 64;

/// A channel to `address` (the setting `field`): a fixed `host:port` is one
/// lazily connected channel; `kube://SERVICE[.NAMESPACE]:PORT` balances each
/// call over the Service's ready endpoints, followed as they change. Calls
/// made while no endpoint is ready wait for one (their deadlines bound it).
pub async fn balanced_channel(
    field: &'static str,
    address: &str,
    token: Option<&BearerToken>,
) -> Result<MeshChannel, DiscoveryError> {
    if !address.starts_with("kube://") {
        return Ok(connect_lazy(address, token)?);
    }
    let mut changes = discover(field, &[address.to_owned()]).await?;
    let (channel, balancer) = Channel::balance_channel::<String>(PENDING_CHANGES);
    tokio::spawn(async move {
        while let Some(Ok(change)) = changes.next().await {
            let change = match change {
                Change::Insert(replica, _) => match endpoint(&replica, Duration::from_secs(5)) {
                    Ok(endpoint) => Balanced::Insert(replica, endpoint),
                    Err(error) => {
                        tracing::error!(field, %replica, %error, "replica left out");
                        continue;
                    }
                },
                Change::Remove(replica) => Balanced::Remove(replica),
            };
            if balancer.send(change).await.is_err() {
                return; // the channel is gone
            }
        }
    });
    Ok(with_token(channel, token))
}
