//! `sleuth auth ensure-secret`: makes the mesh's token Secret once, in the
//! cluster, so no render of the chart ever holds a token. The Helm chart runs
//! it as a pre-install/pre-upgrade hook Job: `helm template` (Argo CD, Flux)
//! then renders the same manifests every time, and an upgrade never changes
//! the tokens running pods hold.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};

/// Arguments of `sleuth auth`.
#[derive(clap::Args, Debug)]
pub struct AuthArgs {
    #[command(subcommand)]
    command: AuthCommand,
}

#[derive(clap::Subcommand, Debug)]
enum AuthCommand {
    /// Create a Secret of random tokens, or add the keys it lacks; keys it
    /// has are never changed. Uses the in-cluster account, or KUBECONFIG.
    EnsureSecret(EnsureSecretArgs),
}

#[derive(clap::Args, Debug)]
struct EnsureSecretArgs {
    /// The Secret's name.
    name: String,
    /// The keys it must hold, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "token,publish-token,admin-token,ticket-key")]
    keys: Vec<String>,
    /// Its namespace; default: the pod's (or the kubeconfig context's).
    #[arg(long)]
    namespace: Option<String>,
    /// Labels of a Secret this creates, `key=value` comma separated.
    #[arg(long, value_delimiter = ',')]
    labels: Vec<String>,
}

/// Characters of 40 drawn from 62: 238 bits, as the chart's old randAlphaNum 40.
const TOKEN_LENGTH: usize = 40;
const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// Runs `sleuth auth`.
pub async fn run(args: AuthArgs) -> Result<()> {
    match args.command {
        AuthCommand::EnsureSecret(args) => ensure_secret(args).await,
    }
}

async fn ensure_secret(args: EnsureSecretArgs) -> Result<()> {
    if args.keys.is_empty() || args.keys.iter().any(|k| !valid_key(k)) {
        bail!("--keys {:?}: each key must be non-empty letters, digits, '-', '_' or '.'", args.keys.join(","));
    }
    let labels = args
        .labels
        .iter()
        .map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect::<Option<BTreeMap<_, _>>>()
        .with_context(|| format!("--labels {:?}: each must be key=value", args.labels.join(",")))?;
    let client = kube::Client::try_default().await.context("no Kubernetes API (in-cluster account or KUBECONFIG)")?;
    let namespace = args.namespace.clone().unwrap_or_else(|| client.default_namespace().to_owned());
    let secrets: Api<Secret> = Api::namespaced(client, &namespace);
    let name = &args.name;
    // A racing creator (two hook pods) or writer makes one attempt fail; the next sees its result.
    for _ in 0..5 {
        let Some(existing) =
            secrets.get_opt(name).await.with_context(|| format!("reading secret {namespace}/{name}"))?
        else {
            let secret = Secret {
                metadata: kube::api::ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(labels.clone()),
                    ..Default::default()
                },
                data: Some(args.keys.iter().map(|k| Ok((k.clone(), ByteString(token()?)))).collect::<Result<_>>()?),
                type_: Some("Opaque".to_owned()),
                ..Default::default()
            };
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    println!("created secret {namespace}/{name} with keys {}", args.keys.join(", "));
                    return Ok(());
                }
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(error) => return Err(error).with_context(|| format!("creating secret {namespace}/{name}")),
            }
        };
        let held = existing.data.unwrap_or_default();
        let missing: Vec<&String> = args.keys.iter().filter(|k| !held.contains_key(k.as_str())).collect();
        if missing.is_empty() {
            println!("secret {namespace}/{name} holds {}; nothing to do", args.keys.join(", "));
            return Ok(());
        }
        let mut data = serde_json::Map::new();
        for key in &missing {
            data.insert((*key).clone(), serde_json::to_value(ByteString(token()?))?);
        }
        // The resourceVersion makes the patch fail if the Secret changed since it was read.
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": existing.metadata.resource_version},
            "data": data,
        });
        match secrets.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {
                let added: Vec<&str> = missing.iter().map(|k| k.as_str()).collect();
                println!("added keys {} to secret {namespace}/{name}", added.join(", "));
                return Ok(());
            }
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => return Err(error).with_context(|| format!("adding keys to secret {namespace}/{name}")),
        }
    }
    bail!("secret {namespace}/{name} kept changing while this tried to complete it; run it again")
}

fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A random token of [`TOKEN_LENGTH`] characters of [`ALPHABET`], drawn
/// without bias (bytes past the largest multiple of 62 are redrawn).
fn token() -> Result<Vec<u8>> {
    let limit = 256 - 256 % ALPHABET.len();
    let mut token = Vec::with_capacity(TOKEN_LENGTH);
    while token.len() < TOKEN_LENGTH {
        let mut bytes = [0u8; 64];
        getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for a token: {e}"))?;
        token.extend(
            bytes.iter().filter(|&&b| usize::from(b) < limit).map(|&b| ALPHABET[usize::from(b) % ALPHABET.len()]),
        );
    }
    token.truncate(TOKEN_LENGTH);
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_long_alphanumeric_and_differ() {
        let (a, b) = (token().unwrap(), token().unwrap());
        assert_eq!(a.len(), TOKEN_LENGTH);
        assert!(a.iter().all(u8::is_ascii_alphanumeric));
        assert_ne!(a, b);
    }

    #[test]
    fn secret_keys_are_checked() {
        assert!(valid_key("publish-token") && valid_key("a.b_c"));
        assert!(!valid_key("") && !valid_key("a/b") && !valid_key("a b"));
    }
}
