//! Where a service's upstreams are: the replicas behind an address list
//! setting (`SLEUTH_AGENT_WORKERS`, `SLEUTH_POLICY_SERVERS`), as a tower
//! `Discover` stream of `Change::Insert(address, address)` and
//! `Change::Remove(address)` that each consumer applies to its own set
//! (the orchestrator's workers, the gateway's replicas, the learner's
//! publication targets).
//!
//! An entry is either a fixed `host:port`, inserted once, or
//! `kube://SERVICE[.NAMESPACE]:PORT`: the ready endpoints of a Kubernetes
//! Service, watched through its EndpointSlices (label
//! `kubernetes.io/service-name`) with kube-rs's watcher, so a
//! `kubectl scale` reaches every consumer within a watch event, with no
//! restart. PORT is the port's name (`grpc`) or number; NAMESPACE defaults
//! to the client's (the pod's own). Only ready, non-terminating endpoints
//! are inserted; one that stops being ready, or whose pod goes away, is
//! removed, and consumers drain it: no new work, in-flight work finishes.
//!
//! Consumers that keep one thing per address (a client, a worker's load)
//! hold them in [`Members`]; callers of a stateless upstream use one
//! [`balanced_channel`] over all of them.
//!
//! The Kubernetes client is configured as kubectl's is (`KUBECONFIG`, then
//! the pod's service account); it needs get/list/watch on endpointslices.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use futures::{Stream, StreamExt};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tower::discover::Change;

mod balance;
pub use balance::balanced_channel;

/// The stream consumers read: tower's `Discover` over addresses.
pub type Changes = Pin<Box<dyn Stream<Item = Result<Change<String, String>, Infallible>> + Send>>;

/// Why an address list cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("{field} entry {entry:?}: {message}")]
    Entry { field: &'static str, entry: String, message: String },
    #[error("{field} entry {entry:?} needs the Kubernetes API (in a pod, or KUBECONFIG): {source}")]
    Client {
        field: &'static str,
        entry: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Kit(#[from] sleuth_kit::KitError),
}

impl sleuth_kit::ServiceError for DiscoveryError {
    fn kind(&self) -> sleuth_kit::ErrorKind {
        match self {
            DiscoveryError::Entry { .. } => sleuth_kit::ErrorKind::InvalidArgument,
            DiscoveryError::Client { .. } => sleuth_kit::ErrorKind::Unavailable,
            DiscoveryError::Kit(error) => error.kind(),
        }
    }
}

/// The port of a Service's endpoints, by name or number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Port {
    Named(String),
    Number(u16),
}

/// One entry of an address list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A fixed `host:port`.
    Fixed(String),
    /// The ready endpoints of a Kubernetes Service.
    Service { name: String, namespace: Option<String>, port: Port },
}

impl Entry {
    /// Reads one entry of the setting `field`.
    pub fn parse(field: &'static str, text: &str) -> Result<Self, DiscoveryError> {
        let Some(rest) = text.strip_prefix("kube://") else { return Ok(Entry::Fixed(text.to_owned())) };
        let bad = |message: &str| DiscoveryError::Entry { field, entry: text.to_owned(), message: message.to_owned() };
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("expected kube://SERVICE[.NAMESPACE]:PORT"))?;
        let (name, namespace) = match host.split_once('.') {
            Some((name, namespace)) => (name, Some(namespace.to_owned())),
            None => (host, None),
        };
        let dns_label = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !s.starts_with('-')
                && !s.ends_with('-')
        };
        if !dns_label(name) || !namespace.as_deref().is_none_or(dns_label) {
            return Err(bad("the Service and namespace must be DNS labels (lowercase letters, digits, '-')"));
        }
        let port = match port.parse::<u16>() {
            Ok(0) => return Err(bad("port 0")),
            Ok(number) => Port::Number(number),
            Err(_) if dns_label(port) => Port::Named(port.to_owned()),
            Err(_) => return Err(bad("the port must be a number or a port name")),
        };
        Ok(Entry::Service { name: name.to_owned(), namespace, port })
    }
}

