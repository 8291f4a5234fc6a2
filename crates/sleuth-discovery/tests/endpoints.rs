//! Discovery against a fake API server speaking the real list and watch
//! protocol: ready endpoints join, unready and deleted ones leave, other
//! Services and ports are not mixed in, and a relist after the watch is
//! cut removes what vanished meanwhile.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use futures::StreamExt;
use sleuth_discovery::{Port, watch};
use sleuth_testkit::kube_api::{FakeKubeApi, NAMESPACE, eventually};
use tower::discover::Change;

async fn client(api: &FakeKubeApi) -> Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(api.kubeconfig())?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

/// Applies the changes of `service`'s watch to a set, in the background.
fn follow(client: kube::Client, service: &str, port: Port) -> Arc<Mutex<BTreeSet<String>>> {
    let seen = Arc::new(Mutex::new(BTreeSet::new()));
    let set = seen.clone();
    let mut changes = Box::pin(watch(client, NAMESPACE.into(), service.into(), port));
    tokio::spawn(async move {
        while let Some(Ok(change)) = changes.next().await {
            let mut set = set.lock().unwrap();
            match change {
                Change::Insert(address, _) => assert!(set.insert(address), "inserted twice"),
                Change::Remove(address) => assert!(set.remove(&address), "removed unknown {address}"),
            }
        }
    });
    seen
}

fn is(seen: &Mutex<BTreeSet<String>>, expected: &[&str]) -> bool {
    *seen.lock().unwrap() == expected.iter().map(|a| (*a).to_owned()).collect()
}

#[tokio::test]
async fn ready_endpoints_join_and_leave_as_their_slices_change() -> Result<()> {
    let api = FakeKubeApi::start().await?;
    api.set_slice("agent", "agent-a", "grpc", 50052, &[("10.0.0.1", true), ("10.0.0.2", false)]);
    api.set_slice("policy", "policy-a", "grpc", 50055, &[("10.0.9.1", true)]);
    let client = client(&api).await?;
    let agents = follow(client.clone(), "agent", Port::Named("grpc".into()));
    let by_number = follow(client, "agent", Port::Number(50052));
    let limit = Duration::from_secs(10);

    eventually("the listed ready endpoint", limit, || is(&agents, &["10.0.0.1:50052"])).await?;
    api.set_slice("agent", "agent-a", "grpc", 50052, &[("10.0.0.1", true), ("10.0.0.2", true)]);
    eventually("the endpoint that became ready", limit, || is(&agents, &["10.0.0.1:50052", "10.0.0.2:50052"])).await?;
    api.set_slice("agent", "agent-b", "grpc", 50052, &[("10.0.1.1", true)]);
    eventually("a second slice's endpoint", limit, || {
        is(&agents, &["10.0.0.1:50052", "10.0.0.2:50052", "10.0.1.1:50052"])
    })
    .await?;
    // A pod going away: not ready (terminating), then its slice entry gone.
    api.set_slice("agent", "agent-a", "grpc", 50052, &[("10.0.0.1", true), ("10.0.0.2", false)]);
    eventually("the terminating endpoint leaving", limit, || is(&agents, &["10.0.0.1:50052", "10.0.1.1:50052"]))
        .await?;
    api.delete_slice("agent-a");
    eventually("the deleted slice's endpoints leaving", limit, || is(&agents, &["10.0.1.1:50052"])).await?;
    // A slice without the watched port contributes nothing.
    api.set_slice("agent", "agent-c", "metrics", 9090, &[("10.0.2.1", true)]);
    api.set_slice("agent", "agent-d", "grpc", 50052, &[("10.0.3.1", true)]);
    eventually("only the grpc port", limit, || is(&agents, &["10.0.1.1:50052", "10.0.3.1:50052"])).await?;
    assert!(is(&by_number, &["10.0.1.1:50052", "10.0.3.1:50052"]), "by number as by name");
    Ok(())
}

#[tokio::test]
async fn fixed_addresses_are_inserted_once_and_bad_entries_named() -> Result<()> {
    let mut changes = sleuth_discovery::discover("policy_servers", &["10.0.0.1:1".into(), "10.0.0.2:2".into()]).await?;
    let mut seen = Vec::new();
    while let Some(Ok(Change::Insert(address, _))) = changes.next().await {
        seen.push(address);
    }
    seen.sort();
    assert_eq!(seen, ["10.0.0.1:1", "10.0.0.2:2"]);
    let error = match sleuth_discovery::discover("policy_servers", &["kube://Policy:grpc".into()]).await {
        Err(error) => error.to_string(),
        Ok(_) => panic!("a bad entry must be refused"),
    };
    assert!(error.contains("policy_servers entry \"kube://Policy:grpc\""), "{error}");
    Ok(())
}