/// Every address `entries` (the setting `field`) name, now and as they change.
pub async fn discover(field: &'static str, entries: &[String]) -> Result<Changes, DiscoveryError> {
    let mut streams: Vec<Changes> = Vec::new();
    let mut client: Option<kube::Client> = None;
    for text in entries.iter().filter(|e| !e.is_empty()) {
        match Entry::parse(field, text)? {
            Entry::Fixed(address) => streams
                .push(Box::pin(futures::stream::once(async move { Ok(Change::Insert(address.clone(), address)) }))),
            Entry::Service { name, namespace, port } => {
                let client = match &client {
                    Some(client) => client.clone(),
                    None => {
                        let made = kube::Client::try_default().await.map_err(|source| DiscoveryError::Client {
                            field,
                            entry: text.clone(),
                            source,
                        })?;
                        client.insert(made).clone()
                    }
                };
                let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_owned());
                tracing::info!(field, service = %name, %namespace, ?port, "watching the service's endpoints");
                streams.push(Box::pin(watch(client, namespace, name, port)));
            }
        }
    }
    Ok(Box::pin(futures::stream::select_all(streams)))
}

/// The ready addresses of `service`'s endpoints on `port`, as changes.
pub fn watch(
    client: kube::Client,
    namespace: String,
    service: String,
    port: Port,
) -> impl Stream<Item = Result<Change<String, String>, Infallible>> + Send {
    let slices: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &namespace);
    let config = watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
    let events = watcher::watcher(slices, config).default_backoff();
    let mut view = View::default();
    events
        .flat_map(move |event| {
            let changes = match event {
                Ok(event) => view.apply(event, &port),
                Err(error) => {
                    // The watcher retries with backoff; the last known endpoints stay in use meanwhile.
                    tracing::warn!(service = %service, %namespace, %error, "watching endpoints failed; retrying");
                    Vec::new()
                }
            };
            futures::stream::iter(changes.into_iter().map(Ok))
        })
        .boxed()
}

/// The current members of an address list, each made once from its address
/// when it joins (a client, a worker with its load counters) and dropped
/// from the set when it leaves; whoever still holds one (an episode running
/// on a worker) keeps it until done.
pub struct Members<T> {
    /// What a member is, for the logs ("agent worker").
    role: &'static str,
    /// Each member with its address, in the order they joined.
    current: Arc<RwLock<Vec<Member<T>>>>,
    /// Builds a member from its address.
    make: Arc<Make<T>>,
}

/// A member and its address.
type Member<T> = (String, Arc<T>);
/// How a member is built from its address.
type Make<T> = dyn Fn(&str) -> Result<T, sleuth_kit::KitError> + Send + Sync;

impl<T> Clone for Members<T> {
    fn clone(&self) -> Self {
        Self { role: self.role, current: self.current.clone(), make: self.make.clone() }
    }
}

impl<T: Send + Sync + 'static> Members<T> {
    /// An empty set whose members `make` builds from their addresses.
    pub fn new(
        role: &'static str,
        make: impl Fn(&str) -> Result<T, sleuth_kit::KitError> + Send + Sync + 'static,
    ) -> Self {
        Self { role, current: Arc::default(), make: Arc::new(make) }
    }

    /// The fixed `host:port` entries of `entries` join at once (the
    /// `kube://` ones through [`Members::follow`]).
    pub fn with_fixed(self, entries: &[String]) -> Result<Self, sleuth_kit::KitError> {
        for address in entries.iter().filter(|a| !a.is_empty() && !a.starts_with("kube://")) {
            self.apply(Change::Insert(address.clone(), address.clone()))?;
        }
        Ok(self)
    }

    /// Keeps the set up to date with `changes`, in the background, for as
    /// long as the stream runs.
    pub fn follow(&self, mut changes: Changes) {
        let members = self.clone();
        tokio::spawn(async move {
            while let Some(Ok(change)) = changes.next().await {
                if let Err(error) = members.apply(change) {
                    tracing::error!(role = members.role, %error, "member left out");
                }
            }
        });
    }

    /// Adds or removes one member; an address already in is left as it is.
    pub fn apply(&self, change: Change<String, String>) -> Result<(), sleuth_kit::KitError> {
        let mut current = self.current.write().expect("members");
        match change {
            Change::Insert(address, _) if !current.iter().any(|(a, _)| *a == address) => {
                let member = (self.make)(&address)?;
                tracing::info!(%address, members = current.len() + 1, "{} joined", self.role);
                current.push((address, Arc::new(member)));
            }
            Change::Insert(..) => {}
            Change::Remove(address) => {
                current.retain(|(a, _)| *a != address);
                tracing::info!(%address, members = current.len(), "{} left", self.role);
            }
        }
        Ok(())
    }

    /// The members now, in the order they joined.
    pub fn current(&self) -> Vec<(String, Arc<T>)> {
        self.current.read().expect("members").clone()
    }

    pub fn len(&self) -> usize {
        self.current.read().expect("members").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The ready addresses of each slice, and the changes an event makes to their union.
#[derive(Default)]
struct View {
    slices: BTreeMap<String, BTreeSet<String>>,
    /// Slices of a relist in progress (between `Init` and `InitDone`).
    relist: Option<BTreeMap<String, BTreeSet<String>>>,
}

impl View {
    fn union(slices: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
        slices.values().flatten().cloned().collect()
    }

    fn apply(&mut self, event: Event<EndpointSlice>, port: &Port) -> Vec<Change<String, String>> {
        let before = Self::union(&self.slices);
        match event {
            Event::Init => self.relist = Some(BTreeMap::new()),
            Event::InitApply(slice) => {
                let relist = self.relist.get_or_insert_default();
                relist.insert(slice.metadata.name.clone().unwrap_or_default(), ready(&slice, port));
                return Vec::new(); // applied at InitDone, so a relist removes what vanished meanwhile
            }
            Event::InitDone => self.slices = self.relist.take().unwrap_or_default(),
            Event::Apply(slice) => {
                self.slices.insert(slice.metadata.name.clone().unwrap_or_default(), ready(&slice, port));
            }
            Event::Delete(slice) => {
                self.slices.remove(&slice.metadata.name.clone().unwrap_or_default());
            }
        }
        let after = Self::union(&self.slices);
        let removed = before.difference(&after).map(|a| Change::Remove(a.clone()));
        let inserted = after.difference(&before).map(|a| Change::Insert(a.clone(), a.clone()));
        removed.chain(inserted).collect()
    }
}

/// `host:port` of each ready, non-terminating endpoint of `slice` on `port`.
fn ready(slice: &EndpointSlice, port: &Port) -> BTreeSet<String> {
    let number = slice.ports.iter().flatten().find_map(|p| match port {
        Port::Named(name) => (p.name.as_deref() == Some(name)).then_some(p.port).flatten(),
        Port::Number(number) => (p.port == Some(i32::from(*number))).then_some(p.port).flatten(),
    });
    let Some(number) = number else { return BTreeSet::new() };
    slice
        .endpoints
        .iter()
        .filter(|e| {
            let conditions = e.conditions.as_ref();
            // Kubernetes: an unknown readiness counts as ready.
            conditions.and_then(|c| c.ready).unwrap_or(true) && !conditions.and_then(|c| c.terminating).unwrap_or(false)
        })
        .flat_map(|e| &e.addresses)
        .map(|ip| if ip.contains(':') { format!("[{ip}]:{number}") } else { format!("{ip}:{number}") })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_addresses_or_services_and_bad_ones_are_named() {
        assert_eq!(Entry::parse("f", "10.0.0.1:50052").unwrap(), Entry::Fixed("10.0.0.1:50052".into()));
        assert_eq!(
            Entry::parse("f", "kube://sleuth-agent:grpc").unwrap(),
            Entry::Service { name: "sleuth-agent".into(), namespace: None, port: Port::Named("grpc".into()) }
        );
        assert_eq!(
            Entry::parse("f", "kube://policy.ml:50055").unwrap(),
            Entry::Service { name: "policy".into(), namespace: Some("ml".into()), port: Port::Number(50055) }
        );
        for bad in ["kube://agent", "kube://Agent:grpc", "kube://agent:0", "kube://agent:gr_pc", "kube://:1"] {
            let error = Entry::parse("agent_workers", bad).unwrap_err().to_string();
            assert!(error.starts_with(&format!("agent_workers entry {bad:?}")), "{error}");
        }
    }
}
